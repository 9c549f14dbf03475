"""vLLM worker-side weight-transfer engine for CPU: receives the learner's gloo broadcast and
loads it in place with vLLM's layerwise reload, keeping a digest of the bytes it received (in the
algorithm the learner's UpdateWeights names: BLAKE3, or sha256). Registered
under `rlmesh.services.weights.gloo.ENGINE` through the `vllm.general_plugins` entry point, so it
exists in every process vLLM spawns; beside it `ADAPTER_ENGINE`, which receives a LoRA adapter the
same way and writes it to disk (`rlmesh.rollout_server.lora` serves it). `WorkerDigests` is the
worker extension through which the rollout server reads those digests back (and reports them to
the learner over gRPC)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from rlmesh.services.weights.gloo import ENGINE
from rlmesh.services.weights.lora import served_config, write_adapter

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

ADAPTER_ENGINE = f"{ENGINE}_lora"
"""The vLLM weight-transfer engine that receives adapters (the gloo transport, written to disk)."""
ROOT_ENV = "RLMESH_LORA_DIR"
"""Where the worker writes version directories (set by the rollout server before vLLM starts its workers)."""


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_epoch: int
    group_prefix: str
    group_secret: str = field(repr=False)  # hex; never logged
    timeout_seconds: float = 120.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    version: int
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    digest_algorithm: str = "sha256"
    extra: dict[str, Any] = field(default_factory=dict)


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False
    reloads_model = True
    """Updates replace the model's weights (layerwise reload); the LoRA engine writes an adapter instead."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._group = None
        self._rank = -1
        self._buffers = None  # wire.WireBuffers: this worker's receive buffers, kept across updates
        self.received_digest = ""
        """Digest of the bytes the last update received (read through `WorkerDigests`)."""
        self._head_refresh_logged = False

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        from rlmesh.services.weights.base import Rendezvous
        from rlmesh.services.weights.gloo import join_group

        self.shutdown()
        # One inference worker per tensor-parallel rank; the learner is rank 0.
        self._rank = init_info.rank_offset + self.parallel_config.rank
        ticket = Rendezvous(init_info.master_address, init_info.master_port, prefix=init_info.group_prefix,
                            secret=bytes.fromhex(init_info.group_secret))
        self._group = join_group(ticket, self._rank, init_info.world_size, init_info.timeout_seconds)
        log.info("joined weight broadcast group epoch %d as rank %d/%d", init_info.group_epoch, self._rank,
                 init_info.world_size)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.received_digest = ""
        if self.reloads_model:
            initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if self.reloads_model:
            finalize_layerwise_reload(self.model, self.model_config)
            if refresh_tied_output_head(self.model) and not self._head_refresh_logged:
                log.info("output head tied to the input embedding: rebuilt after every update")
                self._head_refresh_logged = True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronises an accelerator; on CPU the loads below are already done.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        from rlmesh.services.weights.gloo import receive
        from rlmesh.services.weights.wire import BackgroundDigest, TensorMeta, WireBuffers

        if self._group is None:
            raise RuntimeError("weight update before InitWeightTransfer: the learner must init the group first")
        metas = [TensorMeta(n, d, tuple(s)) for n, d, s in zip(update_info.names, update_info.dtype_names, update_info.shapes)]
        digest = BackgroundDigest(update_info.digest_algorithm)
        # The buckets land in buffers kept across updates (fresh pages cost more than the copy
        # into them; the price is one copy of the sent weights in this worker's memory). The
        # layerwise reload holds views of them only until the update is finalized.
        if self._buffers is None:
            self._buffers = WireBuffers()
        # One load_weights call over the whole stream (it takes any iterable). With cores to spare,
        # the next bucket is received, and this one digested on a side thread, while this one's
        # tensors are copied in; on a CPU-served model every byte is received first (`overlap_load`).
        named = receive(self._group, metas, digest, into=self._buffers)
        try:
            self.load_received(named if overlap_load() else iter(list(named)), update_info)
        except BaseException:
            digest.close()
            raise
        self.received_digest = digest.hexdigest()

    def load_received(self, named: Iterator[tuple[str, torch.Tensor]], update_info: GlooUpdateInfo) -> None:
        """Take the received stream in, to its end (the digest covers all of it): here into the model,
        in place; `AdapterWeightTransferEngine` writes an adapter instead."""
        self.model.load_weights(named)

    def shutdown(self) -> None:
        self._group = None


