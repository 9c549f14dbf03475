import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("sub", [[], ["up"], ["learner"], ["rollout"], ["reward"], ["sft"], ["config"]])
def test_help_is_fast_and_imports_no_torch(sub):
    code = ("import sys, runpy\nsys.argv=['rlmesh', *sys.argv[1:], '--help']\n"
            "try:\n    runpy.run_module('rlmesh.cli', run_name='__main__')\nexcept SystemExit as e:\n"
            "    assert e.code == 0, e.code\n"
            "assert 'torch' not in sys.modules and 'vllm' not in sys.modules\n")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code, *sub], cwd=REPO, capture_output=True, text=True)
    elapsed = time.monotonic() - t0
    assert out.returncode == 0, out.stderr
    assert "usage: rlmesh" in out.stdout
    assert elapsed < 2.0, f"--help took {elapsed:.2f}s"


def test_config_error_exits_2_with_field_name():
    out = subprocess.run([sys.executable, "-m", "rlmesh.cli", "config", "learner.foo=1"], cwd=REPO,
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert "learner.foo" in out.stderr and "allowed" in out.stderr


def test_up_help_says_what_it_starts_how_to_run_and_resume_and_where_outputs_go():
    out = subprocess.run([sys.executable, "-m", "rlmesh.cli", "up", "--help"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0
    for needed in ("embedded Valkey", "Ctrl-C stops every process", "rlmesh up -c examples/smollm2_grpo.yaml",
                   "--run-dir runs/my-run", "resume", "metrics.jsonl", "reward_curve.png", "logs/<service>.log"):
        assert needed in out.stdout, needed


@pytest.mark.parametrize("sub, opening", [("eval", "Held-out greedy accuracy"), ("learner", "Run the learner"),
                                          ("rollout", "Run a rollout server (vLLM)."), ("sft", "Supervised fine-tuning")])
def test_every_command_s_help_opens_with_what_it_does(sub, opening):
    out = subprocess.run([sys.executable, "-m", "rlmesh.cli", sub, "--help"], cwd=REPO, capture_output=True, text=True)
    assert out.stdout.split("\n\n")[1].startswith(opening), out.stdout[:300]
