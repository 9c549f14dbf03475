"""A learner training job as torchrun runs it, for tests: rank 0 drives the real `Trainer` (steps on
the baseline's fixed batch, optional checkpoint load/save, a weight fingerprint), other ranks follow.

    torchrun --nproc-per-node N learner_rank_job.py MODEL_DIR OUT_JSON [--load CKPT_DIR] [--save CHECKPOINTS_ROOT]
        [--steps-before-save K] [--steps N]"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.unit.learner.test_baseline import fingerprint, fixed_groups, make_trainer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    p.add_argument("out")
    p.add_argument("--load")
    p.add_argument("--save")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--steps-before-save", type=int, default=1)
    p.add_argument("--micro-batch-size", type=int, default=12)
    args = p.parse_args()
    trainer = make_trainer(Path(args.model_dir), args.micro_batch_size)
    if int(os.environ.get("RANK", "0")) != 0:
        trainer.follow()
        return
    if args.load:
        trainer.load(Path(args.load))
    seqs = trainer.objective.sequences(fixed_groups())
    losses, metrics, saved = [], [], None
    for i in range(args.steps):
        if args.save and i == args.steps_before_save:
            from learner.checkpoint import save_checkpoint

            save_checkpoint(Path(args.save), i, trainer, args.model_dir, {"trained_groups": []}, keep_last=1,
                            hf_model=False)
            saved = fingerprint(trainer.stream_weights())
        m = trainer.step(seqs, 1e-3)
        losses.append(m["loss"])
        metrics.append(m)
    Path(args.out).write_text(json.dumps({"world_size": trainer.world_size, "loss": losses, "metrics": metrics,
                                          "saved_weights": saved,
                                          "weights": fingerprint(trainer.stream_weights())}))
    trainer.stop()


if __name__ == "__main__":
    main()
