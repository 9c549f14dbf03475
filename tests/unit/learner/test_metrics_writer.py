"""MetricsWriter: metrics.jsonl is written at once; the trackers get every record, in order, on
their own thread (off the learner loop), as written; close waits for them; a tracker's error is
raised on the writer's side, not lost."""

import itertools
import json
import threading
import time
from pathlib import Path

import pytest

from rlmesh.learner.trackers.metrics import MetricsWriter


class SlowTracker:
    def __init__(self, gate: threading.Event | None = None, fail_at: int | None = None) -> None:
        self.records, self.images, self.threads, self.closed = [], [], set(), False
        self.gate, self.fail_at = gate, fail_at

    def log(self, record: dict) -> None:
        if self.gate is not None:
            self.gate.wait(10)
        if record.get("version") == self.fail_at:
            raise OSError("disk full")
        self.threads.add(threading.current_thread().name)
        self.records.append(record)

    def log_image(self, name: str, path: Path, step: int) -> None:
        self.images.append((name, step))

    def close(self) -> None:
        self.closed = True


def test_trackers_run_off_the_writers_thread_in_order_and_close_waits_for_them(tmp_path):
    gate = threading.Event()
    tracker = SlowTracker(gate)
    writer = MetricsWriter(tmp_path, trackers=[tracker])
    record = {"kind": "train", "version": 1, "nested": {"a": 1}}
    writer.write(record)
    record["nested"]["a"] = 99  # changed after the write: the tracker still sees what was written
    for v in range(2, 6):
        writer.write({"kind": "train", "version": v})
    writer.log_image("reward_curve", tmp_path / "x.png", 5)
    # The tracker is blocked, yet every write returned and metrics.jsonl has every line.
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 5 and tracker.records == []
    gate.set()
    writer.close()
    assert [r["version"] for r in tracker.records] == [1, 2, 3, 4, 5]
    assert tracker.records[0]["nested"] == {"a": 1} and "time" in tracker.records[0]
    assert tracker.images == [("reward_curve", 5)] and tracker.closed
    assert threading.current_thread().name not in tracker.threads
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2, 3, 4, 5]


def test_a_failing_tracker_is_raised_by_the_next_write_or_close(tmp_path):
    writer = MetricsWriter(tmp_path, trackers=[SlowTracker(fail_at=2)])
    writer.write({"kind": "train", "version": 1})
    writer.write({"kind": "train", "version": 2})
    with pytest.raises(RuntimeError, match="disk full"):
        writer.close()
    writer = MetricsWriter(tmp_path, "b.jsonl", trackers=[SlowTracker(fail_at=1)])
    deadline = time.monotonic() + 10
    with pytest.raises(RuntimeError, match="disk full"):  # a later write, once the tracker has failed
        for v in itertools.count(1):
            assert time.monotonic() < deadline, "the tracker's error never reached the writer"
            writer.write({"kind": "train", "version": v})
            time.sleep(0.01)
