"""An OpenEnv environment server (its WebSocket reset/step protocol) as a multi-turn environment.

Configured under `reward.openenv.<name>` with the server's base URL. Per episode:
- Reset opens one WebSocket session with OpenEnv's own client (`openenv.core.GenericEnvClient`),
  held until Close, and calls the server's `reset` with the dataset metadata keys listed in
  `reset_keys` (e.g. `seed`) as keyword arguments. A non-empty reset observation is the first
  message the model reads.
- Each Step turns the model's assistant message into the server's action — its text in
  `action_field`, or whatever `action` (a `module:function(text, metadata) -> dict`) builds — and
  the server's observation comes back as one user message: its `observation_field`, or, when
  unset, the observation itself when its only field is text, else the observation as JSON.
- The step's reward is the server's reward (None counts 0); the server's `done` ends the episode,
  and so does `max_turns`.
- A server that cannot be reached, answers an error (a step that raised, a full server), dies
  mid-episode or misses `call_timeout_s` fails the call, naming the server's URL; the rollout server
  ends the episode as `env_error` or `step_timeout` — never a silent reward.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rlmesh.reward_server.environments.base import Message, ResetOutput, StepOutput, ToolSchema, load_callable
from rlmesh.reward_server.environments.loop_thread import LoopThread
from rlmesh.services.config import OpenEnvEnvironmentSection, default


@dataclass
class OpenEnvEpisode:
    client: Any  # openenv.core.GenericEnvClient, one WebSocket session
    metadata: dict[str, Any]
    turns: int = 0
    done: bool = False


class OpenEnvEnvironment:
    def __init__(self, name: str, url: str, *, action_field: str = default(OpenEnvEnvironmentSection, "action_field"), action: str | None = None,
                 observation_field: str | None = None, reset_keys: list[str] | None = None,
                 max_turns: int = default(OpenEnvEnvironmentSection, "max_turns"),
                 call_timeout_s: float = default(OpenEnvEnvironmentSection, "call_timeout_s")) -> None:
        self.name, self.url, self.max_turns = name, url, max_turns
        self.description = f"OpenEnv environment server at {url}"
        self.action_field, self.observation_field = action_field, observation_field
        self._action = load_callable(action) if action else None
        self.reset_keys = list(reset_keys if reset_keys is not None else ["seed"])
        self.call_timeout_s = call_timeout_s
        # Imported here, not at the first reset: the package takes seconds to import.
        from openenv.core import GenericEnvClient

        self._client_cls = GenericEnvClient
        self._loop = LoopThread(f"openenv-{name}", f"OpenEnv server {url}", call_timeout_s)

    def tools(self) -> list[ToolSchema]:
        return []

    def reset(self, metadata: dict[str, Any], prompt: list[Message]) -> ResetOutput:
        kwargs = {k: metadata[k] for k in self.reset_keys if k in metadata}
        # One client per episode: an OpenEnv server keeps one environment instance per WebSocket.
        client = self._client_cls(base_url=self.url, connect_timeout_s=self.call_timeout_s,
                                  message_timeout_s=self.call_timeout_s)

        async def open_and_reset():
            try:
                return await client.reset(**kwargs)
            except BaseException:
                await client.disconnect()
                raise

        result = self._loop.run(open_and_reset, "reset")
        episode = OpenEnvEpisode(client, dict(metadata), done=bool(result.done))
        text = render_observation(result.observation, self.observation_field, self.name)
        return ResetOutput(episode, [{"role": "user", "content": text}] if text else [])

    def step(self, state: OpenEnvEpisode, action: Message) -> StepOutput:
        if state.done:
            raise ValueError(f"{self.name}: the episode is over; close the session")
        state.turns += 1
        text = action.get("content", "")
        payload = self._action(text, state.metadata) if self._action else {self.action_field: text}
        if not isinstance(payload, dict):
            raise TypeError(f"{self.name}: the action function must return a dict of action fields, "
                            f"got {type(payload).__name__}")
        result = self._loop.run(lambda: state.client.step(payload), "step")
        reward = float(result.reward or 0.0)
        state.done = bool(result.done) or state.turns >= self.max_turns
        metadata: dict[str, Any] = {"turns": state.turns}
        if state.done and not result.done:
            metadata["end"] = "max_turns"
        observation = [] if state.done else [{"role": "user", "content": render_observation(result.observation, self.observation_field, self.name)}]
        return StepOutput(observation, reward=reward, done=state.done, metadata=metadata)

    def close(self, state: OpenEnvEpisode) -> None:
        state.done = True
        self._loop.submit(state.client.disconnect())


def render_observation(observation: dict[str, Any], field: str | None, env_name: str) -> str:
    """An OpenEnv observation (its fields without done, reward and metadata) as the text of the
    message the model reads next: `field` of it, or the observation itself when its only field is
    text, else the observation as JSON ("" for an empty one)."""
    if field is not None:
        if field not in observation:
            raise ValueError(f"{env_name}: the server's observation has no field {field!r} (it has "
                             f"{sorted(observation)}); set reward.openenv.{env_name}.observation_field to one of them")
        value = observation[field]
        return value if isinstance(value, str) else json.dumps(value)
    if len(observation) == 1 and isinstance(text := next(iter(observation.values())), str):
        return text
    return json.dumps(observation, sort_keys=True) if observation else ""
