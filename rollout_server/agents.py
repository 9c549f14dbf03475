"""Agent episodes of a prompt group: the user's agent (run by the reward tier, RunAgent) drives the
policy through its episode's OpenAI-compatible endpoint (`rlmesh.rollout_server.agent_endpoint`)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import grpc

from rlmesh.rollout_server.episode import EpisodeTrace, common_prefix
from rlmesh.v1 import common_pb2, reward_pb2

if TYPE_CHECKING:
    from rlmesh.rollout_server.agent_endpoint import AgentEndpoint, AgentEpisode
    from rlmesh.rollout_server.reward_client import RewardPool

log = logging.getLogger(__name__)


class AgentRunner:
    """Runs the `n` episodes of an `agent` environment's prompt group: each gets an episode on the
    endpoint, the reward server runs the user's agent against it (RunAgent), and the episode's
    recorded calls become its sample, with the reward the agent returned. An agent that failed
    (timeout, crash, bad reward, no call, edited history) leaves its sample's error set: never
    trained, never as reward 0."""

    def __init__(self, endpoint: AgentEndpoint | None, pool: RewardPool, timeout_s: float) -> None:
        self.endpoint, self.pool, self.timeout_s = endpoint, pool, timeout_s

    async def run_group(self, group: common_pb2.PromptGroup) -> tuple[list[int], list[common_pb2.Sample]]:
        if self.endpoint is None:
            raise ValueError(f"group {group.group_id}: environment {group.env_name!r} is an agent, and this rollout "
                             "server serves no agent endpoint: set rollout.agent_endpoint.enabled=true")
        if group.n < 1:
            raise ValueError(f"group {group.group_id}: n={group.n} must be >= 1")
        if not group.messages:
            raise ValueError(f"group {group.group_id}: environment {group.env_name!r} is an agent and needs chat "
                             "messages, not prompt_tokens")

        async def one(index: int) -> AgentEpisode:
            episode = self.endpoint.open(group, index)
            request = reward_pb2.RunAgentRequest(env_name=group.env_name, prompt=group.messages,
                                                 env_metadata=group.env_metadata, base_url=self.endpoint.url,
                                                 api_key=episode.key)
            replica = self.pool.pick()
            try:  # never retried: a second run of the agent would be another episode
                reply = await replica.stub.RunAgent(request, timeout=self.timeout_s)
            except grpc.aio.AioRpcError as err:  # the reward tier failed this episode: it ends with the reason
                reply = reward_pb2.RunAgentResponse(error=f"env_error: RunAgent on reward server {replica.address} "
                                                          f"failed: {err.code().name}: {err.details()}")
            trace = episode.trace
            trace.reward, trace.components = reply.reward, dict(reply.components)
            if reply.error and not trace.error:
                trace.finish_reason, trace.error = reply.error.split(":", 1)[0], reply.error
            elif reply.turn_rewards and not trace.error:
                credit_turns(trace, list(reply.turn_rewards), group.env_name)
            return episode

        episodes = await asyncio.gather(*(one(i) for i in range(group.n)))
        for e in episodes:
            self.endpoint.end(e)
        # The group's prompt: the longest start every episode's first call shares (an agent's own
        # system prompt or per-episode context opens its completion, masked out).
        started = [e.trace.context[: e.trace.num_prompt] for e in episodes if e.trace.num_prompt]
        shared = common_prefix(started) if started else []
        samples = [self.endpoint.close(e, len(shared)) for e in episodes]
        for s in samples:
            if s.error:
                log.warning("group %s agent episode %d failed: %s", group.group_id, s.index, s.error)
        return shared, samples


def credit_turns(trace: EpisodeTrace, turn_rewards: list[float], env_name: str) -> None:
    """Puts an agent's reward per model call on the episode's turns (the calls recorded, in order); a
    count that is not the number of calls fails the episode `agent_bad_reward` (a reward per turn
    cannot be matched to turns otherwise)."""
    if len(turn_rewards) != len(trace.turns):
        trace.finish_reason = "agent_bad_reward"
        trace.error = (f"agent_bad_reward: agent {env_name!r} returned {len(turn_rewards)} turn_rewards for "
                       f"{len(trace.turns)} model call(s) recorded; return one per call, in order")
        return
    for turn, reward in zip(trace.turns, turn_rewards):
        turn.reward = reward
