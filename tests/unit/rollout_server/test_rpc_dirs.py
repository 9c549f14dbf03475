"""vLLM's socket directories: one a killed rollout server left behind is removed by the next server
to start; a live server's, or one without a pid, is not."""

import os
import subprocess
import sys

from rlmesh.rollout_server.vllm_engine import remove_orphaned_rpc_dirs


def test_only_directories_of_servers_that_are_gone_are_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone, alive, unknown, other = (tmp_path / f"rlmesh-vllm-{name}" for name in ("gone", "alive", "unknown", "x"))
    for d in (gone, alive, unknown):
        d.mkdir()
        (d / "engine.sock").write_text("")
    (gone / "pid").write_text(str(dead.pid))
    (alive / "pid").write_text(str(os.getpid()))
    other.symlink_to(gone)  # a link is never followed
    assert remove_orphaned_rpc_dirs(tmp_path) == [gone]
    assert not gone.exists() and alive.exists() and unknown.exists() and other.is_symlink()
