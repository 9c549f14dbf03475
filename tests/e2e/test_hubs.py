"""A `verifiers` environment through `rlmesh up`: the environment (tests/integration/verifiers_envs.py's
higher-or-lower game, a classic `MultiTurnEnv`) lives in a virtualenv of its own made by `rlmesh
venv` (tests/integration/test_verifiers.py's), named by `reward.verifiers.game.python`; `rlmesh up`
starts an environment server with that interpreter, the learner reads the game's own dataset with it,
and the tiny random model plays multi-turn episodes through the rollout server for a few GRPO steps.
It is not expected to learn in three steps; every episode must end cleanly and be trained on."""

from __future__ import annotations

import importlib.util
import json

import pytest
import yaml

from tests.e2e.test_mesh import REPO, Up

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(600)
def test_rlmesh_up_trains_on_a_verifiers_environment_in_its_own_virtualenv(tmp_path, verifiers_python, monkeypatch):
    run_dir = tmp_path / "run"
    config = yaml.safe_load((REPO / "examples" / "arithmetic_grpo.yaml").read_text())
    config["data"] = {"type": "verifiers", "env_name": "game", "num_train": 40, "num_eval": 4}
    # Credentials of the tiers (a tracker's key here; the embedded queue's password rlmesh up makes) must not
    # reach the environment's code, which refuses to load where it sees one, nor where its episodes do not
    # run under reward.env_server_memory_mb; the one variable named in env_server_env is handed to it.
    monkeypatch.setenv("WANDB_API_KEY", "planted-tracker-key")
    monkeypatch.setenv("GAME_SETTING", "named")
    config["reward"] = {"env_server_memory_mb": 3500, "env_server_env": ["GAME_SETTING"], "verifiers": {"game": {
        "env_id": "tests.integration.verifiers_envs", "python": str(verifiers_python),
        "args": {"kind": "digits", "refuse_env": ["WANDB_API_KEY", "RLMESH_QUEUE_PASSWORD"], "memory_mb": 3500,
                 "require_env": ["GAME_SETTING"]}}}}
    (tmp_path / "game.yaml").write_text(yaml.safe_dump(config))
    up = Up(run_dir, "sft.num_steps=0", "rollout.max_tokens=4", "rollout.episode.max_turns=3",
            "algorithm.group_size=4", "learner.groups_per_step=4", "learner.num_steps=3", "learner.eval_every=0",
            "checkpoint.every_n_steps=0", config=str(tmp_path / "game.yaml"))
    code = up.finish(timeout=500)
    assert code == 0, up.output()[-4000:]
    assert not up.leftovers(), f"processes outlived rlmesh up: {up.leftovers()}"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["version"] for r in train] == [1, 2, 3]
    assert sum(r["num_failed_samples"] for r in train) == 0, "an episode failed"
    assert all(r["num_samples"] == 16 for r in train)
    # Multi-turn: the game answered the policy before the episode ended.
    assert max(r["turns_mean"] for r in train) > 1.0, train
    # The environment server loaded the game with verifiers, which only the virtualenv has, and the main
    # reward server proxied it.
    assert importlib.util.find_spec("verifiers") is None, "this interpreter must not have verifiers"
    env_log = (run_dir / "logs" / "env-game.log").read_text()
    assert "  game: multi_turn, verifiers environment tests.integration.verifiers_envs (HigherLower" in env_log
    assert "  game: multi_turn, served by 127.0.0.1:" in (run_dir / "logs" / "reward.log").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["last_weights_sha256"] == summary["learner_weights_sha256"]
