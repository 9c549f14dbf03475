"""Multi-turn environments for the episode tests, loaded by the reward server as `module:Class`."""

from __future__ import annotations

import time
from pathlib import Path

from rlmesh.reward_server.environments.base import ResetOutput, StepOutput

LOOKUP_TOOL = {"type": "function", "function": {
    "name": "lookup", "description": "Look a number up.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}


class LookupTools:
    """Offers a `lookup` tool and answers every turn with a tool message (numbers and words, so
    that a BPE tokenizer merges inside it); the episode ends after `metadata.turns` turns (3) with
    reward 1 when the last message holds a digit. A per-session first observation varies with the
    session so that episodes of one group start from different contexts."""

    description = "test: tool answers every turn"

    def __init__(self) -> None:
        self.num_resets = 0

    def tools(self) -> list[dict]:
        return [LOOKUP_TOOL]

    def reset(self, metadata: dict, prompt: list[dict]) -> ResetOutput:
        self.num_resets += 1
        state = {"turns": 0, "max": int(metadata.get("turns", 3))}
        return ResetOutput(state, [{"role": "user", "content": f"Session {self.num_resets % 4}: 12 + 345?"}])

    def step(self, state: dict, action: dict) -> StepOutput:
        state["turns"] += 1
        if state["turns"] >= state["max"]:
            hit = float(any(ch.isdigit() for ch in action["content"]))
            return StepOutput(reward=hit, done=True, components={"correct": hit})
        return StepOutput([{"role": "tool", "name": "lookup", "content": f"result 579 then {state['turns']}0 sum"}])

    def close(self, state: dict) -> None:
        pass


class SleepyTool(LookupTools):
    """Its tool takes `metadata.sleep_s` (5 s) on the first step: past the rollout's step timeout.
    When `metadata.flag` names a file, it is written as the slow step starts."""

    def reset(self, metadata: dict, prompt: list[dict]) -> ResetOutput:
        out = super().reset(metadata, prompt)
        out.state.update(sleep_s=float(metadata.get("sleep_s", 5.0)), flag=metadata.get("flag", ""))
        return out

    def step(self, state: dict, action: dict) -> StepOutput:
        if state["turns"] == 0:
            if state["flag"]:
                Path(state["flag"]).write_text("stepping")
            time.sleep(state["sleep_s"])
        return super().step(state, action)


class RaisingTool(LookupTools):
    """Its tool raises on the second step."""

    def step(self, state: dict, action: dict) -> StepOutput:
        if state["turns"] == 1:
            raise RuntimeError("the lookup tool exploded")
        return super().step(state, action)


# --- agents (reward.agents): plain functions that own their loop and talk to the policy through the
# `openai` client, configured only by OPENAI_BASE_URL / OPENAI_API_KEY as any agent is.

def tool_agent(prompt: list[dict], metadata: dict) -> dict:
    """Asks, feeds a tool result back, asks again: the loop an agent framework runs."""
    from openai import OpenAI

    client = OpenAI(max_retries=0)
    messages = list(prompt)
    first = client.chat.completions.create(model="policy", messages=messages, tools=[LOOKUP_TOOL])
    said = first.choices[0].message
    messages.append({"role": "assistant", "content": said.content or ""})
    messages.append({"role": "tool", "tool_call_id": "call_0", "content": f"result {int(metadata['answer'])} then"})
    second = client.chat.completions.create(model="policy", messages=messages, tools=[LOOKUP_TOOL])
    reward = float(len(second.choices[0].message.content or "") % 2)
    # a reward for each call (per-turn credit): the first call's, and the rest on the second
    return {"reward": reward, "components": {"calls": 2.0}, "turn_rewards": [0.25, reward - 0.25]}


def sdk_agent(prompt: list[dict], metadata: dict) -> float:
    """An agent written with the OpenAI Agents SDK as its users write one (a function tool, the Runner),
    on chat completions; it finds the endpoint and key in OPENAI_BASE_URL / OPENAI_API_KEY."""
    from agents import Agent, Runner, function_tool, set_default_openai_api, set_tracing_disabled

    set_default_openai_api("chat_completions")
    set_tracing_disabled(True)

    @function_tool
    def lookup(a: int) -> str:
        """Look a number up."""
        return f"result {a}"

    agent = Agent(name="solver", instructions="Use the lookup tool, then answer.", tools=[lookup])
    result = Runner.run_sync(agent, prompt[-1]["content"], max_turns=4)
    return float(str(int(metadata["answer"])) in str(result.final_output))


def probing_agent(prompt: list[dict], metadata: dict) -> dict:
    """Tries its endpoint as a careless or hostile client would, then makes real calls up to its call
    budget, the last one streamed; reports every HTTP status it got as a reward component."""
    import json
    import os

    import httpx
    from openai import OpenAI

    url, key = os.environ["OPENAI_BASE_URL"] + "/chat/completions", os.environ["OPENAI_API_KEY"]
    ok = {"role": "user", "content": "hi"}
    status = {}
    tries = {"no_key": ({}, {"messages": [ok]}), "wrong_key": ({"Authorization": "Bearer rlm-ep-guess"}, {"messages": [ok]}),
             "empty": (None, {"messages": []}), "bad_role": (None, {"messages": [{"role": "wizard", "content": "x"}]}),
             "n2": (None, {"n": 2, "messages": [ok]}), "too_many": (None, {"messages": [ok] * (int(metadata["max_messages"]) + 1)}),
             "oversized": (None, {"messages": [{"role": "user", "content": "x" * int(metadata["max_bytes"])}]})}
    with httpx.Client(timeout=60) as http:
        for name, (headers, body) in tries.items():
            r = http.post(url, content=json.dumps(body), headers={"Content-Type": "application/json",
                                                                   **({"Authorization": f"Bearer {key}"} if headers is None else headers)})
            status[name] = r.status_code
        status["not_json"] = http.post(url, content=b"{not json", headers={"Authorization": f"Bearer {key}"}).status_code
    client = OpenAI(max_retries=0)
    messages = list(prompt)
    for _ in range(int(metadata["max_calls"]) - 1):
        said = client.chat.completions.create(model="policy", messages=messages).choices[0].message
        messages += [{"role": "assistant", "content": said.content}, {"role": "user", "content": "more"}]
    pieces = [c.choices[0].delta.content or "" for c in
              client.chat.completions.create(model="policy", messages=messages, stream=True) if c.choices]
    streamed = "".join(pieces)
    try:
        client.chat.completions.create(model="policy", messages=messages)
    except Exception as err:  # openai.RateLimitError: the budget is spent
        status["over_budget"] = getattr(err, "status_code", 0)
    return {"reward": 0.0, "components": {**{k: float(v) for k, v in status.items()}, "streamed_chars": len(streamed),
                                          "streamed_pieces": sum(1 for p in pieces if p)}}


def editing_agent(prompt: list[dict], metadata: dict) -> float:
    """Rewrites what the model said before asking again, as memory-summarising agents do."""
    from openai import OpenAI

    client = OpenAI(max_retries=0)
    client.chat.completions.create(model="policy", messages=prompt)
    client.chat.completions.create(model="policy", messages=[*prompt, {"role": "assistant", "content": "edited"},
                                                               {"role": "user", "content": "go on"}])
    return 1.0


def hanging_agent(prompt: list[dict], metadata: dict) -> float:
    time.sleep(3600)
    return 1.0


def crashing_agent(prompt: list[dict], metadata: dict) -> float:
    raise RuntimeError("the agent fell over")