class AdapterWeightTransferEngine(GlooWeightTransferEngine):
    """Receives the adapter like any update (same group, same digest) and writes it as a version
    directory; the base model's weights are never touched, so no layerwise reload."""

    reloads_model = False

    def load_received(self, named: Iterator[tuple[str, torch.Tensor]], update_info: GlooUpdateInfo) -> None:
        tensors = {name: t.clone() for name, t in named}
        if self.parallel_config.rank != 0:
            return  # one directory per server: tensor-parallel rank 0 writes it, every rank digests
        bad = [n for n in tensors if ".lora_A." not in n and ".lora_B." not in n]
        if bad:
            raise ValueError(f"this rollout server serves a LoRA adapter (learner.lora.rank > 0) but the update "
                             f"carries non-adapter tensors such as {bad[0]!r}; start the learner with the same "
                             "learner.lora section")
        write_adapter(version_dir(Path(os.environ[ROOT_ENV]), update_info.version), tensors, served_config(tensors))


def refresh_tied_output_head(model: torch.nn.Module) -> bool:
    """Give the output head a kernel of the new weights after an in-place reload when it shares its
    weight with the input embedding (tie_word_embeddings: SmolLM2, Qwen2.5-0.5B, Llama-3.2-1B, ...). The
    learner sends that tensor once, under the embedding's name, so the layerwise reload processes only
    the embedding's layer and puts the head back as it was; on CPU the head's matmul runs from a copy
    made when it was processed (oneDNN prepacks bf16 weights), so without this the served head stayed at
    version 0 while the embedding moved: the on-policy train/inference mismatch grew 1e-3 -> 0.2 nats in
    10 steps on SmolLM2-135M. Returns whether the head was given one."""
    found = {name.rsplit(".", 1)[-1]: module for name, module in model.named_modules()
             if name.endswith(("lm_head", "embed_tokens"))}
    head, embed = found.get("lm_head"), found.get("embed_tokens")
    method = getattr(head, "quant_method", None)
    if embed is None or method is None or head.weight.data_ptr() != embed.weight.data_ptr():
        return False
    if callable(getattr(embed, "cpu_linear", None)):
        # vLLM-CPU packs the embedding's weight for a matmul too, when the reload processes it: the
        # head shares that kernel rather than packing the same 49k x hidden matrix again (0.10 s of
        # every update of SmolLM2-135M on 2 cores, and a second packed copy in memory).
        head.cpu_linear = embed.cpu_linear
    else:
        method.process_weights_after_loading(head)
    return True


def overlap_load() -> bool:
    """Whether a worker loads each received bucket while the next is on the wire: where vLLM serves
    from an accelerator, so loading is a device copy beside the receiving. Not on vLLM-CPU: loading
    there is vLLM repacking every layer on the CPU, and the worker's main thread is bound to one core
    by OpenMP whatever `rollout.cpu_cores` gives it, so the receiving thread, the digest and the
    repacking only took turns; receiving every byte first was faster (SmolLM2-135M in float32,
    513 MiB, 2 cores: served in 1.0 s against 1.1-1.3 s)."""
    from vllm.platforms import current_platform

    return not current_platform.is_cpu()


def version_dir(root: Path, version: int) -> Path:
    return root / f"v{version}"


class WorkerDigests:
    """vLLM worker extension (`worker_extension_cls`): lets the rollout server ask every worker,
    through `collective_rpc`, for the digest of what it received ("" for an engine that does not
    digest, e.g. vLLM's nccl)."""

    def rlmesh_received_digest(self) -> str:
        return getattr(self.weight_transfer_engine, "received_digest", "")


class _RotaryCacheReloadFilter(logging.Filter):
    """vLLM's layerwise reload warns "RotaryEmbedding: Failed to load weights" at every update: the
    rotary cos/sin cache is a buffer no checkpoint carries, and vLLM puts it back as it was (which is
    right). Only that line is dropped; the same warning for any other layer still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "RotaryEmbedding: Failed to load weights"


def register() -> None:
    """vLLM general-plugin hook (runs once per process; registering twice is harmless)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _RotaryCacheReloadFilter) for f in layerwise.filters):
        layerwise.addFilter(_RotaryCacheReloadFilter())

    if ENGINE not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(ENGINE, GlooWeightTransferEngine)
    if ADAPTER_ENGINE not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(ADAPTER_ENGINE, AdapterWeightTransferEngine)
