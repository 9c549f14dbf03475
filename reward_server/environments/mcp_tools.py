"""An MCP tool server (Model Context Protocol) as a multi-turn tool-use environment.

Configured under `reward.mcp.<name>` with a scoring function and either the `url` of a server
speaking Streamable HTTP, or the `command` (+ `env`, `cwd`) of a stdio server, launched the way MCP
clients launch one (the SDK's stdio client: the server's stdin/stdout carry the protocol, its stderr
goes to the reward server's log). Per episode:
- Reset opens an MCP client session that lives until Close; the server's `tools/list` becomes the
  tools offered to the model (OpenAI-style function schemas for the chat template's `tools=`).
  A stdio server is one process per episode, started by Reset and ended by Close: an episode
  starts from the server's initial state whatever earlier episodes did to it (tools with state —
  a file system, a database — are common), and a server that crashes takes down only its own
  episode. The cost is a process start per episode (about a second for a Python server), small next
  to generating an episode; a server too slow to start that way can be served over HTTP instead.
- Each Step takes the model's assistant message. Its tool calls (`<tool_call>{json}</tool_call>`)
  are executed with `tools/call` and their results come back as `tool` messages; a malformed call,
  an unknown tool or a tool error comes back as an error message the model reads, never as a failure.
- A message without tool calls is the final answer: the scoring function gives the reward, and
  the episode ends. After `max_turns` steps without an answer it ends with reward 0.
- A server that cannot be reached or started, or dies mid-episode, fails the call (the reward
  server answers the Step with an error naming this environment and the URL or command; the
  rollout server ends the episode as `env_error`) — never a silent reward.

The scoring function, `module:function(answer, metadata, messages)`, returns a float reward or a
dict of components with a `reward` key; without one, `exact_answer` compares the answer with
`metadata.answer`.
"""

from __future__ import annotations

import asyncio
import shlex
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlmesh.services.domain.scoring import as_int, score_integer
from rlmesh.reward_server.environments.base import Message, ResetOutput, StepOutput, ToolSchema, load_callable
from rlmesh.reward_server.environments.loop_thread import LoopThread
from rlmesh.reward_server.environments.tool_calls import MalformedToolCall, has_tool_call, parse_tool_calls

if TYPE_CHECKING:
    from mcp.client.stdio import StdioServerParameters


def exact_answer(answer: str, metadata: dict[str, Any], messages: list[Message]) -> dict[str, float]:
    """1 when the final answer is exactly `metadata.answer`: as an exact integer where the answer
    expected is one, else as the same text (surrounding whitespace aside)."""
    expected = as_int(metadata.get("answer"))
    if expected is not None:
        correct = score_integer(answer, expected).correct
    else:
        want = str(metadata.get("answer", "")).strip()
        correct = float(answer.strip() == want and want != "")
    return {"reward": correct, "correct": correct}


class _Session:
    """One MCP client session, open for one episode. The MCP SDK needs the task that opened a
    session to close it, so each session is one task on the environment's event-loop thread,
    serving the calls handed to it."""

    def __init__(self, server: str | StdioServerParameters) -> None:
        self.server = server
        self._calls: asyncio.Queue = asyncio.Queue()
        self.tools: asyncio.Future = asyncio.get_running_loop().create_future()

    async def serve(self) -> None:
        from mcp import Client

        try:
            async with Client(self.server) as client:
                listed = await client.list_tools()
                self.tools.set_result([_schema(t) for t in listed.tools])
                while (item := await self._calls.get()) is not None:
                    name, arguments, reply = item
                    try:
                        reply.set_result(await client.call_tool(name, arguments))
                    except Exception as err:  # handed to the waiting step, which reports it
                        reply.set_exception(err)
        except Exception as err:
            if not self.tools.done():
                self.tools.set_exception(err)
            while not self._calls.empty():
                item = self._calls.get_nowait()
                if item is not None:
                    item[2].set_exception(err)

    async def call(self, name: str, arguments: dict[str, Any]):
        reply = asyncio.get_running_loop().create_future()
        await self._calls.put((name, arguments, reply))
        return await reply

    async def close(self) -> None:
        await self._calls.put(None)


def _schema(tool) -> ToolSchema:
    return {"type": "function", "function": {"name": tool.name, "description": tool.description or "",
                                             "parameters": tool.input_schema or {"type": "object", "properties": {}}}}


