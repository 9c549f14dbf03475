"""learner.backend.param_dtype=auto: bfloat16 only where this machine's bf16 matmul is clearly faster,
one answer for every rank of a learner, and rollout.dtype=learner serving in that same dtype."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.multiprocessing as mp

from rlmesh.services import precision
from rlmesh.services.config import load_config


def test_bf16_is_chosen_only_when_clearly_faster():
    assert precision.choose(fp32_gflops=93, bf16_gflops=203) == "bfloat16"  # AMD EPYC Zen 4, one thread
    assert precision.choose(fp32_gflops=121, bf16_gflops=71) == "float32"  # Intel Xeon, AVX512-BF16 without AMX
    assert precision.choose(fp32_gflops=100, bf16_gflops=110) == "float32"  # a gain below 1.25x is not worth it


def test_an_explicit_dtype_is_kept_without_measuring(monkeypatch):
    monkeypatch.setattr(precision, "matmul_gflops", lambda *a, **k: pytest.fail("measured an explicit dtype"))
    assert precision.resolve_param_dtype("float32") == "float32"
    assert precision.resolve_param_dtype("bfloat16") == "bfloat16"


@pytest.mark.parametrize(("rates", "expected"), [({"float32": 90.0, "bfloat16": 200.0}, "bfloat16"),
                                                  ({"float32": 120.0, "bfloat16": 70.0}, "float32")])
def test_auto_follows_this_machines_measured_rates(monkeypatch, rates, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(precision, "matmul_gflops", lambda dtype, **k: rates[str(dtype).removeprefix("torch.")])
    assert precision.resolve_param_dtype("auto") == expected


def test_the_measurement_is_real():
    assert precision.matmul_gflops(torch.float32, size=256, repeats=1) > 0.1


def test_auto_is_a_config_value_of_both_backends():
    assert load_config(None, ["learner.backend.param_dtype=auto"]).learner.backend.param_dtype == "auto"
    megatron = load_config(None, ["learner.backend.type=megatron", "learner.backend.param_dtype=auto"])
    assert megatron.learner.backend.param_dtype == "auto"


@pytest.mark.parametrize("measured", ["bfloat16", "float32"])
def test_the_sampler_follows_the_learners_resolved_dtype(monkeypatch, measured):
    monkeypatch.setattr(precision, "resolve_param_dtype", lambda d: measured if d == "auto" else d)
    config = load_config("examples/smollm2_grpo.yaml", ["learner.backend.param_dtype=auto", "rollout.dtype=learner"])
    resolved = precision.resolve_precision(config)
    assert (resolved.learner.backend.param_dtype, resolved.rollout.dtype) == (measured, measured)
    # The demo's learning rate for the dtype it computes in (learner.lr_bfloat16 in bf16, else learner.lr).
    assert resolved.learner.lr == {"bfloat16": config.learner.lr_bfloat16, "float32": config.learner.lr}[measured]
    assert config.learner.lr_bfloat16 > config.learner.lr and resolved.learner.lr_bfloat16 is None
    assert precision.resolve_precision(resolved) is resolved  # resolved once, for good
    assert (config.learner.backend.param_dtype, config.rollout.dtype) == ("auto", "learner")  # a copy
    # Explicit on both sides: nothing measured, nothing copied.
    explicit = load_config(None, ["learner.backend.param_dtype=float32", "rollout.dtype=float32",
                                   "learner.lr_bfloat16=1e-4"])
    assert precision.resolve_precision(explicit) is explicit
    pinned = precision.resolve_precision(load_config(None, ["learner.backend.param_dtype=bfloat16",
                                                            "rollout.dtype=learner", "learner.lr_bfloat16=1e-4"]))
    assert (pinned.rollout.dtype, pinned.learner.lr) == ("bfloat16", 1e-4)


def _rank(rank: int, store: str, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    # Rank 0 measures bf16 faster, rank 1 slower: a learner's ranks must still compute in one dtype.
    faster = rank == 0
    precision.matmul_gflops = lambda dtype, **k: 200.0 if (dtype == torch.bfloat16) == faster else 100.0
    torch.cuda.is_available = lambda: False
    with open(f"{out}.{rank}", "w") as f:
        json.dump(precision.resolve_param_dtype("auto"), f)
    torch.distributed.destroy_process_group()


@pytest.mark.skipif(sys.platform != "linux", reason="gloo file store")
def test_every_rank_takes_rank_0s_answer(tmp_path):
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path / "dtype")), nprocs=2, join=True)
    answers = [json.loads((tmp_path / f"dtype.{r}").read_text()) for r in (0, 1)]
    assert answers == ["bfloat16", "bfloat16"]
