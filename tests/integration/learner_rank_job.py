"""A learner training job as torchrun runs it, for tests: rank 0 drives the real `Trainer` (steps on
the baseline's fixed batch, optional checkpoint load/save, a weight fingerprint), other ranks follow.

    torchrun --nproc-per-node N learner_rank_job.py MODEL_DIR OUT_JSON [--load CKPT_DIR] [--save CHECKPOINTS_ROOT]
        [--steps-before-save K] [--steps N] [--parts P] [--override KEY=VALUE ...]

`job_parser`, `drive` and `torchrun` are shared with megatron_rank_job.py and the tests."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.unit.learner.test_baseline import fingerprint, fixed_groups, make_trainer  # noqa: E402


def job_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    p.add_argument("out")
    p.add_argument("--load")
    p.add_argument("--save")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--steps-before-save", type=int, default=1)
    p.add_argument("--micro-batch-size", type=int, default=12)
    p.add_argument("--parts", type=int, default=0,
                   help="train each step in this many parts of the batch's groups (accumulate, finish); 0: at once")
    p.add_argument("--override", action="append", default=[], help="a config override (repeatable)")
    return p


def drive(trainer, args: argparse.Namespace, after_step: Callable[[int], None] | None = None) -> dict | None:
    """Rank 0: load, step (saving a checkpoint before step `steps_before_save`), fingerprint, stop;
    returns the results. Other ranks follow and return None."""
    if int(os.environ.get("RANK", "0")) != 0:
        trainer.follow()
        return None
    if args.load:
        trainer.load(Path(args.load))
    groups = fixed_groups()
    seqs = trainer.objective.sequences(groups)
    losses, metrics, saved = [], [], None
    for i in range(args.steps):
        if args.save and i == args.steps_before_save:
            from rlmesh.learner.train.checkpoint import save_checkpoint

            save_checkpoint(Path(args.save), i, trainer, args.model_dir, {"trained_groups": []}, keep_last=1,
                            hf_model=False)
            saved = fingerprint(trainer.stream_weights())
        if args.parts:
            for k in range(args.parts):  # unequal parts where the groups do not divide evenly
                trainer.accumulate(trainer.objective.sequences(groups[k * len(groups) // args.parts:
                                                                     (k + 1) * len(groups) // args.parts]))
            m = trainer.finish(1e-3)
        else:
            m = trainer.step(seqs, 1e-3)
        losses.append(m["loss"])
        metrics.append(m)
        if after_step is not None:
            after_step(i)
    result = {"world_size": trainer.world_size, "loss": losses, "metrics": metrics, "saved_weights": saved,
              "weights": fingerprint(trainer.stream_weights())}
    trainer.stop()
    return result


def torchrun(script: str, nproc: int, *args: str, timeout: float = 300) -> dict:
    """Run `script` (a job of this folder) under torchrun; its JSON results (args[1])."""
    out = Path(args[1])
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                           str(Path(__file__).parent / script), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


def main() -> None:
    args = job_parser().parse_args()
    result = drive(make_trainer(Path(args.model_dir), args.micro_batch_size, *args.override), args)
    if result is not None:
        Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
