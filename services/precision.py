"""The run's compute dtypes where the config leaves them to the machine: `learner.backend.param_dtype:
auto` is bfloat16 where this machine multiplies bf16 matrices clearly faster than float32, else float32;
`rollout.dtype: learner` serves in whatever the learner computes in. The two belong together: a sampler
and a learner that compute with the same rounded weights follow each other, where a bf16 side beside a
float32 one drops every update below half a bf16 step on one side only, and the on-policy mismatch grows
step by step (docs/real-model.md). Master weights and optimizer state stay float32 either way.

Why measured, not read off the CPU's flags: AVX512-BF16 alone says little. On one development machine
(an Intel Xeon without AMX) a one-thread bf16 matmul ran at 0.6x float32's speed; on an AMD EPYC (Zen 4)
with the same flag, at 2.2x; on AVX2-only cores bf16 is emulated. A GPU with bf16 support always takes it."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rlmesh.services.config import RunConfig

log = logging.getLogger(__name__)

BF16_MIN_SPEEDUP = 1.25
"""bf16 is chosen on a CPU when its matmul is at least this much faster than float32's: below it, the
casts each step adds (and bf16's coarser logprobs) are not worth the gain."""


def matmul_gflops(dtype: torch.dtype, size: int = 1024, repeats: int = 3) -> float:
    """GFLOP/s of a size³ matmul in `dtype` on one thread (what one core's instructions do: the ratio
    between the dtypes, which is what is compared, is a property of the core), best of `repeats` after a
    warm-up."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
        a @ b
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return 2 * size**3 / best / 1e9


def choose(fp32_gflops: float, bf16_gflops: float) -> str:
    """The compute dtype for the measured rates (the rule `auto` applies on a CPU)."""
    return "bfloat16" if bf16_gflops >= BF16_MIN_SPEEDUP * fp32_gflops else "float32"


def resolve_param_dtype(param_dtype: str) -> str:
    """`param_dtype` itself, or for "auto" the dtype this machine trains faster in. Every rank of a
    multi-rank learner gets the same answer (rank 0's measurement is broadcast), since the ranks of one
    model must compute in one dtype."""
    if param_dtype != "auto":
        return param_dtype
    if torch.cuda.is_available():
        chosen = "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
        log.info("learner.backend.param_dtype=auto: %s (%s)", chosen, torch.cuda.get_device_name())
        return chosen
    fp32, bf16 = matmul_gflops(torch.float32), matmul_gflops(torch.bfloat16)
    chosen = choose(fp32, bf16)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        flag = torch.tensor([chosen == "bfloat16"], dtype=torch.int32)
        torch.distributed.broadcast(flag, 0)
        chosen = "bfloat16" if flag.item() else "float32"
    log.info("learner.backend.param_dtype=auto: %s (a 1024^3 matmul on one core: bfloat16 %.0f GFLOP/s, "
             "float32 %.0f; bf16 is taken at >= %.2fx)", chosen, bf16, fp32, BF16_MIN_SPEEDUP)
    return chosen


def resolve_precision(config: RunConfig) -> RunConfig:
    """`config` with both compute dtypes explicit, and `learner.lr` the one for the dtype the learner
    computes in (`learner.lr_bfloat16` in bf16, where it is set): a copy where anything was resolved,
    the same object where nothing was left open. Measured once, so that the learner, the dtype it
    broadcasts in and its learning rate agree. `rlmesh up` resolves before it writes
    config.resolved.yaml, so every tier it starts gets the same answer; a tier started on its own
    resolves on its own machine (set the dtypes explicitly where the learner and the rollout servers run
    on different hardware)."""
    learner = config.learner
    param, served = learner.backend.param_dtype, config.rollout.dtype
    bf16_lr = learner.lr_bfloat16 is not None and param in ("auto", "bfloat16")
    if param != "auto" and served != "learner" and not bf16_lr:
        return config
    resolved = config.model_copy(deep=True)
    resolved.learner.backend.param_dtype = param = resolve_param_dtype(param)
    if served == "learner":
        resolved.rollout.dtype = param
    if param == "bfloat16" and learner.lr_bfloat16 is not None:
        log.info("learner.lr=%g (learner.lr_bfloat16: the learner computes in bfloat16)", learner.lr_bfloat16)
        resolved.learner.lr = learner.lr_bfloat16
    resolved.learner.lr_bfloat16 = None  # applied: a resolved config is resolved again as it is
    return resolved
