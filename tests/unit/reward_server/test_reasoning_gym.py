"""The `reasoning_gym` environment with real reasoning-gym scorers, run in worker processes: right, wrong
and partly right answers read from `<answer>` tags; a scorer that raises or returns a non-number, an
unknown dataset and malformed metadata are item errors (named, never trained on) while the other items
are scored; the server's own process never imports reasoning-gym."""

import json

import pytest

import rlmesh.reward_server.environments.reasoning_gym as rg_env
from rlmesh.reward_server.environments.base import ScoreInput
from rlmesh.reward_server.environments.reasoning_gym import ReasoningGymEnvironment
from rlmesh.reward_server.registry import BUILTIN
from rlmesh.services.domain.tasks import reasoning_gym_metadata

ENTRY = {"question": "Calculate 3 + 4.", "answer": "7",
         "metadata": {"source_dataset": "basic_arithmetic", "expression": "3 + 4", "num_terms": 2}}


def _item(completion: str, metadata: dict | None = None) -> ScoreInput:
    metadata = reasoning_gym_metadata("basic_arithmetic", ENTRY) if metadata is None else metadata
    return ScoreInput("0", [{"role": "user", "content": ENTRY["question"]}], completion, metadata)


@pytest.fixture(scope="module")
def env():
    env = ReasoningGymEnvironment()
    yield env
    env.close()


def test_scores_with_reasoning_gyms_own_scorer(env):
    out = env.score([_item("3 plus 4 is 7.\n<answer>7</answer>"), _item("<answer> 8 </answer>"),
                     _item("The answer is 7."), _item("<answer>6</answer> no, <answer>7</answer>"),
                     _item("<answer>77</answer>")])
    assert not any(o.error for o in out)
    assert [o.reward for o in out[:4]] == [1.0, 0.0, 0.0, 1.0], "the last <answer> tag counts; none scores 0"
    assert [o.components["correct"] for o in out] == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert [o.components["format"] for o in out] == [1.0, 1.0, 0.0, 1.0, 1.0]
    assert 0.0 < out[4].reward < 1.0, "the scorer's partial credit is the reward; not correct"
    assert "reasoning_gym" in BUILTIN and BUILTIN["reasoning_gym"] is ReasoningGymEnvironment


def test_each_dataset_is_scored_by_its_own_scorer_from_its_entry(env):
    import reasoning_gym

    entry = reasoning_gym.create_dataset("word_sorting", seed=3, size=1)[0]
    meta = reasoning_gym_metadata("word_sorting", entry)
    # word_sorting's scorer splits the answer at commas and compares with metadata.sorted_words; the
    # default scorer (basic_arithmetic's) would compare the text and give this 0.
    unspaced = ",".join(entry["metadata"]["sorted_words"])
    right, wrong = env.score([_item(f"<answer>{unspaced}</answer>", meta), _item("<answer>a, b</answer>", meta)])
    assert unspaced != entry["answer"] and (right.reward, wrong.reward) == (1.0, 0.0)


def _raising(answer, entry):
    raise KeyError("expression")


@pytest.mark.parametrize("scorer, error", [
    (_raising, "basic_arithmetic's scorer raised KeyError: 'expression'"),
    (lambda answer, entry: None, "basic_arithmetic's scorer returned None, not a finite number"),
    (lambda answer, entry: "1.0", "scorer returned '1.0', not a finite number"),
    (lambda answer, entry: float("nan"), "scorer returned nan, not a finite number"),
])
def test_a_scorer_that_raises_or_returns_a_non_number_is_an_item_error(monkeypatch, scorer, error):
    """What a worker runs per item (`score_item`), in this process with a planted scorer: the item's error
    is the ItemError's message (the pool prefixes the environment's name: below)."""
    from rlmesh.reward_server.environments.base import ItemError

    monkeypatch.setitem(rg_env._SCORERS, "basic_arithmetic", scorer)
    with pytest.raises(ItemError) as err:
        rg_env.score_item([], "<answer>7</answer>", reasoning_gym_metadata("basic_arithmetic", ENTRY))
    assert str(err.value) == error or error in str(err.value)
    assert rg_env.score_item([], "<answer>1</answer>", reasoning_gym_metadata(
        "leg_counting", {"question": "", "answer": "1", "metadata": {}}))["reward"] == 1.0


