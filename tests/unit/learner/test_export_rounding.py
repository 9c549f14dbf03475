"""`rlmesh export` to a 16-bit dtype says when rounding puts the trained weights back where the run started."""

from __future__ import annotations

import logging

import pytest
import yaml

torch = pytest.importorskip("torch")
from safetensors.torch import save_file  # noqa: E402

from rlmesh.learner.train.checkpoint import warn_if_rounded_back  # noqa: E402


def _run(tmp_path, start: dict, param_dtype: str = "float32") -> tuple:
    model_dir, checkpoint = tmp_path / "start", tmp_path / "run" / "checkpoints" / "step_000016"
    model_dir.mkdir()
    checkpoint.mkdir(parents=True)
    save_file(start, str(model_dir / "model.safetensors"))
    (tmp_path / "run" / "config.resolved.yaml").write_text(yaml.safe_dump({"model": {"path": str(model_dir)},
                                                                          "learner": {"backend": {"param_dtype": param_dtype}}}))
    return checkpoint


def test_updates_below_half_a_bf16_step_are_reported_as_lost(tmp_path, caplog):
    g = torch.Generator().manual_seed(0)
    start = {"w": torch.randn(64, 64, generator=g).to(torch.bfloat16), "b": torch.randn(64, generator=g).to(torch.bfloat16)}
    checkpoint = _run(tmp_path, start)
    # An RL run's worth of updates: 1e-5 per step, 16 steps, on weights of magnitude ~1 (bf16's step there: 2^-7).
    small = {n: t.float() + 16e-5 * torch.randn(t.shape, generator=g).sign() for n, t in start.items()}
    with caplog.at_level(logging.WARNING):
        assert warn_if_rounded_back(small, checkpoint, "bfloat16") > 0.9
    assert "round back to the starting model's" in caplog.text and "--dtype float32" in caplog.text
    caplog.clear()
    large = {n: t.float() + 0.05 * torch.randn(t.shape, generator=g) for n, t in start.items()}
    assert warn_if_rounded_back(large, checkpoint, "bfloat16") < 0.5 and caplog.text == ""


def test_a_run_that_computed_in_bf16_exports_its_own_policy_without_a_warning(tmp_path, caplog):
    # learner.backend.param_dtype=bfloat16: the learner computed, and vLLM served, the rounded weights.
    start = {"w": torch.ones(64, 64).to(torch.bfloat16)}
    checkpoint = _run(tmp_path, start, param_dtype="bfloat16")
    with caplog.at_level(logging.WARNING):
        assert warn_if_rounded_back({"w": torch.ones(64, 64) + 1e-5}, checkpoint, "bfloat16") is None
    assert caplog.text == ""


def test_without_the_starting_model_nothing_is_claimed(tmp_path):
    checkpoint = _run(tmp_path, {"w": torch.zeros(2, 2)})
    (tmp_path / "run" / "config.resolved.yaml").write_text(yaml.safe_dump({"model": {"path": str(tmp_path / "gone")}}))
    assert warn_if_rounded_back({"w": torch.zeros(2, 2)}, checkpoint, "bfloat16") is None
