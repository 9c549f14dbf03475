"""FSDP2 (`fully_shard`) training backend over an HF causal LM: gloo on CPU, NCCL on GPU, any
number of ranks (each decoder layer and the root are sharded over the whole world)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from rlmesh.learner.train import freeze as frozen
from rlmesh.learner.train import lora as adapters
from rlmesh.learner.train.backends import shared_attention
from rlmesh.learner.train.backends.base import Accumulated, LossFn
from rlmesh.learner.train.batch import MicroBatch
from rlmesh.learner.train.distributed import init_distributed
from rlmesh.services.weights.lora import is_adapter, stored_name, write_adapter
from rlmesh.services.weights.wire import TensorMeta
from rlmesh.services.config import FSDP2BackendSection, RolloutSection, default

if TYPE_CHECKING:
    from rlmesh.services.config import LoRASection

log = logging.getLogger(__name__)


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits at the sampling temperature. At 1 the division is skipped: over [B, T, vocab] it is a
    pass over the step's largest tensor forward and again backward (~2% of a SmolLM2 step on a CPU)."""
    return logits if temperature == 1.0 else logits / temperature


class FSDP2Backend:
    streams = True  # a step in parts: gradients accumulate in the sharded grads, reduce-scattered per backward

    def __init__(self, model_path: str, *, lr: float, weight_decay: float, max_grad_norm: float,
                 param_dtype: str = default(FSDP2BackendSection, "param_dtype"), seed: int = 0, lora: LoRASection | None = None,
                 freeze: list[str] | None = None) -> None:
        self.rank, self.world_size = init_distributed()
        self.dp_rank, self.dp_size = self.rank, self.world_size  # FSDP2 shards only: every rank is a replica
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        torch.manual_seed(seed)
        self.model_path, self.param_dtype = model_path, param_dtype
        # learner.lora: peft wraps the model before sharding; only the adapter trains and is broadcast.
        self.lora = lora if lora is not None and lora.rank else None
        self.model = model = self._sharded_model(self.lora, freeze or [])
        # The KL penalty's frozen reference policy: built on first use (algorithm.kl.coef > 0).
        self.reference: torch.nn.Module | None = None
        self.max_grad_norm = max_grad_norm
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                                           weight_decay=weight_decay)

    def _sharded_model(self, lora: LoRASection | None = None, freeze: list[str] | None = None) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        shared_attention.install()  # shared-prompt rows' attention by segment (`_shared_logprobs`)
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
        model.to(self.device)
        if lora is not None:
            model = adapters.wrap(model, lora)
        frozen.freeze(model, freeze or [])
        mp = MixedPrecisionPolicy(param_dtype=getattr(torch, self.param_dtype), reduce_dtype=torch.float32)
        # One rank: a layer's parameters stay gathered from its forward to its backward (nothing
        # to free by resharding; the backward's gather again is a copy and a cast of every layer).
        for layer in adapters.decoder_layers(model):
            fully_shard(layer, mp_policy=mp, reshard_after_forward=self.world_size > 1)
        fully_shard(model, mp_policy=mp)
        return model

    def _logprobs(self, micro: MicroBatch, temperature: float, model: torch.nn.Module | None = None) -> torch.Tensor:
        model = self.model if model is None else model
        if micro.shared is not None:
            return self._shared_logprobs(micro, temperature, model)
        input_ids = micro.input_ids_BT.to(self.device)
        logits_BTV = model(input_ids=input_ids, attention_mask=micro.attention_mask_BT.to(self.device)).logits
        logits_BTV = _scaled(logits_BTV[:, :-1].float(), temperature)
        targets_BT = input_ids[:, 1:]
        # log_softmax gathered at the target = -cross_entropy, without materialising [B,T,V] twice.
        return -torch.nn.functional.cross_entropy(
            logits_BTV.transpose(1, 2), targets_BT, reduction="none"
        )

    def _shared_logprobs(self, micro: MicroBatch, temperature: float, model: torch.nn.Module) -> torch.Tensor:
        """The same [B, T-1] logprobs from the rows with each prompt once (`SharedPrompts`): a
        custom attention mask and restarted positions, logits only from the first completion's
        predictor on (the rest of the prompt predicts nothing that is trained)."""
        sp = micro.shared
        d = self.device
        with shared_attention.segments(sp.segments.to(d) if sp.segments is not None else None):
            logits_RKV = model(input_ids=sp.input_ids_RL.to(d), attention_mask=sp.mask_R1LL.to(d),
                               position_ids=sp.position_ids_RL.to(d), logits_to_keep=sp.keep_K.to(d)).logits
        logits_NV = _scaled(logits_RKV.reshape(-1, logits_RKV.shape[-1])[sp.src_N.to(d)].float(), temperature)
        logprobs_N = -torch.nn.functional.cross_entropy(logits_NV, sp.targets_N.to(d), reduction="none")
        b, t = micro.input_ids_BT.shape
        return logprobs_N.new_zeros(b * (t - 1)).index_put((sp.dst_N.to(d),), logprobs_N).view(b, t - 1)

    @torch.no_grad()
    def compute_logprobs(self, micro: MicroBatch, temperature: float = default(RolloutSection, "temperature")) -> torch.Tensor:
        self.model.eval()
        return self._logprobs(micro, temperature).cpu()

    @torch.no_grad()
    def reference_logprobs(self, micro: MicroBatch, temperature: float = default(RolloutSection, "temperature")) -> torch.Tensor:
        if self.reference is None:
            # The starting model again, sharded the same way, without gradients or optimizer state;
            # after a resume it is rebuilt from the same path, so it stays the run's starting policy.
            self.reference = self._sharded_model().eval().requires_grad_(False)
            log.info("reference policy for the KL penalty loaded from %s", self.model_path)
        return self._logprobs(micro, temperature, self.reference).cpu()

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def train_step(self, micros: list[MicroBatch], loss_fn: LossFn, temperature: float = default(RolloutSection, "temperature")) -> dict[str, float]:
        self.zero_grad()
        return self.finish(self.accumulate(micros, loss_fn, temperature), 1.0)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def accumulate(self, micros: list[MicroBatch], loss_fn: LossFn, temperature: float = default(RolloutSection, "temperature"),
                   into: Accumulated | None = None) -> Accumulated:
        """Forward and backward over this rank's `micros`, gradients added to those already held;
        the losses and the loss function's metrics added to `into` (a new record when None)."""
        self.model.train()
        acc = into if into is not None else Accumulated()
        for micro in micros:
            logprobs_BT = self._logprobs(micro, temperature)
            # Batch tensors live on CPU; the loss is computed there (a no-op move on CPU hosts).
            loss, metrics = loss_fn(logprobs_BT.cpu(), micro)
            # FSDP averages gradients over ranks; the loss normalisers already span the whole
            # step, so scaling by the world size makes the update equal the single-rank one.
            (loss * self.world_size).backward()
            acc.add(micro.is_padding, float(loss.detach()), metrics)
        return acc

    def finish(self, acc: Accumulated, scale: float) -> dict[str, float]:
        """Scale the accumulated gradient (and loss) by `scale`, clip, step the optimizer; the
        metrics reduced over all ranks."""
        if scale != 1.0:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        keys = sorted(acc.sums)
        totals = torch.tensor([acc.num_real, acc.loss_sum * scale, *(acc.sums[k] for k in keys)], dtype=torch.float64)
        if self.world_size > 1:
            reduced = totals.to(self.device)
            dist.all_reduce(reduced)
            totals = reduced.cpu()
        out = {k: float(totals[2 + i] / max(float(totals[0]), 1.0)) for i, k in enumerate(keys)}
        out["loss"] = float(totals[1])
        out["grad_norm"] = float(grad_norm)
        return out

    def weight_metas(self) -> list[TensorMeta]:
        names = self.model.state_dict()
        if self.lora is not None:  # the broadcast moves the adapter only (served form, see learner.train.lora)
            names = {stored_name(n): t for n, t in names.items() if is_adapter(n)}
        return [TensorMeta(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in names.items()]

    def _gathered(self, adapter_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        # One parameter gathered at a time: never a second full copy of the model.
        for name, t in self.model.state_dict().items():
            if not adapter_only or is_adapter(name):
                yield name, (t.full_tensor() if isinstance(t, DTensor) else t).detach()

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.lora is not None:
            yield from adapters.served(self._gathered(adapter_only=True), self.lora)
        else:
            yield from self._gathered()

    def save_pretrained(self, path: str) -> None:
        """An HF model directory; with learner.lora, the base model with the adapter merged in."""
        if self.lora is not None:
            state = dict(adapters.merged(self._gathered(), adapters.scale_of(self.lora)))
            if self.rank == 0:
                self.model.get_base_model().save_pretrained(path, state_dict=state, safe_serialization=True)
            return
        state = dict(self._gathered())
        if self.rank == 0:
            self.model.save_pretrained(path, state_dict=state, safe_serialization=True)

    def save_adapter(self, path: Path) -> None:
        """With learner.lora: the adapter in peft's own format (rank 0 writes; a collective)."""
        state = {stored_name(n): t for n, t in self._gathered(adapter_only=True)}
        if self.rank == 0:
            write_adapter(path, state, adapters.stored_config(self.model, self.model_path))

    def save_checkpoint(self, path: Path) -> None:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(path))
        if self.lora is not None:
            # Next to the sharded state: the adapter alone, readable without rlmesh (`rlmesh export`).
            self.save_adapter(path.parent / "adapter")

    def load_checkpoint(self, path: Path) -> None:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optimizer": optim_sd}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
