"""`rlmesh status --once` on a run directory: the last step and evaluation from metrics.jsonl, the
learner's Prometheus numbers, and tiers that do not answer shown as unreachable."""

import json
import socket

from rlmesh.cli import main
from rlmesh.learner.rl.prom import PrometheusTracker
from rlmesh.services.config import RunConfig, dump_config
from rlmesh.services.prom import serve_metrics


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_status_once_shows_the_last_step_and_unreachable_tiers(tmp_path, capsys):
    config = RunConfig.model_validate({"network": {"learner_address": f"127.0.0.1:{_free_port()}",
                                                   "reward_address": f"127.0.0.1:{_free_port()}"},
                                       "logging": {"metrics_port": 0}})
    dump_config(config, tmp_path / "config.yaml")
    step = {"kind": "train", "version": 7, "reward_mean": 0.625, "step_s": 1.5, "train_s": 0.5, "broadcast_s": 0.1,
            "staleness_mean": 0.5, "staleness_max": 1, "tokens_per_s": 321.0, "num_groups": 2, "num_tokens": 10,
            "in_flight": 3}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(step) + "\n" + json.dumps(
        {"kind": "eval", "version": 7, "accuracy": 0.4}) + "\n")
    serve_metrics(config, "learner", run_dir=tmp_path)
    PrometheusTracker().log(step)

    assert main(["status", "--once", "--timeout", "0.5", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "last step v7: reward 0.625  step 1.50s" in out
    assert "staleness mean 0.50 max 1" in out and "321 tok/s" in out
    assert "last eval v7: accuracy 0.400" in out
    assert "learner_policy_version 7" in out
    learner_line = next(line for line in out.splitlines() if line.strip().startswith("learner "))
    assert "unreachable" in learner_line


def test_status_of_a_directory_that_is_no_run(tmp_path, capsys):
    assert main(["status", "--once", str(tmp_path)]) == 2
    assert "holds no config.yaml" in capsys.readouterr().err