@dataclass
class McpEpisode:
    session: _Session
    task: Any
    metadata: dict[str, Any]
    transcript: list[Message]
    turns: int = 0
    num_tool_calls: int = 0
    done: bool = False
    tool_names: set[str] = field(default_factory=set)


class McpToolEnvironment:
    def __init__(self, name: str, url: str | None = None, *, command: list[str] | None = None,
                 env: dict[str, str] | None = None, cwd: str | None = None, score: str | None,
                 max_turns: int, call_timeout_s: float) -> None:
        """Exactly one of `url` (Streamable HTTP) and `command` (a stdio server, with `env`, `cwd`)."""
        if (url is None) == (command is None):
            raise ValueError(f"MCP environment {name!r}: set exactly one of url and command")
        self.name, self.max_turns, self.call_timeout_s = name, max_turns, call_timeout_s
        if command is not None:
            from mcp.client.stdio import StdioServerParameters

            self._server: str | StdioServerParameters = StdioServerParameters(
                command=command[0], args=list(command[1:]), env=env or None, cwd=cwd)
            # Errors name the server as "MCP server `cmd args`" wherever an HTTP one names its URL.
            self.url = f"`{shlex.join(command)}`"
            self.description = f"MCP tool server launched per episode: {shlex.join(command)}"
        else:
            self._server = self.url = url
            self.description = f"MCP tool server at {url}"
        self._score = load_callable(score) if score else exact_answer
        self._tools: list[ToolSchema] = []
        self._loop = LoopThread(f"mcp-{name}", f"MCP server {self.url}", call_timeout_s)

    def tools(self) -> list[ToolSchema]:
        return self._tools

    def reset(self, metadata: dict[str, Any], prompt: list[Message]) -> ResetOutput:
        async def open_session():
            session = _Session(self._server)
            task = asyncio.get_running_loop().create_task(session.serve())
            return session, task, await session.tools

        session, task, tools = self._loop.run(open_session, "opening a session (tools/list)")
        self._tools = tools
        names = {t["function"]["name"] for t in tools}
        return ResetOutput(McpEpisode(session, task, dict(metadata), list(prompt), tool_names=names))

    def step(self, state: McpEpisode, action: Message) -> StepOutput:
        if state.done:
            raise ValueError(f"{self.name}: the episode is over; close the session")
        state.turns += 1
        text = action.get("content", "")
        state.transcript.append({"role": "assistant", "content": text})
        if not has_tool_call(text):
            state.done = True
            scored = self._score(text, state.metadata, state.transcript)
            components = {"reward": float(scored)} if isinstance(scored, (int, float)) else dict(scored)
            reward = float(components.pop("reward"))
            components["num_tool_calls"] = float(state.num_tool_calls)
            return StepOutput(reward=reward, done=True, components=components, metadata={"turns": state.turns})
        observation = [self._execute(state, call) for call in parse_tool_calls(text)]
        state.transcript += observation
        if state.turns >= self.max_turns:
            state.done = True
            return StepOutput(observation, done=True, metadata={"turns": state.turns, "end": "max_turns"},
                              components={"correct": 0.0, "num_tool_calls": float(state.num_tool_calls)})
        return StepOutput(observation, metadata={"turns": state.turns})

    def _execute(self, state: McpEpisode, call) -> Message:
        if isinstance(call, MalformedToolCall):
            return {"role": "tool", "name": "", "content": f"error: {call.error}"}
        if call.name not in state.tool_names:
            return {"role": "tool", "name": call.name,
                    "content": f"error: unknown tool {call.name!r}; available: {', '.join(sorted(state.tool_names))}"}
        state.num_tool_calls += 1
        if state.task.done():
            raise ConnectionError(f"MCP server {self.url}: the episode's session has ended (the server went away?)")
        result = self._loop.run(lambda: state.session.call(call.name, call.arguments), f"tools/call {call.name}")
        text = "\n".join(getattr(block, "text", str(block)) for block in result.content)
        return {"role": "tool", "name": call.name, "content": f"error: {text}" if result.is_error else text}

    def close(self, state: McpEpisode) -> None:
        state.done = True
        self._loop.submit(state.session.close())
