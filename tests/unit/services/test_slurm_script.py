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
    time.sleep(float(os.environ.get("LEARNER_S", "0")))
    sys.exit(int(os.environ.get("LEARNER_EXIT", "0")))
node = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--nodelist="))
if node in os.environ.get("DOWN_NODES", "").split():
    sys.exit(1)  # the step's node is gone
time.sleep(60)
"""
SCONTROL = """#!/bin/sh
if [ "$1 $2" = "show hostnames" ]; then printf '%s\\n' $NODES; exit 0; fi
if [ "$1 $2" = "show node" ]; then
  case " $DOWN_NODES " in *" $3 "*) echo "NodeName=$3 State=DOWN+NOT_RESPONDING";; *) echo "NodeName=$3 State=ALLOCATED";; esac
  exit 0
fi
echo "scontrol $*" >> "$CALLS.scontrol"
"""
# `squeue -s` lists the job's steps (stop_steps); `squeue -j MAIN -o %T` says whether the joined job runs.
SQUEUE = """#!/bin/sh
case "$*" in *" -s "*) echo 1234.0;; *"%T"*) [ -e "$MAIN_ALIVE" ] && echo RUNNING;; esac
exit 0
"""


def _run(tmp_path: Path, nodes: list[str], learner_exit: int = 0, args: list[str] | None = None,
         **env: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    # squeue lists one step; scancel stops every stand-in srun (Slurm would signal the steps' processes).
    stand_ins = (("srun", SRUN), ("scontrol", SCONTROL), ("squeue", SQUEUE),
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
    args = args if args is not None else [str(config), str(tmp_path / "run"), "learner.lr=1e-4"]
    proc = subprocess.run(["bash", str(SCRIPT), *args], env=full_env, capture_output=True, text=True, timeout=120)
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


def test_a_rollout_server_whose_node_is_lost_is_let_go_and_the_job_goes_on(tmp_path):
    """Submitted with --no-kill, Slurm keeps the job when a node fails: its rollout server is not
    started again on the dead node, and the job runs on to the learner's end (no requeue)."""
    proc, rows = _run(tmp_path, ["n1", "n2", "n3", "n4"], LEARNER_S="5", DOWN_NODES="n2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rollout-n2-0 on n2 exited (1) and is not started again (node down" in proc.stdout
    assert "the learner finished" in proc.stdout and "stopping the job" not in proc.stdout
    assert not (tmp_path / "calls.jsonl.scontrol").exists() or "requeue" not in (tmp_path / "calls.jsonl.scontrol").read_text()
    assert sum(1 for r in rows if "--nodelist=n2" in r["argv"]) == 1, "started again on a dead node"


def _main_job(tmp_path: Path, **env: str) -> Path:
    proc, _ = _run(tmp_path, ["n1", "n2", "n3"], **env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return tmp_path / "run"


def test_a_second_job_adds_rollout_servers_with_the_running_jobs_addresses_and_gives_them_back(tmp_path):
    secrets = {"RLMESH_TOKEN": "t" * 64, "RLMESH_QUEUE_PASSWORD": "p" * 64}
    run_dir = _main_job(tmp_path, **secrets)
    mesh_env = (run_dir / "mesh.env").read_text()
    assert "t" * 64 not in mesh_env and "p" * 64 not in mesh_env and "SECRETS_FROM=submitter" in mesh_env
    (tmp_path / "calls.jsonl").unlink()
    alive = tmp_path / "main-alive"
    alive.touch()
    join = tmp_path / "join"
    join.mkdir()
    # The joined job ends 4 s in: the join job stops its servers and ends too.
    ender = subprocess.Popen(["bash", "-c", f"sleep 4; rm {alive}"])
    proc, rows = _run(join, ["n7", "n8"], args=["--join", str(run_dir)], MAIN_ALIVE=str(alive),
                      SLURM_JOB_ID="5678", **secrets)
    ender.wait()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "job 5678 joins job 1234" in proc.stdout and "job 1234 has ended" in proc.stdout
    assert sorted(next(a for a in r["argv"] if a.startswith("--nodelist=")) for r in rows) == \
        ["--nodelist=n7", "--nodelist=n8"], "one rollout server on each node of the join job, and nothing else"
    port = 20000 + (1234 % 2000) * 16
    for row in rows:
        command = row["argv"][-1].replace("\\", "")
        assert "rlmesh.cli rollout" in command and f"network.learner_address=n1:{port}" in command
        assert f"queue.url=redis://n1:{port + 8}/0" in command and "learner.lr=1e-4" in command
        assert "-j5678" in command  # generator ids apart from the main job's
        assert row["token"] == "t" * 64 and row["password"] == "p" * 64
        assert "t" * 64 not in json.dumps(row["argv"])


def test_a_job_that_made_its_own_secrets_cannot_be_joined_and_the_join_says_why(tmp_path):
    run_dir = _main_job(tmp_path)
    assert "SECRETS_FROM=job" in (run_dir / "mesh.env").read_text()
    proc, rows = _run(tmp_path / "run", ["n7"], args=["--join", str(run_dir)],
                      RLMESH_TOKEN="t" * 64, RLMESH_QUEUE_PASSWORD="p" * 64)
    assert proc.returncode == 2 and "made its own secrets" in proc.stderr and rows == []
    proc, rows = _run(tmp_path / "run", ["n7"], args=["--join", str(tmp_path / "nowhere")])
    assert proc.returncode == 2 and "mesh.env" in proc.stderr and rows == []
