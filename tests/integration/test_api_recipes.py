"""`rlmesh.sft`, `rlmesh.dpo` and `rlmesh.export` through the Python API, each a few steps on the
tiny model: the same recipes as `rlmesh sft` / `rlmesh dpo` / `rlmesh export`, run in a child process,
with the API's config forms and overrides."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import rlmesh

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def test_sft_then_dpo_then_export(tmp_path):
    model = rlmesh.sft({"data": {"num_eval": 20}}, output=tmp_path / "sft", sft__num_steps=3, sft__batch_size=8)
    assert model == (tmp_path / "sft").resolve()
    assert (model / "config.json").is_file() and (model / "model.safetensors").is_file()

    summary = rlmesh.dpo(REPO / "examples" / "arithmetic_dpo.yaml", output=tmp_path / "dpo",
                         overrides={"sft.num_steps": 0, "dpo.num_steps": 2, "dpo.eval_every": 0})
    assert summary["num_steps"] == 2 and Path(summary["model"]).is_dir()
    assert json.loads((tmp_path / "dpo" / "summary.json").read_text()) == summary

    with pytest.raises(ValueError, match="sft.num_steps is 0"):
        rlmesh.sft(output=tmp_path / "none")


def test_export_names_a_missing_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="has no checkpoints"):
        rlmesh.export(tmp_path, output=tmp_path / "out")
