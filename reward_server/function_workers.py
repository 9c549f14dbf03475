"""User reward functions run in worker processes that the reward server can kill.

A thread cannot be stopped, so a reward function in the server's own process that never returns,
or allocates without bound, takes the server down with it. Here each function gets a small pool of
processes (`reward.function_workers`), each started with:
- a clean environment: only the basics (PATH, locale, home, temp and cache directories:
  `services.child_env.BASIC`), the server's import path (PYTHONPATH, from its
  `sys.path`, so whatever module the server can import the worker can too), the same working
  directory, and the variables named in `reward.function_env` — never the token or other secrets;
- an address-space limit (RLIMIT_AS, `reward.function_memory_mb`): an allocation past it raises
  MemoryError, the item fails and the worker is replaced;
- a CPU-time limit per call (RLIMIT_CPU, `reward.function_cpu_s`): the kernel kills a call that
  spins past it; and a wall-clock deadline per call (`reward.env_timeout_s`, or the Score call's own
  deadline when that comes sooner), past which the server kills the worker itself (SIGKILL) and
  starts a replacement. So a call whose caller has stopped waiting (its Score was answered with an
  error) neither keeps its worker nor goes on waiting for a free one.

Calls and answers travel as JSON lines over pipes (never pickle: the worker runs code the server
must not trust with its own process). A worker's stdout goes to its stderr, so a `print` in a
reward function reaches the server's log and cannot corrupt an answer."""

from __future__ import annotations

import json
import logging
import os
import queue
import resource
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlmesh.services.child_env import child_env

if TYPE_CHECKING:
    from rlmesh.services.config import RewardSection

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerLimits:
    """How reward-function workers run: the `reward.function_*` keys and `reward.env_timeout_s`
    (`from_config`; their defaults are the config's)."""

    num_workers: int
    memory_mb: int
    cpu_s: float
    timeout_s: float
    env: tuple[str, ...]
    start_timeout_s: float = 60.0

    @classmethod
    def from_config(cls, section: RewardSection) -> WorkerLimits:
        return cls(num_workers=section.function_workers, memory_mb=section.function_memory_mb,
                   cpu_s=section.function_cpu_s, timeout_s=section.env_timeout_s, env=tuple(section.function_env))


class WorkerDied(Exception):
    """The worker exited (killed by a limit, or crashed) before answering."""


def worker_env(names: tuple[str, ...]) -> dict[str, str]:
    """The environment a worker starts with: nothing secret unless named in `names`."""
    env = child_env(names)
    env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


