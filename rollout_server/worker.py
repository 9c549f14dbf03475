"""The rollout server's queue loop: prompt groups in, scored trajectory groups out.

A prompt entry is acked only after its trajectory group is in the trajectory stream; entries a
dead server left pending are claimed after `queue.claim_idle_ms`. A live server refreshes the idle
time of the entries it is still generating, so a long generation is never mistaken for a dead
server's work and done twice. The refresh runs on its own thread with its own connection: an
event loop busy with a large batch of outputs must not let its claims lapse. Prompts that cannot be parsed go
to a dead-letter stream with the reason (never silently dropped). A sample whose reward is not
finite or beyond `reward.max_abs_reward`, or whose token data do not line up, fails with the
reason (`error`), so it is never trained on; the learner checks every group again."""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import Counter

from google.protobuf.message import DecodeError

from rlmesh.v1 import common_pb2, reward_pb2
from rlmesh.rollout_server.agents import AgentRunner
from rlmesh.rollout_server.episode import EpisodeRunner
from rlmesh.rollout_server.generator import VLLMGenerator, rejects
from rlmesh.rollout_server.reward_client import AGENT, MULTI_TURN, RewardPool
from rlmesh.services.queue import Entry, StreamQueue
from rlmesh.services.telemetry import group_span

log = logging.getLogger(__name__)


def sample_problem(sample: common_pb2.Sample, max_abs_reward: float) -> str:
    """Why a scored sample must not be trained on, or ""."""
    n = len(sample.completion.token_ids)
    if len(sample.completion.loss_mask) != n or len(sample.logprobs) != n:
        return (f"{n} completion tokens, {len(sample.completion.loss_mask)} loss-mask entries and "
                f"{len(sample.logprobs)} logprobs")
    values = {"reward": sample.reward, **{f"reward component {k!r}": v for k, v in sample.reward_components.items()}}
    for name, value in values.items():
        if not (math.isfinite(value) and abs(value) <= max_abs_reward):
            return f"{name} {value} is not finite or beyond +/-{max_abs_reward:g} (reward.max_abs_reward)"
    return ""


