"""A torchrun rank dies with its launcher: torchrun starts ranks in sessions of their own, so without
this a SIGKILLed launcher leaves them training beside the job `rlmesh up` starts in its place."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil

RANK = textwrap.dedent("""
    import time
    from rlmesh.learner.train.distributed import die_with_launcher
    die_with_launcher()
    print("ready", flush=True)
    time.sleep(120)
""")
# A launcher like torchrun's: the rank in a session of its own, with torchrun's variables.
LAUNCHER = textwrap.dedent(f"""
    import os, subprocess, sys, time
    rank = subprocess.Popen([sys.executable, "-c", {RANK!r}], start_new_session=True, stdout=subprocess.PIPE,
                            env={{**os.environ, "TORCHELASTIC_RESTART_COUNT": "0", "RANK": "1"}})
    assert rank.stdout.readline().strip() == b"ready"
    print(rank.pid, flush=True)
    time.sleep(120)
""")


def test_a_rank_dies_when_its_launcher_is_killed():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE)
    rank = psutil.Process(int(launcher.stdout.readline()))
    assert rank.is_running()
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait(10)
    deadline = time.monotonic() + 10
    while rank.is_running() and rank.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not rank.is_running() or rank.status() == psutil.STATUS_ZOMBIE, "the rank outlived its launcher"
