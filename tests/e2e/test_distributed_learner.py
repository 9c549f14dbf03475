"""The learner as a 2-rank torchrun job inside `rlmesh up`: it learns like the single-rank demo,
and when one of its ranks is SIGKILLed mid-run, torchrun restarts the job, which resumes from the
newest checkpoint; the run completes with no group trained twice and none lost."""

from __future__ import annotations

import json
import signal
import time

import psutil
import pytest
import redis

from tests.e2e.test_mesh import Up

pytestmark = pytest.mark.e2e


def _learner_rank(up: Up, rank: int) -> psutil.Process | None:
    up.poll_children()
    for proc in up.seen.values():
        try:
            if "rlmesh.entrypoints.cli learner" in " ".join(proc.cmdline()) and proc.environ().get("RANK") == str(rank):
                return proc
        except psutil.NoSuchProcess:
            continue
    return None


@pytest.mark.timeout(900)
def test_killed_learner_rank_is_restarted_and_the_run_completes_exactly_once(tmp_path, valkey_url):
    from rlmesh.learner.metrics import surviving_lineage

    run_dir = tmp_path / "run"
    streams = f"k{time.monotonic_ns()}"
    num_steps, per_step = 14, 16
    up = Up(run_dir, "learner.num_ranks=2", f"learner.num_steps={num_steps}", f"learner.groups_per_step={per_step}",
            "learner.eval_every=0",
            "checkpoint.every_n_steps=4", "checkpoint.keep_last=20", "sft.num_steps=100", f"queue.url={valkey_url}",
            f"queue.prompt_stream={streams}:p", f"queue.trajectory_stream={streams}:t")
    up.wait_for(lambda: (run_dir / "checkpoints" / "step_000008").is_dir(), 500, "checkpoint 8")
    victim = _learner_rank(up, 1)
    assert victim is not None, "learner rank 1 not found among rlmesh up's processes"
    victim.send_signal(signal.SIGKILL)
    assert up.finish(timeout=500) == 0, up.output()[-4000:]
    assert not up.leftovers(), f"processes outlived rlmesh up: {up.leftovers()}"

    log = (run_dir / "logs" / "learner.log").read_text()
    assert "resumed from step_" in log, "the restarted job resumed from a checkpoint"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["num_steps"] == num_steps and summary["num_ranks"] == 2 and summary["resumed_from"] >= 8
    assert summary["last_weights_sha256"] == summary["learner_weights_sha256"]

    rows = [json.loads(line) for line in (run_dir / "trained_groups.jsonl").read_text().splitlines()]
    lineage = surviving_lineage(rows)
    assert [r["version"] for r in lineage] == list(range(1, num_steps + 1))
    trained = [gid for r in lineage for gid in r["group_ids"]]
    assert len(trained) == len(set(trained)) == num_steps * per_step, "no group trained twice"

    client = redis.Redis.from_url(valkey_url)
    stream = f"{streams}:t"
    pending = {client.xrange(stream, p["message_id"], p["message_id"])[0][1][b"key"].decode()
               for p in client.xpending_range(stream, "learner", "-", "+", 100000)}
    dropped_path = run_dir / "dropped_groups.jsonl"
    dropped = ({json.loads(line)["group_id"] for line in dropped_path.read_text().splitlines()}
               if dropped_path.exists() else set())
    lost = [g for r in rows if "version" in r and r not in lineage for g in r["group_ids"]]
    for gid in lost:
        assert gid in trained or gid in pending or gid in dropped, f"group {gid} trained in a lost step vanished"
    assert not pending & set(trained), "trained groups are acked once their checkpoint is durable"
