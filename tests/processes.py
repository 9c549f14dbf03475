"""Every process a test starts is stopped, whatever the test's outcome.

Each test runs with `RLMESH_TEST_OWNER=<id>` in the environment, each test module with
`RLMESH_TEST_MODULE=<id>` and the whole session with `RLMESH_TEST_SESSION=<id>`. They are inherited
by everything a test launches — `rlmesh up`, the services it starts in process sessions of their
own, vLLM's engine processes, torchrun's ranks — so a process can be found by its environment even
after its parent died or it was re-parented. After each test the processes carrying its owner id
are signalled (SIGTERM, then SIGKILL); after each module, everything carrying the module's id; at
the end of the session any process still carrying the session id fails the run, as does any process
a test or module left running (stopped then, and named in the session's summary). Worker pools the
test process itself holds are spared throughout (its `multiprocessing` children, such as a module
fixture's pool started on first use, or multiprocessing's resource tracker): their owners stop them,
and they end with the test process."""

from __future__ import annotations

import os
import time
import uuid

import psutil

OWNER_ENV = "RLMESH_TEST_OWNER"
MODULE_ENV = "RLMESH_TEST_MODULE"
SESSION_ENV = "RLMESH_TEST_SESSION"
# Machine-wide daemons a test may start once and leave for the next run (the Docker engine that
# `deploy/docker/stack.sh engine` starts when none is running): not a test's processes.
DAEMONS = frozenset({"dockerd", "containerd"})


def new_id() -> str:
    return uuid.uuid4().hex[:16]


def held_pool_worker(proc: psutil.Process) -> bool:
    """A `multiprocessing` child of this (the pytest) process: a worker of a pool some object here
    holds and stops (spawned or forkserver children run multiprocessing's entry point; forked ones
    run this process's command line)."""
    try:
        if proc.ppid() != os.getpid():
            return False
        cmdline = proc.cmdline()
    except psutil.Error:
        return False
    return any("multiprocessing" in part for part in cmdline) or cmdline == psutil.Process().cmdline()


def _carrying(key: str, value: str, since: float, spare=lambda proc: False) -> list[psutil.Process]:
    me = os.getpid()
    found = []
    for proc in psutil.process_iter(["pid", "create_time", "name"]):
        info = proc.info
        if info["pid"] == me or (info["create_time"] or 0) < since or info["name"] in DAEMONS:
            continue
        try:
            if proc.environ().get(key) == value and proc.status() != psutil.STATUS_ZOMBIE and not spare(proc):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid} {' '.join(proc.cmdline())[:160]}"
    except psutil.Error:
        return f"{proc.pid} (exited)"


def _with_descendants(procs: list[psutil.Process]) -> list[psutil.Process]:
    """`procs` and everything below them: a process may scrub its own environment (valkey-server
    rewrites it with its process title), so the id is not seen on it, but it is still a child."""
    seen = {p.pid: p for p in procs}
    for proc in procs:
        try:
            seen.update((c.pid, c) for c in proc.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    return list(seen.values())


def reap(key: str, value: str, since: float, grace_s: float = 5.0, spare=lambda proc: False) -> list[str]:
    """Stop every live process whose environment has `key=value`, but those `spare` keeps (SIGTERM,
    then SIGKILL after `grace_s`); returns what was found running, described. Ones caught mid-exit get
    the moment `still_running` gives them and are not counted."""
    if not still_running(key, value, since, spare):
        return []
    procs = _with_descendants(_carrying(key, value, since, spare))
    if not procs:
        return []
    found = [describe(p) for p in procs]
    for proc in procs:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5.0)
    return found


def still_running(key: str, value: str, since: float, spare=lambda proc: False) -> list[str]:
    """Live processes carrying `key=value` (but those `spare` keeps), after giving ones caught
    mid-exit a moment."""
    deadline = time.monotonic() + 3.0
    while (procs := _carrying(key, value, since, spare)) and time.monotonic() < deadline:
        time.sleep(0.25)
    return [describe(p) for p in procs]
