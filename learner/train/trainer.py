"""Every learner rank's training side: the backend and objective, driven by rank 0.

On rank 0 the controller calls `step`, `stream_weights`, `save`, ... on its one torch thread;
each announces itself on the command channel, then runs the same collective locally. The other
ranks sit in `follow`, running what rank 0 announces, until `stop`."""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rlmesh.learner.train.backends import build_backend
from rlmesh.learner.train.distributed import CommandChannel, init_distributed
from rlmesh.learner.train.backends.base import Accumulated
from rlmesh.learner.train.objectives.base import Objective, accumulate_part, run_step
from rlmesh.learner.train.objectives.grpo import GRPOObjective
from rlmesh.services.affinity import pin_to_cores
from rlmesh.services.precision import resolve_precision

if TYPE_CHECKING:
    from rlmesh.learner.train.batch import Sequence
    from rlmesh.services.config import RunConfig
    from rlmesh.services.weights.wire import TensorMeta

log = logging.getLogger(__name__)
_FLOATS = frozenset({"float64", "float32", "float16", "bfloat16"})


class Trainer:
    def __init__(self, config: RunConfig, model_path: str, objective: Objective | None = None, *,
                 lr: float | None = None, pad_id: int = 0, threads: int | None = None) -> None:
        """`objective` defaults to the RL learner's (the GRPO family member `algorithm.name` names);
        the offline recipes pass theirs (SFT, DPO). `threads`: torch threads, learner.torch_threads
        when None; 0 is one per core this process may use once pinned."""
        pin_to_cores(config.learner.cpu_cores, "learner.cpu_cores")
        threads = config.learner.torch_threads if threads is None else threads
        torch.set_num_threads(threads or len(os.sched_getaffinity(0)))
        self.rank, self.world_size = init_distributed()
        # learner.backend.param_dtype=auto and rollout.dtype=learner, resolved once (on every rank alike)
        # so that the dtype trained in and the dtype broadcast in agree.
        config = resolve_precision(config)
        self.config, self.pad_id = config, pad_id
        self.backend = build_backend(config.learner, model_path, seed=config.run.seed, lr=lr)
        self.objective: Objective = objective if objective is not None else GRPOObjective.from_config(config)
        self.channel = CommandChannel()
        # The broadcast carries the bytes of the dtype the rollout tier serves: a bf16 vLLM gets bf16
        # (half of fp32's bytes), never fp32 it would cast on load.
        served = config.rollout.dtype
        self.wire_dtype: torch.dtype | None = getattr(torch, served) if served in ("bfloat16", "float16") else None
        # A tied output layer is the embedding matrix under a second name: sent once, as the embedding
        # (vLLM ties them as the model does, and skips lm_head.weight when it loads a tied model).
        self.not_sent = frozenset({"lm_head.weight"} if tied_output_layer(model_path) else ())
        # A step trained in parts (`accumulate` as its groups arrive, then `finish`): what it holds so far.
        self._part: Accumulated | None = None
        self._part_seqs: list[Sequence] = []
        self._part_s = 0.0

    @property
    def streams(self) -> bool:
        """Whether a step can be trained group by group as its data arrives (learner.train_on_arrival):
        a backend whose gradient accumulates across calls (fsdp2), and a GRPO-family loss whose
        penalty does not reshape advantages across the whole step (algorithm.kl.where=reward does)."""
        return (self.config.learner.train_on_arrival and self.backend.streams
                and isinstance(self.objective, GRPOObjective) and not self.objective.kl_in_reward)

    # --- rank 0: announce, then run the same collective here --------------------------------------

    def step(self, seqs: list[Sequence], lr: float) -> dict[str, float]:
        assert self._part is None, "a step trained in parts is open: finish it first"
        self.channel.announce("step", (seqs, lr))
        return self._step(seqs, lr)

    def accumulate(self, seqs: list[Sequence]) -> None:
        """Forward and backward over part of the next step's batch (`streams`); the optimizer step
        waits for `finish`. The weights stay those the step started from until then."""
        assert self.streams, "this step cannot be trained in parts (see Trainer.streams): call step"
        self.channel.announce("accumulate", seqs)
        self._accumulate(seqs)

    def finish(self, lr: float) -> dict[str, float]:
        """The optimizer step over every part accumulated since the last one (the gradient divided by
        the whole step's normaliser, as `step` over the same sequences would)."""
        self.channel.announce("finish", lr)
        return self._finish(lr)

    def weight_metas(self) -> list[TensorMeta]:
        metas = [m for m in self.backend.weight_metas() if m.name not in self.not_sent]
        if self.wire_dtype is None:
            return metas
        wire = str(self.wire_dtype).removeprefix("torch.")
        return [dataclasses.replace(m, dtype=wire) if m.dtype in _FLOATS else m for m in metas]

    def stream_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.channel.announce("weights")
        for name, tensor in self.backend.full_weights():  # every tensor gathered: a collective on all ranks
            if name in self.not_sent:
                continue
            cast = self.wire_dtype is not None and tensor.is_floating_point()
            yield name, tensor.to(self.wire_dtype) if cast else tensor

    def save(self, path: Path) -> None:
        self.channel.announce("save", str(path))
        self._save(str(path))

    def load(self, path: Path) -> None:
        self.channel.announce("load", str(path))
        self._load(str(path))

    def save_pretrained(self, path: Path) -> None:
        self.channel.announce("save_pretrained", str(path))
        self.backend.save_pretrained(str(path))

    def stop(self) -> None:
        self.channel.announce("stop")
        self._close()

    # --- the collectives, identical on every rank -------------------------------------------------

    def _step(self, seqs: list[Sequence], lr: float) -> dict[str, float]:
        return run_step(self.backend, self.objective, seqs, micro_batch_size=self.config.learner.micro_batch_size,
                        pad_id=self.pad_id, lr=lr,
                        max_tokens_per_micro_batch=self.config.learner.max_tokens_per_micro_batch,
                        shared_prompt_row_tokens=self.config.learner.shared_prompt_row_tokens)

    def _accumulate(self, seqs: list[Sequence]) -> None:
        t0 = time.monotonic()
        if self._part is None:
            self.backend.zero_grad()
            self._part, self._part_seqs, self._part_s = Accumulated(), [], 0.0
        cfg = self.config.learner
        accumulate_part(self.backend, self.objective, seqs, self._part, micro_batch_size=cfg.micro_batch_size,
                        pad_id=self.pad_id, max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch,
                        shared_prompt_row_tokens=cfg.shared_prompt_row_tokens)
        self._part_seqs.extend(seqs)
        self._part_s += time.monotonic() - t0

    def _finish(self, lr: float) -> dict[str, float]:
        assert self._part is not None and isinstance(self.objective, GRPOObjective), "finish without accumulate"
        part, seqs, part_s = self._part, self._part_seqs, self._part_s
        self._part, self._part_seqs = None, []
        t0 = time.monotonic()
        self.backend.set_lr(lr)
        metrics = self.backend.finish(part, self.objective.part_scale(seqs))
        # Seconds of forward and backward over the step's parts (all but the last beside generation),
        # and of the optimizer step after them: the step's training seconds are their sum.
        return {**metrics, "lr": lr, "accumulated_s": part_s, "optimizer_s": time.monotonic() - t0}

    def _save(self, path: str) -> None:
        self.backend.save_checkpoint(Path(path) / "dcp")
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate()},
                   Path(path) / f"rng_rank{self.rank}.pt")
        if self.world_size > 1:
            # Rank 0 renames the directory into place once this returns: every rank's files first.
            torch.distributed.barrier()

    def _load(self, path: str) -> None:
        self.backend.load_checkpoint(Path(path) / "dcp")
        # A checkpoint from fewer ranks has no RNG state for this rank: take rank 0's.
        rng = Path(path) / f"rng_rank{self.rank}.pt"
        # weights_only: a checkpoint directory must not be a way to run code in the learner.
        state = torch.load(rng if rng.is_file() else Path(path) / "rng_rank0.pt", weights_only=True)
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])

    def _close(self) -> None:
        """Tear the process groups down now, on every rank: left to interpreter exit, gloo's threads
        sometimes abort the process ("terminate called without an active exception") after the
        work is done, and torchrun reports the job failed."""
        if self.world_size > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    # --- ranks > 0 ----------------------------------------------------------------------------------

    def follow(self) -> None:
        """Run rank 0's commands until it says stop (or its death breaks the group)."""
        log.info("learner rank %d/%d following rank 0", self.rank, self.world_size)
        while True:
            command, payload = self.channel.receive()
            if command == "stop":
                self._close()
                return
            if command == "step":
                self._step(*payload)
            elif command == "accumulate":
                self._accumulate(payload)
            elif command == "finish":
                self._finish(payload)
            elif command == "weights":
                for _ in self.backend.full_weights():
                    pass
            elif command == "save":
                self._save(payload)
            elif command == "load":
                self._load(payload)
            elif command == "save_pretrained":
                self.backend.save_pretrained(payload)
            else:
                raise AssertionError(f"unknown learner command {command!r}")


def tied_output_layer(model_path: str) -> bool:
    """Whether the model's output layer is its input embedding (the config's `tie_word_embeddings`,
    with the architecture's own default)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError):  # not an HF model directory: every tensor is sent
        return False
    return bool(getattr(config, "tie_word_embeddings", False))
