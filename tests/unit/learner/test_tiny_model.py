"""write_tiny_model renames a complete directory into place (`rlmesh up` starts rollout servers on
it the moment it appears), into a fresh path, an empty directory or over an older model."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from rlmesh.learner.devtools.tiny_model import write_tiny_model  # noqa: E402
from rlmesh.services.config import TinyModelSection  # noqa: E402

FILES = {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"}


def test_the_model_appears_whole_and_leaves_no_staging_directory(tmp_path):
    spec = TinyModelSection(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
    fresh = write_tiny_model(spec, tmp_path / "a" / "model", seed=0)
    assert FILES <= {p.name for p in fresh.iterdir()}
    (tmp_path / "empty").mkdir()
    assert FILES <= {p.name for p in write_tiny_model(spec, tmp_path / "empty", seed=0).iterdir()}
    # Over an older model: its files are replaced, others kept.
    (fresh / "notes.txt").write_text("kept")
    write_tiny_model(spec.model_copy(update={"hidden_size": 64}), fresh, seed=1)
    assert json.loads((fresh / "config.json").read_text())["hidden_size"] == 64
    assert (fresh / "notes.txt").read_text() == "kept"
    leftovers = [p.name for p in tmp_path.rglob(".*partial*")]
    assert leftovers == []
