"""The running test's time left under its pytest-timeout limit, so that a test's own waits end
first and a hang is reported as what hung (its wait's message), not as a timeout's stack dump."""

from __future__ import annotations

import time

MARGIN_S = 10.0
_deadline: float | None = None


def start(limit_s: float | None) -> None:
    """Called as a test's setup begins (its module's fixtures count against its limit too)."""
    global _deadline
    _deadline = None if not limit_s else time.monotonic() + limit_s


def cap(timeout_s: float) -> float:
    """`timeout_s`, or less: what is left of the test's limit, less a margin to report in."""
    if _deadline is None:
        return timeout_s
    return max(1.0, min(timeout_s, _deadline - time.monotonic() - MARGIN_S))
