"""The run's reward-curve PNG: train reward and held-out accuracy, and beside them completion lengths."""

import json

from PIL import Image

from rlmesh.learner.trackers.metrics import current_rows, plot_reward_curve


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_curve_has_a_completion_length_panel_when_lengths_are_recorded(tmp_path):
    rows = [{"kind": "eval", "version": 0, "accuracy": 0.1}]
    rows += [{"kind": "train", "version": v, "reward_mean": v / 10, "completion_tokens": [20 + v, 90, 150]}
             for v in range(1, 6)]
    _write(tmp_path / "metrics.jsonl", rows)
    png = plot_reward_curve(tmp_path / "metrics.jsonl", tmp_path / "curve.png")
    with_lengths = Image.open(png).size

    _write(tmp_path / "bare.jsonl", [{k: v for k, v in r.items() if k != "completion_tokens"} for r in rows])
    bare = Image.open(plot_reward_curve(tmp_path / "bare.jsonl", tmp_path / "bare.png")).size
    assert with_lengths[1] == bare[1] and with_lengths[0] > 1.5 * bare[0], (with_lengths, bare)


def test_no_train_rows_no_curve(tmp_path):
    _write(tmp_path / "metrics.jsonl", [{"kind": "eval", "version": 0, "accuracy": 0.1}])
    assert plot_reward_curve(tmp_path / "metrics.jsonl", tmp_path / "curve.png") is None


def test_a_resumed_run_is_drawn_from_the_rows_that_stand():
    """Resumed from the checkpoint at version 2 after steps 3 and 4 were lost: those rows are superseded."""
    first = [{"kind": "train", "version": v, "reward_mean": 0.1} for v in (1, 2, 3, 4)]
    first += [{"kind": "eval", "version": 0, "accuracy": 0.1}, {"kind": "eval", "version": 2, "accuracy": 0.2}]
    again = [{"kind": "eval", "version": 2, "accuracy": 0.25}]
    again += [{"kind": "train", "version": v, "reward_mean": 0.5} for v in (3, 4, 5)]
    rows = first + again
    assert [(r["version"], r["reward_mean"]) for r in current_rows(rows, "train")] == [
        (1, 0.1), (2, 0.1), (3, 0.5), (4, 0.5), (5, 0.5)]
    assert [(r["version"], r["accuracy"]) for r in current_rows(rows, "eval")] == [(0, 0.1), (2, 0.25)]
    # A resumed process that dies before re-training step 4 leaves no row of the lost step 4.
    assert [r["version"] for r in current_rows(first + again[:2], "train")] == [1, 2, 3]
