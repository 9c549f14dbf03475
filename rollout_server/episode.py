"""Multi-turn episodes against a reward server's sessions, token-in/token-out.

An episode is one `Session` stream to a reward server (see `reward_client`): reset (the
environment's first messages and its tools) → generate → step with the model's message → append
the environment's answer → generate again, until the environment says
done or a budget ends it (`rollout.episode`: turns, total tokens, per-call and per-episode time).

Token-in/token-out: what vLLM sampled is kept exactly, id for id, and the next turn is generated
from those same ids; only the environment's new messages are tokenized, through the model's own
chat template, and appended. Nothing is ever re-rendered from text, so the ids the learner trains
on are the ids vLLM sampled (re-tokenizing "579" sampled as "5" "79" would give other ids, and
other logprobs). Environment tokens carry loss_mask false and logprob 0; each turn records the
policy versions it was sampled under (`Sample.turns`).

An episode that fails (environment error, timeout) is reported with its reason in
`Sample.finish_reason` and `Sample.error`: the learner never trains on it (`on_error: drop`), or,
with `on_error: penalize`, it is trained with `error_reward` and marked by the `episode_failed`
component — never silently as reward 0. An episode cut by the turn or token budget is not a failure:
it keeps the reward its steps earned, with finish_reason `max_turns` or `max_tokens`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.json_format import MessageToDict

from rlmesh.v1 import common_pb2, reward_pb2
from rlmesh.services.domain.chat import as_dicts
from rlmesh.services.grpc_client import rpc_problem

if TYPE_CHECKING:
    from rlmesh.rollout_server.generator import Generation, VLLMGenerator
    from rlmesh.rollout_server.reward_client import EnvSession, RewardPool
    from rlmesh.services.config import EpisodeSection

log = logging.getLogger(__name__)

class EpisodeFailed(Exception):
    """The episode cannot go on; `reason` is a short name (`step_timeout`, `env_error`, ...)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


@dataclass
class EpisodeTrace:
    """One episode as it is built: the context vLLM sees and the completion the learner trains on."""

    context: list[int]
    num_prompt: int
    completion: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[common_pb2.Turn] = field(default_factory=list)
    reward: float = 0.0
    components: dict[str, float] = field(default_factory=dict)
    finish_reason: str = ""
    error: str = ""
    text: list[str] = field(default_factory=list)

    def add_sampled(self, gen: Generation) -> common_pb2.Turn:
        """One generation's ids, logprobs and text, appended as a turn (loss mask true)."""
        turn = common_pb2.Turn(start=len(self.completion), num_sampled_tokens=len(gen.token_ids),
                               min_version=gen.min_version, max_version=gen.max_version,
                               finish_reason=gen.finish_reason)
        self.turns.append(turn)
        self.context += gen.token_ids
        self.completion += gen.token_ids
        self.loss_mask += [True] * len(gen.token_ids)
        self.logprobs += gen.logprobs
        self.text.append(gen.text)
        return turn

    def add_env(self, ids: list[int]) -> None:
        self.context += ids
        self.completion += ids
        self.loss_mask += [False] * len(ids)
        self.logprobs += [0.0] * len(ids)


