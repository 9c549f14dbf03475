"""The environments one reward server hosts, and the calls into them: which exist (built-ins, user
functions, agents, remote servers proxied by name; how one is loaded: `rlmesh.reward_server.registry`),
batched scoring and multi-turn sessions. `rlmesh.reward_server.service` maps the gRPC methods onto it.

Local environments (built-in ones and user functions) run through an `EnvRunner` each: a bounded
pool of worker threads with a timeout, so a hung or slow environment fails its own items and never
starves the others. Remote environments are proxied to the server registered for them. Sessions
(`Reset`/`Step`/`Close`, or one `Session` stream each) are routed by their id, which names this replica and the environment (see
`rlmesh.reward_server.sessions`, which also says how sessions stay on one replica when scaled out).

`score` never fails as a whole for what an environment does; every item gets a result, with `error`
set when it could not be scored (an environment that raised, hung, returned NaN, or a remote that
died or answered wrongly), within its budget (`reward.score_timeout_s`, or the caller's deadline when
sooner) plus `SCORE_MARGIN_S`: items still unscored at 90% of it fail with an error saying what did
not return in time. Session calls raise a `SessionError` naming the status code the servicer answers
with (the list is in `rlmesh.reward_server.service`); a session whose environment failed is closed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from google.protobuf.json_format import MessageToDict

from rlmesh.reward_server.environments.agent import AgentEnvironment
from rlmesh.reward_server.environments.base import Message, ScoreInput, is_multi_turn, nonfinite_error
from rlmesh.reward_server.environments.function import FunctionEnvironment
from rlmesh.reward_server.function_workers import WorkerLimits
from rlmesh.reward_server.limits import RequestLimits
from rlmesh.reward_server.registry import BUILTIN, kind_of, load_environment
from rlmesh.reward_server.remote import RemoteEnvironment
from rlmesh.reward_server.runner import EnvironmentTimeout, EnvRunner
from rlmesh.reward_server.sessions import LocalSession, SessionError, SessionTable, check_name
from rlmesh.services.auth import TLSFiles
from rlmesh.services.config import RewardSection, default
from rlmesh.v1 import common_pb2, reward_pb2
from rlmesh.services.domain.chat import as_dicts as to_messages

log = logging.getLogger(__name__)

SCORE_MARGIN_S = 1.0
"""How late past `reward.score_timeout_s` a Score may be answered: event-loop and thread scheduling
on a loaded host (tens of milliseconds on an idle one); no environment work is waited for in it."""


def to_proto_messages(env_name: str, messages: list[Message]) -> list[common_pb2.ChatMessage]:
    try:
        return [common_pb2.ChatMessage(**m) for m in messages]
    except (TypeError, ValueError) as err:
        raise SessionError("INTERNAL", f"environment {env_name!r} returned a malformed message ({err}); messages "
                                       "are dicts of role, content, name, tool_call_id strings") from None


class EnvironmentHost:
    def __init__(self, functions: dict[str, str] | None = None, *, token: str | None = None,
                 remote_timeout_s: float = default(RewardSection, "score_timeout_s"),
                 score_timeout_s: float = default(RewardSection, "score_timeout_s"),
                 env_timeout_s: float = default(RewardSection, "env_timeout_s"),
                 env_max_concurrency: int = default(RewardSection, "env_max_concurrency"),
                 session_idle_timeout_s: float = default(RewardSection, "session_idle_timeout_s"),
                 replica_id: str | None = None, builtin: Iterable[str] | None = None,
                 allow_register: bool = default(RewardSection, "allow_register"),
                 limits: RequestLimits | None = None, tls: TLSFiles | None = None,
                 function_limits: WorkerLimits | None = None) -> None:
        """`score_timeout_s` bounds every Score call, whatever deadline its caller set (see the
        module docstring); `env_timeout_s` bounds every local environment call (a Score batch, a
        reset, a step); `env_max_concurrency` is how many calls each local environment runs at
        once; `builtin` picks the built-in environments to serve (all by default; none for a pure
        proxy); `allow_register` accepts RegisterEnvironment calls; `limits` bound each request;
        `tls` is used on the channels to remote environment servers; `function_limits` says how
        user reward functions' worker processes run."""
        names = list(BUILTIN) if builtin is None else list(builtin)
        unknown = sorted(set(names) - set(BUILTIN))
        if unknown:
            raise ValueError(f"unknown built-in environment(s) {', '.join(unknown)}; choices: {', '.join(BUILTIN)}")
        self._env_max_concurrency, self._env_timeout_s = env_max_concurrency, env_timeout_s
        self.score_timeout_s = score_timeout_s
        self.local: dict[str, Any] = {}
        self.remote: dict[str, RemoteEnvironment] = {}
        self._runners: dict[str, EnvRunner] = {}
        function_limits = function_limits or WorkerLimits.from_config(RewardSection(env_timeout_s=env_timeout_s))
        for name in names:  # a built-in whose code runs in worker processes runs under the functions' limits
            kind = BUILTIN[name]
            self.add_local(name, kind(function_limits) if issubclass(kind, FunctionEnvironment) else kind())
        for name, path in (functions or {}).items():
            self.add_local(name, load_environment(name, path, function_limits))
        self.sessions = SessionTable(replica_id or uuid.uuid4().hex[:8], session_idle_timeout_s)
        self._token, self._remote_timeout_s, self._tls = token, remote_timeout_s, tls
        self.allow_register = allow_register
        self.limits = limits or RequestLimits.from_config(RewardSection())
        self._background: set[asyncio.Task] = set()

    def add_local(self, name: str, env: Any) -> None:
        """Serve `env` (a single- or multi-turn environment object) under `name`."""
        check_name("environment", name)
        if name in self.local or name in self.remote:
            raise ValueError(f"environment {name!r} is already served here; pick another name")
        self.local[name] = env
        self._runners[name] = EnvRunner(name, max_concurrency=self._env_max_concurrency,
                                        timeout_s=self._env_timeout_s)

    async def register_remote(self, name: str, address: str) -> reward_pb2.EnvironmentInfo:
        if name in self.local:
            raise ValueError(f"environment {name!r} is already served locally; pick another name")
        check_name("environment", name)
        remote = RemoteEnvironment(name, address, token=self._token, timeout_s=self._remote_timeout_s,
                                   tls=self._tls)
        try:
            await remote.describe()
        except ValueError:
            await remote.channel.close()
            raise
        old = self.remote.pop(name, None)
        if old is not None:
            self._spawn(old.channel.close(grace=5.0))
        self.remote[name] = remote
        log.info("environment %s now proxied to %s", name, address)
        return remote.info()

    def environments(self) -> list[reward_pb2.EnvironmentInfo]:
        infos = [reward_pb2.EnvironmentInfo(name=n, kind=kind_of(e), description=e.description)
                 for n, e in sorted(self.local.items())]
        return infos + [r.info() for _, r in sorted(self.remote.items())]

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # --- Score -------------------------------------------------------------------------------

    async def score(self, items: list[reward_pb2.ScoreItem], budget_s: float | None = None,
                    ) -> list[reward_pb2.ScoreResult]:
        results: list[reward_pb2.ScoreResult | None] = [None] * len(items)
        by_env: dict[str, list[int]] = defaultdict(list)
        for i, item in enumerate(items):
            by_env[item.env_name].append(i)

        def fail(idx: list[int], msg: str) -> None:
            for i in idx:
                results[i] = reward_pb2.ScoreResult(id=items[i].id, error=msg)

        async def run(env_name: str, idx: list[int]) -> None:
            if env_name in self.remote:
                remote_results = await self.remote[env_name].score([items[i] for i in idx], budget_s)
                for i, res in zip(idx, remote_results):
                    results[i] = res
            elif env_name not in self.local:
                known = sorted([*self.local, *self.remote])
                fail(idx, f"unknown environment {env_name!r}; known: {', '.join(known)}")
            elif isinstance(self.local[env_name], AgentEnvironment):
                fail(idx, f"environment {env_name!r} is an agent: run its episodes with RunAgent")
            elif not callable(getattr(self.local[env_name], "score", None)):
                fail(idx, f"environment {env_name!r} is multi-turn: run its episodes with Reset/Step/Close")
            else:
                size = getattr(self.local[env_name], "max_batch_size", None) or len(idx)
                await asyncio.gather(*(self._score_local(env_name, items, idx[k:k + size], results, budget_s)
                                       for k in range(0, len(idx), size)))

        await asyncio.gather(*(run(env, idx) for env, idx in by_env.items()))
        return results  # type: ignore[return-value]

    async def _score_local(self, env_name: str, items: list[reward_pb2.ScoreItem], idx: list[int],
                           results: list, budget_s: float | None) -> None:
        env = self.local[env_name]
        inputs = [ScoreInput(items[i].id, to_messages(items[i].prompt), items[i].completion,
                             MessageToDict(items[i].env_metadata)) for i in idx]
        score = env.score
        if isinstance(env, FunctionEnvironment) and budget_s is not None:
            # Its worker is killed when the caller stops waiting, not env_timeout_s later: a hung
            # function would otherwise hold the worker past the answer, and a call still queued for
            # a worker would hang the replacement too.
            score = functools.partial(env.score, deadline=time.monotonic() + budget_s)
        error = ""
        try:
            outputs = await self._runners[env_name].call("score", score, inputs, timeout_s=budget_s)
            if len(outputs) != len(inputs):
                error = f"environment {env_name!r} returned {len(outputs)} results for {len(inputs)} items"
        except EnvironmentTimeout as err:
            error = str(err)
        except Exception as err:
            log.exception("environment %s failed on a batch of %d", env_name, len(idx))
            error = f"environment {env_name!r} raised {type(err).__name__}: {err}"
        if error:
            for i in idx:
                results[i] = reward_pb2.ScoreResult(id=items[i].id, error=error)
            return
        for i, out in zip(idx, outputs):
            bad = out.error or nonfinite_error(out.reward, out.components)
            results[i] = (reward_pb2.ScoreResult(id=items[i].id, error=out.error or f"environment {env_name!r}: {bad}")
                          if bad else reward_pb2.ScoreResult(id=items[i].id, reward=out.reward,
                                                             components=out.components))

    # --- Sessions ----------------------------------------------------------------------------

    async def _env_call(self, env_name: str, what: str, fn, *args, budget_s: float | None):
        """A local environment call, its failures turned into `SessionError`s."""
        try:
            return await self._runners[env_name].call(what, fn, *args, timeout_s=budget_s)
        except EnvironmentTimeout as err:
            raise SessionError("DEADLINE_EXCEEDED", str(err)) from None
        except ValueError as err:
            raise SessionError("INVALID_ARGUMENT", f"environment {env_name!r} {what}: {err}") from None
        except Exception as err:
            log.exception("environment %s failed in %s", env_name, what)
            raise SessionError("INTERNAL", f"environment {env_name!r} {what} raised {type(err).__name__}: {err}") \
                from None

    def close_idle(self) -> int:
        """Close the sessions idle past the timeout; how many there were."""
        idle = self.sessions.evict_idle()
        for session in idle:
            log.info("closing session of %s idle for over %.0fs", session.env_name, self.sessions.idle_timeout_s)
            self._spawn(self._close_quietly(session))
        return len(idle)

    async def close_idle_forever(self, every_s: float | None = None) -> None:
        """Close idle sessions on a timer (a caller that never comes back holds no slot for long)."""
        every_s = every_s or min(max(self.sessions.idle_timeout_s / 4, 0.05), 30.0)
        while True:
            await asyncio.sleep(every_s)
            self.close_idle()

    async def reset(self, request: reward_pb2.ResetRequest, budget_s: float | None = None, *,
                    owner: str = "") -> reward_pb2.ResetResponse:
        name = request.env_name
        self.close_idle()
        self.limits.check_input(f"Reset of {name!r}", request.prompt, request.env_metadata)
        if name in self.remote:
            reply = await self.remote[name].reset(request, budget_s)
            reply.session_id = str(self.sessions.new_id(name, reply.session_id))
            return reply
        env = self.local.get(name)
        if env is None:
            raise SessionError("NOT_FOUND", f"unknown environment {name!r}; known: "
                                            f"{', '.join(sorted([*self.local, *self.remote]))}")
        if not is_multi_turn(env):
            raise SessionError("FAILED_PRECONDITION", f"Reset: environment {name!r} is single-turn and has no "
                                                      "multi-turn sessions; score it with Score")
        self.limits.check_room(len(self.sessions), self.sessions.num_owned_by(owner), owner)

        def start(metadata: dict, prompt: list[Message]):
            return env.reset(metadata, prompt), env.tools()

        out, tools = await self._env_call(name, "reset", start, MessageToDict(request.env_metadata),
                                          to_messages(request.prompt), budget_s=budget_s)
        try:
            reply = reward_pb2.ResetResponse(observation=to_proto_messages(name, out.observation))
            for tool in tools:
                reply.tools.add().update(tool)
        except (SessionError, TypeError, ValueError, AttributeError) as err:
            self._spawn(self._close_quietly(LocalSession(name, out.state)))
            if isinstance(err, SessionError):
                raise
            raise SessionError("INTERNAL", f"environment {name!r} tools() returned something other than a list "
                                           f"of JSON objects: {err}") from None
        sid = self.sessions.new_id(name)
        self.sessions.add(sid, LocalSession(name, out.state, owner=owner))
        reply.session_id = str(sid)
        return reply

    async def step(self, request: reward_pb2.StepRequest, budget_s: float | None = None) -> reward_pb2.StepResponse:
        self.limits.check_text(f"Step of {request.session_id!r} action", request.action.content)
        sid = self.sessions.route(request.session_id)
        if sid.env_name in self.remote:
            return await self.remote[sid.env_name].step(sid.inner, request.action, budget_s)
        session = self.sessions.get(sid)
        if session.busy:
            raise SessionError("FAILED_PRECONDITION", f"session {request.session_id!r} already has a step running; "
                                                      "send one step at a time")
        if session.done:
            raise SessionError("FAILED_PRECONDITION", f"session {request.session_id!r}: the episode is over; "
                                                      "Close the session")
        env = self.local[sid.env_name]
        session.busy = True
        try:
            out = await self._env_call(sid.env_name, "step", env.step, session.state, to_messages([request.action])[0],
                                       budget_s=budget_s)
            bad = nonfinite_error(out.reward, out.components)
            if bad:
                raise SessionError("INTERNAL", f"environment {sid.env_name!r} step: {bad}")
            try:
                reply = reward_pb2.StepResponse(observation=to_proto_messages(sid.env_name, out.observation),
                                                reward=out.reward, done=out.done, components=out.components)
                reply.metadata.update(out.metadata)
            except (TypeError, ValueError, AttributeError) as err:
                raise SessionError("INTERNAL", f"environment {sid.env_name!r} step returned a bad StepOutput: "
                                               f"{err}") from None
        except (SessionError, asyncio.CancelledError):
            # The state may be half-updated, or still in use by a step that timed out: never reuse it.
            self._drop(sid)
            raise
        finally:
            session.busy = False
        session.done = out.done
        return reply

    async def close(self, request: reward_pb2.CloseRequest, budget_s: float | None = None) -> None:
        """Closing an unknown local session succeeds, so that a retried Close is harmless."""
        sid = self.sessions.route(request.session_id)
        if sid.env_name in self.remote:
            await self.remote[sid.env_name].close(sid.inner, budget_s)
            return
        session = self.sessions.pop(sid)
        if session is not None:
            await self._env_call(sid.env_name, "close", self.local[sid.env_name].close, session.state,
                                 budget_s=budget_s)

    def _drop(self, sid) -> None:
        """End a session whose environment failed; its close runs in the background."""
        session = self.sessions.pop(sid)
        if session is not None:
            self._spawn(self._close_quietly(session))

    async def _close_quietly(self, session: LocalSession) -> None:
        try:
            await self._env_call(session.env_name, "close", self.local[session.env_name].close, session.state,
                                 budget_s=None)
        except SessionError as err:
            log.warning("closing a session of %s failed: %s", session.env_name, err)
