"""A run never stalls in silence, and every command that starts services stops them however it ends:
`rlmesh eval` on SIGTERM and `rlmesh check` on SIGHUP here, `rlmesh up` on SIGINT in tests/e2e/test_mesh.py
(every stop signal's handling, in process: tests/unit/entrypoints/test_stop_signals.py), `rlmesh eval` when the rollout server
rejects every prompt or the user's reward function raises on every answer (stopped with the error and
the log path, within a minute of the server being ready), and `rlmesh check`'s verdict on a model with no footing (a random tiny model)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.e2e.test_mesh import REPO, Up

pytestmark = pytest.mark.e2e
CONFIG = str(REPO / "examples" / "arithmetic_grpo.yaml")


class Command(Up):
    """Any `rlmesh` command in a subprocess, tracking every descendant it ever had."""

    def __init__(self, out_dir: Path, *argv: str, path: str = "") -> None:  # noqa: super().__init__ would start `rlmesh up`
        self.run_dir = out_dir
        self.out_path = out_dir.parent / f"{out_dir.name}.out"
        self.t0 = time.monotonic()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), path) if p)}
        self.proc = subprocess.Popen([sys.executable, "-m", "rlmesh.cli", *argv], stdout=self.out_path.open("wb"),
                                     stderr=subprocess.STDOUT, cwd=REPO, env=env)
        self.seen = {}


def _command(kind: str, tmp_path: Path, model: Path, *extra: str, path: str = "") -> Command:
    out = tmp_path / kind
    if kind == "eval":
        return Command(out, "eval", "-c", CONFIG, "--model", str(model), "--output", str(out), *extra, path=path)
    # The demo's config with the tiny model as a local HF directory.
    config = yaml.safe_load(Path(CONFIG).read_text()) | {"model": {"type": "hf", "path": str(model)}}
    (tmp_path / "check.yaml").write_text(yaml.safe_dump(config))
    return Command(out, "check", "-c", str(tmp_path / "check.yaml"), "--output", str(out), *extra)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind,signum", [("eval", signal.SIGTERM), ("check", signal.SIGHUP)])
def test_a_stop_signal_stops_every_service_the_command_started(tmp_path, tiny_model_dir, kind, signum):
    cmd = _command(kind, tmp_path, tiny_model_dir)
    cmd.wait_for(lambda: "loading vLLM" in cmd.output(), 180, "services to start")
    time.sleep(3)  # let vLLM's engine process appear
    cmd.poll_children()
    assert len(cmd.seen) >= 3, f"expected the services to be running: {cmd.seen}"
    cmd.proc.send_signal(signum)
    assert cmd.finish(timeout=60) == 130, cmd.output()[-3000:]
    assert "interrupted; stopping every service" in cmd.output()
    assert not cmd.leftovers(), f"processes outlived {signal.Signals(signum).name}: {cmd.leftovers()}"


@pytest.mark.timeout(240)
def test_eval_stops_within_a_minute_when_the_rollout_server_rejects_every_prompt(tmp_path, tiny_model_dir):
    # The chat-rendered arithmetic prompt is 23 tokens: longer than a 16-token context, so vLLM refuses each one.
    cmd = _command("eval", tmp_path, tiny_model_dir, "rollout.max_model_len=16", "data.num_eval=20")
    cmd.wait_for(lambda: "rollout server ready after" in cmd.output(), 180, "the rollout server")
    ready = time.monotonic()
    code = cmd.finish(timeout=90)
    print(f"rlmesh eval stopped {time.monotonic() - ready:.1f}s after the rollout server was ready")
    assert time.monotonic() - ready < 60
    out = cmd.output()
    assert code == 1, out[-3000:]
    assert "rlmesh eval: the run cannot progress: 20 prompt groups in a row failed" in out, out[-3000:]
    assert "in the rollout server rollout-0: VLLMValidationError" in out and "maximum context length is 16" in out
    assert f"its log: {tmp_path / 'eval' / 'logs' / 'rollout-0.log'}" in out
    assert not cmd.leftovers(), f"processes outlived the failed eval: {cmd.leftovers()}"


@pytest.mark.timeout(240)
def test_eval_stops_within_a_minute_when_the_reward_function_raises_on_every_answer(tmp_path, tiny_model_dir):
    """A user's reward function that raises for every sample: the samples fail in the reward server (its
    worker catches the error), and `rlmesh eval` stops with the function's own error, the tier and its log."""
    (tmp_path / "user_reward.py").write_text(
        "def score(prompt, completion, metadata):\n"
        "    raise KeyError('the metadata has no gold_answer field')\n")
    cmd = _command("eval", tmp_path, tiny_model_dir, "reward.functions.mine=user_reward:score", "data.env_name=mine",
                   "data.num_eval=16", "rollout.max_tokens=4", path=str(tmp_path))
    cmd.wait_for(lambda: "rollout server ready after" in cmd.output(), 180, "the rollout server")
    ready = time.monotonic()
    code = cmd.finish(timeout=90)
    print(f"rlmesh eval stopped {time.monotonic() - ready:.1f}s after the rollout server was ready")
    out = cmd.output()
    assert code == 1 and time.monotonic() - ready < 60, out[-3000:]
    assert "rlmesh eval: the run cannot progress" in out, out[-3000:]
    assert ("in the reward server: mine: reward function raised KeyError: 'the metadata has no gold_answer field'"
            in out), out[-3000:]
    assert str(tmp_path / "eval" / "logs" / "reward.log") in out, out[-3000:]
    assert not cmd.leftovers(), f"processes outlived the failed eval: {cmd.leftovers()}"


@pytest.mark.timeout(240)
def test_check_gives_its_numbers_and_says_no_when_no_group_carries_a_signal(tmp_path, tiny_model_dir):
    cmd = _command("check", tmp_path, tiny_model_dir, "--groups", "4", "--greedy", "4", "rollout.max_tokens=4")
    code = cmd.finish(timeout=200)
    out = cmd.output()
    record = json.loads((tmp_path / "check" / "check.json").read_text())
    assert record["num_groups"] == 4 and record["num_greedy"] == 4 and record["prompt_format"] == "chat"
    assert record["prompt_tokens"][-1] and "".join(record["prompt_tokens"]).endswith("assistant\n")
    # A random tiny model answers no sum: every sample scores 0, so no group has a signal.
    assert record["num_groups_with_signal"] == 0 and code == 1, out[-3000:]
    assert "groups carry a signal: every sample of each group scored the same" in out and "groups with a signal: 0 of 4" in out
    assert f"cut at max_tokens (4): {record['share_cut_at_max_tokens']:.0%}" in out
    assert not cmd.leftovers(), f"processes outlived rlmesh check: {cmd.leftovers()}"
