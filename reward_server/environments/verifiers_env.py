"""`verifiers` environments (Prime Intellect's Environments Hub, the classic API of `verifiers` 0.1.12
to 0.3.x) served unchanged: `reward.verifiers.NAME: {env_id, args}`.

The environment is what `verifiers.load_environment(env_id, **args)` returns, from the package its
author published. `verifiers` pins libraries rlmesh pins otherwise (mcp, openai), so it usually runs
in a virtualenv of its own (`rlmesh venv`) as an environment server that the reward server proxies;
`rlmesh up` starts that server with the interpreter `reward.verifiers.NAME.python` names.

- A single-turn environment (`SingleTurnEnv`, max_turns 1) scores finished completions with its
  rubric: the reward is the rubric's weighted sum, and every rubric function's own score is a
  reward component (named after the function).
- Any other (`MultiTurnEnv`, `ToolEnv`, ...) runs as an rlmesh episode. Its own `rollout` loop runs
  unchanged, with a client that hands each of its model calls to the episode instead of a model
  endpoint: reset runs it to its first model call, each step answers that call with the policy's
  message (tool calls parsed from the text, `<tool_call>{...}</tool_call>`) and runs it to the next
  call or to its end. The environment's own hooks decide everything else (`setup_state`,
  `env_response`, its stop conditions and `max_turns`, `final_env_response`). At the end the rubric
  scores the whole rollout: that is the episode's reward, its functions the components, and the
  environment's stop condition the step metadata's `end`. Tools are the environment's `tool_defs`.

Prompts come from the environment's own dataset (`data.type: verifiers`): this module's `rows` command,
run with the same interpreter, prints them. What can go wrong is named: an id that does not load, a
hook that raises (the step fails with its error, also where the rollout caught it as its own
`has_error` ending: nothing of that episode is trained on), a call that hangs (past `reward.verifiers.NAME.timeout_s`), a reward that is not a number.
Note that `verifiers` itself scores a rubric function that raises as 0 and logs it: such a score
is trained on as 0, as it would be under verifiers' own trainers; the server's log has the error."""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from rlmesh.reward_server.environments.base import (Message, ResetOutput, ScoreInput, ScoreOutput, StepOutput,
                                                    ToolSchema)
from rlmesh.reward_server.environments.loop_thread import LoopThread
from rlmesh.reward_server.environments.tool_calls import ToolCall as ParsedCall
from rlmesh.reward_server.environments.tool_calls import parse_tool_calls

MODEL = "rlmesh-policy"  # the model name the environment's rollout sees


def load(env_id: str, args: dict[str, Any]) -> Any:
    """`verifiers.load_environment(env_id, **args)`, its failures named."""
    try:
        import verifiers as vf
    except ImportError as err:
        raise ValueError(f"verifiers environment {env_id!r}: `verifiers` is not installed for {sys.executable} "
                         f"({err}); make its virtualenv with `rlmesh venv` and name its python in "
                         "reward.verifiers.NAME.python") from err
    try:
        return vf.load_environment(env_id, **args)
    except Exception as err:  # the package's own code: anything
        raise ValueError(f"verifiers environment {env_id!r} did not load with args {args}: "
                         f"{type(err).__name__}: {err}") from err