class _Worker:
    def __init__(self, path: str, limits: WorkerLimits) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rlmesh.reward_server.function_workers", path, str(limits.memory_mb),
             str(limits.cpu_s)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=worker_env(limits.env), cwd=os.getcwd(),
            close_fds=True)
        self._buf = b""
        self.busy_since: float | None = None
        try:
            ready = self.read(time.monotonic() + limits.start_timeout_s)
        except (TimeoutError, WorkerDied, ValueError) as err:
            self.kill()
            raise ValueError(f"reward function {path!r}: its worker did not start "
                             f"({err or f'no answer in {limits.start_timeout_s:g}s'})") from None
        if "error" in ready:
            self.kill()
            raise ValueError(ready["error"])
        self.multi_turn: bool = ready["multi_turn"]

    def read(self, deadline: float) -> dict:
        """One JSON line from the worker, by `deadline` (TimeoutError) or WorkerDied."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, 65536)
            if not chunk:
                raise WorkerDied(f"exit status {self.proc.wait()}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def call(self, request: dict, deadline: float) -> dict:
        self.busy_since = time.monotonic()
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise WorkerDied(f"exit status {self.proc.wait()}") from None
        answer = self.read(deadline)
        self.busy_since = None
        return answer

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            pipe.close()


@dataclass
class PoolStatus:
    num_workers: int
    num_idle: int
    num_stuck: int
    """Busy on one call for more than half the deadline."""
    num_replaced: int
    start_error: str = ""


class FunctionWorkerPool:
    """`num_workers` processes serving `module:function`; `call` is blocking and thread-safe."""

    def __init__(self, name: str, path: str, limits: WorkerLimits) -> None:
        self.name, self.path, self.limits = name, path, limits
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._all: set[_Worker] = set()
        self._lock = threading.Lock()
        self.num_replaced = 0
        self.start_error = ""
        first = _Worker(path, limits)  # a function that cannot be imported fails here, at start-up
        self._add(first)
        # `path` names a multi-turn environment class, not a function: the caller serves it instead.
        self.multi_turn = first.multi_turn
        for _ in range(0 if self.multi_turn else limits.num_workers - 1):
            self._add(_Worker(path, limits))

    def _add(self, worker: _Worker) -> None:
        with self._lock:
            self._all.add(worker)
        self._idle.put(worker)

    def _replace(self, worker: _Worker, why: str) -> None:
        worker.kill()
        with self._lock:
            self._all.discard(worker)
            self.num_replaced += 1
        log.warning("reward function %s (%s): worker pid %d %s; starting a replacement", self.name, self.path,
                    worker.proc.pid, why)

        def start() -> None:
            try:
                self._add(_Worker(self.path, self.limits))
                self.start_error = ""
            except (OSError, ValueError, TimeoutError, WorkerDied) as err:
                self.start_error = f"cannot start a worker for {self.path}: {err}"
                log.error("reward function %s: %s", self.name, self.start_error)

        threading.Thread(target=start, name=f"fn-{self.name}-start", daemon=True).start()

    def call(self, request: dict, deadline: float | None = None) -> dict:
        """Run one call by `deadline` (`time.monotonic()`; at most `limits.timeout_s` from now): the
        worker's answer, or {"error": ...} when no worker answered in time."""
        now = time.monotonic()
        latest = now + self.limits.timeout_s
        deadline = latest if deadline is None else min(deadline, latest)
        timeout = deadline - now
        try:
            worker = self._idle.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return {"error": f"no free worker within {timeout:.3g}s (all {self.limits.num_workers} busy; "
                             "reward.function_workers)"}
        try:
            answer = worker.call(request, deadline)
        except TimeoutError:
            self._replace(worker, f"missed its call's deadline of {timeout:.3g}s and was killed")
            return {"error": f"did not return within {timeout:.3g}s (its call's deadline: reward.env_timeout_s, or "
                             "the Score call's when sooner); its worker was killed and replaced"}
        except WorkerDied as err:
            self._replace(worker, f"died ({err})")
            return {"error": f"its worker died ({err}): over reward.function_cpu_s={self.limits.cpu_s:g} CPU "
                             "seconds, or crashed; replaced"}
        except ValueError as err:  # not a JSON line: the function wrote into the answer pipe
            self._replace(worker, f"broke the answer protocol ({err})")
            return {"error": f"its worker wrote something that is not an answer ({err}); replaced"}
        if answer.pop("exit", False):  # it hit the memory limit and is exiting: state may be broken
            self._replace(worker, "hit its memory limit")
        else:
            self._idle.put(worker)
        return answer

    def status(self) -> PoolStatus:
        now = time.monotonic()
        with self._lock:
            workers = list(self._all)
        stuck = sum(1 for w in workers if w.busy_since is not None and now - w.busy_since > self.limits.timeout_s / 2)
        return PoolStatus(len(workers), self._idle.qsize(), stuck, self.num_replaced, self.start_error)

    def healthy(self) -> str:
        """Why this function cannot answer now (every worker stuck, none can start), or ""."""
        s = self.status()
        if s.num_workers == 0 or s.start_error:
            return s.start_error or "no worker running"
        if s.num_stuck == s.num_workers:
            return f"all {s.num_workers} workers stuck on calls past half the deadline"
        return ""

    def close(self) -> None:
        with self._lock:
            workers, self._all = list(self._all), set()
        for w in workers:
            w.kill()


# --- the worker process ---------------------------------------------------------------------------


def _as_answer(value: Any) -> dict:
    if isinstance(value, dict):
        try:
            return {"reward": float(value.get("reward", 0.0)),
                    "components": {str(k): float(v) for k, v in value.items() if k != "reward"}}
        except (TypeError, ValueError) as err:
            return {"error": f"reward function returned a dict with a non-numeric value ({err})"}
    if isinstance(value, (int, float)):
        return {"reward": float(value)}
    return {"error": f"reward function returned {type(value).__name__}, expected a float or a dict with 'reward'"}


def exit_with_parent(parent: int, *, with_group: bool = False) -> None:
    """Exit when the reward server (pid `parent`) is gone, however it went (a stuck call never reads
    its input); `with_group` takes this process's group along (what an agent started). Given the pid
    rather than read here, a server that died before this ran is noticed at once."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        if with_group:
            os.killpg(os.getpgrp(), signal.SIGKILL)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def limit_memory(memory_mb: int) -> None:
    """Cap this process's address space (RLIMIT_AS): past it an allocation raises MemoryError in the
    call that made it (a reward-function worker, an environment server's call into its environment)."""
    limit = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _serve(path: str, memory_mb: int, cpu_s: float) -> None:
    exit_with_parent(os.getppid())
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the function's prints go to the server's log, not into the answers
    sys.stdout = sys.stderr

    def send(obj: dict) -> None:
        answers.write(json.dumps(obj) + "\n")

    limit_memory(memory_mb)
    from rlmesh.reward_server.environments.base import ItemError, is_multi_turn, load_callable

    try:
        fn = load_callable(path)
    except (ValueError, MemoryError) as err:
        send({"error": str(err)})
        return
    send({"ready": True, "multi_turn": isinstance(fn, type) and is_multi_turn(fn)})
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    for line in sys.stdin:
        item = json.loads(line)
        used = resource.getrusage(resource.RUSAGE_SELF)
        soft = int(used.ru_utime + used.ru_stime + cpu_s) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
        try:
            answer = _as_answer(fn(item["prompt"], item["completion"], item["metadata"]))
        except MemoryError:
            send({"error": f"reward function went over reward.function_memory_mb={memory_mb} MiB", "exit": True})
            os._exit(3)
        except ItemError as err:
            answer = {"error": str(err)}
        except Exception as err:  # a bug in the user's function fails its item, not the worker
            answer = {"error": f"reward function raised {type(err).__name__}: {err}"}
        send(answer)


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
