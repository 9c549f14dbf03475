"""The learner's admission rules, with a recording fake in place of the Redis stream."""

from pathlib import Path

import pytest

from learner.data import Example
from learner.driver import Learner
from rlmesh.v1 import common_pb2
from services.config import load_config
from services.queue import Entry


class FakeQueue:
    def __init__(self):
        self.published: list[str] = []
        self.acked: list[str] = []

    async def publish(self, key, data, **_):
        self.published.append(key)
        return key

    async def ack(self, *ids):
        self.acked.extend(ids)
        return len(ids)


class NullWriter:
    def write(self, record):
        pass


def _learner(tmp_path: Path, k: int = 1, groups_per_step: int = 4) -> Learner:
    config = load_config(None, ["model.type=hf", "model.path=unused", f"algorithm.max_staleness={k}",
                                f"learner.groups_per_step={groups_per_step}"])
    learner = Learner(config, tmp_path)
    learner.prompts, learner.trajectories = FakeQueue(), FakeQueue()
    learner.dropped_log = NullWriter()
    learner.train_set = [Example(str(i), f"{i}+1=", str(i + 1), "arithmetic") for i in range(10)]
    return learner


def _group(gid: str, versions: list[tuple[int, int]], errors: int = 0, rewards=None) -> tuple[Entry, common_pb2.TrajectoryGroup]:
    samples = [common_pb2.Sample(index=i, min_version=lo, max_version=hi, reward=(rewards or [1.0, 0.0] * 4)[i],
                                 error="boom" if i < errors else "") for i, (lo, hi) in enumerate(versions)]
    group = common_pb2.TrajectoryGroup(group_id=gid, samples=samples)
    return Entry(id=f"e-{gid}", key=gid, data=b""), group


async def test_issuance_keeps_at_most_k_plus_one_steps_outstanding(tmp_path):
    learner = _learner(tmp_path, k=1, groups_per_step=4)
    await learner.issue_train_prompts(num_buffered=0)
    assert learner.in_flight == 8 and len(learner.prompts.published) == 8
    await learner.issue_train_prompts(num_buffered=0)
    assert len(learner.prompts.published) == 8, "no more than (k+1)*B outstanding"
    learner.in_flight = 4
    await learner.issue_train_prompts(num_buffered=4)
    assert len(learner.prompts.published) == 8, "buffered groups count as outstanding"


async def test_synchronous_mode_issues_exactly_one_step(tmp_path):
    learner = _learner(tmp_path, k=0, groups_per_step=4)
    await learner.issue_train_prompts(num_buffered=0)
    assert learner.in_flight == 4


async def test_fresh_group_is_accepted(tmp_path):
    learner = _learner(tmp_path)
    learner.version, learner.in_flight = 3, 5
    assert await learner._accept(*_group("a", [(2, 3)] * 4))
    assert learner.in_flight == 4 and learner.trajectories.acked == []


async def test_too_stale_group_is_dropped_counted_and_acked(tmp_path):
    learner = _learner(tmp_path, k=1)
    learner.version, learner.in_flight = 5, 3
    assert not await learner._accept(*_group("old", [(3, 4), (4, 4), (4, 4), (4, 4)]))
    assert learner.num_dropped_stale == 1 and learner.trajectories.acked == ["e-old"]
    assert learner.in_flight == 2


async def test_duplicate_of_a_trained_group_is_acked_without_counting_in_flight(tmp_path):
    learner = _learner(tmp_path)
    learner.trained_groups.add("dup")
    learner.in_flight = 2
    assert not await learner._accept(*_group("dup", [(0, 0)] * 4))
    assert learner.num_duplicates == 1 and learner.in_flight == 2 and learner.trajectories.acked == ["e-dup"]


async def test_group_from_weights_lost_in_a_restart_is_dropped(tmp_path):
    learner = _learner(tmp_path)
    learner.version = 4
    assert not await learner._accept(*_group("future", [(5, 5)] * 4))
    assert learner.num_dropped_other == 1


async def test_group_with_fewer_than_two_valid_samples_is_dropped(tmp_path):
    learner = _learner(tmp_path)
    assert not await learner._accept(*_group("errs", [(0, 0)] * 4, errors=3))
    assert learner.num_dropped_other == 1


@pytest.mark.parametrize("drop", [True, False])
async def test_dynamic_sampling_drops_groups_without_signal(tmp_path, drop):
    learner = _learner(tmp_path)
    learner.config.algorithm.drop_zero_advantage_groups = drop
    accepted = await learner._accept(*_group("flat", [(0, 0)] * 4, rewards=[1.0] * 4))
    assert accepted is (not drop)


def test_linear_schedule_decays_from_peak_to_final_ratio(tmp_path):
    learner = _learner(tmp_path)
    learner.config.learner.lr_schedule = "linear"
    learner.config.learner.num_steps = 11
    learner.config.learner.lr_final_ratio = 0.1
    lr = learner.config.learner.lr
    rates = []
    for v in range(11):
        learner.version = v
        rates.append(learner.learning_rate())
    assert rates[0] == pytest.approx(lr) and rates[-1] == pytest.approx(0.1 * lr)
    assert all(a > b for a, b in zip(rates, rates[1:]))
    learner.config.learner.lr_schedule = "constant"
    assert learner.learning_rate() == lr
