"""A learner job on the Megatron backend as torchrun runs it, for tests (learner_rank_job.py's
job with the backend's layout as flags, plus two checks every rank runs first):

1. HF -> Megatron -> HF: `full_weights()` against the HF safetensors, tensor by tensor;
2. logprobs of the fixed batch's micro-batches against the HF model's (on rank 0's share).

Then rank 0 drives the real `Trainer` (steps on the baseline's fixed batch, optional checkpoint
load/save) and the other ranks follow.

    torchrun --nproc-per-node N megatron_rank_job.py MODEL_DIR OUT_JSON --tp T --pp P [--load CKPT_DIR]
        [--save CHECKPOINTS_ROOT] [--steps-before-save K] [--steps N] [--weights-after-first-step PT]"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.integration.learner_rank_job import drive, job_parser  # noqa: E402
from tests.unit.learner.test_baseline import fixed_groups, make_trainer  # noqa: E402


def check_round_trip(backend, model_dir: Path) -> list[str]:
    """Names whose gathered tensor is not bit-identical to the HF checkpoint's (every rank gathers)."""
    import torch
    from safetensors.torch import load_file

    want = load_file(str(model_dir / "model.safetensors"))
    got = dict(backend.full_weights())
    bad = [n for n, t in want.items() if n not in got or not torch.equal(got[n].cpu(), t)]
    return bad + [n for n in got if n not in want and n != "lm_head.weight"]


def check_logprobs(backend, seqs, model_dir: Path, micro_batch_size: int) -> float:
    """Max |Megatron - HF| logprob over real tokens of this rank's micro-batches, at temperatures 1 and
    0.7 (every rank runs)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlmesh.learner.train.batch import plan_step

    micros = plan_step(seqs, micro_batch_size, 0, backend.dp_rank, backend.dp_size)
    temperatures = (1.0, 0.7)
    got = {t: [backend.compute_logprobs(m, t) for m in micros] for t in temperatures}
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    worst = 0.0
    with torch.no_grad():
        for i, m in enumerate(micros):
            logits = hf(input_ids=m.input_ids_BT, attention_mask=m.attention_mask_BT).logits[:, :-1]
            real = m.attention_mask_BT[:, 1:].bool()
            for t in temperatures:
                want = -torch.nn.functional.cross_entropy(logits.transpose(1, 2) / t, m.input_ids_BT[:, 1:],
                                                          reduction="none")
                worst = max(worst, float((got[t][i] - want)[real].abs().max()))
    return worst


def main() -> None:
    import torch

    p = job_parser()
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--weights-after-first-step", help="torch.save the HF-named weights after step 1 here")
    args = p.parse_args()
    model_dir = Path(args.model_dir)
    trainer = make_trainer(model_dir, args.micro_batch_size, "learner.backend.type=megatron",
                           f"learner.backend.tensor_parallel={args.tp}", f"learner.backend.pipeline_parallel={args.pp}")
    seqs = trainer.objective.sequences(fixed_groups())
    round_trip_bad = check_round_trip(trainer.backend, model_dir)
    logprob_diff = check_logprobs(trainer.backend, seqs, model_dir, args.micro_batch_size)

    def after_step(i: int) -> None:
        if i == 0 and args.weights_after_first_step:
            torch.save({n: t.cpu().clone() for n, t in trainer.stream_weights()}, args.weights_after_first_step)

    b = trainer.backend
    layout = {"tp": b.tp, "pp": b.pp, "dp": b.dp_size}
    result = drive(trainer, args, after_step)
    if result is not None:
        Path(args.out).write_text(json.dumps({**result, "layout": layout, "round_trip_mismatches": round_trip_bad,
                                              "max_logprob_diff": logprob_diff}))


if __name__ == "__main__":
    main()