class _Message(dict):
    """A chat message as both a dict and an object (`m["content"]` and `m.content`): reward functions
    written against older `verifiers` read dicts, newer ones attributes."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None


def to_message(m: Any) -> Message:
    """An rlmesh chat message from a verifiers one (a pydantic model or a dict): text content, the
    tool call id and name of tool results."""
    d = m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m)
    content = d.get("content") or ""
    if isinstance(content, list):  # content parts: their text
        content = "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    out = {"role": str(d.get("role", "user")), "content": str(content)}
    for key in ("tool_call_id", "name"):
        if d.get(key):
            out[key] = str(d[key])
    return out


def _finite(value: Any, what: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} is {value!r}, not a number") from None
    if not math.isfinite(number):
        raise ValueError(f"{what} is {number}; rewards must be finite")
    return number


def _scores(state: dict, env_id: str) -> tuple[float, dict[str, float]]:
    reward = _finite(state.get("reward"), f"{env_id}'s rubric reward")
    metrics = state.get("metrics") or {}
    return reward, {str(k): _finite(v, f"{env_id}'s rubric function {k!r}") for k, v in metrics.items()}


def _row(metadata: dict[str, Any], prompt: list[Message]) -> dict[str, Any]:
    """The dataset row the environment's rollout takes, from an item's metadata (what `rows` wrote)."""
    row: dict[str, Any] = {"prompt": [_Message(m) for m in prompt], "answer": metadata.get("answer", ""),
                           "info": metadata.get("info") or {}, "example_id": int(metadata.get("example_id", 0))}
    if isinstance(metadata.get("task"), dict):  # the classic string `task` column is refused by 0.3
        row["task"] = metadata["task"]
    return row


def _policy_client_class() -> type:
    """A `verifiers.Client` that parks each model call of a rollout until the episode answers it."""
    import verifiers as vf

    class PolicyClient(vf.Client):
        def __init__(self) -> None:
            super().__init__(None)
            self.calls: asyncio.Queue = asyncio.Queue()

        def setup_client(self, config: Any) -> None:
            return None

        async def to_native_tool(self, tool: Any) -> Any:
            return tool

        async def to_native_prompt(self, messages: Any) -> Any:
            return messages, {}

        async def get_native_response(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("the policy's messages come from rlmesh's rollout server")

        async def from_native_response(self, response: Any) -> Any:
            return response

        async def raise_from_native_response(self, response: Any) -> None:
            return None

        async def close(self) -> None:
            return None

        async def get_response(self, prompt: Any, model: str, sampling_args: Any, tools: Any = None,
                               **kwargs: Any) -> Any:
            from verifiers.types import Response, ResponseMessage

            answer: asyncio.Future = asyncio.get_running_loop().create_future()
            await self.calls.put((prompt, answer))
            content, tool_calls = await answer
            return Response(id=f"rlmesh-{time.time_ns()}", created=int(time.time()), model=model,
                            message=ResponseMessage(content=content, tool_calls=tool_calls or None,
                                                    finish_reason="tool_calls" if tool_calls else "stop",
                                                    is_truncated=False))

    return PolicyClient


@dataclass
class Episode:
    client: Any
    rollout: asyncio.Task
    seen: int = 0  # messages of the rollout's prompt the episode has already shown the model
    answer: asyncio.Future | None = None
    turns: int = 0
    done: bool = False
    state: dict = field(default_factory=dict)


class VerifiersScorer:
    """A single-turn `verifiers` environment: its rubric scores each completion."""

    max_batch_size = 16

    def __init__(self, name: str, env_id: str, env: Any, timeout_s: float) -> None:
        self.name, self.env_id, self.env = name, env_id, env
        self.description = f"verifiers environment {env_id} (single-turn; rubric functions as components)"
        self.loop = LoopThread(f"verifiers-{name}", f"verifiers environment {env_id}", timeout_s)
        self.client = _policy_client_class()()

    def score(self, items: list[ScoreInput]) -> list[ScoreOutput]:
        async def all_items() -> list[ScoreOutput]:
            return list(await asyncio.gather(*(self._score(item) for item in items)))

        return self.loop.run(all_items, f"scoring {len(items)} completion(s)")

    async def _score(self, item: ScoreInput) -> ScoreOutput:
        from verifiers.types import AssistantMessage

        try:
            state = await self.env.init_state(_row(item.metadata, item.prompt), self.client, MODEL)
            completion = _Message(AssistantMessage(content=item.completion).model_dump(exclude_none=True))
            state["completion"] = [completion]
            state["trajectory"] = [{"prompt": state["prompt"], "completion": state["completion"], "response": None,
                                    "tokens": None, "reward": None, "advantage": None, "is_truncated": False,
                                    "trajectory_id": state.get("trajectory_id"), "extras": {}}]
            await self.env.rubric.score_rollout(state)
            reward, components = _scores(state, self.env_id)
        except Exception as err:  # the environment's code: anything, named per item
            return ScoreOutput(error=f"verifiers environment {self.env_id}: {type(err).__name__}: {err}")
        return ScoreOutput(reward=reward, components=components)


class VerifiersEpisodes:
    """A multi-turn `verifiers` environment, its own rollout loop driven one model call per step."""

    def __init__(self, name: str, env_id: str, env: Any, timeout_s: float) -> None:
        self.name, self.env_id, self.env = name, env_id, env
        self.description = (f"verifiers environment {env_id} ({type(env).__name__}, multi-turn; rubric functions "
                            "as components)")
        self.loop = LoopThread(f"verifiers-{name}", f"verifiers environment {env_id}", timeout_s)
        self.client_class = _policy_client_class()
        self._tools = [{"type": "function", "function": t.model_dump(exclude_none=True)}
                       for t in getattr(env, "tool_defs", None) or []]

    def tools(self) -> list[ToolSchema]:
        return self._tools

    def reset(self, metadata: dict[str, Any], prompt: list[Message]) -> ResetOutput:
        async def start() -> tuple[Episode, list[Message]]:
            client = self.client_class()
            rollout = asyncio.ensure_future(self.env.rollout(_row(metadata, prompt), client, MODEL, {}))
            episode = Episode(client, rollout, seen=len(prompt))
            try:
                observation = await self._advance(episode)
            except BaseException:  # a failed or timed-out start leaves no rollout waiting for a model call
                rollout.cancel()
                raise
            if episode.done:
                raise ValueError(f"verifiers environment {self.env_id} ended its episode before the model's first "
                                 f"turn (stop condition {episode.state.get('stop_condition')!r}"
                                 f"{self._error(episode.state)})")
            return episode, observation

        episode, observation = self.loop.run(start, "starting an episode")
        return ResetOutput(state=episode, observation=observation)

    def step(self, state: Episode, action: Message) -> StepOutput:
        if state.done or state.answer is None:
            raise ValueError("a step after the episode ended")

        async def answer() -> StepOutput:
            state.answer.set_result(self._assistant(action.get("content", ""), state.turns))
            state.turns += 1
            observation = await self._advance(state)
            if not state.done:
                return StepOutput(observation=observation)
            if state.state.get("error") is not None:  # its rollout caught an error of its own hooks: no reward
                raise RuntimeError(f"its rollout ended with an error (stop condition "
                                   f"{state.state.get('stop_condition')!r}){self._error(state.state)}")
            await self.env.rubric.score_rollout(state.state)
            reward, components = _scores(state.state, self.env_id)
            return StepOutput(observation=observation, reward=reward, done=True, components=components,
                              metadata={"end": str(state.state.get("stop_condition") or "done")})

        return self.loop.run(answer, f"step {state.turns + 1} of an episode")

    def close(self, state: Episode) -> None:
        if not state.rollout.done():
            self.loop.submit(self._cancel(state.rollout))

    @staticmethod
    async def _cancel(task: asyncio.Task) -> None:
        task.cancel()

    async def _advance(self, episode: Episode) -> list[Message]:
        """Run the rollout to its next model call (the messages it added since the last one) or its end
        (its final environment response, if any)."""
        call = asyncio.ensure_future(episode.client.calls.get())
        await asyncio.wait({call, episode.rollout}, return_when=asyncio.FIRST_COMPLETED)
        if call.done():
            prompt, episode.answer = call.result()
            new, episode.seen = prompt[episode.seen:], len(prompt)
            # The policy's own message is in the prompt again: what the environment added comes after it.
            return [said for said in map(to_message, new) if said["role"] != "assistant"]
        call.cancel()
        episode.done, episode.answer = True, None
        episode.state = episode.rollout.result()  # raises what the rollout raised
        return [to_message(m) for m in episode.state.get("final_env_response") or []]

    @staticmethod
    def _assistant(text: str, turn: int) -> tuple[str, list[Any] | None]:
        from verifiers.types import ToolCall

        calls = [c for c in parse_tool_calls(text) if isinstance(c, ParsedCall)]
        return text, [ToolCall(id=f"call_{turn}_{i}", name=c.name, arguments=json.dumps(c.arguments))
                      for i, c in enumerate(calls)] or None

    @staticmethod
    def _error(state: dict) -> str:
        err = state.get("error")
        return f"; its error: {type(err).__name__}: {err}" if err else ""


def make_environment(name: str, env_id: str, args: dict[str, Any], timeout_s: float) -> Any:
    """The reward server's environment for `reward.verifiers.NAME`: a scorer or an episode runner."""
    env = load(env_id, args)
    if getattr(env, "max_turns", None) == 1:
        return VerifiersScorer(name, env_id, env, timeout_s)
    return VerifiersEpisodes(name, env_id, env, timeout_s)


