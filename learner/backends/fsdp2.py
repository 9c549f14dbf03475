"""FSDP2 (`fully_shard`) training backend over an HF causal LM: gloo on CPU, NCCL on GPU."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from learner.backends.base import LossFn
from learner.batch import MicroBatch
from services.ports import free_port

log = logging.getLogger(__name__)


def init_distributed() -> tuple[int, int]:
    """Join torchrun's group when launched by it; otherwise a world of one (gloo on CPU)."""
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if "RANK" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


class FSDP2Backend:
    def __init__(self, model_path: str, *, lr: float, weight_decay: float, max_grad_norm: float,
                 param_dtype: str = "float32", seed: int = 0) -> None:
        from transformers import AutoModelForCausalLM

        self.rank, self.world_size = init_distributed()
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        model.to(self.device)
        mp = MixedPrecisionPolicy(param_dtype=getattr(torch, param_dtype), reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        self.model = model
        self.max_grad_norm = max_grad_norm
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)

    def _logprobs(self, micro: MicroBatch, temperature: float) -> torch.Tensor:
        input_ids = micro.input_ids_BT.to(self.device)
        logits_BTV = self.model(input_ids=input_ids, attention_mask=micro.attention_mask_BT.to(self.device)).logits
        logits_BTV = logits_BTV[:, :-1].float() / temperature
        targets_BT = input_ids[:, 1:]
        # log_softmax gathered at the target = -cross_entropy, without materialising [B,T,V] twice.
        return -torch.nn.functional.cross_entropy(
            logits_BTV.transpose(1, 2), targets_BT, reduction="none"
        )

    @torch.no_grad()
    def compute_logprobs(self, micro: MicroBatch, temperature: float = 1.0) -> torch.Tensor:
        self.model.eval()
        return self._logprobs(micro, temperature).cpu()

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def train_step(self, micros: list[MicroBatch], loss_fn: LossFn, temperature: float = 1.0) -> dict[str, float]:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {}
        for micro in micros:
            logprobs_BT = self._logprobs(micro, temperature)
            # Batch tensors live on CPU; the loss is computed there (a no-op move on CPU hosts).
            loss, metrics = loss_fn(logprobs_BT.cpu(), micro)
            loss.backward()
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + v / len(micros)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        totals["grad_norm"] = float(grad_norm)
        return totals

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        yield from state.items()

    def save_pretrained(self, path: str) -> None:
        state = dict(self.full_weights())
        if self.rank == 0:
            self.model.save_pretrained(path, state_dict=state, safe_serialization=True)

    def state_dict_for_checkpoint(self) -> dict:
        options = StateDictOptions(full_state_dict=True)
        return {
            "model": get_model_state_dict(self.model, options=options),
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer, options=options),
        }

    def load_checkpoint_state(self, state: dict) -> None:
        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.model, state["model"], options=options)
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=options)
