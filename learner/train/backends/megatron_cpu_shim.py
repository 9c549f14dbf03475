"""Run megatron-core on hosts without CUDA (tests and the CPU demo over gloo). Never active on a GPU.

megatron-core 0.16 assumes CUDA in a few places: tensors are made with `device="cuda"` or
`device=torch.cuda.current_device()`, `.cuda()` is called on buffers, the distributed optimizer
checks `param.type() == "torch.cuda.FloatTensor"`, and `torch.cuda.synchronize()` is called around
collectives. Without CUDA, `activate()` makes those work on CPU:

- `torch.cuda.current_device()` answers the CPU device, `synchronize` / `empty_cache` do nothing;
- `cpu_device_mode()`, a `TorchFunctionMode` the backend enters around each of its calls, rewrites
  `device="cuda"` arguments and `.cuda()` to the CPU, and reports CPU tensors' `type()` as the
  CUDA type name Megatron checks for;
- the RNG tracker is Megatron's inference tracker (no per-TP-rank CUDA RNG states to fork): the
  backend trains without dropout, and model init comes from the HF checkpoint, so nothing draws
  from those states.

The GPU path never imports this module's effects: `activate()` returns at once when CUDA exists."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_ACTIVE = False
_CPU = torch.device("cpu")
# CPU tensor type names -> the CUDA ones megatron-core's optimizers compare against.
_CUDA_TYPE_NAMES = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.HalfTensor": "torch.cuda.HalfTensor",
                    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}


def needed() -> bool:
    return not torch.cuda.is_available()


def activate() -> None:
    """Patch the process-wide `torch.cuda` calls megatron-core makes (idempotent; CPU only)."""
    global _ACTIVE
    if _ACTIVE or not needed():
        return
    torch.cuda.current_device = lambda: _CPU  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    torch.cuda.empty_cache = lambda: None  # type: ignore[assignment]
    from megatron.core import tensor_parallel

    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    _ACTIVE = True


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": _CPU}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], _CPU, *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_device_mode() -> Iterator[None]:
    """Around megatron-core calls on a CPU host (the mode stack is per thread, so it is entered per
    call rather than once); a no-op with CUDA."""
    if not _ACTIVE:
        yield
        return
    with _CudaToCpu():
        yield
