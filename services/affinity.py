"""CPU pinning for the tiers that share a small machine: the learner on some cores, vLLM on others,
so that generation and training overlap instead of taking turns on the same cores."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

log = logging.getLogger(__name__)


def parse_cores(spec: str) -> set[int]:
    """'1-3,6' -> {1, 2, 3, 6}."""
    cores: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


UNPINNED = ("auto", "nobind")
"""Core settings that pin nothing ('nobind': rollout.cpu_cores only)."""


def pin_to_cores(spec: str, setting: str) -> None:
    """Pin this process, and every thread and child it starts later, to the cores in `spec`;
    'auto' and 'nobind' (rollout.cpu_cores) leave it alone. `setting` names the config field in errors."""
    if spec in UNPINNED:
        return
    cores, available = parse_cores(spec), os.sched_getaffinity(0)
    if not cores <= available:
        raise ValueError(f"{setting}={spec!r} names cores this process cannot use; available: {sorted(available)}")
    os.sched_setaffinity(0, cores)
    log.info("%s: pinned to cores %s", setting, sorted(cores))


SERVER_CORES_ENV = "RLMESH_SERVER_CORES"
"""The cores the rollout server process holds (set before vLLM starts, so its worker processes read
them): vLLM binds a worker's own threads to fewer of them (it keeps one for its scheduler and front
end, which idle while an update has the engine paused)."""


def format_cores(cores: set[int]) -> str:
    return ",".join(str(c) for c in sorted(cores))


def server_cores() -> set[int]:
    """SERVER_CORES_ENV's cores, or this thread's own when unset or unreadable."""
    try:
        return parse_cores(os.environ[SERVER_CORES_ENV])
    except (KeyError, ValueError):
        return os.sched_getaffinity(0)


@contextlib.contextmanager
def threads_on(cores: set[int]) -> Iterator[None]:
    """Threads started inside run on `cores` (Linux: the calling thread's affinity, which new threads
    inherit, is set for the block and put back after it)."""
    own = os.sched_getaffinity(0)
    if cores == own:
        yield
        return
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)
