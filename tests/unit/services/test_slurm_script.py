"""deploy/slurm/rlmesh.sbatch's decisions, without a cluster: where each tier goes, what each step's
command line holds (addresses, never a secret), and what it does when the learner fails. Slurm's
commands are stand-ins that record their arguments (srun also its environment's secrets); the real
thing runs on a Slurm cluster of containers in tests/containers/test_slurm.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "deploy/slurm/rlmesh.sbatch"

# srun records its argv and whether the secrets reached it through the environment; the learner's
# step ends at once with $LEARNER_EXIT, the others wait to be stopped.
SRUN = """#!/usr/bin/env python3
import json, os, sys, time
with open(os.environ["CALLS"], "a") as f:
    f.write(json.dumps({"argv": sys.argv[1:], "token": os.environ.get("RLMESH_TOKEN", ""),
                        "password": os.environ.get("RLMESH_QUEUE_PASSWORD", "")}) + "\\n")
if any(a == "--job-name=rlmesh-learner" for a in sys.argv):
    sys.exit(int(os.environ.get("LEARNER_EXIT", "0")))
time.sleep(60)
"""
SCONTROL = """#!/bin/sh
if [ "$1 $2" = "show hostnames" ]; then printf '%s\\n' $NODES; exit 0; fi
echo "scontrol $*" >> "$CALLS.scontrol"
"""


def _run(tmp_path: Path, nodes: list[str], learner_exit: int = 0, **env: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    # squeue lists one step; scancel stops every stand-in srun (Slurm would signal the steps' processes).
    stand_ins = (("srun", SRUN), ("scontrol", SCONTROL), ("squeue", "#!/bin/sh\necho 1234.0\n"),
                 ("scancel", f"#!/bin/sh\npkill -TERM -f '{bin_dir}/srun'\nexit 0\n"))
    for name, text in stand_ins:
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls.jsonl"
    config = tmp_path / "run.yaml"
    config.write_text("learner:\n  num_steps: 1\n")
    full_env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls), "NODES": " ".join(nodes),
                "SLURM_JOB_ID": "1234", "SLURM_JOB_NODELIST": "whatever", "RLMESH_PYTHON": sys.executable,
                "LEARNER_EXIT": str(learner_exit), "HOME": str(tmp_path), **env}
    proc = subprocess.run(["bash", str(SCRIPT), str(config), str(tmp_path / "run"), "learner.lr=1e-4"],
                          env=full_env, capture_output=True, text=True, timeout=120)
    rows = [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []
    return proc, rows


def _steps(rows: list[dict]) -> dict[str, dict]:
    out = {}
    for row in rows:
        argv = row["argv"]
        name = next(a.split("=", 1)[1] for a in argv if a.startswith("--job-name=")).removeprefix("rlmesh-")
        nodes = next(a.split("=", 1)[1] for a in argv if a.startswith("--nodelist="))
        out[name] = {"nodes": nodes.split(","), "command": argv[-1].replace("\\", ""), **row}
    return out


def test_four_nodes_put_the_learner_on_two_a_rollout_server_on_the_third_and_the_reward_server_on_the_fourth(tmp_path):
    proc, rows = _run(tmp_path, ["n1", "n2", "n3", "n4"], RLMESH_LEARNER_NODES="2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = _steps(rows)
    assert {name: s["nodes"] for name, s in steps.items()} == {
        "valkey": ["n1"], "reward": ["n4"], "learner": ["n1", "n2"], "rollout-0": ["n3"]}
    learner = steps["learner"]["command"]
    assert "torch.distributed.run" in learner and "--nnodes=2" in learner and "--master-addr=n1" in learner
    assert "--node-rank=$SLURM_NODEID" in learner
    port = 20000 + (1234 % 2000) * 16
    for name in ("learner", "reward", "rollout-0"):
        command = steps[name]["command"]
        assert f"network.learner_address=n1:{port}" in command and f"network.reward_address=n4:{port + 1}" in command
        assert f"queue.url=redis://n1:{port + 8}/0" in command and "weight_sync.master_address=n1" in command
        assert "learner.lr=1e-4" in command
    assert "--advertise-host n3" in steps["rollout-0"]["command"]
    assert "the learner finished" in proc.stdout


def test_secrets_reach_every_step_through_its_environment_and_no_command_line(tmp_path):
    proc, rows = _run(tmp_path, ["n1", "n2", "n3"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tokens = {row["token"] for row in rows}
    passwords = {row["password"] for row in rows}
    assert len(tokens) == len(passwords) == 1 and len(next(iter(tokens))) == 64
    token, password = next(iter(tokens)), next(iter(passwords))
    for row in rows:
        assert token not in json.dumps(row["argv"]) and password not in json.dumps(row["argv"])
    # written to Valkey's stdin, from its environment; no administrative command even with it
    assert "user default on >%s ~* &* +@all -@dangerous" in _steps(rows)["valkey"]["command"]
    assert token not in proc.stdout + proc.stderr


def test_one_node_runs_every_tier(tmp_path):
    proc, rows = _run(tmp_path, ["solo"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = _steps(rows)
    assert all(s["nodes"] == ["solo"] for s in steps.values()) and set(steps) == {"valkey", "reward", "learner", "rollout-0"}
    assert "torch.distributed.run" not in steps["learner"]["command"]


def test_a_learner_that_fails_requeues_the_job_to_resume_from_its_checkpoint(tmp_path):
    proc, _ = _run(tmp_path, ["n1", "n2"], learner_exit=3)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "requeueing the job" in proc.stdout
    assert (tmp_path / "calls.jsonl.scontrol").read_text().strip() == "scontrol requeue 1234"
    proc, _ = _run(tmp_path, ["n1", "n2"], learner_exit=3, SLURM_RESTART_COUNT="3")
    assert proc.returncode == 3 and "after 3 requeue(s)" in proc.stdout


@pytest.mark.parametrize("env, nodes, message", [
    ({"RLMESH_LEARNER_NODES": "5"}, ["n1", "n2"], "RLMESH_LEARNER_NODES=5 does not fit the allocation's 2 node(s)"),
    ({"RLMESH_PYTHON": "/nonexistent/python"}, ["n1"], "cannot import rlmesh: set RLMESH_PYTHON"),
])
def test_a_wrong_setting_is_refused_naming_it(tmp_path, env, nodes, message):
    proc, rows = _run(tmp_path, nodes, **env)
    assert proc.returncode == 2 and message in proc.stderr and rows == [], proc.stderr
