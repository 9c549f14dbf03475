"""GPU-only paths, skipped without CUDA (see tests/conftest.py). They have not run yet: the
machines this was written on have no GPU. On a CUDA host with `pip install -e .[train,gpu,dev]`:
    pytest -m gpu tests/e2e/test_gpu_paths.py"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.gpu]
REPO = Path(__file__).resolve().parents[2]


def _up(run_dir: Path, *overrides: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "rlmesh.cli", "up", "-c", str(REPO / "examples/arithmetic_grpo.yaml"),
                           "--run-dir", str(run_dir), "logging.progress=false", *overrides], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads((run_dir / "summary.json").read_text())


def test_nccl_broadcast_into_vllm_learns(tmp_path):
    """The learner (FSDP2 on CUDA) pushes every version over NCCL into vLLM's own `nccl` engine."""
    summary = _up(tmp_path / "run", "weight_sync.backend=nccl", "learner.num_steps=30", "learner.eval_every=0")
    assert summary["weight_transport"] == "nccl"
    assert summary["weights_sent_versions"] >= 30
    assert summary["held_out_accuracy_after"] >= summary["held_out_accuracy_before"] + 0.2


def test_two_rank_nccl_learner_with_nccl_broadcast(tmp_path):
    summary = _up(tmp_path / "run", "weight_sync.backend=nccl", "learner.num_ranks=2", "learner.num_steps=20",
                  "learner.eval_every=0")
    assert summary["num_ranks"] == 2 and summary["weights_sent_versions"] >= 20
