"""Runs blocking environment calls off the event loop, each with a deadline, at most
`max_concurrency` at a time per environment.

`asyncio.to_thread` is not enough for code the server does not control: a call that hangs (a user
function in an endless loop, a tool waiting on a dead socket) keeps one thread of the loop's shared
default executor forever, and a few of those starve every environment. Python cannot kill a
thread, so the runner contains the damage instead:

- a call that misses its deadline fails at once with `EnvironmentTimeout`; its thread keeps the
  environment's slot until the call really returns, so the stuck work is counted, not forgotten;
- stuck calls take only their own environment's slots: once all are taken, further calls of that
  environment wait for a slot until their deadline and then fail saying how many calls are stuck,
  while other environments are served as before;
- worker threads are daemons, so a call that never returns cannot keep the process from exiting.

User reward functions (`reward.functions`) go further: their calls run in worker processes that are
killed at the deadline and replaced (`rlmesh.reward_server.function_workers`), so their thread here
is always given back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from rlmesh.reward_server.prom import ENV_CALLS, ENV_SECONDS

T = TypeVar("T")


class EnvironmentTimeout(Exception):
    """An environment call missed its deadline, or found no free worker before it."""


class _DaemonPool:
    """A thread pool whose workers are daemon threads, started as they are first needed."""

    def __init__(self, name: str, size: int) -> None:
        self._name, self._size = name, size
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        # Jobs submitted and not finished; a thread is started whenever they outnumber the threads.
        self._num_threads = self._num_jobs = 0

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            self._num_jobs += 1
            if self._num_jobs > self._num_threads and self._num_threads < self._size:
                self._num_threads += 1
                threading.Thread(target=self._work, name=f"{self._name}-{self._num_threads}", daemon=True).start()
        self._jobs.put((future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            future, fn, args = self._jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as err:  # handed to the awaiting caller
                    future.set_exception(err)
            with self._lock:
                self._num_jobs -= 1


class EnvRunner:
    """Runs one environment's calls: at most `max_concurrency` at once, each within `timeout_s`."""

    def __init__(self, name: str, *, max_concurrency: int, timeout_s: float) -> None:
        if max_concurrency < 1 or timeout_s <= 0:
            raise ValueError(f"environment {name!r}: max_concurrency must be >= 1 and timeout_s > 0, "
                             f"got {max_concurrency} and {timeout_s}")
        self.name, self.max_concurrency, self.timeout_s = name, max_concurrency, timeout_s
        self._pool = _DaemonPool(f"env-{name}", max_concurrency)
        self._slots = asyncio.Semaphore(max_concurrency)
        self.num_overdue = 0
        """Calls that missed their deadline and still hold a worker."""

    async def call(self, what: str, fn: Callable[..., T], *args: Any, timeout_s: float | None = None) -> T:
        """`fn(*args)` on a worker thread. `timeout_s` (capped at the runner's) covers waiting for a
        worker and running; `what` names the call in errors ("score", "step", ...). Counted and
        timed in the server's Prometheus metrics."""
        t0, outcome = time.monotonic(), "error"
        try:
            result = await self._call(what, fn, *args, timeout_s=timeout_s)
            outcome = "ok"
            return result
        except EnvironmentTimeout:
            outcome = "timeout"
            raise
        finally:
            ENV_CALLS.labels(self.name, what, outcome).inc()
            ENV_SECONDS.labels(self.name, what).observe(time.monotonic() - t0)

    async def _call(self, what: str, fn: Callable[..., T], *args: Any, timeout_s: float | None) -> T:
        timeout = self.timeout_s if timeout_s is None else min(timeout_s, self.timeout_s)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            async with asyncio.timeout_at(deadline):
                await self._slots.acquire()
        except TimeoutError:
            raise EnvironmentTimeout(
                f"environment {self.name!r} {what}: no free worker within {timeout:.3g}s; all {self.max_concurrency} "
                f"are busy, {self.num_overdue} of them with calls past their deadline (a hung environment?)"
            ) from None
        future = asyncio.wrap_future(self._pool.submit(fn, *args))
        overdue = False

        def release(_: asyncio.Future) -> None:
            self._slots.release()
            if overdue:
                self.num_overdue -= 1

        future.add_done_callback(release)
        try:
            async with asyncio.timeout_at(deadline):
                # shield: a timeout or a cancelled caller must not cancel the bookkeeping of a
                # call that is still running on its thread.
                return await asyncio.shield(future)
        except TimeoutError:
            if future.done():
                return future.result()
            overdue = True
            self.num_overdue += 1
            raise EnvironmentTimeout(f"environment {self.name!r} {what} did not return within {timeout:.3g}s") from None
