"""RewardService without a server: scoring isolation (hung, NaN, multi-turn names) and local
sessions. The gRPC side is in tests/integration/test_reward_server.py."""

import asyncio
import re
import threading
import time

import pytest
from google.protobuf.struct_pb2 import Struct

from rlmesh.reward_server.environments.base import ResetOutput, StepOutput
from rlmesh.reward_server.remote import check_results
from rlmesh.reward_server.service import RewardService
from rlmesh.reward_server.sessions import SessionError
from rlmesh.v1 import common_pb2, reward_pb2

RELEASE = threading.Event()


def nonfinite_reward(prompt, completion, metadata):
    return {"nan": float("nan"), "inf": float("inf"), "ok": 1.0}[completion] if completion != "bad-comp" \
        else {"reward": 1.0, "score": float("-inf")}


def hangs_on_request(prompt, completion, metadata):
    if completion == "hang":
        RELEASE.wait(5)
    return 1.0


class NaNStepEnv:
    description = "steps return NaN"

    def tools(self):
        return []

    def reset(self, metadata, prompt):
        return ResetOutput(state={})

    def step(self, state, action):
        if action["content"] == "hang":
            RELEASE.wait(5)
        return StepOutput(reward=float("nan"), done=True)

    def close(self, state):
        pass


def _item(i, env, completion, **meta):
    s = Struct()
    s.update(meta)
    return reward_pb2.ScoreItem(id=i, env_name=env, completion=completion, env_metadata=s)


def _action(text):
    return common_pb2.ChatMessage(role="assistant", content=text)


async def test_nonfinite_rewards_are_item_errors():
    service = RewardService({"f": f"{__name__}:nonfinite_reward"}, builtin=[])
    results = await service.score([_item(c, "f", c) for c in ("nan", "inf", "ok", "bad-comp")])
    assert "reward is nan" in results[0].error and results[0].reward == 0.0
    assert "reward is inf" in results[1].error
    assert results[2].reward == 1.0 and not results[2].error
    assert "component(s) score not finite" in results[3].error


async def test_a_hung_item_times_out_alone():
    RELEASE.clear()
    service = RewardService({"h": f"{__name__}:hangs_on_request"}, builtin=["arithmetic"], env_timeout_s=0.3)
    t0 = time.monotonic()
    results = await service.score([_item("a", "h", "hang"), _item("b", "h", "fine"),
                                   _item("c", "arithmetic", "2", answer="2")])
    assert time.monotonic() - t0 < 2
    assert "'h' score did not return within 0.3s" in results[0].error
    assert results[1].reward == 1.0 and results[2].reward == 1.0
    RELEASE.set()


async def test_caller_deadline_shortens_the_environment_timeout():
    RELEASE.clear()
    service = RewardService({"h": f"{__name__}:hangs_on_request"}, builtin=[], env_timeout_s=30)
    results = await service.score([_item("a", "h", "hang")], budget_s=0.2)
    # What is left of the caller's 0.2 s when the item starts (0.199 s once in CI), not the 30 s setting.
    waited = re.search(r"did not return within ([0-9.]+)s", results[0].error)
    assert waited and 0.1 < float(waited.group(1)) <= 0.2, results[0].error
    RELEASE.set()


async def test_score_refuses_multi_turn_and_unknown_environments_per_item():
    results = await RewardService().score([_item("a", "calculator", "1"), _item("b", "nope", "1")])
    assert "multi-turn: run its episodes with Reset/Step/Close" in results[0].error
    assert "unknown environment 'nope'" in results[1].error and "guess_number" in results[1].error


async def test_local_calculator_session_end_to_end():
    service = RewardService(replica_id="rep")
    meta = Struct()
    meta.update({"a": 100, "b": 250, "answer": 350})
    reset = await service.reset(reward_pb2.ResetRequest(env_name="calculator", env_metadata=meta))
    assert reset.session_id.startswith("rep/calculator/")
    assert reset.tools[0]["function"]["name"] == "add"
    assert "100 + 250" in reset.observation[0].content
    call = '<tool_call>{"name": "add", "arguments": {"a": 100, "b": 250}}</tool_call>'
    step = await service.step(reward_pb2.StepRequest(session_id=reset.session_id, action=_action(call)))
    assert [(m.role, m.name, m.content) for m in step.observation] == [("tool", "add", "350")] and not step.done
    final = await service.step(reward_pb2.StepRequest(session_id=reset.session_id, action=_action("350")))
    assert final.done and final.reward == 1.0 and final.components["correct"] == 1.0
    assert final.metadata["end"] == "answered"
    with pytest.raises(SessionError, match="episode is over") as err:
        await service.step(reward_pb2.StepRequest(session_id=reset.session_id, action=_action("350")))
    assert err.value.code == "FAILED_PRECONDITION"
    await service.close(reward_pb2.CloseRequest(session_id=reset.session_id))
    await service.close(reward_pb2.CloseRequest(session_id=reset.session_id))  # a retried Close is harmless
    with pytest.raises(SessionError, match="no session") as err:
        await service.step(reward_pb2.StepRequest(session_id=reset.session_id, action=_action("1")))
    assert err.value.code == "NOT_FOUND" and len(service.sessions) == 0


