"""`agent` environments: the user's own agent, run unchanged for one episode in a process of its own.

The agent is `module:function`, called as `function(prompt, metadata)` (sync or async): `prompt` is
the task's chat messages (a list of dicts), `metadata` its env_metadata. It talks to the policy
through any OpenAI client: its process gets `OPENAI_BASE_URL` and `OPENAI_API_KEY` pointing at the
episode's endpoint on the rollout server (`rlmesh.rollout_server.agent_endpoint`), and nothing else
secret (the variables of `reward.function_env`, as reward functions get). It returns the episode's
reward: a number, or `{"reward": r, "components": {...}, "turn_rewards": [...]}` (a reward per model
call it made, in order, for per-turn credit; optional).

A launcher process imports the agent once and forks each episode's process from it
(`agent_process`), so an episode does not pay the agent's imports. An agent may also be a command (a
list: program and arguments), started afresh for each episode with the task as JSON on stdin
({"prompt", "metadata"}) and its reward the last line of its stdout. Each episode's process is killed
(with its children) when it passes `reward.agent_timeout_s`; an agent that raises, exits, cannot be
imported, or returns a reward that is not a finite number ends its episode with a named reason
(`agent_timeout`, `agent_crashed`, `agent_bad_reward`), which the rollout server reports instead of
training on the episode.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import os
import shlex
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor

from rlmesh.reward_server.environments.agent_process import kill_episode
from rlmesh.reward_server.environments.base import ScoreOutput
from rlmesh.services.config import RewardSection, default
from rlmesh.services.domain.scoring import as_finite
from rlmesh.services.scratch import process_scratch
from rlmesh.reward_server.function_workers import worker_env

log = logging.getLogger(__name__)

_LAUNCHER = "rlmesh.reward_server.environments.agent_process"
_ERR_TAIL = 2000


@functools.cache
def episodes_root() -> str:
    """This process's directory for its episodes' own (made on first use, removed at exit; one a
    reward server killed outright left is removed by the next to make one: `services.scratch`)."""
    return str(process_scratch("rlmesh-agent-"))


class LauncherGone(Exception):
    """The launcher exited (or never loaded the agent): the message says why."""


class _Launcher:
    """One launcher process and the episodes it runs; replies are read by a thread and handed to the
    event loop that asked."""

    def __init__(self, path: str, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", _LAUNCHER, path, str(os.getpid())],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                     start_new_session=True)
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.loop = asyncio.get_running_loop()
        self.waiting: dict[int, tuple[asyncio.Future[int], asyncio.Future[int]]] = {}  # id -> (pid, exit)
        self.gone = ""
        self._ids = itertools.count()
        self._lock = threading.Lock()
        threading.Thread(target=self._read, name=f"agent-launcher-{self.proc.pid}", daemon=True).start()

    def start(self, task: str, answer: str, log_path: str,
              env: dict[str, str]) -> tuple[asyncio.Future[int], asyncio.Future[int]]:
        """Asks for one episode; returns futures of its pid and of its exit code."""
        futures = (self.loop.create_future(), self.loop.create_future())
        with self._lock:
            if self.gone:
                raise LauncherGone(self.gone)
            episode = next(self._ids)
            self.waiting[episode] = futures
            line = json.dumps({"id": episode, "task": task, "answer": answer, "log": log_path, "env": env})
            try:
                self.proc.stdin.write(line.encode() + b"\n")
                self.proc.stdin.flush()
            except OSError as err:
                del self.waiting[episode]
                raise LauncherGone(f"the agent launcher's pipe is closed ({err})") from err
        return futures

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if "ready" in msg:
                self._post(_settle, self.ready, None)
            elif "fatal" in msg:
                self.gone = f"it could not be loaded: {msg['fatal'].strip()}"
            elif "pid" in msg and msg.get("id") in self.waiting:
                self._post(_settle, self.waiting[msg["id"]][0], msg["pid"])
            elif "exit" in msg:
                with self._lock:
                    futures = self.waiting.pop(msg.get("id"), None)
                if futures:
                    self._post(_settle, futures[1], msg["exit"])
        code = self.proc.wait()
        with self._lock:
            self.gone = self.gone or f"its launcher process exited with {code}"
            waiting, self.waiting = self.waiting, {}
        error = LauncherGone(self.gone)
        for future in (self.ready, *(f for pair in waiting.values() for f in pair)):
            self._post(_fail, future, error)

    def _post(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop that asked has closed: nobody waits for this any more
            pass

    def close(self) -> None:
        try:
            self.proc.stdin.close()  # the launcher kills its episodes and exits
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _settle(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future, error: Exception) -> None:
    if not future.done():
        future.set_exception(error)
        future.exception()  # retrieved: a future nobody awaits any more is not an unhandled error


class AgentEnvironment:
    kind = "agent"

    def __init__(self, name: str, path: str | list[str], *, timeout_s: float, env: tuple[str, ...] = (),
                 max_concurrency: int = default(RewardSection, "agent_max_concurrency"),
                 ca_file: str | None = None) -> None:
        """`ca_file`: the CA an HTTPS endpoint's certificate is checked against, given to the agent as
        SSL_CERT_FILE (which the openai client's httpx reads)."""
        self.command: list[str] | None = None
        if isinstance(path, str):
            module, sep, attr = path.partition(":")
            if not sep or not module or not attr:
                raise ValueError(f"reward.agents.{name}={path!r} must look like 'package.module:function', "
                                 "or be a command as a list, e.g. ['python', 'my_agent.py']")
        else:
            if not path or not all(isinstance(a, str) and a for a in path):
                raise ValueError(f"reward.agents.{name}={path!r}: a command is a non-empty list of "
                                 "non-empty strings, e.g. ['python', 'my_agent.py']")
            self.command, path = list(path), shlex.join(path)
        self.name, self.path, self.timeout_s, self.env = name, path, timeout_s, env
        self.tls_env = {"SSL_CERT_FILE": ca_file} if ca_file else {}
        self.description = f"agent {path}"
        self._slots = asyncio.Semaphore(max_concurrency)  # episodes whose agent process runs at once
        self._launcher: _Launcher | None = None
        self._running: set[int] = set()  # pids of the episodes running now
        # a command agent's episodes are waited for in threads of their own, never the loop's default pool
        self._waiters = ThreadPoolExecutor(max_concurrency, thread_name_prefix=f"agent-{name}") if self.command else None

    async def run(self, prompt: list[dict], metadata: dict, base_url: str, api_key: str) -> ScoreOutput:
        async with self._slots:
            return await self._run(prompt, metadata, base_url, api_key)

    async def _launched(self) -> _Launcher:
        """The launcher, started (again, if the last one exited) and ready."""
        if self._launcher is None or (self._launcher.gone and self._launcher.ready.done()):
            self._launcher = _Launcher(self.path, worker_env(self.env))
        launcher = self._launcher
        await asyncio.shield(launcher.ready)
        return launcher

    async def _run(self, prompt: list[dict], metadata: dict, base_url: str, api_key: str) -> ScoreOutput:
        # The task, answer and log are files in a directory only this user can read; beside them the
        # episode's own temporary directory (TMPDIR), gone with the episode.
        with tempfile.TemporaryDirectory(prefix="episode-", dir=episodes_root(), ignore_cleanup_errors=True) as tmp:
            own_tmp = os.path.join(tmp, "tmp")
            os.mkdir(own_tmp, 0o700)
            episode_env = {**self.tls_env, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key, "TMPDIR": own_tmp}
            if self.command is not None:
                return await self._run_command(json.dumps({"prompt": prompt, "metadata": metadata}), episode_env)
            task, answer, log_path = (os.path.join(tmp, n) for n in ("task.json", "answer.json", "log"))
            with open(task, "w") as f:
                json.dump({"prompt": prompt, "metadata": metadata}, f)
            try:
                launcher = await self._launched()
                pid_future, exit_future = launcher.start(task, answer, log_path, episode_env)
                pid = await pid_future
            except LauncherGone as err:
                return ScoreOutput(error=f"agent_crashed: agent {self.path}: {err}")
            self._running.add(pid)
            try:
                code = await asyncio.wait_for(asyncio.shield(exit_future), self.timeout_s)
            except asyncio.TimeoutError:
                kill_episode(pid)
                await _exited(exit_future)
                return self._timed_out()
            except asyncio.CancelledError:  # the caller gave up (its deadline): the agent goes with it
                kill_episode(pid)
                raise
            except LauncherGone as err:
                return ScoreOutput(error=f"agent_crashed: agent {self.path}: {err}")
            finally:
                self._running.discard(pid)
            if code != 0:
                return self._crashed(code, _tail(log_path))
            try:
                with open(answer) as f:
                    out = f.read()
            except FileNotFoundError:
                out = ""
            return parse_answer(self.path, out)

    async def _run_command(self, task: str, episode_env: dict[str, str]) -> ScoreOutput:
        """One episode of a command agent: its own process (and session), the task on stdin, the answer
        its last line of stdout; started and waited for in a thread with plain subprocess, as the
        reward-function workers are, not by the event loop."""
        loop = asyncio.get_running_loop()
        try:
            proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, env={**worker_env(self.env), **episode_env},
                                    start_new_session=True)
        except OSError as err:
            return ScoreOutput(error=f"agent_crashed: agent {self.path} could not start: {err}")
        self._running.add(proc.pid)
        try:
            out, err = await loop.run_in_executor(
                self._waiters, functools.partial(_communicate, proc, task.encode(), self.timeout_s))
        except subprocess.TimeoutExpired:
            kill_episode(proc.pid)
            await loop.run_in_executor(self._waiters, proc.wait)
            return self._timed_out()
        except asyncio.CancelledError:
            kill_episode(proc.pid)
            raise
        finally:
            self._running.discard(proc.pid)
        if proc.returncode != 0:
            return self._crashed(proc.returncode, err.decode(errors="replace")[-_ERR_TAIL:].strip())
        return parse_answer(self.path, out.decode(errors="replace"))

    def _timed_out(self) -> ScoreOutput:
        return ScoreOutput(error=f"agent_timeout: agent {self.path} ran past reward.agent_timeout_s="
                                 f"{self.timeout_s}s and was killed")

    def _crashed(self, code: int, stderr_tail: str) -> ScoreOutput:
        return ScoreOutput(error=f"agent_crashed: agent {self.path} exited with {code}: "
                                 f"{stderr_tail or '(no output on stderr)'}")

    def close(self) -> None:
        """Kills the agents still running, and the launcher."""
        for pid in list(self._running):
            kill_episode(pid)
        if self._launcher is not None:
            self._launcher.close()
        if self._waiters is not None:  # their waits return at once: the processes are dead
            self._waiters.shutdown(wait=False, cancel_futures=True)


