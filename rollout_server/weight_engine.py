"""vLLM worker-side weight-transfer engine for CPU: receives the learner's gloo broadcast and
loads it in place (`rlmesh.services.weights.direct`; vLLM's layerwise reload for a model that path
does not take), keeping a digest of the bytes it received (in the
algorithm the learner's UpdateWeights names: BLAKE3, or sha256). Every update is audited
(`rlmesh.services.weights.served`): a layer vLLM's reload would leave at its old weights fails the
update, naming it; with `RLMESH_VERIFY_SERVED_WEIGHTS=1` what the model serves afterwards is also read
back against vLLM's own load of the received tensors. Names arrive as the learner's transformers model
holds them and are loaded in checkpoint layout (`rlmesh.services.weights.layout`). Registered
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
    """Updates replace the model's weights in place; the LoRA engine writes an adapter instead."""
    _layout = None  # layout.CheckpointLayout of the served model (made on the first update)
    _received: list | None = None  # the received tensors, kept for the read-back when it is on
    _audit = None  # the update in progress: direct.DirectReload, or served.ReloadAudit around vLLM's reload
    _direct: Any = False  # direct.DirectReload of the served model; None: vLLM's reload loads it; False: not planned

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._group = None
        self._rank = -1
        self._buffers = None  # wire.WireBuffers: this worker's receive buffers, kept across updates
        self.received_digest = ""
        """Digest of the bytes the last update received (read through `WorkerDigests`)."""
        self.served_check: dict[str, Any] = {}
        """The last update's audit and read-back (read through `WorkerDigests`)."""
        self._head_refresh_logged = False

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        from rlmesh.services.affinity import server_cores, threads_on
        from rlmesh.services.weights.base import Rendezvous
        from rlmesh.services.weights.gloo import join_group

        self.shutdown()
        # One inference worker per tensor-parallel rank; the learner is rank 0.
        self._rank = init_info.rank_offset + self.parallel_config.rank
        ticket = Rendezvous(init_info.master_address, init_info.master_port, prefix=init_info.group_prefix,
                            secret=bytes.fromhex(init_info.group_secret))
        # Gloo's threads (they move the bytes) start here: on every core of the rollout server, not
        # only on those vLLM bound this worker's threads to (`overlap_load`).
        with threads_on(server_cores()):
            self._group = join_group(ticket, self._rank, init_info.world_size, init_info.timeout_seconds)
        log.info("joined weight broadcast group epoch %d as rank %d/%d", init_info.group_epoch, self._rank,
                 init_info.world_size)
        if self.reloads_model:
            self._plan()  # here, not in the first update: the plan's tensors are allocated and touched once

    def _plan(self) -> Any:
        """How updates load into the served model (planned once per model): `DirectReload`, or None for
        vLLM's layerwise reload."""
        from rlmesh.services.weights.direct import DirectReload

        if self._direct is False or (self._direct is not None and self._direct.model is not self.model):
            self._direct = DirectReload.plan(self.model, self.architecture)
        return self._direct

    def start_weight_update(self) -> None:
        """The model's reload begins in `receive_weights`, once the first buckets are on the wire."""
        self.received_digest, self.served_check, self._received, self._audit = "", {}, None, None

    def _begin_reload(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        from rlmesh.services.weights.served import ReloadAudit

        self._audit = self._plan()
        if self._audit is None:
            initialize_layerwise_reload(self.model)
            self._audit = ReloadAudit(self.model, self.architecture, self.model_config)
        self._audit.begin()

    def finish_weight_update(self) -> None:
        """Finalize the reload, then fail the update if any layer kept its old weights (vLLM itself
        only warns) or, with the read-back on, if what is served differs from vLLM's own load."""
        if not self.reloads_model or self._audit is None:
            return  # nothing was received: the model was never touched
        audit, self._audit = self._audit, None
        failures = audit.failures()
        self._finalize(audit)
        self.served_check = {"architecture": self.architecture, "layers_not_reloaded": failures,
                             "settled": audit.settled, "reload": "layerwise" if self._direct is None else "direct"}
        if failures:
            self._received = None
            err = audit.error(failures)
            log.error("%s", err)
            raise err
        if self._received is not None:
            self._read_back()

    def _finalize(self, audit: Any) -> None:
        # Every layer gets kernel tensors back, even after a failed load: the model stays servable.
        audit.finalize()
        if refresh_tied_output_head(self.model) and not self._head_refresh_logged:
            log.info("output head tied to the input embedding: rebuilt after every update")
            self._head_refresh_logged = True

    def _read_back(self) -> None:
        import time

        from rlmesh.services.weights.served import ReloadError, reference_model, served_mismatches

        t0 = time.monotonic()
        reference = reference_model(self.vllm_config, iter(self._received))
        differ, compared = served_mismatches(self.model, reference)
        del reference
        self._received = None
        self.served_check.update(verified=not differ, served_mismatches=differ[:20], compared=compared,
                                 read_back_s=round(time.monotonic() - t0, 4))
        if differ:
            raise ReloadError(f"weight update into {self.architecture}: {len(differ)} served tensor(s) differ from "
                              f"vLLM's own load of the received weights, e.g. {', '.join(differ[:5])}")

    @property
    def architecture(self) -> str:
        return (getattr(self.model_config.hf_config, "architectures", None) or [type(self.model).__name__])[0]

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronises an accelerator; on CPU the loads below are already done.
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            if self.reloads_model and self._audit is not None:
                # vLLM's worker ends the update here without finish_weight_update: put every layer's
                # tensors back now, or the model is left on the meta device and every request fails.
                audit, self._audit = self._audit, None
                self._finalize(audit)
            raise

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        from rlmesh.services.weights.gloo import receive
        from rlmesh.services.weights.wire import BackgroundDigest, TensorMeta, WireBuffers

        if self._group is None:
            raise RuntimeError("weight update before InitWeightTransfer: the learner must init the group first")
        metas = [TensorMeta(n, d, tuple(s)) for n, d, s in zip(update_info.names, update_info.dtype_names, update_info.shapes)]
        # Beside a load on this worker's own cores, the digest hashes on the server's others.
        digest = BackgroundDigest(update_info.digest_algorithm, cores=spare_cores() or None)
        # The buckets land in buffers kept across updates (fresh pages cost more than the copy
        # into them; the price is one copy of the sent weights in this worker's memory). The
        # layerwise reload holds views of them only until the update is finalized.
        if self._buffers is None:
            self._buffers = WireBuffers()
        # One load_weights call over the whole stream (it takes any iterable). With a core to spare,
        # the next bucket is received, and this one digested on a side thread, while this one's
        # tensors are loaded; without, every byte is received first (`overlap_load`).
        try:
            named = receive(self._group, metas, digest, into=self._buffers)
            if self.reloads_model:  # while the first buckets arrive
                self._begin_reload()
            self.load_received(named if overlap_load() else iter(list(named)), update_info)
        except BaseException:
            digest.close()
            raise
        self.received_digest = digest.hexdigest()

    def load_received(self, named: Iterator[tuple[str, torch.Tensor]], update_info: GlooUpdateInfo) -> None:
        """Take the received stream in, to its end (the digest covers all of it): here into the model,
        in place, in checkpoint names; `AdapterWeightTransferEngine` writes an adapter instead."""
        from rlmesh.services.weights.layout import CheckpointLayout
        from rlmesh.services.weights.served import VERIFY_ENV
        from rlmesh.services.weights.wire import TensorMeta

        hf_config = getattr(getattr(self, "model_config", None), "hf_config", None)
        if self._layout is None and hf_config is not None:  # (an engine made without vLLM's config loads as sent)
            self._layout = CheckpointLayout(hf_config)
        converted = named
        if self._layout is not None:
            self._layout.plan([TensorMeta(n, d, tuple(s)) for n, d, s in
                               zip(update_info.names, update_info.dtype_names, update_info.shapes)])
            converted = self._layout.convert(named)
        if os.environ.get(VERIFY_ENV) == "1":
            # Kept (views of the receive buffers, valid until the next update) for the read-back.
            self._received = list(converted)
            converted = iter(self._received)
        self.model.load_weights(converted)

    def shutdown(self) -> None:
        self._group = None

    @property
    def last_load(self) -> str:
        """How the last update loaded: "direct" or "layerwise" ("" before any)."""
        return self.served_check.get("reload", "")


class AdapterWeightTransferEngine(GlooWeightTransferEngine):
    """Receives the adapter like any update (same group, same digest) and writes it as a version
    directory; the base model's weights are never touched, so no layerwise reload."""

    reloads_model = False
    last_load = "adapter"  # written as the next LoRA version

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
    """Whether a worker loads each received bucket while the next is on the wire. Where vLLM serves
    from an accelerator, yes: loading is a device copy beside the receiving. On vLLM-CPU, loading is
    vLLM repacking every layer on the worker's own cores, so only where the rollout server holds a
    core beyond them (`spare_cores`) for gloo's and the digest's threads. On the worker's cores alone
    the receiving, the digest and the repacking only take turns, and receiving every byte first was
    faster (SmolLM2-135M in float32, 513 MiB, one core: served in 1.0 s against 1.1-1.3 s)."""
    from vllm.platforms import current_platform

    return not current_platform.is_cpu() or bool(spare_cores())


def spare_cores() -> set[int]:
    """The rollout server's cores that this worker's threads are not bound to. vLLM-CPU starts a
    worker with its OpenMP threads bound to one place (OMP_PLACES), the cores it picked, which is
    the main thread's affinity; with rollout.cpu_cores "auto" it keeps a core out of it for its
    scheduler and front end (idle while an update has the engine paused). Empty where vLLM was
    given every core (a list of cores, "nobind"), binds nothing (an accelerator), or runs the model
    in its engine-core process (`vllm_engine.executor_args`, the server's choice on a CPU), whose
    threads it leaves on every core of the server. There, narrowing the load to one core and giving
    the other to the wire was measured slower than receiving first (docs/performance-log.md, 2026-12-06)."""
    from rlmesh.services.affinity import server_cores

    return server_cores() - os.sched_getaffinity(0)


def version_dir(root: Path, version: int) -> Path:
    return root / f"v{version}"


class WorkerDigests:
    """vLLM worker extension (`worker_extension_cls`): lets the rollout server ask every worker,
    through `collective_rpc`, for the digest of what it received ("" for an engine that does not
    digest, e.g. vLLM's nccl), and for the last update's audit and served-weight read-back; and
    runs an update in two calls rather than four (vLLM's own start, update and finish, and the
    digest read with the finish)."""

    def rlmesh_start_and_update_weights(self, update_info: dict) -> None:
        self.start_weight_update()
        self.update_weights(update_info)

    def rlmesh_finish_weight_update(self) -> dict[str, str]:
        """vLLM's finish_weight_update; {"digest": of what this worker received, "reload": how the
        update loaded ("direct", "layerwise", "adapter": written as the next LoRA version, or "" where
        the engine does not report it)}."""
        self.finish_weight_update()
        return {"digest": self.rlmesh_received_digest(),
                "reload": getattr(self.weight_transfer_engine, "last_load", "")}

    def rlmesh_received_digest(self) -> str:
        return getattr(self.weight_transfer_engine, "received_digest", "")

    def rlmesh_served_check(self) -> dict[str, Any]:
        """{"architecture", "layers_not_reloaded", "settled", "reload" ("direct" or "layerwise")} and, with
        RLMESH_VERIFY_SERVED_WEIGHTS=1, {"verified", "served_mismatches", "compared", "read_back_s"} of the
        last update ({} if none)."""
        return dict(getattr(self.weight_transfer_engine, "served_check", {}))


def register() -> None:
    """vLLM general-plugin hook (runs once per process; registering twice is harmless)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if ENGINE not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(ENGINE, GlooWeightTransferEngine)
    if ADAPTER_ENGINE not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(ADAPTER_ENGINE, AdapterWeightTransferEngine)