@pytest.mark.parametrize("env, code, text", [
    ("arithmetic", "FAILED_PRECONDITION", "single-turn"),
    ("nope", "NOT_FOUND", "unknown environment 'nope'"),
])
async def test_reset_refusals(env, code, text):
    with pytest.raises(SessionError, match=text) as err:
        await RewardService().reset(reward_pb2.ResetRequest(env_name=env))
    assert err.value.code == code


async def test_bad_metadata_is_invalid_argument():
    with pytest.raises(SessionError, match="calculator.*metadata.answer") as err:
        await RewardService().reset(reward_pb2.ResetRequest(env_name="calculator"))
    assert err.value.code == "INVALID_ARGUMENT"


async def test_a_failing_step_ends_its_session_with_a_named_reason():
    RELEASE.clear()
    service = RewardService({"nan": f"{__name__}:NaNStepEnv"}, builtin=[], env_timeout_s=0.3)
    assert [e.kind for e in service.environments()] == ["multi_turn"], "a class by import path is multi-turn"
    for text, code, message in [("x", "INTERNAL", "'nan' step: reward is nan"),
                                ("hang", "DEADLINE_EXCEEDED", "'nan' step did not return within 0.3s")]:
        sid = (await service.reset(reward_pb2.ResetRequest(env_name="nan"))).session_id
        with pytest.raises(SessionError, match=message) as err:
            await service.step(reward_pb2.StepRequest(session_id=sid, action=_action(text)))
        assert err.value.code == code
        with pytest.raises(SessionError, match="no session"):
            await service.step(reward_pb2.StepRequest(session_id=sid, action=_action("x")))
    RELEASE.set()


def test_check_results_rejects_wrong_count_ids_and_nonfinite_values():
    items = [reward_pb2.ScoreItem(id="a"), reward_pb2.ScoreItem(id="b")]

    def res(i, reward=1.0):
        return reward_pb2.ScoreResult(id=i, reward=reward)

    assert [r.reward for r in check_results("e", "h:1", items, [res("a"), res("b")])] == [1.0, 1.0]
    short = check_results("e", "h:1", items, [res("a")])
    assert all("answered 1 results for 2 items" in r.error for r in short) and [r.id for r in short] == ["a", "b"]
    swapped = check_results("e", "h:1", items, [res("b"), res("a")])
    assert all("result 0 with id 'b', expected 'a'" in r.error for r in swapped)
    nan = check_results("e", "h:1", items, [res("a", float("nan")), res("b")])
    assert "remote environment 'e' at h:1: reward is nan" in nan[0].error and nan[1].reward == 1.0


def test_builtin_selection_is_checked():
    assert [e.name for e in RewardService(builtin=["guess_number"]).environments()] == ["guess_number"]
    with pytest.raises(ValueError, match="unknown built-in environment.*choices: arithmetic"):
        RewardService(builtin=["chess"])


async def test_a_cancelled_step_ends_its_session():
    RELEASE.clear()
    service = RewardService({"nan": f"{__name__}:NaNStepEnv"}, builtin=[], env_timeout_s=5)
    sid = (await service.reset(reward_pb2.ResetRequest(env_name="nan"))).session_id
    task = asyncio.ensure_future(service.step(reward_pb2.StepRequest(session_id=sid, action=_action("hang"))))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    RELEASE.set()
    with pytest.raises(SessionError, match="no session"):
        await service.step(reward_pb2.StepRequest(session_id=sid, action=_action("x")))


async def test_idle_sessions_are_evicted_on_reset():
    service = RewardService(builtin=["guess_number"], session_idle_timeout_s=0.05)
    first = (await service.reset(reward_pb2.ResetRequest(env_name="guess_number"))).session_id
    await asyncio.sleep(0.1)
    await service.reset(reward_pb2.ResetRequest(env_name="guess_number"))
    assert len(service.sessions) == 1
    with pytest.raises(SessionError, match="idle for more than"):
        await service.step(reward_pb2.StepRequest(session_id=first, action=_action("1")))
