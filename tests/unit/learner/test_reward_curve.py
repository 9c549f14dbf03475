"""The run's reward-curve PNG: train reward and held-out accuracy, and beside them completion lengths."""

import json

from PIL import Image

from rlmesh.learner.metrics import plot_reward_curve


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
