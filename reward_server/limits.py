"""Bounds on what one call may ask of a reward server: items per Score, text and metadata sizes,
open sessions per server and per caller. Each refusal is a `SessionError` whose message names the
limit and its config key (`reward.max_*`), answered as INVALID_ARGUMENT (a request too big) or
RESOURCE_EXHAUSTED (no room for another session); the server goes on serving everyone else."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlmesh.reward_server.sessions import SessionError

if TYPE_CHECKING:
    from google.protobuf.struct_pb2 import Struct

    from rlmesh.services.config import RewardSection
    from rlmesh.v1 import common_pb2, reward_pb2


@dataclass(frozen=True)
class RequestLimits:
    """The `reward.max_*` keys (`from_config`; their defaults are the config's)."""

    max_score_items: int
    max_text_chars: int
    max_metadata_bytes: int
    max_sessions: int
    max_sessions_per_client: int

    @classmethod
    def from_config(cls, section: RewardSection) -> RequestLimits:
        return cls(section.max_score_items, section.max_text_chars, section.max_metadata_bytes,
                   section.max_sessions, section.max_sessions_per_client)

    def check_score(self, items: Sequence[reward_pb2.ScoreItem]) -> None:
        if len(items) > self.max_score_items:
            raise SessionError("INVALID_ARGUMENT", f"Score carries {len(items)} items, over the limit "
                                                   f"reward.max_score_items={self.max_score_items}; split the batch")
        for item in items:
            self.check_input(f"Score item {item.id!r}", item.prompt, item.env_metadata)
            self.check_text(f"Score item {item.id!r} completion", item.completion)

    def check_input(self, what: str, prompt: Iterable[common_pb2.ChatMessage], metadata: Struct) -> None:
        self.check_text(f"{what} prompt", "".join(m.content for m in prompt))
        size = metadata.ByteSize()
        if size > self.max_metadata_bytes:
            raise SessionError("INVALID_ARGUMENT", f"{what}: env_metadata of {size} bytes is over the limit "
                                                   f"reward.max_metadata_bytes={self.max_metadata_bytes}")

    def check_text(self, what: str, text: str) -> None:
        if len(text) > self.max_text_chars:
            raise SessionError("INVALID_ARGUMENT", f"{what} has {len(text)} characters, over the limit "
                                                   f"reward.max_text_chars={self.max_text_chars}")

    def check_room(self, num_open: int, num_open_by_client: int, client: str) -> None:
        """Room for one more session, opened by `client`."""
        if num_open >= self.max_sessions:
            raise SessionError("RESOURCE_EXHAUSTED",
                               f"{num_open} sessions are open on this reward server, the limit reward.max_sessions="
                               f"{self.max_sessions}; Close finished sessions (idle ones close after "
                               "reward.session_idle_timeout_s) or raise the limit")
        if num_open_by_client >= self.max_sessions_per_client:
            raise SessionError("RESOURCE_EXHAUSTED",
                               f"caller {client} holds {num_open_by_client} open sessions, the limit "
                               f"reward.max_sessions_per_client={self.max_sessions_per_client}; Close finished "
                               "sessions or raise the limit")
