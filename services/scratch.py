"""Scratch directories a process makes under the system's temporary directory and removes when it
ends. A process killed outright (SIGKILL, the OOM killer) cannot remove its own: each directory
carries the pid of the process that made it, and the next process to make one of the same kind
removes those of this user whose process is gone."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

PID_FILE = "pid"


def process_scratch(prefix: str, tmp: Path | None = None) -> Path:
    """A fresh private directory named `prefix`..., marked with this process's pid and removed when
    the process exits normally; first removes the orphaned ones of the same prefix (`remove_orphans`)."""
    tmp = Path(tmp) if tmp is not None else Path(tempfile.gettempdir())
    remove_orphans(tmp, prefix)
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=tmp))
    (path / PID_FILE).write_text(str(os.getpid()))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def remove_orphans(tmp: Path, prefix: str) -> list[Path]:
    """Remove each directory `prefix`* in `tmp` of this user whose process (the pid written in it) is
    gone. One whose pid is alive, that has none, or that is a link, is left alone. Returns what was removed."""
    removed = []
    for d in sorted(tmp.glob(prefix + "*")):
        try:
            if d.is_symlink() or not d.is_dir() or d.stat().st_uid != os.getuid():
                continue
            pid = int((d / PID_FILE).read_text())
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
        except (OSError, ValueError):  # no pid file, unreadable, or a live process of another user
            continue
    return removed
