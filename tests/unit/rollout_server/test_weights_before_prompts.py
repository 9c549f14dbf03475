"""A rollout server generates a prompt group only once it holds the version the group was issued at
(the learner issues prompts at a version as soon as it has sent it, before every server has loaded
it): the worker's real queue loop on a real Valkey, with a stand-in generator whose version the test
moves. A group an earlier learner process issued does not wait; one whose version does not come in
time is handed back, unacked, for any server to claim."""

from __future__ import annotations

import asyncio
import logging
import uuid

from rlmesh.rollout_server import worker as worker_module
from rlmesh.rollout_server.worker import RolloutWorker
from rlmesh.services.config import QueueSection
from rlmesh.services.queue import connect, run_streams
from rlmesh.v1 import common_pb2, reward_pb2


class Generator:
    """Generates at whatever `version` holds; records the version of each group it generated."""

    def __init__(self) -> None:
        self.version = 0
        self.generated: dict[str, int] = {}

    async def generate_group(self, group: common_pb2.PromptGroup):
        self.generated[group.group_id] = self.version
        samples = [common_pb2.Sample(index=i, min_version=self.version, max_version=self.version, logprobs=[-0.1],
                                     completion=common_pb2.TokenSequence(token_ids=[5], loss_mask=[True]))
                   for i in range(group.n)]
        return [1, 2], samples


class Rewards:
    async def kind(self, env_name: str) -> str:
        return "single_turn"

    async def score(self, request, what):
        return reward_pb2.ScoreResponse(results=[reward_pb2.ScoreResult(id=i.id, reward=1.0) for i in request.items])


async def _worker(valkey_url: str):
    cfg = QueueSection(url=valkey_url, prompt_stream=f"p-{uuid.uuid4().hex}", trajectory_stream=f"t-{uuid.uuid4().hex}")
    prompts, trajectories = run_streams(connect(valkey_url), cfg)
    generator = Generator()
    worker = RolloutWorker(generator, prompts, trajectories, Rewards(), None, consumer="gen-1", max_concurrent_groups=4,
                           max_abs_reward=10)
    worker.learner_run_id = "run-now"
    worker.ready.set()
    return worker, generator, prompts, trajectories


async def _issue(prompts, group_id: str, run_id: str, version: int) -> None:
    group = common_pb2.PromptGroup(group_id=group_id, run_id=run_id, n=2, issued_at_version=version, split="train")
    await prompts.publish(group_id, group.SerializeToString())


async def _until(predicate, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("timed out")


async def test_a_group_waits_for_the_version_it_was_issued_at_one_of_an_earlier_learner_does_not(valkey_url):
    worker, generator, prompts, trajectories = await _worker(valkey_url)
    running = asyncio.create_task(worker.run())
    try:
        await _issue(prompts, "run-now/train/0/a", "run-now", version=1)
        await _issue(prompts, "run-old/train/7/b", "run-old", version=5)  # leftover of a restarted learner
        await _until(lambda: "run-old/train/7/b" in generator.generated)
        await asyncio.sleep(0.5)
        assert "run-now/train/0/a" not in generator.generated and worker.num_inflight == 1  # claimed, waiting
        generator.version = 1
        worker.weights_changed()
        await _until(lambda: worker.num_completed == 2)
        assert generator.generated == {"run-old/train/7/b": 0, "run-now/train/0/a": 1}
        published = {e.key: common_pb2.TrajectoryGroup.FromString(e.data)
                     for e in await trajectories.read("learner", count=10, block_ms=100)}
        assert {s.min_version for s in published["run-now/train/0/a"].samples} == {1}
        assert (await prompts.depth()).pending == 0  # both acked
    finally:
        running.cancel()
        await worker.stop()


async def test_a_group_whose_version_does_not_come_is_handed_back_unacked(valkey_url, monkeypatch, caplog):
    monkeypatch.setattr(worker_module, "WEIGHTS_WAIT_S", 0.3)
    worker, generator, prompts, _ = await _worker(valkey_url)
    running = asyncio.create_task(worker.run())
    try:
        with caplog.at_level(logging.WARNING, logger=worker_module.__name__):
            await _issue(prompts, "run-now/train/0/c", "run-now", version=3)
            await _until(lambda: "left for another server" in caplog.text)
            await _until(lambda: worker.num_inflight == 0)
        assert generator.generated == {} and worker.num_completed == 0
        assert "issued at version 3; this server still holds 0" in caplog.text
        assert not worker._working  # no longer kept claimed: another server takes it after claim_idle_ms
        assert (await prompts.depth()).pending == 1  # not acked: nothing lost
    finally:
        running.cancel()
        await worker.stop()
