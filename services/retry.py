"""Retry with exponential backoff: the one loop behind every reconnect and wait-for-a-peer in rlmesh.

`retry(op, ...)` awaits `op()` until it returns, sleeping a growing, jittered delay after each
failure that `retry_on` accepts, and logging what it retries and why; any other error propagates
at once. With `deadline_s` it gives up once that long has passed since it started, with
`max_attempts` after that many tries: it raises what `give_up` builds (a caller's own error naming
what stayed unreachable), or the last error. A
`Backoff` alone gives the delays to code that schedules its own waits (`rlmesh up`'s restarts)."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
_log = logging.getLogger(__name__)

RetryOn = type[BaseException] | tuple[type[BaseException], ...] | Callable[[BaseException], bool]


@dataclass(frozen=True)
class Backoff:
    """Delays that start at `initial_s` and grow by `multiplier` per failure up to `max_s`; each is
    shortened by a random share of up to `jitter`, so that clients that lost the same server do
    not all come back in the same instant."""

    initial_s: float
    max_s: float
    multiplier: float = 2.0
    jitter: float = 0.1

    def __post_init__(self) -> None:
        if not (0 < self.initial_s <= self.max_s and self.multiplier >= 1 and 0 <= self.jitter < 1):
            raise ValueError(f"{self}: needs 0 < initial_s <= max_s, multiplier >= 1 and 0 <= jitter < 1")

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failure number `attempt` (0 for the first)."""
        grown = min(self.initial_s * self.multiplier ** min(attempt, 64), self.max_s)
        return grown * (1.0 - self.jitter * random.random())


def _retryable(retry_on: RetryOn) -> Callable[[BaseException], bool]:
    if isinstance(retry_on, type | tuple):
        return lambda err: isinstance(err, retry_on)
    return retry_on


def describe_error(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


async def retry(
    op: Callable[[], Awaitable[T]],
    *,
    what: str,
    retry_on: RetryOn,
    backoff: Backoff,
    deadline_s: float | None = None,
    max_attempts: int | None = None,
    give_up: Callable[[BaseException, float], BaseException] | None = None,
    on_failure: Callable[[BaseException], None] | None = None,
    describe: Callable[[BaseException], str] = describe_error,
    log: logging.Logger = _log,
    level: int = logging.WARNING,
    log_every_s: float = 0.0,
) -> T:
    """`await op()` until it succeeds, retrying the errors `retry_on` accepts (exception types, or
    a predicate) after `backoff`'s delays.

    After each retryable failure, in this order: `on_failure(err)` runs (to mark a connection down,
    or to raise when retrying is pointless); past `deadline_s` seconds since the start, or after
    `max_attempts` tries, the error `give_up(err, elapsed_s)` builds is raised from `err` (without
    `give_up`, `err` itself); a line naming `what`, the problem (`describe(err)`) and the delay is
    logged at `level`, at most once per `log_every_s`; then the delay is slept."""
    if max_attempts is not None and max_attempts < 1:
        raise ValueError(f"retry {what!r}: max_attempts={max_attempts} must be at least 1")
    retryable = _retryable(retry_on)
    start = time.monotonic()
    last_log = -float("inf")
    attempt = 0
    while True:
        try:
            return await op()
        except Exception as err:
            if not retryable(err):
                raise
            if on_failure is not None:
                on_failure(err)
            now = time.monotonic()
            attempt += 1
            if (deadline_s is not None and now - start >= deadline_s) or attempt == max_attempts:
                if give_up is None:
                    raise
                raise give_up(err, now - start) from err
            delay = backoff.delay(attempt - 1)
            if now - last_log >= log_every_s:
                until = "" if deadline_s is None else f" (giving up {deadline_s:g}s after the first try)"
                log.log(level, "%s: %s; retrying in %.1fs%s", what, describe(err), delay, until)
                last_log = now
        await asyncio.sleep(delay)
