"""The stall watch: an error that repeats for every group stops the run naming the tier and the
error; groups with no reward signal are reported with the numbers, then stop the run (or not)."""

import pytest

from rlmesh.learner.rl.watch import RunStalled, StallWatch, failure_limit, zero_signal_limit
from rlmesh.services.config import LearnerSection


class Rows(list):
    def write(self, record: dict) -> None:
        self.append(record)


def test_failures_in_a_row_stop_the_run_with_the_error_and_the_tier():
    rows = Rows()
    watch = StallWatch(rows, failure_limit=3, log_hint="/run/logs/{service}.log")
    for _ in range(2):
        watch.failed("rollout server rollout-0", "Cannot use chat template functions", "rollout-0")
    with pytest.raises(RunStalled, match=r"3 prompt groups in a row failed .* rollout server rollout-0: Cannot use "
                                         r"chat template functions \(its log: /run/logs/rollout-0.log\)"):
        watch.failed("rollout server rollout-0", "Cannot use chat template functions", "rollout-0")
    assert rows[-1]["kind"] == "alert" and rows[-1]["level"] == "fatal"


def test_a_success_in_between_resets_the_count():
    watch = StallWatch(Rows(), failure_limit=2)
    for _ in range(5):
        watch.failed("reward server", "reward function raised")
        watch.scored([0.0, 1.0])  # a group with a signal


def test_no_signal_is_reported_then_stops_the_run_or_goes_on_as_configured():
    rows = Rows()
    watch = StallWatch(rows, failure_limit=0, zero_signal_limit=8)
    for _ in range(7):
        watch.scored([0.0] * 4)
    warnings = [r for r in rows if r["level"] == "warning"]
    assert warnings and "groups in a row had every sample score the same (" in warnings[0]["message"]
    with pytest.raises(RunStalled, match=r"8 groups in a row .* \(8 at 0\)"):
        watch.scored([0.0] * 4)
    going_on = StallWatch(Rows(), failure_limit=0, zero_signal_limit=8, stop_on_zero_signal=False)
    for _ in range(20):
        going_on.scored([1.0] * 4)
    assert going_on.flat_in_a_row == 20


def test_limits_default_from_the_batch():
    assert failure_limit(LearnerSection(groups_per_step=8)) == 16
    assert failure_limit(LearnerSection(groups_per_step=2)) == 8
    assert zero_signal_limit(LearnerSection(groups_per_step=16)) == 128
    assert zero_signal_limit(LearnerSection(groups_per_step=2, stall={"zero_signal_groups": 5})) == 5


def test_groups_the_model_solves_are_told_apart_from_a_model_without_footing():
    """Flat groups mostly at the best reward of the run (others scored lower before) mean the prompts are
    solved: the advice is harder prompts, not the footing check (seen on reasoning-gym's basic_arithmetic,
    12 of 16 groups solved by all 8 samples at step 11)."""
    rows = Rows()
    watch = StallWatch(rows, failure_limit=0, zero_signal_limit=64)
    watch.scored([0.0, 1.0, 1.0, 0.0])  # a signal: the run has seen 0 and 1
    for r in [1.0] * 12 + [0.0] * 4:
        watch.scored([r] * 8)
    said = [r["message"] for r in rows if r["kind"] == "alert"][-1]
    assert "(12 at 1, 4 at 0)" in said and "the model solves these prompts" in said and "Harder prompts" in said
    assert "footing" not in said
    # A model that never scores: the footing advice, whatever the value it is stuck at.
    stuck = Rows()
    watch = StallWatch(stuck, failure_limit=0, zero_signal_limit=64)
    for _ in range(16):
        watch.scored([0.0] * 8)
    said = [r["message"] for r in stuck if r["kind"] == "alert"][-1]
    assert "rlmesh check" in said and "solves" not in said
