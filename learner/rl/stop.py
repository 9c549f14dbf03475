"""How `rlmesh.train`'s callbacks reach the learner: two small files in the run directory.

- `stop_request`: a callback ended the run. The learner looks for it before each step and, once it
  is there, trains no further step: it runs its final evaluation, writes a checkpoint at the version
  it reached and summary.json, and exits as it does after `learner.num_steps`.
- `callbacks_seen`: the last step whose metrics row the callbacks have handled. While it exists,
  the learner starts a step only once the callbacks have seen the one before it, so a callback that
  stops the run on step N stops it at N exactly (the wait overlaps the learner's own wait for data;
  generation goes on meanwhile). `rlmesh up` without callbacks writes neither file."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

STOP_REQUEST = "stop_request"
CALLBACKS_SEEN = "callbacks_seen"


def request_stop(run_dir: Path, reason: str) -> None:
    """Ask the learner of the run in `run_dir` to stop after the step it is on."""
    (run_dir / STOP_REQUEST).write_text(reason.strip() + "\n")


def stop_requested(run_dir: Path) -> str | None:
    """The reason given for a stop request, or None when none was made."""
    try:
        return (run_dir / STOP_REQUEST).read_text().strip() or "stop requested"
    except FileNotFoundError:
        return None


def clear_requests(run_dir: Path) -> None:
    """Forget what an earlier run in this directory left (`rlmesh up --run-dir` reuses one)."""
    for name in (STOP_REQUEST, CALLBACKS_SEEN):
        (run_dir / name).unlink(missing_ok=True)


def mark_seen(run_dir: Path, version: int) -> None:
    """The callbacks have handled every row up to step `version` (written atomically)."""
    tmp = run_dir / f".{CALLBACKS_SEEN}.tmp"
    tmp.write_text(str(version))
    os.replace(tmp, run_dir / CALLBACKS_SEEN)


def _seen(run_dir: Path) -> int | None:
    try:
        return int((run_dir / CALLBACKS_SEEN).read_text())
    except FileNotFoundError:
        return None


async def wait_until_seen(run_dir: Path, version: int, timeout_s: float = 120.0, poll_s: float = 0.01) -> None:
    """Return once callbacks are attached and have seen step `version`, or at once when none are.
    Callbacks that fall `timeout_s` behind (a hung callback, a launcher gone) are waited for no
    longer: the file is removed, so the run goes on without waiting until they mark a step again."""
    t0 = time.monotonic()
    while (seen := _seen(run_dir)) is not None and seen < version:
        if time.monotonic() - t0 > timeout_s:
            log.warning("callbacks have not seen step %d after %.0fs (they are at %d); training on without "
                        "waiting for them", version, timeout_s, seen)
            (run_dir / CALLBACKS_SEEN).unlink(missing_ok=True)
            return
        await asyncio.sleep(poll_s)
