"""The one retry-with-backoff helper: what it retries, how long it waits, when it gives up, what it logs."""

import asyncio
import logging
import time

import pytest

from rlmesh.services.retry import Backoff, retry


class Flaky:
    """Fails `failures` times with `error`, then returns "ok"; records when it was called."""

    def __init__(self, failures: int, error: Exception = ConnectionError("refused")) -> None:
        self.failures, self.error, self.calls = failures, error, []

    async def __call__(self) -> str:
        self.calls.append(time.monotonic())
        if len(self.calls) <= self.failures:
            raise self.error
        return "ok"


FAST = Backoff(0.01, 0.04, jitter=0.0)


def test_backoff_grows_to_its_cap_and_jitter_only_shortens():
    b = Backoff(0.5, 10.0, jitter=0.0)
    assert [b.delay(n) for n in range(7)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert b.delay(10_000) == 10.0  # no overflow however long the outage
    jittered = [Backoff(1.0, 1.0, jitter=0.25).delay(0) for _ in range(200)]
    assert all(0.75 <= d <= 1.0 for d in jittered) and len(set(jittered)) > 1


@pytest.mark.parametrize("bad", [dict(initial_s=0, max_s=1), dict(initial_s=2, max_s=1),
                                 dict(initial_s=1, max_s=2, multiplier=0.5), dict(initial_s=1, max_s=2, jitter=1.0)])
def test_backoff_rejects_nonsense(bad):
    with pytest.raises(ValueError, match="initial_s"):
        Backoff(**bad)


def test_retries_the_named_errors_until_success_and_logs_what(caplog):
    op = Flaky(3)
    with caplog.at_level(logging.WARNING):
        assert asyncio.run(retry(op, what="queue read on s", retry_on=ConnectionError, backoff=FAST)) == "ok"
    assert len(op.calls) == 4
    gaps = [b - a for a, b in zip(op.calls, op.calls[1:])]
    assert gaps[0] >= 0.01 and gaps[2] >= 0.04  # 0.01, 0.02, 0.04
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert lines[0] == "queue read on s: ConnectionError: refused; retrying in 0.0s"


def test_other_errors_propagate_at_once():
    op = Flaky(1, ValueError("bad request"))
    with pytest.raises(ValueError, match="bad request"):
        asyncio.run(retry(op, what="x", retry_on=ConnectionError, backoff=FAST))
    assert len(op.calls) == 1


def test_a_predicate_decides_what_is_retryable():
    op = Flaky(2, OSError(111, "refused"))
    assert asyncio.run(retry(op, what="x", retry_on=lambda e: isinstance(e, OSError) and e.errno == 111,
                             backoff=FAST)) == "ok"
    op = Flaky(2, OSError(13, "denied"))
    with pytest.raises(OSError, match="denied"):
        asyncio.run(retry(op, what="x", retry_on=lambda e: isinstance(e, OSError) and e.errno == 111, backoff=FAST))


def test_deadline_gives_up_with_the_callers_error():
    op = Flaky(10_000)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"server down for 0\.[0-9]s") as info:
        asyncio.run(retry(op, what="x", retry_on=ConnectionError, backoff=FAST, deadline_s=0.2,
                          give_up=lambda err, elapsed: TimeoutError(f"server down for {elapsed:.1f}s")))
    assert 0.2 <= time.monotonic() - start < 1.0
    assert isinstance(info.value.__cause__, ConnectionError)
    with pytest.raises(ConnectionError):  # without give_up: the last error itself
        asyncio.run(retry(Flaky(10_000), what="x", retry_on=ConnectionError, backoff=FAST, deadline_s=0.05))


def test_on_failure_sees_every_failure_and_may_stop_the_retrying():
    seen = []
    assert asyncio.run(retry(Flaky(2), what="x", retry_on=ConnectionError, backoff=FAST,
                             on_failure=seen.append)) == "ok"
    assert len(seen) == 2

    def exited(err):
        raise RuntimeError("the server's process exited")

    op = Flaky(5)
    with pytest.raises(RuntimeError, match="exited"):
        asyncio.run(retry(op, what="x", retry_on=ConnectionError, backoff=FAST, on_failure=exited))
    assert len(op.calls) == 1


def test_log_lines_are_throttled_and_name_the_deadline(caplog):
    with caplog.at_level(logging.INFO):
        asyncio.run(retry(Flaky(6), what="waiting for reward", retry_on=ConnectionError, backoff=FAST,
                          deadline_s=30, level=logging.INFO, log_every_s=3600))
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert caplog.records[0].getMessage().endswith("(giving up 30s after the first try)")


def test_max_attempts_counts_every_try():
    op = Flaky(10)
    with pytest.raises(ConnectionError, match="judge failed after 3 tries"):
        asyncio.run(retry(op, what="x", retry_on=ConnectionError, backoff=FAST, max_attempts=3,
                          give_up=lambda err, elapsed: ConnectionError("judge failed after 3 tries")))
    assert len(op.calls) == 3
    assert asyncio.run(retry(Flaky(2), what="x", retry_on=ConnectionError, backoff=FAST, max_attempts=3)) == "ok"
    op = Flaky(10)
    with pytest.raises(ConnectionError, match="refused"):  # one try: no retry at all
        asyncio.run(retry(op, what="x", retry_on=ConnectionError, backoff=FAST, max_attempts=1))
    assert len(op.calls) == 1
    with pytest.raises(ValueError, match="max_attempts=0"):
        asyncio.run(retry(op, what="x", retry_on=ConnectionError, backoff=FAST, max_attempts=0))