class EpisodeRunner:
    def __init__(self, generator: VLLMGenerator, pool: RewardPool, cfg: EpisodeSection, max_model_len: int) -> None:
        self.generator, self.pool, self.cfg = generator, pool, cfg
        self.max_total = min(cfg.max_total_tokens or max_model_len, max_model_len)
        self.codec = generator.codec
        self.num_failed = 0

    async def run_group(self, group: common_pb2.PromptGroup) -> tuple[list[int], list[common_pb2.Sample]]:
        """`n` episodes of one prompt. The group's prompt ids are the longest prefix every episode's
        first context shares; the rest of an episode's first context (e.g. a per-session
        observation) opens its completion with loss_mask false."""
        if group.n < 1:
            raise ValueError(f"group {group.group_id}: n={group.n} must be >= 1")
        if group.prompt_tokens.token_ids:
            raise ValueError(f"group {group.group_id}: environment {group.env_name!r} is multi-turn and needs chat "
                             "messages, not prompt_tokens")
        priority = self.generator.claim_order()  # every turn of every episode takes the group's place
        traces = await asyncio.gather(*(self.run_episode(group, i, priority) for i in range(group.n)))
        started = [t.context[: t.num_prompt] for t in traces if t.num_prompt]
        shared = common_prefix(started) if started else []
        penalty = self.cfg.error_reward if self.cfg.on_error == "penalize" else None
        samples = [trace_sample(i, t, len(shared), self.generator.version, penalty) for i, t in enumerate(traces)]
        return shared, samples

    async def run_episode(self, group: common_pb2.PromptGroup, index: int, priority: int | None = None) -> EpisodeTrace:
        trace = EpisodeTrace(context=[], num_prompt=0)
        session: EnvSession | None = None
        try:
            async with asyncio.timeout(self.cfg.episode_timeout_s):
                reset = reward_pb2.ResetRequest(env_name=group.env_name, env_metadata=group.env_metadata,
                                                prompt=group.messages)
                try:
                    session, reply = await self.pool.open_session(
                        reset, timeout_s=self.cfg.step_timeout_s,
                        stream_timeout_s=self.cfg.episode_timeout_s + self.cfg.step_timeout_s)
                except (grpc.aio.AioRpcError, TimeoutError) as err:
                    raise self._env_failed(group.env_name, "reset", "the reward tier", err) from None
                tools = [MessageToDict(t) for t in reply.tools]
                try:
                    trace.context = self.codec.prompt(as_dicts(group.messages) + as_dicts(reply.observation), tools)
                except ValueError as err:
                    raise EpisodeFailed("invalid_prompt", str(err)) from None
                trace.num_prompt = len(trace.context)
                await self._turns(group, index, session, tools, trace, priority)
        except EpisodeFailed as err:
            trace.finish_reason, trace.error = err.reason, str(err)
        except TimeoutError:
            trace.finish_reason = "episode_timeout"
            trace.error = (f"episode_timeout: the episode ran past rollout.episode.episode_timeout_s="
                           f"{self.cfg.episode_timeout_s}s")
        finally:
            if session is not None:
                await session.close(self.cfg.step_timeout_s)
        if trace.error:
            self.num_failed += 1
            log.warning("group %s episode %d failed: %s", group.group_id, index, trace.error)
        return trace

    async def _turns(self, group: common_pb2.PromptGroup, index: int, session: EnvSession,
                     tools: list[dict[str, Any]], trace: EpisodeTrace, priority: int | None = None) -> None:
        for turn in range(self.cfg.max_turns):
            budget = self.max_total - len(trace.context)
            if budget < 1:
                trace.finish_reason = "max_tokens"
                return
            params = self.generator.sampling_params(group, index, max_tokens=budget, turn=turn)
            request_id = f"{group.group_id}-{index}-t{turn}-{uuid.uuid4().hex[:8]}"
            try:
                gen = await self.generator.generate_ids(trace.context, params, request_id, priority=priority)
            except ValueError as err:  # vLLM refused the request (e.g. the context no longer fits)
                raise EpisodeFailed("invalid_request", str(err)) from None
            record = trace.add_sampled(gen)

            t0 = time.monotonic()
            action = common_pb2.ChatMessage(role="assistant", content=gen.text)
            try:
                reply = await session.exchange(reward_pb2.SessionRequest(step=reward_pb2.StepRequest(action=action)),
                                               self.cfg.step_timeout_s)
            except (grpc.aio.AioRpcError, TimeoutError) as err:
                raise self._env_failed(group.env_name, "step", f"reward server {session.address}", err) from None
            step = reply.step
            record.env_seconds = time.monotonic() - t0
            record.reward = step.reward
            trace.reward += step.reward
            if step.done:
                trace.components = dict(step.components)
                trace.finish_reason = "done"
                return
            ended_with_eos = bool(gen.token_ids) and gen.token_ids[-1] == self.codec.eos_id
            try:
                env_ids = self.codec.continuation(as_dicts(step.observation), tools, ended_with_eos)
            except ValueError as err:
                raise EpisodeFailed("invalid_observation", str(err)) from None
            trace.add_env(env_ids)
            record.num_env_tokens = len(env_ids)
        trace.finish_reason = "max_turns"

    def _env_failed(self, env_name: str, what: str, where: str, err: BaseException) -> EpisodeFailed:
        """The episode's ending for a reset or step that failed (`step_timeout` or `env_error`)."""
        if isinstance(err, TimeoutError) or (isinstance(err, grpc.aio.AioRpcError)
                                             and err.code() == grpc.StatusCode.DEADLINE_EXCEEDED):
            said = f" ({err.details()})" if isinstance(err, grpc.aio.AioRpcError) else ""
            return EpisodeFailed("step_timeout", f"environment {env_name!r}: the {what} took longer than "
                                                 f"rollout.episode.step_timeout_s={self.cfg.step_timeout_s}s{said}")
        return EpisodeFailed("env_error", f"environment {env_name!r}: the {what} on {where} failed: {rpc_problem(err)}")


def trace_sample(index: int, trace: EpisodeTrace, num_shared: int, version: int,
                 error_reward: float | None = None) -> common_pb2.Sample:
    """The sample of one recorded episode. The first `num_shared` context ids are the group's prompt;
    the rest of the episode's first context opens the completion with loss mask false. A failed episode
    carries its error (never trained), or with `error_reward` set is trained with that reward and
    marked by the `episode_failed` component."""
    head = trace.context[num_shared: trace.num_prompt] if trace.num_prompt else []
    for turn in trace.turns:
        turn.start += len(head)
    sample = common_pb2.Sample(
        index=index,
        completion=common_pb2.TokenSequence(token_ids=head + trace.completion,
                                            loss_mask=[False] * len(head) + trace.loss_mask),
        logprobs=[0.0] * len(head) + trace.logprobs,
        finish_reason=trace.finish_reason,
        min_version=min((t.min_version for t in trace.turns), default=version),
        max_version=max((t.max_version for t in trace.turns), default=version),
        reward=trace.reward,
        text="".join(trace.text),
        num_turns=len(trace.turns),
        turns=trace.turns,
    )
    sample.reward_components.update(trace.components)
    if trace.error and error_reward is not None and trace.completion:
        sample.reward = error_reward
        sample.reward_components["episode_failed"] = 1.0
    elif trace.error:
        sample.error = trace.error
    return sample


def common_prefix(seqs: list[list[int]]) -> list[int]:
    first = seqs[0]
    n = len(first)
    for s in seqs[1:]:
        n = min(n, len(s))
        for j in range(n):
            if s[j] != first[j]:
                n = j
                break
    return first[:n]
