"""The learner's logprobs are those of the sampling distribution: log-softmax of the logits divided
by the temperature, on both the one-row-per-sample and the shared-prompt paths (at temperature 1 the
backend skips the division, which must change nothing). Reference: the HF model's own float32 logits."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from rlmesh.learner.train.batch import plan_step  # noqa: E402

from tests.unit.learner.test_baseline import make_trainer  # noqa: E402
from tests.unit.learner.test_shared_prompts import groups  # noqa: E402


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_are_those_of_the_sampling_distribution(tiny_model_dir, temperature):
    from transformers import AutoModelForCausalLM

    backend = make_trainer(tiny_model_dir, 8).backend
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    seqs = groups(2, 4)
    for plan in (plan_step(seqs, 8, 0), plan_step(seqs, 8, 0, shared_row_tokens=80)):
        for m in plan:
            got_BT = backend.compute_logprobs(m, temperature)
            with torch.no_grad():
                logits_BTV = reference(input_ids=m.input_ids_BT, attention_mask=m.attention_mask_BT).logits[:, :-1]
            want_BT = torch.log_softmax(logits_BTV / temperature, -1).gather(-1, m.input_ids_BT[:, 1:, None])[..., 0]
            mask = m.loss_mask_BT.bool()
            assert mask.any()
            assert torch.allclose(got_BT[mask], want_BT[mask], atol=1e-4), (got_BT - want_BT)[mask].abs().max()
