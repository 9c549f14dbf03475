"""`agent` environments: the user's own agent, run unchanged for one episode in a process of its own.

The agent is `module:function`, called as `function(prompt, metadata)` (sync or async): `prompt` is
the task's chat messages (a list of dicts), `metadata` its env_metadata. It talks to the policy
through any OpenAI client: its process gets `OPENAI_BASE_URL` and `OPENAI_API_KEY` pointing at the
episode's endpoint on the rollout server (`rlmesh.rollout_server.agent_endpoint`), and nothing else
secret (the variables of `reward.function_env`, as reward functions get). It returns the episode's
reward: a number, or `{"reward": r, "components": {...}}`.

Each episode is a fresh process, killed (with its children) when it passes `reward.agent_timeout_s`;
an agent that raises, exits, prints something other than its answer last, or returns a reward that
is not a finite number ends its episode with a named reason (`agent_timeout`, `agent_crashed`,
`agent_bad_reward`), which the rollout server reports instead of training on the episode.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import os
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from rlmesh.reward_server.function_workers import worker_env

log = logging.getLogger(__name__)

_RUNNER = "rlmesh.reward_server.environments.agent_process"
_ERR_TAIL = 2000


@dataclass
class AgentResult:
    reward: float = 0.0
    components: dict[str, float] = field(default_factory=dict)
    error: str = ""


class AgentEnvironment:
    kind = "agent"

    def __init__(self, name: str, path: str, *, timeout_s: float, env: tuple[str, ...] = (),
                 max_concurrency: int = 8) -> None:
        module, sep, attr = path.partition(":")
        if not sep or not module or not attr:
            raise ValueError(f"reward.agents.{name}={path!r} must look like 'package.module:function'")
        self.name, self.path, self.timeout_s, self.env = name, path, timeout_s, env
        self.description = f"agent {path}"
        self._slots = asyncio.Semaphore(max_concurrency)  # episodes whose agent process runs at once
        # one waiting thread per running episode, never shared with the loop's default pool
        self._waiters = ThreadPoolExecutor(max_concurrency, thread_name_prefix=f"agent-{name}")
        self._running: set[subprocess.Popen] = set()

    async def run(self, prompt: list[dict], metadata: dict, base_url: str, api_key: str) -> AgentResult:
        async with self._slots:
            return await self._run(prompt, metadata, base_url, api_key)

    async def _run(self, prompt: list[dict], metadata: dict, base_url: str, api_key: str) -> AgentResult:
        env = {**worker_env(self.env), "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key}
        # The task goes in a file only this user can read; the process is started and waited for in a
        # thread with plain subprocess (as the reward-function workers are), not the event loop's.
        with tempfile.NamedTemporaryFile("w", prefix="rlmesh-agent-", suffix=".json") as task:
            json.dump({"prompt": prompt, "metadata": metadata}, task)
            task.flush()
            argv = [sys.executable, "-m", _RUNNER, self.path, task.name, str(os.getpid())]
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env=env, start_new_session=True)
            self._running.add(proc)
            try:
                out, err = await asyncio.get_running_loop().run_in_executor(
                    self._waiters, functools.partial(proc.communicate, timeout=self.timeout_s))
            except subprocess.TimeoutExpired:
                _kill(proc)
                await asyncio.get_running_loop().run_in_executor(self._waiters, proc.communicate)
                return AgentResult(error=f"agent_timeout: agent {self.path} ran past reward.agent_timeout_s="
                                         f"{self.timeout_s}s and was killed")
            except asyncio.CancelledError:  # the caller gave up (its deadline): the agent goes with it
                _kill(proc)
                raise
            finally:
                self._running.discard(proc)
        tail = err.decode(errors="replace")[-_ERR_TAIL:].strip()
        if proc.returncode != 0:
            return AgentResult(error=f"agent_crashed: agent {self.path} exited with {proc.returncode}: "
                                     f"{tail or '(no output on stderr)'}")
        return parse_answer(self.path, out.decode(errors="replace"))

    def close(self) -> None:
        """Kills the agents still running (their waiting threads then return at once)."""
        for proc in list(self._running):
            _kill(proc)
        self._waiters.shutdown(wait=False, cancel_futures=True)


def parse_answer(path: str, stdout: str) -> AgentResult:
    """The reward on the agent process's last line of stdout."""
    lines = stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else None
    except ValueError:
        answer = None
    if not isinstance(answer, dict) or "reward" not in answer:
        return AgentResult(error=f"agent_crashed: agent {path} gave no answer line")
    reward, components = answer["reward"], answer.get("components") or {}
    ok = isinstance(reward, (int, float)) and not isinstance(reward, bool) and math.isfinite(reward) \
        and isinstance(components, dict) \
        and all(isinstance(v, (int, float)) and math.isfinite(v) for v in components.values())
    if not ok:
        return AgentResult(error=f"agent_bad_reward: agent {path} returned {answer['reward']!r} "
                                 f"(components {components!r}); return a finite number or "
                                 "{'reward': number, 'components': {name: number}}")
    return AgentResult(float(reward), {str(k): float(v) for k, v in components.items()})


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
