"""An update loaded straight into the served model, without vLLM's layerwise reload (inside the vLLM
worker; imports vLLM). For vLLM-CPU serving an unquantized model, the case where that reload's
machinery buys nothing: there, vLLM's CPU GEMM dispatch packs each linear layer's weight into a oneDNN
kernel and drops the plain tensor, and the reload rebuilds each layer from the meta device, wraps
every weight loader in a dispatch mode that counts the elements it copies, and copies the result back.
On SmolLM2-135M in bf16 that is 0.18-0.25 s an update against 0.11-0.14 s for what this does
(docs/performance-log.md, 2026-12-07): load each linear layer's tensors into a plain weight kept
across updates (one copy of the linear weights in the worker's memory), pack it with vLLM's own
dispatch; load norms and embeddings in place; repack the embeddings (a tied output head uses them).

`DirectReload.plan` takes a model only where every layer that holds parameters is one of the kinds it
knows (the plain, column-, row-, QKV- and merged-column-parallel linear layers with vLLM's unquantized
method, vocabulary embeddings and output heads, and layers vLLM never post-processes, such as norms);
anything else (fused-MoE experts, quantized layers, attention with weights) gets None and vLLM's
layerwise reload, as does vLLM's zentorch platform (its unpacked kernels keep the tensor they were
given). `RLMESH_LAYERWISE_RELOAD=1` forces that reload for every model.

The audit is the layerwise one's (`served.ReloadAudit`): every parameter records the shards its
loader was called with, and a layer missing any fails the update, naming it. A linear layer that did
not receive all of its tensors keeps serving its old weights whole (vLLM's reload serves the rest of
such a layer uninitialised); a norm or embedding that received nothing keeps its old tensor."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from rlmesh.services.weights.served import ReloadError

log = logging.getLogger(__name__)

FORCE_LAYERWISE_ENV = "RLMESH_LAYERWISE_RELOAD"
"""Set to 1 in the rollout server's environment to load every update through vLLM's layerwise reload."""


class _Slot:
    """One parameter an update must reach: which shards its loader was called with."""

    def __init__(self, layer_name: str, layer: torch.nn.Module, name: str, expected: frozenset) -> None:
        self.layer_name, self.layer, self.name, self.expected = layer_name, layer, name, expected
        self.shards: set = set()

    def complete(self) -> bool:
        return None in self.shards or (bool(self.shards) and self.expected <= self.shards)

    def describe(self) -> str:
        if not self.shards:
            return "nothing (old weights kept)"
        return (f"shard(s) {', '.join(sorted(map(str, self.shards)))} of {', '.join(sorted(map(str, self.expected)))} "
                "(old weights kept)")


class DirectReload:
    """Plans once per served model; each update is `begin`, the model's `load_weights`, `failures`,
    `finalize` (the same calls as `served.ReloadAudit` and vLLM's reload around it)."""

    def __init__(self, model: torch.nn.Module, architecture: str, staged: dict[torch.nn.Module, torch.nn.Parameter],
                 embeddings: list[torch.nn.Module], slots: list[_Slot], settled: list[str]) -> None:
        self.model, self.architecture = model, architecture
        self._staged, self._embeddings, self._slots = staged, embeddings, slots
        self.settled = settled
        """Layers that share another's parameters (a tied output head): the other's load writes them."""
        self._removed: dict[torch.nn.Module, torch.nn.Parameter] = {}
        self._kept: dict[torch.nn.Module, dict[str, torch.Tensor]] = {}  # a linear layer's bias before the load
        self._loaders: list[tuple[torch.nn.Parameter, Callable | None]] = []  # each loader to put back (None: none)

    @classmethod
    def plan(cls, model: torch.nn.Module, architecture: str) -> DirectReload | None:
        """The plan for `model`, or None (logged, with the layer that decided it) where vLLM's layerwise
        reload must load it."""
        from vllm.platforms import current_platform

        if os.environ.get(FORCE_LAYERWISE_ENV) == "1":
            return None
        if not current_platform.is_cpu():
            return None  # an accelerator keeps plain weights: vLLM's reload copies them in place already
        if current_platform.is_zen_cpu():
            return None  # zentorch may serve from the very tensor it was given: the plain weight must not be reused
        staged, embeddings, slots, settled = {}, [], [], []
        seen: set[int] = set()
        for name, layer in model.named_modules():
            own = {n: p for n, p in layer._parameters.items() if p is not None}
            if not own:
                continue
            if all(id(p) in seen for p in own.values()):
                settled.append(name)
                continue
            kind = _kind(layer)
            if kind is None:
                log.info("weight updates go through vLLM's layerwise reload: %s (%s, %s) is not a layer the direct "
                         "load knows", name, type(layer).__name__, type(getattr(layer, "quant_method", None)).__name__)
                return None
            if kind == "staged":
                weight = _plain_weight(layer)
                if weight is None:
                    log.info("weight updates go through vLLM's layerwise reload: %s has no recorded layout", name)
                    return None
                staged[layer] = weight
                own["weight"] = weight
            elif kind == "embedding":
                embeddings.append(layer)
            for pname, p in own.items():
                seen.add(id(p))
                if p.numel() or pname == "weight":
                    slots.append(_Slot(name, layer, pname, _expected_shards(layer)))
        return cls(model, architecture, staged, embeddings, slots, settled)

    def begin(self) -> None:
        """Each linear layer gets its plain weight back for the loaders to write into; every loader records."""
        for layer, weight in self._staged.items():
            self._removed[layer] = layer._parameters["weight"]
            layer._parameters["weight"] = weight
            self._kept[layer] = {n: p.detach().clone() for n, p in layer._parameters.items()
                                 if n != "weight" and p is not None and p.numel()}
        for slot in self._slots:
            slot.shards.clear()
            param = slot.layer._parameters[slot.name]
            # (vLLM's parameter classes hold theirs behind a property: read and set it, never __dict__)
            self._loaders.append((param, param.weight_loader if hasattr(param, "weight_loader") else None))
            param.weight_loader = _recording(_loader(param), slot)

    def failures(self) -> list[str]:
        """Each layer some of whose parameters the update did not fully reach."""
        bad: dict[str, list[str]] = {}
        for slot in self._slots:
            if not slot.complete():
                bad.setdefault(f"{slot.layer_name or '<root>'} ({type(slot.layer).__name__})", []).append(
                    f"{slot.name} received {slot.describe()}")
        return [f"{layer}: {'; '.join(what)}" for layer, what in bad.items()]

    def finalize(self) -> None:
        """Pack every linear layer whose tensors arrived whole, put the loaders back, repack the embeddings.
        A linear layer whose tensors did not all arrive whole keeps its old kernel and bias (its plain
        weight is written whole again by the next complete update). Runs after a failed load too."""
        incomplete = {id(s.layer) for s in self._slots if not s.complete()}
        for param, loader in self._loaders:
            if loader is None:
                del param.weight_loader
            else:
                param.weight_loader = loader
        self._loaders.clear()
        with torch.no_grad():
            for layer in self._staged:
                if id(layer) in incomplete:
                    layer._parameters["weight"] = self._removed[layer]
                    for name, before in self._kept[layer].items():
                        layer._parameters[name].data.copy_(before)
                else:
                    layer.quant_method.process_weights_after_loading(layer)
            for layer in self._embeddings:
                if id(layer) not in incomplete:
                    layer.quant_method.process_weights_after_loading(layer)
        self._removed.clear()
        self._kept.clear()

    def error(self, failures: list[str]) -> ReloadError:
        from rlmesh.services.weights.served import reload_error

        return reload_error(self.architecture, failures)


def _kind(layer: torch.nn.Module) -> str | None:
    """"staged" (a linear layer whose kernel holds its only copy), "embedding", "plain" (loaded in place,
    never post-processed), or None: a layer this module does not load."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
        UnquantizedLinearMethod,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    method = getattr(layer, "quant_method", None)
    linear = (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear, QKVParallelLinear, MergedColumnParallelLinear)
    if type(layer) in linear and type(method) is UnquantizedLinearMethod:
        weight = layer._parameters.get("weight")
        removed = weight is not None and weight.numel() == 0 and callable(getattr(layer, "cpu_linear", None))
        return "staged" if removed and not getattr(layer, "_cpu_skip_gemm_dispatch", False) else None
    if type(layer) in (VocabParallelEmbedding, ParallelLMHead) and type(method) is UnquantizedEmbeddingMethod:
        return "embedding"
    post_processed = is_deferred_attention_layer(layer) or hasattr(layer, "process_weights_after_loading")
    if method is None and not post_processed:
        return "plain"
    return None


def _plain_weight(layer: torch.nn.Module) -> torch.nn.Parameter | None:
    """A real tensor in the layout (and with the loader attributes) the layer's weight had when vLLM
    loaded it, from what vLLM recorded then for its own reloads."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    meta = get_layerwise_info(layer).restore_metadata[0].get("weight")
    if meta is None or not meta.is_meta:
        return None
    with torch.no_grad():  # touched now: the first update does not pay for the pages
        return restore_layer_refs(materialize_meta_tensor(meta).zero_(), layer)


def _expected_shards(layer: torch.nn.Module) -> frozenset:
    """The shard ids a loader call names for this layer's parameters to arrive whole (a call naming
    none is the whole tensor)."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    if isinstance(layer, QKVParallelLinear):
        return frozenset({"q", "k", "v"})
    if isinstance(layer, MergedColumnParallelLinear):
        return frozenset(range(len(layer.output_sizes)))
    return frozenset({None})


def _loader(param: torch.nn.Parameter) -> Callable:
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    return getattr(param, "weight_loader", default_weight_loader)


def _recording(loader: Callable, slot: _Slot) -> Callable:
    def load(param: torch.nn.Parameter, loaded_weight: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = loader(param, loaded_weight, *args, **kwargs)
        shard = args[0] if args else kwargs.get("loaded_shard_id", kwargs.get("shard_id"))
        slot.shards.update(shard if isinstance(shard, tuple) else (shard,))
        return out

    return load
