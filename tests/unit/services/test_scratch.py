"""Scratch directories (vLLM's sockets, LoRA adapters, agent episodes): one whose process was killed
outright is removed by the next process that makes one of its kind; a live process's, one without a
pid, another kind's, or a link, is not."""

import os
import subprocess
import sys

from rlmesh.services.scratch import PID_FILE, process_scratch, remove_orphans


def _dead_pid() -> int:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    return dead.pid


def test_only_directories_of_processes_that_are_gone_are_removed(tmp_path):
    gone, alive, unknown, other = (tmp_path / f"rlmesh-vllm-{name}" for name in ("gone", "alive", "unknown", "x"))
    for d in (gone, alive, unknown):
        d.mkdir()
        (d / "engine.sock").write_text("")
    (gone / PID_FILE).write_text(str(_dead_pid()))
    (alive / PID_FILE).write_text(str(os.getpid()))
    other.symlink_to(gone)  # a link is never followed
    assert remove_orphans(tmp_path, "rlmesh-vllm-") == [gone]
    assert not gone.exists() and alive.exists() and unknown.exists() and other.is_symlink()


def test_a_new_scratch_directory_is_marked_and_clears_only_orphans_of_its_own_kind(tmp_path):
    orphan, other_kind = tmp_path / "rlmesh-lora-old", tmp_path / "rlmesh-agent-old"
    for d in (orphan, other_kind):
        d.mkdir()
        (d / PID_FILE).write_text(str(_dead_pid()))
    made = process_scratch("rlmesh-lora-", tmp_path)
    assert made.parent == tmp_path and made.name.startswith("rlmesh-lora-")
    assert (made / PID_FILE).read_text() == str(os.getpid())
    assert oct(made.stat().st_mode & 0o777) == oct(0o700)  # this user's alone
    assert not orphan.exists() and other_kind.exists()
    assert remove_orphans(tmp_path, "rlmesh-lora-") == []  # its own process is alive


def test_a_killed_process_s_directory_goes_with_the_next_one(tmp_path):
    code = f"from rlmesh.services.scratch import process_scratch; print(process_scratch('rlmesh-agent-', {str(tmp_path)!r}), flush=True); import time; time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        left = child.stdout.readline().strip()
    finally:
        child.kill()  # SIGKILL: no atexit runs
        child.wait()
    assert os.path.isdir(left)
    process_scratch("rlmesh-agent-", tmp_path)
    assert not os.path.exists(left)
