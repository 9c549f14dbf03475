"""Multi-turn sessions: how a session id routes Step and Close, and the table of local sessions.

A session id is `<replica>/<environment>/<inner id>`:
- `replica` names the reward-server process that answered Reset (its `replica_id`, random per
  start unless set, e.g. to the pod name);
- `environment` is the environment's name (names cannot contain "/");
- the inner id is a fresh random id for a local environment, or, for a remote one, the session id
  the remote server returned, which is handed back to it unchanged on Step and Close.

So routing needs no table shared between replicas and survives nothing it should not: a session's
state lives in the memory of one process, and the id says which one.

Scaled out: a session stays on one replica because every Step and Close must go to the replica
that answered its Reset. Rollout servers open each session as one `Session` stream
(`rlmesh.reward_server.session_stream`), which gRPC keeps on one connection, so it stays whole
however their channel balances over a reward name's replicas. A caller of the unary methods must
send Step and Close to the replica that answered Reset itself (address replicas directly — a
Kubernetes headless Service or StatefulSet names each pod; set `replica_id` to the pod name — or hash
on the session id behind an L7 balancer). A Step that reaches another replica is refused with
FAILED_PRECONDITION naming both replicas, never served with the wrong state. `Score` is stateless
and can go to any replica. A replica that restarts loses its sessions; their Steps get NOT_FOUND
(or the stream ends UNAVAILABLE) and the episode ends with that reason.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

class SessionError(Exception):
    """A session id that cannot be served here; `code` is the gRPC status code name to answer with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class SessionId:
    replica: str
    env_name: str
    inner: str

    def __str__(self) -> str:
        return f"{self.replica}/{self.env_name}/{self.inner}"

    @classmethod
    def parse(cls, text: str) -> SessionId:
        parts = text.split("/", 2)
        if len(parts) != 3 or not all(parts):
            raise SessionError("INVALID_ARGUMENT", f"session id {text!r} is not '<replica>/<environment>/<id>'; "
                                                   "pass the session_id that Reset returned, unchanged")
        return cls(*parts)


def check_name(kind: str, name: str) -> None:
    if not name or "/" in name:
        raise ValueError(f"{kind} name {name!r} must be non-empty and contain no '/' (it is part of session ids)")


@dataclass
class LocalSession:
    env_name: str
    state: Any
    done: bool = False
    last_used: float = field(default_factory=time.monotonic)
    # Set while a step or close runs, so that a session's calls never overlap.
    busy: bool = False
    owner: str = ""
    """The caller that opened it (its tier under mutual TLS, else its address), for per-caller limits."""


class SessionTable:
    """Sessions of local environments on this replica; ones idle past `idle_timeout_s` are evicted."""

    def __init__(self, replica: str, idle_timeout_s: float) -> None:
        check_name("replica", replica)
        self.replica, self.idle_timeout_s = replica, idle_timeout_s
        self._sessions: dict[str, LocalSession] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def new_id(self, env_name: str, inner: str | None = None) -> SessionId:
        return SessionId(self.replica, env_name, inner or uuid.uuid4().hex)

    def route(self, session_id: str) -> SessionId:
        """Parse an incoming id and check that this replica owns it."""
        sid = SessionId.parse(session_id)
        if sid.replica != self.replica:
            raise SessionError(
                "FAILED_PRECONDITION",
                f"session {session_id!r} belongs to reward-server replica {sid.replica!r}, this is {self.replica!r}; "
                "send Step and Close to the replica that answered Reset (or it restarted and the session is lost)")
        return sid

    def add(self, sid: SessionId, session: LocalSession) -> None:
        self._sessions[sid.inner] = session

    def num_owned_by(self, owner: str) -> int:
        return sum(1 for s in self._sessions.values() if s.owner == owner)

    def get(self, sid: SessionId) -> LocalSession:
        session = self._sessions.get(sid.inner)
        if session is None or session.env_name != sid.env_name:
            raise SessionError("NOT_FOUND", f"no session {str(sid)!r}: it was closed, idle for more than "
                                            f"{self.idle_timeout_s:.0f}s, or ended by an environment error")
        session.last_used = time.monotonic()
        return session

    def pop(self, sid: SessionId) -> LocalSession | None:
        session = self._sessions.get(sid.inner)
        if session is not None and session.env_name == sid.env_name:
            return self._sessions.pop(sid.inner)
        return None

    def evict_idle(self) -> list[LocalSession]:
        """Remove and return sessions idle past the timeout (their environments still need close)."""
        cutoff = time.monotonic() - self.idle_timeout_s
        stale = [k for k, s in self._sessions.items() if s.last_used < cutoff and not s.busy]
        return [self._sessions.pop(k) for k in stale]