class RolloutWorker:
    def __init__(self, generator: VLLMGenerator, prompts: StreamQueue, trajectories: StreamQueue,
                 rewards: RewardPool, episodes: EpisodeRunner, *, consumer: str, max_concurrent_groups: int,
                 max_abs_reward: float, queue_url: str | None = None, agents: AgentRunner | None = None) -> None:
        self.generator, self.prompts, self.trajectories = generator, prompts, trajectories
        self.rewards, self.episodes = rewards, episodes
        self.agents = agents or AgentRunner(None, rewards, 0.0)
        self.consumer = consumer
        self.max_concurrent_groups = max_concurrent_groups
        self.max_abs_reward = max_abs_reward
        self.ready = asyncio.Event()  # set once this server holds the learner's current weights
        self.num_inflight = 0
        self.num_completed = 0
        self.num_claimed = 0
        self.num_duplicates = 0
        self.finish_reasons: Counter[str] = Counter()  # samples and episodes published, by finish reason
        self._tasks: set[asyncio.Task] = set()
        self._working: set[str] = set()  # prompt entry ids being generated here
        self._keepalive_stop = threading.Event()
        if queue_url is not None:
            threading.Thread(target=self._keep_claims, args=(queue_url,), name="claim-keepalive", daemon=True).start()

    def _keep_claims(self, url: str) -> None:
        """Reset the idle time of every entry still being generated, every claim_idle_ms / 4."""
        refresh = self.prompts.claim_refresher(url)
        period = self.prompts.claim_idle_ms / 4000
        while not self._keepalive_stop.wait(period):
            working = list(self._working)
            if working:
                refresh(self.consumer, working)

    async def run(self) -> None:
        await self.prompts.ensure_group()
        await self.trajectories.ensure_group()
        last_claim = 0.0
        replayed = False
        while True:
            if not self.ready.is_set():
                await asyncio.sleep(0.2)
                continue
            free = self.max_concurrent_groups - self.num_inflight
            if free <= 0:
                await asyncio.sleep(0.01)
                continue
            entries: list[Entry] = []
            if not replayed:
                # A server restarted under the same name first finishes what it held when it died.
                entries = await self.prompts.read_own_pending(self.consumer, count=100000)
                replayed = True
                if entries:
                    log.warning("resuming %d prompt groups this server held when it last stopped", len(entries))
            elif time.monotonic() - last_claim > self.prompts.claim_idle_ms / 2000:
                entries = await self.prompts.claim_stale(self.consumer, count=free)
                if entries:
                    self.num_claimed += len(entries)
                    log.warning("claimed %d prompt groups left pending by a dead rollout server", len(entries))
                last_claim = time.monotonic()
            if not entries:
                entries = await self.prompts.read(self.consumer, count=free, block_ms=200)
            for entry in entries:
                self.num_inflight += 1
                self._working.add(entry.id)
                task = asyncio.create_task(self._handle(entry))
                self._tasks.add(task)
                task.add_done_callback(lambda t, entry_id=entry.id: self._done(t, entry_id))

    def _done(self, task: asyncio.Task, entry_id: str) -> None:
        self._tasks.discard(task)
        self._working.discard(entry_id)
        self.num_inflight -= 1
        if not task.cancelled() and task.exception() is not None:
            # Unexpected failures leave the entry pending (claimed later); surface them loudly.
            log.error("prompt group failed: %r", task.exception())

    async def _handle(self, entry: Entry) -> None:
        try:
            group = common_pb2.PromptGroup.FromString(entry.data)
        except DecodeError as err:
            await self._dead_letter(entry, f"undecodable PromptGroup: {err}")
            return
        t0 = time.monotonic()
        trace_context: dict[str, str] = {}
        # Continues the learner's trace of this group; the reward server's spans (Score, or an
        # episode's Reset/Step/Close) join it through the gRPC metadata.
        with group_span("generate", group.group_id, parent=group.trace_context, carrier=trace_context,
                        version=self.generator.version, generator=self.consumer):
            try:
                kind = await self.rewards.kind(group.env_name)
                if kind == MULTI_TURN:
                    prompt_ids, samples = await self.episodes.run_group(group)  # scored step by step
                elif kind == AGENT:
                    prompt_ids, samples = await self.agents.run_group(group)  # the user's agent drives
                else:
                    prompt_ids, samples = await self.generator.generate_group(group)
                    with group_span("score", group.group_id):
                        await self._score(group, samples)
            except Exception as err:
                if not rejects(err):
                    raise
                await self._dead_letter(entry, f"{type(err).__name__}: {err}")
                return
        for sample in samples:
            self.finish_reasons[sample.finish_reason or "error"] += 1
            if not sample.error and (problem := sample_problem(sample, self.max_abs_reward)):
                log.warning("group %s sample %d failed: %s", group.group_id, sample.index, problem)
                sample.error = f"invalid_sample: {problem}"
        trajectory = common_pb2.TrajectoryGroup(
            group_id=group.group_id, run_id=group.run_id, prompt=group, prompt_token_ids=prompt_ids,
            samples=samples, generator_id=self.consumer, generation_seconds=time.monotonic() - t0,
            trace_context=trace_context,
        )
        if await self.trajectories.publish(group.group_id, trajectory.SerializeToString()) is None:
            self.num_duplicates += 1
            log.warning("group %s was already published (generated twice); this copy is dropped", group.group_id)
        await self.prompts.ack(entry.id)
        self.num_completed += 1

    async def _score(self, group: common_pb2.PromptGroup, samples: list[common_pb2.Sample]) -> None:
        request = reward_pb2.ScoreRequest(items=[
            reward_pb2.ScoreItem(id=str(s.index), env_name=group.env_name, prompt=group.messages,
                                 completion=s.text, completion_token_ids=s.completion.token_ids,
                                 env_metadata=group.env_metadata)
            for s in samples
        ])
        reply = await self.rewards.score(request, f"group {group.group_id}")
        # Matched by id: a reply that leaves a sample out must not leave it at reward 0.
        results = {r.id: r for r in reply.results}
        for sample in samples:
            result = results.get(str(sample.index))
            if result is None:
                sample.error = f"invalid_sample: the reward server returned no result for item {sample.index}"
                continue
            sample.reward = result.reward
            sample.reward_components.update(result.components)
            if result.error:
                sample.error = result.error

    async def _dead_letter(self, entry: Entry, reason: str) -> None:
        log.error("prompt entry %s (key %s) rejected: %s", entry.id, entry.key, reason)
        await self.prompts.dead_letter(entry, reason, by=self.consumer)

    async def stop(self) -> None:
        self._keepalive_stop.set()
        for task in list(self._tasks):
            task.cancel()