@pytest.mark.parametrize("metadata, error", [
    ({}, "metadata.dataset must name a reasoning-gym dataset, got None"),
    ({"dataset": "no_such_task", "entry": json.dumps(ENTRY)}, "metadata.dataset='no_such_task' is not a reasoning-gym"),
    ({"dataset": "__init__", "entry": json.dumps(ENTRY)}, "'__init__' is not a reasoning-gym dataset"),
    ({"dataset": ["basic_arithmetic"], "entry": json.dumps(ENTRY)}, "metadata.dataset must name"),
    ({"dataset": "basic_arithmetic"}, "metadata.entry must be the reasoning-gym entry as JSON text"),
    ({"dataset": "basic_arithmetic", "entry": ENTRY}, "as JSON text ({question, answer, metadata}), got dict"),
    ({"dataset": "basic_arithmetic", "entry": "{not json"}, "metadata.entry is not JSON"),
    ({"dataset": "basic_arithmetic", "entry": "[" * 50000}, "metadata.entry is not JSON (RecursionError"),
    ({"dataset": "basic_arithmetic", "entry": "[1, 2]"}, "must be a JSON object with an 'answer'"),
    ({"dataset": "basic_arithmetic", "entry": json.dumps({"answer": 7, "metadata": {}})}, "'answer' (text or null)"),
    ({"dataset": "basic_arithmetic", "entry": json.dumps({"answer": "7", "metadata": "x"})}, "a 'metadata' object"),
])
def test_hostile_metadata_is_an_item_error(env, metadata, error):
    out, good = env.score([_item("<answer>7</answer>", metadata), _item("<answer>7</answer>")])
    assert out.error.startswith("reasoning_gym: ") and error in out.error
    assert "reward function raised" not in out.error, "the worker's ItemError message, as it is"
    assert not good.error and good.reward == 1.0


def test_unknown_dataset_names_are_not_cached():
    rg_env._SCORERS.clear()
    for name in ("no_such_task", "__init__", "basic_arithmetic"):
        try:
            rg_env.score_item([], "<answer>7</answer>", {"dataset": name, "entry": json.dumps(ENTRY)})
        except Exception:
            pass
    assert list(rg_env._SCORERS) == ["basic_arithmetic"]


def test_the_scorers_run_in_worker_processes_never_in_the_server():
    """A fresh interpreter stands in for the reward server: it scores through the environment, and
    reasoning-gym (whose scorers `eval` model text) is imported only in the worker processes."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from tests.unit.reward_server.test_reasoning_gym import _item\n"
            "from rlmesh.reward_server.environments.reasoning_gym import ReasoningGymEnvironment\n"
            "env = ReasoningGymEnvironment()\n"
            "assert env.healthy() == '' and env._pool is None, 'no worker before the first item'\n"
            "(out,) = env.score([_item('<answer>7</answer>')])\n"
            "assert out.reward == 1.0 and not out.error, out\n"
            "assert env.workers.status().num_workers >= 1\n"
            "assert not any(m.startswith('reasoning_gym') for m in sys.modules), 'imported in the server'\n"
            "env.close()\n"
            "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr[-2000:]


def test_without_reasoning_gym_items_say_what_to_install(monkeypatch):
    import builtins

    from rlmesh.reward_server.environments.base import ItemError

    real_import = builtins.__import__

    def no_reasoning_gym(name, *args, **kwargs):
        if name.startswith("reasoning_gym"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_reasoning_gym)
    monkeypatch.setattr(rg_env, "_SCORERS", {})
    with pytest.raises(ItemError, match=r"reasoning-gym is not installed on this reward server.*rlmesh\[envs\]"):
        rg_env.score_item([], "<answer>7</answer>", reasoning_gym_metadata("basic_arithmetic", ENTRY))
