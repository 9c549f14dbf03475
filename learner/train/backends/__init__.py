"""Training backends behind one interface (`base.TrainingBackend`), chosen by `learner.backend.type`."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlmesh.learner.train.backends.base import TrainingBackend
    from rlmesh.services.config import LearnerSection


def build_backend(cfg: LearnerSection, model_path: str, *, seed: int, lr: float | None = None) -> TrainingBackend:
    """The backend `cfg.backend.type` names, loaded from the HF model at `model_path`."""
    param_dtype = cfg.backend.param_dtype  # explicit: the Trainer resolved `auto` (services.precision)
    if cfg.backend.type == "fsdp2":
        from rlmesh.learner.train.backends.fsdp2 import FSDP2Backend

        return FSDP2Backend(model_path, lr=cfg.lr if lr is None else lr, weight_decay=cfg.weight_decay,
                            max_grad_norm=cfg.max_grad_norm, param_dtype=param_dtype, seed=seed,
                            lora=cfg.lora, freeze=cfg.freeze)
    if cfg.backend.type == "megatron":
        if cfg.lora.rank:
            raise ValueError(f"learner.lora.rank={cfg.lora.rank}: LoRA is built for the fsdp2 backend only; use "
                             "learner.backend.type=fsdp2 or learner.lora.rank=0")
        from rlmesh.learner.train.backends.megatron import MegatronBackend

        return MegatronBackend(model_path, tensor_parallel=cfg.backend.tensor_parallel,
                               pipeline_parallel=cfg.backend.pipeline_parallel, lr=cfg.lr if lr is None else lr,
                               weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm,
                               param_dtype=param_dtype, seed=seed)
    raise ValueError(f"learner.backend.type={cfg.backend.type!r}; choose fsdp2 or megatron")
