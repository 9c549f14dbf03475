"""`verifiers` environments, unchanged, behind the reward tier: a virtualenv made by `rlmesh venv`
(verifiers 0.3.1, which pins mcp and openai apart from rlmesh, and `sophistry-bench-sprint`, an
environment someone else published) runs an environment server, which the main reward server (this
interpreter, no verifiers) proxies like any remote environment. Through them: the published
single-turn environment scores with its own rubric (each function a component), a multi-turn game and
a tool environment play as episodes step by step, the prompts come from the environment's own dataset,
and what goes wrong in an environment is named. `rlmesh up` training through it: tests/e2e/test_hubs.py."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
import yaml
from google.protobuf.struct_pb2 import Struct

from rlmesh.services.grpc_client import make_channel
from rlmesh.services.ports import free_port
from rlmesh.v1 import common_pb2, reward_pb2, reward_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]
OWN = "tests.integration.verifiers_envs"
ENVS = {
    "sophistry": {"env_id": "sophistry-bench-sprint"},
    "guess": {"env_id": OWN, "args": {"kind": "guess"}},
    "tools": {"env_id": OWN, "args": {"kind": "tools"}},
    "raising": {"env_id": OWN, "args": {"kind": "broken", "mode": "raise"}},
    "hanging": {"env_id": OWN, "args": {"kind": "broken", "mode": "hang"}, "timeout_s": 3.0},
    "nan": {"env_id": OWN, "args": {"kind": "broken", "mode": "nan"}},
    "hog": {"env_id": OWN, "args": {"kind": "broken", "mode": "hog"}},
}
HUB_MEMORY_MB = 4096  # the environment server's address-space limit (~2.1 GiB of it mapped at start here)


@pytest.fixture(scope="module")
def python(verifiers_python) -> Path:
    return verifiers_python  # tests/conftest.py: one virtualenv for the session


def _spawn(python: Path | str, config: Path, port: int, log: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([str(python), "-m", "rlmesh.cli", "reward", "-c", str(config), "--port", str(port), *args],
                            stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})


async def _serving(port: int, proc: subprocess.Popen, log: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"the reward server exited:\n{log.read_text()[-3000:]}"
        try:
            async with make_channel(f"127.0.0.1:{port}") as channel:
                await reward_pb2_grpc.RewardServiceStub(channel).ListEnvironments(
                    reward_pb2.ListEnvironmentsRequest(), timeout=2)
            return
        except grpc.aio.AioRpcError:
            assert time.monotonic() < deadline, f"not serving after {timeout_s} s:\n{log.read_text()[-3000:]}"
            await asyncio.sleep(0.5)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stub(python, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("verifiers")
    hub_port, main_port = free_port(), free_port()
    (tmp / "hub.yaml").write_text(yaml.safe_dump({"reward": {"verifiers": ENVS, "env_timeout_s": 10}}))
    (tmp / "main.yaml").write_text(yaml.safe_dump({"reward": {
        "remote": {name: f"127.0.0.1:{hub_port}" for name in ENVS}, "score_timeout_s": 20}}))
    procs = [_spawn(python, tmp / "hub.yaml", hub_port, tmp / "hub.log", "--memory-mb", str(HUB_MEMORY_MB))]
    try:
        await _serving(hub_port, procs[0], tmp / "hub.log")
        procs.append(_spawn(sys.executable, tmp / "main.yaml", main_port, tmp / "main.log"))
        await _serving(main_port, procs[1], tmp / "main.log")
        async with make_channel(f"127.0.0.1:{main_port}") as channel:
            yield reward_pb2_grpc.RewardServiceStub(channel)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            p.wait(timeout=30)


def _rows(python: Path, name: str, num_train: int, num_eval: int, seed: int = 0):
    from rlmesh.learner.data.sources import load_dataset
    from rlmesh.services.config import RewardSection, VerifiersDataSection

    reward = RewardSection(verifiers={name: {**ENVS[name], "python": str(python)}})
    return load_dataset(VerifiersDataSection(env_name=name, num_train=num_train, num_eval=num_eval), seed, reward)


def _struct(values: dict) -> Struct:
    s = Struct()
    s.update(values)
    return s


def _item(i: str, example, completion: str) -> reward_pb2.ScoreItem:
    return reward_pb2.ScoreItem(id=i, env_name=example.env, completion=completion,
                                prompt=[common_pb2.ChatMessage(role=m["role"], content=m["content"])
                                        for m in example.messages], env_metadata=_struct(example.metadata))


@pytest.mark.asyncio(loop_scope="session")
async def test_a_published_environment_scores_with_its_own_rubric_through_the_reward_tier(python, stub):
    train, held_out = _rows(python, "sophistry", num_train=20, num_eval=5)
    train = list(train)
    assert (len(train), len(held_out)) == (20, 5)
    assert not {e.id for e in train} & {e.id for e in held_out}, "a held-out prompt is also trained on"
    example = held_out[0]
    assert example.env == "sophistry" and example.messages[0]["role"] == "system"
    assert "<claim>" in example.messages[0]["content"] and example.metadata["info"]["passage"]
    # Eight claims, each citing a sentence of the passage: what its rubric rewards, against none.
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", example.metadata["info"]["passage"]) if s.strip()]
    argued = "".join(f"<claim>The passage supports this, point {i}.</claim><cite>{sentences[i % len(sentences)]}</cite>"
                     for i in range(8))
    reply = await stub.Score(reward_pb2.ScoreRequest(items=[_item("argued", example, argued),
                                                            _item("bare", example, "I think so.")]), timeout=60)
    argued_r, bare_r = reply.results
    assert not argued_r.error and not bare_r.error, (argued_r.error, bare_r.error)
    # Each function of its rubric is a component, under the function's own name.
    assert {"aggregate_reward", "correctness_reward", "n_claims_metric", "n_citations_metric"} <= set(argued_r.components)
    assert argued_r.components["n_claims_metric"] == 8 == argued_r.components["n_citations_metric"]
    assert bare_r.components["n_claims_metric"] == 0
    assert argued_r.reward > bare_r.reward, (argued_r.reward, bare_r.reward)
    environments = {e.name: e for e in (await stub.ListEnvironments(reward_pb2.ListEnvironmentsRequest())).environments}
    assert environments["sophistry"].kind == "single_turn" and environments["guess"].kind == "multi_turn"


async def _episode(stub, example, actions: list[str]) -> list[reward_pb2.StepResponse]:
    reset = await stub.Reset(reward_pb2.ResetRequest(
        env_name=example.env, env_metadata=_struct(example.metadata),
        prompt=[common_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in example.messages]), timeout=60)
    steps = []
    for action in actions:
        steps.append(await stub.Step(reward_pb2.StepRequest(
            session_id=reset.session_id, action=common_pb2.ChatMessage(role="assistant", content=action)), timeout=60))
        if steps[-1].done:
            break
    await stub.Close(reward_pb2.CloseRequest(session_id=reset.session_id), timeout=30)
    return reset, steps


@pytest.mark.asyncio(loop_scope="session")
async def test_a_game_and_a_tool_environment_play_as_episodes_step_by_step(python, stub):
    train, _ = _rows(python, "guess", num_train=10, num_eval=4)
    example = next(e for e in train if e.metadata["answer"] not in ("1", "9"))
    target = int(example.metadata["answer"])
    _, steps = await _episode(stub, example, ["9", "1", str(target)])
    assert [s.observation[0].content for s in steps] == ["lower", "higher", "Correct!"]
    assert [s.done for s in steps] == [False, False, True]
    last = steps[-1]
    assert last.components["guessed"] == 1.0 and abs(last.components["few_guesses"] - 1 / 3) < 1e-6
    assert abs(last.reward - (1.0 + 0.5 / 3)) < 1e-5 and last.metadata["end"] == "has_final_env_response"

    train, _ = _rows(python, "tools", num_train=2, num_eval=1)
    example = train[0]
    a, b = map(int, re.findall(r"\d+", example.messages[-1]["content"]))
    call = json.dumps({"name": "add", "arguments": {"a": a, "b": b}})
    reset, steps = await _episode(stub, example, [f"<tool_call>\n{call}\n</tool_call>", f"It is {a + b}."])
    assert [t["function"]["name"] for t in map(dict, reset.tools)] == ["add"]
    assert (steps[0].observation[0].role, steps[0].observation[0].content) == ("tool", str(a + b))
    assert steps[1].done and steps[1].reward == 1.0 and steps[1].components["total_tool_calls"] == 1.0
    assert steps[1].metadata["end"] == "no_tools_called"


@pytest.mark.asyncio(loop_scope="session")
async def test_what_goes_wrong_in_an_environment_is_named(python, stub, tmp_path):
    train, _ = _rows(python, "guess", num_train=4, num_eval=1)
    example = train[0]
    for name, expected in (("raising", r"KeyError.*the environment's own bug"),
                           ("hanging", r"took longer than 3\.0s"),
                           ("nan", r"reward is nan|not a number|must be finite"),
                           ("hog", r"MemoryError")):  # past --memory-mb: the call fails, the server goes on
        broken = type(example)(**{**example.__dict__, "env": name})
        try:
            said = await _episode(stub, broken, [example.metadata["answer"]])  # right: the game ends, is scored
        except grpc.aio.AioRpcError as err:
            said = err.details()
        assert re.search(expected, str(said)), (name, said)
    # The server goes on: a good episode right after.
    _, steps = await _episode(stub, example, [example.metadata["answer"]])
    assert steps[-1].done and steps[-1].components["guessed"] == 1.0
    # An id that loads nothing stops the environment server at its start, naming it.
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({"reward": {"verifiers": {"x": {"env_id": "no-such-env"}}}}))
    proc = _spawn(python, tmp_path / "bad.yaml", free_port(), tmp_path / "bad.log")
    assert proc.wait(timeout=120) != 0
    assert "verifiers environment 'no-such-env' did not load" in (tmp_path / "bad.log").read_text()
    # The main interpreter has no verifiers: hosting one there says how to fix it.
    from rlmesh.reward_server.environments.verifiers_env import load

    with pytest.raises(ValueError, match="rlmesh venv"):
        load("sophistry-bench-sprint", {})