def rows(env_id: str, args: dict[str, Any], num_train: int, num_eval: int, seed: int) -> list[dict[str, Any]]:
    """The environment's dataset as rows for rlmesh: the held-out rows from its eval dataset (or, when
    it has none, the first `num_eval` of its shuffled train dataset, which training then skips), and
    `num_train` training rows. Each: split, example_id, prompt (chat messages), answer, info, task."""
    env = load(env_id, args)
    train = env.get_dataset(seed=seed)
    env.build_eval_dataset()
    if getattr(env, "eval_dataset", None) is not None:
        held_out, train_from = env.get_eval_dataset(n=num_eval, seed=seed), 0
    else:
        held_out, train_from = train.select(range(min(num_eval, len(train)))), num_eval
    train = train.select(range(min(train_from, len(train)), min(train_from + num_train, len(train))))
    out = []
    for split, dataset in (("eval", held_out), ("train", train)):
        for i, r in enumerate(dataset):
            prompt = r.get("prompt")
            messages = [to_message(m) for m in prompt] if isinstance(prompt, list) else \
                [{"role": "user", "content": str(prompt)}]
            info = r.get("info") if isinstance(r.get("info"), dict) else {}
            out.append({"split": split, "example_id": int(r.get("example_id", i)), "prompt": messages,
                        "answer": r.get("answer") or "", "info": json.loads(json.dumps(info, default=str)),
                        **({"task": r["task"]} if isinstance(r.get("task"), dict) else {})})
    return out


def main(argv: list[str]) -> int:
    """`python -m rlmesh.reward_server.environments.verifiers_env rows SPEC_JSON`: the rows as JSON lines."""
    if len(argv) != 2 or argv[0] != "rows":
        print("usage: python -m rlmesh.reward_server.environments.verifiers_env rows "
              '\'{"env_id": ..., "args": {...}, "num_train": N, "num_eval": N, "seed": N}\'', file=sys.stderr)
        return 2
    spec = json.loads(argv[1])
    try:
        found = rows(spec["env_id"], spec.get("args") or {}, spec["num_train"], spec["num_eval"], spec["seed"])
    except ValueError as err:
        print(err, file=sys.stderr)
        return 1
    for row in found:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