async def _exited(future: asyncio.Future) -> None:
    try:
        await asyncio.wait_for(future, 10)
    except (asyncio.TimeoutError, LauncherGone):
        pass


def _tail(path: str) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - _ERR_TAIL))
            return f.read().decode(errors="replace").strip()
    except FileNotFoundError:
        return ""


def _communicate(proc: subprocess.Popen, task: bytes, timeout_s: float) -> tuple[bytes, bytes]:
    try:
        return proc.communicate(task, timeout=timeout_s)
    except BrokenPipeError:  # the agent exited without reading its task
        return proc.communicate(timeout=timeout_s)


def parse_answer(path: str, stdout: str) -> ScoreOutput:
    """The reward on the last line of what the agent's episode process answered: a JSON object
    {"reward", "components", "turn_rewards"} (the last two optional) or a bare number."""
    lines = stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else None
    except ValueError:
        answer = None
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = {"reward": answer}
    if not isinstance(answer, dict) or "reward" not in answer:
        return ScoreOutput(error=f"agent_crashed: agent {path} gave no answer: its last line must be a number "
                                 'or {"reward": number, "components": {name: number}}')
    reward, components, turns = answer["reward"], answer.get("components") or {}, answer.get("turn_rewards") or []
    ok = as_finite(reward) is not None and isinstance(components, dict) \
        and all(as_finite(v) is not None for v in components.values()) \
        and isinstance(turns, list) and all(as_finite(v) is not None for v in turns)
    if not ok:
        return ScoreOutput(error=f"agent_bad_reward: agent {path} returned {answer['reward']!r} "
                                 f"(components {components!r}, turn_rewards {turns!r}); return a finite number or "
                                 "{'reward': number, 'components': {name: number}, 'turn_rewards': [number per call]}")
    return ScoreOutput(float(reward), {str(k): float(v) for k, v in components.items()},
                       turn_rewards=[float(v) for v in turns])
