"""The KL penalty (a frozen reference per rank, in the loss and in the reward, whose per-sequence KL
is gathered over ranks) and token-budget micro-batches (uneven micro-batch counts per rank, evened
out by empty ones) under torchrun: 2 gloo ranks (and 3, with the token budget) step like 1.

Tolerances as test_multirank_learner.py: loss 1e-5 absolute; each tensor's sum and norm 1e-4 relative."""

from __future__ import annotations

import pytest

from tests.integration.learner_rank_job import torchrun as run_job  # noqa: E402
from tests.integration.test_multirank_learner import assert_same_weights  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("overrides", [
    ("algorithm.kl.coef=0.5", "algorithm.kl.where=loss", "learner.max_tokens_per_micro_batch=40"),
    ("algorithm.kl.coef=0.5", "algorithm.kl.where=reward", "algorithm.kl.estimator=k1"),
], ids=["kl_loss_budget", "kl_reward"])
def test_ranks_step_like_one(tiny_model_dir, tmp_path, overrides):
    flags = [f"--override={o}" for o in overrides]
    one = run_job("learner_rank_job.py", 1, str(tiny_model_dir), str(tmp_path / "one.json"), *flags)
    # 3 ranks where micro-batch counts differ per rank (the token budget); the gathered reward-side KL needs 2.
    for nproc in (2, 3) if "learner.max_tokens_per_micro_batch=40" in overrides else (2,):
        many = run_job("learner_rank_job.py", nproc, str(tiny_model_dir), str(tmp_path / f"{nproc}.json"), *flags)
        assert many["world_size"] == nproc
        assert many["loss"] == pytest.approx(one["loss"], abs=1e-5)
        if "algorithm.kl.where=reward" in overrides:
            # Computed over the whole batch (gathered), unlike loss-side metrics, which are means of
            # micro-batch means and so depend on the split.
            assert [m["kl_ref"] for m in many["metrics"]] == pytest.approx(
                [m["kl_ref"] for m in one["metrics"]], rel=1e-4, abs=1e-7)
        assert_same_weights(one["weights"], many["weights"])
    assert one["metrics"][-1]["kl_ref"] != 0


def test_ranks_training_in_parts_step_like_one_at_once(tiny_model_dir, tmp_path):
    """learner.train_on_arrival on 2 ranks (and 3, under the token budget, micro-batch counts uneven
    per part): each step accumulated over parts of its groups as they would arrive, then one optimizer
    step, updates the weights as one rank stepping on the whole batch at once."""
    flags = ["--override=learner.max_tokens_per_micro_batch=40"]
    one = run_job("learner_rank_job.py", 1, str(tiny_model_dir), str(tmp_path / "one.json"), *flags)
    for nproc in (2, 3):
        many = run_job("learner_rank_job.py", nproc, str(tiny_model_dir), str(tmp_path / f"{nproc}.json"), *flags,
                       "--parts=3")
        assert many["world_size"] == nproc
        assert many["loss"] == pytest.approx(one["loss"], abs=1e-5)
        assert_same_weights(many["weights"], one["weights"])
