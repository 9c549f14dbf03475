"""examples/hf_mcp_stdio.yaml through `rlmesh up`: prompts from a Parquet file through Hugging Face
datasets, episodes served by a real third-party stdio MCP server (`mcp-server-calculator`, launched
per episode by command), and two GRPO steps trained end to end. The tiny random model is not
expected to learn; the run must finish its steps with every episode ending cleanly."""

from __future__ import annotations

import json

import pytest

from tests.e2e.test_mesh import Up
from tests.integration.test_mcp_stdio import calculator_command  # noqa: F401  (the fixture)

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(400)
def test_parquet_prompts_and_a_stdio_mcp_server_train_end_to_end(tmp_path, calculator_command):  # noqa: F811
    run_dir = tmp_path / "run"
    # Two steps and 4 held-out prompts of the example's 3 and 8 (CI time: each episode starts a server process).
    up = Up(run_dir, f"reward.mcp.calc.command={json.dumps(calculator_command)}", "learner.num_steps=2",
            "data.num_eval=4", "checkpoint.every_n_steps=2", config="examples/hf_mcp_stdio.yaml")
    code = up.finish(timeout=350)
    assert code == 0, up.output()[-4000:]
    assert not up.leftovers(), f"processes outlived rlmesh up: {up.leftovers()}"

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["version"] for r in train] == [1, 2]
    # Every episode ran to its end against the server: no environment errors or timeouts.
    assert sum(r["num_failed_samples"] for r in train) == 0
    assert len(evals) == 2 and all(r["num_errors"] == 0 and r["num_prompts"] == 4 for r in evals)
    assert all(r["num_samples"] == 16 for r in train)
    # One server process per episode: each Reset listed the server's tools over stdio.
    reward_log = (run_dir / "logs" / "reward.log").read_text()
    assert reward_log.count("ListToolsRequest") >= 2 * 16
    resolved = (run_dir / "config.resolved.yaml").read_text()
    assert "mcp-server-calculator" in resolved and "reasoning/train.parquet" in resolved
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["last_weights_sha256"] == summary["learner_weights_sha256"]
