"""The Python API (`rlmesh.train` and friends, rlmesh.api) without starting a mesh:
config forms, a reward function turned into an import path the reward server can load, callbacks
fed from metrics rows (through the launcher's real watch loop), and `import rlmesh` staying light."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import rlmesh
from rlmesh.api import (REWARD_FN_ENV, Callback, StopTraining, _Dispatcher, resolve_config,
                                    reward_fn_import_path)
from rlmesh.learner.rl.stop import (CALLBACKS_SEEN, STOP_REQUEST, clear_requests, mark_seen, request_stop, stop_requested,
                                 wait_until_seen)
from rlmesh.services.config import ConfigError, RunConfig

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "arithmetic_grpo.yaml"


def top_level_reward(prompt, completion, metadata):
    return float(completion.strip() == str(metadata["answer"]))


# --- config forms ------------------------------------------------------------------------------

def test_config_from_a_path_with_dict_list_and_keyword_overrides():
    cfg = resolve_config(DEMO, {"learner.num_steps": 20}, algorithm__max_staleness=0, **{"rollout.max_tokens": 8})
    assert (cfg.run.name, cfg.learner.num_steps, cfg.algorithm.max_staleness, cfg.rollout.max_tokens) == \
        ("arithmetic-grpo", 20, 0, 8)
    assert cfg.sft.num_steps == 300  # the file's value where no override touches it
    # The command line's form: strings parsed as YAML.
    assert resolve_config(DEMO, ["learner.lr=1e-4", "data.ops=['+', '-']"]).data.ops == ["+", "-"]


def test_config_from_a_mapping_is_not_mutated_and_none_is_the_defaults():
    data = {"learner": {"num_steps": 7}, "model": {"hidden_size": 64}}
    cfg = resolve_config(data, learner__lr=1e-4)
    assert (cfg.learner.num_steps, cfg.learner.lr, cfg.model.type, cfg.model.hidden_size) == (7, 1e-4, "tiny", 64)
    assert data == {"learner": {"num_steps": 7}, "model": {"hidden_size": 64}}
    assert resolve_config(None) == RunConfig()


def test_config_object_is_copied_and_overridden():
    given = RunConfig()
    given.learner.num_steps = 3
    same = resolve_config(given)
    assert same == given and same is not given
    changed = resolve_config(given, learner__groups_per_step=4)
    assert (changed.learner.num_steps, changed.learner.groups_per_step) == (3, 4)
    assert given.learner.groups_per_step == 16


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"learner\.lrr: unknown key 'lrr'"):
        resolve_config(DEMO, learner__lrr=1)
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_config("no/such.yaml")
    with pytest.raises(TypeError, match="expected a YAML path"):
        resolve_config(42)


# --- reward_fn -> import path ---------------------------------------------------------------------

def test_a_top_level_function_becomes_its_module_path():
    path, root = reward_fn_import_path(top_level_reward)
    assert path == f"{__name__}:top_level_reward"
    assert root == REPO  # tests.unit.test_api is imported from the repository root
    assert reward_fn_import_path("pkg.mod:fn") == ("pkg.mod:fn", None)


class Scorer:
    def score(self, prompt, completion, metadata):
        return 1.0


def make_closure(answer):
    def inner(prompt, completion, metadata):
        return float(completion == answer)
    return inner


@pytest.mark.parametrize("fn, words", [
    (lambda p, c, m: 1.0, "is a lambda"),
    (make_closure("7"), "nested in a function"),
    (Scorer().score, "bound method"),
    (functools.partial(top_level_reward, metadata={}), "no importable name"),
])
def test_what_cannot_be_shipped_is_refused_with_the_fix(fn, words):
    with pytest.raises(TypeError, match=words) as err:
        reward_fn_import_path(fn)
    assert "at the top level of a module" in str(err.value) and "'package.module:function'" in str(err.value)


def test_a_malformed_import_path_is_refused():
    with pytest.raises(ValueError, match="package.module:function"):
        reward_fn_import_path("pkg.mod.fn")


SCRIPT = '''
import json, sys
from rlmesh.api import reward_fn_import_path

def graded(prompt, completion, metadata):
    return {"reward": float(completion == metadata["answer"]), "correct": 1.0}

if __name__ == "__main__":
    path, root = reward_fn_import_path(graded)
    print(json.dumps([path, str(root)]))
'''


def test_a_function_in_a_script_loads_in_another_process_as_the_reward_server_loads_it(tmp_path):
    """`python my_script.py` defines the function in __main__: the reward server gets the script's
    stem as module name and its directory on PYTHONPATH, and loads it with its own loader."""
    (tmp_path / "my_script.py").write_text(SCRIPT)
    out = subprocess.run([sys.executable, "my_script.py"], cwd=tmp_path, capture_output=True, text=True, check=True)
    path, root = json.loads(out.stdout)
    assert (path, root) == ("my_script:graded", str(tmp_path))
    # The reward server's process: another cwd, PYTHONPATH as `train` sets it.
    load = ("from rlmesh.reward_server.environments.function import FunctionEnvironment\n"
            "from rlmesh.reward_server.environments.base import ScoreInput\n"
            f"env = FunctionEnvironment('reward_fn', {path!r})\n"
            "out = env.score([ScoreInput(id='0', prompt=[], completion='7', metadata={'answer': '7'})])[0]\n"
            "import json; print(json.dumps([out.reward, out.components, out.error or None]))")
    served = subprocess.run([sys.executable, "-c", load], cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": root})
    assert served.returncode == 0, served.stderr
    assert json.loads(served.stdout) == [1.0, {"correct": 1.0}, None]


def test_a_script_without_the_main_guard_is_named_when_a_service_imports_it(tmp_path):
    (tmp_path / "unguarded.py").write_text("import rlmesh\n\ndef f(p, c, m):\n    return 1.0\n\n"
                                           "rlmesh.train(reward_fn=f)\n")
    load = "from rlmesh.reward_server.environments.base import load_callable; load_callable('unguarded:f')"
    out = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(tmp_path), "RLMESH_API_SERVICE": "1"})
    assert out.returncode != 0
    assert 'if __name__ == "__main__":' in out.stderr


def test_reward_fn_becomes_the_datasets_environment():
    from rlmesh import api

    cfg = api.resolve_config(DEMO)
    data = cfg.model_dump(mode="json")
    data["reward"]["functions"][REWARD_FN_ENV] = reward_fn_import_path(top_level_reward)[0]
    data["data"]["env_name"] = REWARD_FN_ENV
    from rlmesh.learner.data.sources import load_dataset
    from rlmesh.services.config import validate_config

    train, held_out = load_dataset(validate_config(data).data, 0)
    assert {ex.env for ex in [*train, *held_out]} == {REWARD_FN_ENV}


# --- callbacks ---------------------------------------------------------------------------------

class Recorder(Callback):
    def __init__(self, stop_at: int | None = None, how: str = "false") -> None:
        self.steps: list[int] = []
        self.evals: list[tuple[int, float]] = []
        self.stop_at, self.how = stop_at, how

    def on_step_end(self, step, metrics):
        self.steps.append(step)
        assert metrics["version"] == step
        if self.stop_at is not None and step >= self.stop_at:
            if self.how == "raise":
                raise StopTraining("enough")
            return False
        return None

    def on_eval(self, version, record):
        self.evals.append((version, record["accuracy"]))


@pytest.mark.parametrize("how, reason", [("false", "Recorder.on_step_end at version 2 returned False"),
                                         ("raise", "Recorder.on_step_end at version 2 raised StopTraining: enough")])
def test_rows_reach_callbacks_and_the_first_stop_is_requested(tmp_path, how, reason):
    rec, other = Recorder(stop_at=2, how=how), Recorder()
    dispatch = _Dispatcher([rec, other], tmp_path)
    rows = [{"kind": "eval", "version": 0, "accuracy": 0.5}, {"kind": "train", "version": 1},
            {"kind": "queue_loss", "version": 1}, {"kind": "train", "version": 2}, {"kind": "train", "version": 3},
            {"kind": "eval", "version": 3, "accuracy": 0.9}]
    for row in rows:
        dispatch(row)
    assert rec.steps == other.steps == [1, 2, 3]
    assert rec.evals == other.evals == [(0, 0.5), (3, 0.9)]
    assert dispatch.stop_reason == reason and stop_requested(tmp_path) == reason
    assert (tmp_path / CALLBACKS_SEEN).read_text() == "3"  # every train row acknowledged


def test_a_callback_error_other_than_stop_propagates(tmp_path):
    class Broken(Callback):
        def on_eval(self, version, record):
            raise KeyError("oops")

    with pytest.raises(KeyError):
        _Dispatcher([Broken()], tmp_path)({"kind": "eval", "version": 0, "accuracy": 0.0})
    assert stop_requested(tmp_path) is None


def test_callbacks_are_objects_with_hooks():
    from rlmesh.api import _check_callbacks

    with pytest.raises(TypeError, match="subclass rlmesh.Callback"):
        _check_callbacks([object()])
    one = Recorder()
    assert _check_callbacks(one) == [one]  # one callback need not be wrapped in a list


def test_stop_request_round_trip(tmp_path):
    assert stop_requested(tmp_path) is None
    request_stop(tmp_path, "because\n")
    mark_seen(tmp_path, 3)
    assert (tmp_path / STOP_REQUEST).is_file() and stop_requested(tmp_path) == "because"
    clear_requests(tmp_path)
    assert stop_requested(tmp_path) is None and not (tmp_path / CALLBACKS_SEEN).exists()


async def test_the_learner_waits_for_attached_callbacks_only(tmp_path):
    import asyncio

    await asyncio.wait_for(wait_until_seen(tmp_path, 5), 1)  # none attached: no wait
    mark_seen(tmp_path, 4)
    waiting = asyncio.ensure_future(wait_until_seen(tmp_path, 5))
    await asyncio.sleep(0.1)
    assert not waiting.done()
    mark_seen(tmp_path, 5)
    await asyncio.wait_for(waiting, 1)
    # Callbacks that fall behind (a hung one, a launcher gone) are not waited for forever.
    t0 = time.monotonic()
    await wait_until_seen(tmp_path, 6, timeout_s=0.2)
    assert time.monotonic() - t0 < 1 and not (tmp_path / CALLBACKS_SEEN).exists()


# A stand-in learner (a real process) for the launcher's watch loop, keeping the real learner's
# protocol: before each step it waits for attached callbacks to have seen the last one, and stops
# at a stop request; then writes its final eval row and summary.json, and exits 0 at once.
FAKE_LEARNER = '''
import asyncio, json, sys, time
from pathlib import Path
from rlmesh.learner.rl.stop import stop_requested, wait_until_seen
run_dir = Path(sys.argv[1])
metrics = (run_dir / "metrics.jsonl").open("a", buffering=1)
metrics.write(json.dumps({"kind": "eval", "version": 0, "accuracy": 0.25}) + "\\n")
version = 0
while version < 200:
    asyncio.run(wait_until_seen(run_dir, version))
    if stop_requested(run_dir):
        break
    version += 1
    metrics.write(json.dumps({"kind": "train", "version": version, "reward_mean": 0.5, "tokens_per_s": 1.0,
                              "staleness_max": 0}) + "\\n")
    time.sleep(0.01)
metrics.write(json.dumps({"kind": "eval", "version": version, "accuracy": 0.75}) + "\\n")
(run_dir / "summary.json").write_text(json.dumps({
    "num_steps": version, "held_out_accuracy_before": 0.25, "held_out_accuracy_after": 0.75,
    "max_staleness_seen": 0, "max_staleness": 0, "num_dropped_stale": 0, "weights_verified_versions": version,
    "last_weights_sha256": "ab" * 32, "learner_weights_sha256": "ab" * 32}))
'''


def test_the_launchers_watch_loop_feeds_callbacks_and_its_stop_ends_the_learner(tmp_path):
    from rlmesh.processes import Mesh, Service
    from rlmesh.up import _watch
    from rlmesh.learner.rl.stop import mark_seen

    (tmp_path / "learner.py").write_text(FAKE_LEARNER)
    run_dir = tmp_path / "run"
    mesh = Mesh(run_dir)
    log_path = run_dir / "logs" / "learner.log"
    learner = Service("learner", subprocess.Popen([sys.executable, str(tmp_path / "learner.py"), str(run_dir)],
                                                  stdout=log_path.open("wb"), stderr=subprocess.STDOUT),
                      log_path, argv=[])
    mesh.services.append(learner)
    mark_seen(run_dir, 0)  # as run_up does when callbacks are given
    rec = Recorder(stop_at=5)
    cfg = resolve_config(None, logging__progress=False, learner__num_steps=200)
    t0 = time.monotonic()
    try:
        assert _watch(mesh, learner, cfg, run_dir, on_row=_Dispatcher([rec], run_dir)) == 0
    finally:
        mesh.stop()
    assert time.monotonic() - t0 < 20
    # The learner stopped at exactly the step the callback stopped on, and every row it wrote, the
    # final evaluation included, reached the callback in order.
    assert json.loads((run_dir / "summary.json").read_text())["num_steps"] == 5
    assert rec.steps == [1, 2, 3, 4, 5] and rec.evals == [(0, 0.25), (5, 0.75)]


def test_the_launcher_reads_complete_new_rows_once_and_skips_a_torn_one(tmp_path):
    from rlmesh.up import _Tail

    path = tmp_path / "metrics.jsonl"
    tail = _Tail(path)
    assert tail.rows() == []
    path.write_text('{"a": 1}\n{"b": ')
    assert tail.rows() == [{"a": 1}]  # a line being written waits
    with path.open("a") as f:
        f.write('2}\n{"kind": "tr' + '{"c": 3}\n{"d": 4}\n')  # a writer killed mid-line, then restarted
    assert tail.rows() == [{"b": 2}, {"d": 4}]
    # A run directory used again: the rows already there (and a torn last one) are not shown again.
    again = _Tail(path, skip_existing=True)
    assert again.rows() == []
    with path.open("a") as f:
        f.write('{"e": 5}\n')
    assert again.rows() == [{"e": 5}] and tail.rows() == [{"e": 5}]
    assert tail.rows() == again.rows() == []  # each row once


# --- the package root --------------------------------------------------------------------------

def test_import_rlmesh_is_light_and_help_works():
    code = ("import rlmesh, sys, pydoc\n"
            "text = pydoc.render_doc(rlmesh.train)\n"
            "assert 'reward_fn' in text and 'RunResult' in text, text\n"
            "heavy = sorted(m for m in ('torch', 'vllm', 'transformers', 'grpc', 'pydantic') if m in sys.modules)\n"
            "assert not heavy, heavy\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "PAGER": "cat"})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_the_root_exports_the_api():
    assert set(rlmesh.__all__) <= set(dir(rlmesh))
    for name in rlmesh.__all__:
        obj = getattr(rlmesh, name)
        assert obj.__doc__, f"rlmesh.{name} has no docstring"
    assert rlmesh.train.__module__ == "rlmesh.api"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        rlmesh.nope  # noqa: B018
