"""Calculator: a tool-use task. The model is asked to add two 3-digit numbers (too hard for a tiny
model's weights) and may call one tool, `add(a, b)`, offered through the chat template's `tools=`.

Each step takes the model's assistant message. If it calls tools (Qwen / Hermes `<tool_call>`
blocks), the calls are executed and the results come back as `tool` messages; a malformed call or
bad arguments come back as an error message the model sees, never as a failure. A message without a
tool call is the final answer: reward 1 when it is exactly the integer `metadata.answer`
(surrounding whitespace aside), else 0; the episode ends. After `max_turns` steps without an answer
the episode ends with reward 0.

A turn reward for the tool call (`tool_call_reward`, 0 unless the metadata sets it): the first turn
of an episode that calls `add` on two integers summing to the answer gets it as its step's reward, so
an episode's turns are rewarded apart (per-turn credit, `algorithm.credit.assign: turn`) and its
reward is the call's plus the answer's.

Metadata: `answer` (required), `a` and `b` (needed only when the prompt is empty and the rules are
given as the first message), `max_turns` (4), `tool_call_reward` (0).
Components: `correct`, `num_tool_calls` (this episode), `correct_tool_calls` (of them, `add` calls
whose result is the answer; their ratio over held-out episodes is the tool-call accuracy),
`answer_in_text` (the first integer of the final message was right even when the format was not).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlmesh.services.domain.scoring import as_finite, as_int, score_integer
from rlmesh.services.domain.tasks import ADD_TOOL, calculator_prompt
from rlmesh.reward_server.environments.base import Message, ResetOutput, StepOutput, ToolSchema
from rlmesh.reward_server.environments.tool_calls import MalformedToolCall, has_tool_call, parse_tool_calls


@dataclass
class CalculatorState:
    answer: int
    max_turns: int
    tool_call_reward: float
    turns: int = 0
    num_tool_calls: int = 0
    correct_tool_calls: int = 0
    done: bool = False


def add(arguments: dict[str, Any]) -> str:
    """The `add` tool: the sum as text, or an error the model can read."""
    extra = sorted(set(arguments) - {"a", "b"})
    if extra:
        return f"error: add takes only a and b, got also {', '.join(extra)}"
    values = {k: as_int(arguments.get(k)) for k in ("a", "b")}
    bad = [f"{k}={arguments.get(k)!r}" for k, v in values.items() if v is None]
    if bad:
        return f"error: add needs integer arguments a and b; got {', '.join(bad)}"
    return str(values["a"] + values["b"])


class CalculatorEnvironment:
    name = "calculator"
    description = "add two numbers with an `add` tool; reward 1 for the exact sum as the final answer"

    def tools(self) -> list[ToolSchema]:
        return [ADD_TOOL]

    def reset(self, metadata: dict[str, Any], prompt: list[Message]) -> ResetOutput:
        answer = as_int(metadata.get("answer"))
        if answer is None:
            raise ValueError(f"calculator: metadata.answer={metadata.get('answer')!r} is not an integer; "
                             "the prompt group must carry env_metadata.answer")
        max_turns = as_int(metadata.get("max_turns", 4))
        if max_turns is None or max_turns < 1:
            raise ValueError(f"calculator: metadata.max_turns={metadata.get('max_turns')!r} must be an integer >= 1")
        tool_call_reward = as_finite(metadata.get("tool_call_reward", 0))
        if tool_call_reward is None or tool_call_reward < 0:
            raise ValueError(f"calculator: metadata.tool_call_reward={metadata.get('tool_call_reward')!r} must be a "
                             "finite number >= 0")
        observation = []
        if not prompt:
            a, b = as_int(metadata.get("a")), as_int(metadata.get("b"))
            if a is None or b is None:
                raise ValueError("calculator: an empty prompt needs integer metadata.a and metadata.b to state "
                                 "the task")
            observation = [{"role": "user", "content": calculator_prompt(a, b)}]
        return ResetOutput(CalculatorState(answer, max_turns, tool_call_reward), observation)

    def step(self, state: CalculatorState, action: Message) -> StepOutput:
        if state.done:
            raise ValueError("calculator: the episode is over; close the session")
        state.turns += 1
        text = action.get("content", "")
        if has_tool_call(text):
            calls = parse_tool_calls(text)
            observation = [self._execute(call) for call in calls]
            right = sum(self._is_right(call, result, state.answer) for call, result in zip(calls, observation))
            reward = state.tool_call_reward if right and not state.correct_tool_calls else 0.0
            state.num_tool_calls += len(observation)
            state.correct_tool_calls += right
            if state.turns < state.max_turns:
                return StepOutput(observation, reward=reward, metadata={"turns": state.turns})
            state.done = True
            return StepOutput(observation, reward=reward, done=True, components=self._components(state, 0.0, 0.0),
                              metadata={"turns": state.turns, "end": "max_turns"})
        state.done = True
        correct, in_text = score_integer(text, state.answer)
        return StepOutput([], reward=correct, done=True, components=self._components(state, correct, in_text),
                          metadata={"turns": state.turns, "end": "answered"})

    @staticmethod
    def _components(state: CalculatorState, correct: float, in_text: float) -> dict[str, float]:
        return {"correct": correct, "num_tool_calls": float(state.num_tool_calls),
                "correct_tool_calls": float(state.correct_tool_calls), "answer_in_text": in_text}

    @staticmethod
    def _is_right(call, result: Message, answer: int) -> bool:
        """An `add` call that ran and whose result is the task's answer."""
        return not isinstance(call, MalformedToolCall) and call.name == "add" and result["content"] == str(answer)

    @staticmethod
    def _execute(call) -> Message:
        if isinstance(call, MalformedToolCall):
            return {"role": "tool", "name": "", "content": f"error: {call.error}"}
        if call.name != "add":
            return {"role": "tool", "name": call.name, "content": f"error: unknown tool {call.name!r}; available: add"}
        return {"role": "tool", "name": "add", "content": add(call.arguments)}

    def close(self, state: CalculatorState) -> None:
        state.done = True
