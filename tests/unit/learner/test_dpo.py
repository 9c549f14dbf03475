"""DPO: the loss on hand-made pairs, preference data from JSONL, and `rlmesh dpo` end to end on the
real trainer (FSDP2 backend, one rank) and a tiny model."""

from __future__ import annotations

import json

import pytest
import torch

from rlmesh.learner.train.objectives.dpo import dpo_loss
from rlmesh.learner.train.batch import Sequence, plan_step


def _pairs():
    # [chosen, rejected] x 2; reference logprobs ride in behaviour_logprobs.
    return [Sequence([1, 2], [3, 4], [True, True], [-1.0, -1.0]), Sequence([1, 2], [5], [True], [-2.0]),
            Sequence([1], [6], [True], [-0.5]), Sequence([1], [7, 8], [True, True], [-0.5, -0.5])]


def _policy_logprobs(micro, values):
    lp = torch.zeros_like(micro.loss_mask_BT)
    for row, v in enumerate(values):
        lp[row] = v
    return lp * micro.loss_mask_BT


def test_dpo_loss_is_log2_at_the_reference_and_ranks_by_the_margin():
    (micro,) = plan_step(_pairs(), 4, pad_id=0)
    at_ref = micro.behaviour_logprobs_BT.clone()
    loss, m = dpo_loss(at_ref, micro, beta=0.5)
    assert float(loss) == pytest.approx(torch.log(torch.tensor(2.0)).item(), abs=1e-6)
    assert m["reward_margin"] == pytest.approx(0.0, abs=1e-7)
    # Chosen above its reference, rejected below: every pair ranked right, and a lower loss.
    better = _policy_logprobs(micro, [-0.5, -3.0, 0.0, -1.0])
    loss2, m2 = dpo_loss(better, micro, beta=0.5)
    assert m2["reward_accuracy"] == 1.0 and float(loss2) < float(loss)
    # Pair 0: chosen reward 0.5 * (2 * 0.5) = 0.5, rejected 0.5 * (-1) = -0.5 -> margin 1.0.
    # Pair 1: chosen 0.5 * 0.5 = 0.25, rejected 0.5 * (2 * -0.5) = -0.5 -> margin 0.75.
    assert m2["reward_margin"] == pytest.approx((1.0 + 0.75) / 2)


def test_dpo_loss_does_not_depend_on_the_micro_batch_split():
    lp = [-0.7, -2.5, -0.1, -0.9]
    (whole,) = plan_step(_pairs(), 4, pad_id=0)
    halves = plan_step(_pairs(), 2, pad_id=0)
    full, _ = dpo_loss(_policy_logprobs(whole, lp), whole, beta=0.1, sft_weight=0.5)
    split = sum(float(dpo_loss(_policy_logprobs(h, lp[2 * i : 2 * i + 2]), h, beta=0.1, sft_weight=0.5)[0])
                for i, h in enumerate(halves))
    assert float(full) == pytest.approx(split, rel=1e-6)


def test_an_odd_micro_batch_is_a_clear_error():
    (micro,) = plan_step(_pairs()[:3], 3, pad_id=0)
    with pytest.raises(ValueError, match="even learner.micro_batch_size"):
        dpo_loss(micro.behaviour_logprobs_BT, micro, beta=0.1)


def test_jsonl_pairs_take_strings_and_trl_conversations(tmp_path):
    from rlmesh.learner.data.sources import load_dataset
    from rlmesh.services.config import load_config

    rows = [{"prompt": "2+2=", "chosen": "4", "rejected": "5", "answer": "4"},
            {"prompt": "3+3=", "chosen": [{"role": "user", "content": "3+3="}, {"role": "assistant", "content": "6"}],
             "rejected": [{"role": "assistant", "content": "7"}]}]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = load_config(None, ["data.type=jsonl", f"data.train_path={path}", f"data.eval_path={path}"])
    train, _ = load_dataset(cfg.data, 0)
    assert [(ex.chosen, ex.rejected) for ex in train] == [("4", "5"), ("6", "7")]
    assert train[0].metadata == {"answer": "4"}  # the pair is not passed on as environment metadata
    path.write_text(json.dumps({"prompt": "1+1=", "chosen": {"text": "2"}, "rejected": "3"}))
    with pytest.raises(ValueError, match="'chosen' must be a string or a list of messages"):
        load_dataset(cfg.data, 0)


def test_rlmesh_dpo_learns_the_preference_on_held_out_pairs(tmp_path):
    from rlmesh.learner.recipes.dpo import run_dpo
    from rlmesh.services.config import load_config

    config = load_config(None, ["dpo.num_steps=15", "dpo.batch_size=16", "dpo.lr=2e-3", "dpo.beta=0.5",
                                "dpo.eval_every=5", "learner.micro_batch_size=8", "learner.torch_threads=1",
                                "data.num_eval=10"])
    summary = run_dpo(config, tmp_path / "out", show_progress=False)
    assert summary["before"]["preference_accuracy"] == 0.0  # the reference itself: every margin is 0
    assert summary["before"]["reward_margin"] == pytest.approx(0.0, abs=1e-6)
    assert summary["after"]["preference_accuracy"] >= 0.9
    assert summary["after"]["reward_margin"] > 0.1
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [0, 5, 10, 15]
    assert sum(r["kind"] == "train" for r in rows) == 15
    assert (tmp_path / "out" / "model" / "config.json").is_file()
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["after"] == summary["after"]


def test_rlmesh_dpo_without_pairs_or_steps_says_how_to_fix_it(tmp_path):
    from rlmesh.cli import main

    with pytest.raises(SystemExit, match="dpo.num_steps is 0"):
        main(["dpo", "--output", str(tmp_path / "a")])
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "2+2=", "answer": "4"}))
    with pytest.raises(SystemExit, match="no preference pairs"):
        main(["dpo", "--output", str(tmp_path / "b"), "dpo.num_steps=1", "data.type=jsonl",
              f"data.train_path={path}", f"data.eval_path={path}"])
