"""A sandbox for running untrusted Python (a model's program) against tests, one process tree per run.

Built on what util-linux and the kernel ship, no extra install: `unshare` puts each run in fresh
mount, network, pid, IPC and UTS namespaces, and `sandbox_init` (process 1 there) builds a minimal
read-only root and runs `sandbox_harness` without privileges under rlimits. As root, the program
runs as an unprivileged uid of its own; otherwise `unshare --user --map-root-user` adds a user
namespace (unprivileged user namespaces must be enabled: `sysctl kernel.unprivileged_userns_clone`
on Debian, `user.max_user_namespaces` > 0) and the program runs as that namespace's root with every
capability dropped. `Sandbox.check()` runs a probe at start-up and fails, saying what is missing,
where neither works (e.g. a container whose seccomp profile forbids namespaces: Docker's default
without `--cap-add SYS_ADMIN`, Kubernetes' RuntimeDefault).

What a run is protected against:
- the network: an empty network namespace (not even loopback is up; every connect fails);
- the host's files: the run sees only read-only binds of the system library directories and the
  Python installation, four device nodes and its own `/sandbox` tmpfs (size-limited, gone with the
  run); no `/etc/passwd`, `/proc`, `/tmp`, home or run directories;
- other processes: its own pid namespace (it sees and can signal only itself); when the run ends,
  every process it started is killed with it;
- privileges: none (another uid, or no capabilities; no_new_privs), so the chroot and mounts stay;
- resources: CPU seconds per process (RLIMIT_CPU), address space (RLIMIT_AS), processes of its user
  (RLIMIT_NPROC; each concurrent run gets a uid — or a user namespace — of its own, so one run's
  fork bomb does not eat another's budget), file size (RLIMIT_FSIZE), open files, and a wall-clock
  limit on the whole run; output read back is truncated.

What it does not protect against: kernel vulnerabilities (it is namespaces and rlimits, not a VM
or gVisor); CPU contention — a run may use every core until its wall time ends (there is no
cgroup CPU quota); memory is bounded per process (RLIMIT_AS) times the process limit, not per run;
the system libraries and the Python installation are readable; and assert-style tests run in the
program's own interpreter, so a program written to cheat can pass them without solving the task
(return an object whose `__eq__` is always true, or dig the result nonce out of the harness's
frames) — stdin/stdout tests compare what a separate process printed and are not open to that.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # this module runs on the standard library alone (tests run it as a lone file)
    from rlmesh.services.config import CodeEnvironmentSection

log = logging.getLogger(__name__)

_HERE = Path(__file__).resolve().parent
# Sandbox users are uids no account on the host is likely to have: one per concurrent run, and
# different sandboxes (several code environments in one server) never share one.
_UIDS = itertools.count(2_000_000_000)
_SYSTEM_BINDS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache")


@dataclass(frozen=True)
class SandboxLimits:
    """A code environment's `reward.code.<name>.*` limits (`from_config`; their defaults are the config's)."""

    cpu_s: int
    wall_s: float
    memory_mb: int
    max_processes: int
    file_size_mb: int
    work_mb: int
    test_timeout_s: float
    max_output_bytes: int

    @classmethod
    def from_config(cls, section: CodeEnvironmentSection) -> SandboxLimits:
        return cls(cpu_s=section.cpu_s, wall_s=section.wall_s, memory_mb=section.memory_mb,
                   max_processes=section.max_processes, file_size_mb=section.file_size_mb,
                   work_mb=section.work_mb, test_timeout_s=section.test_timeout_s,
                   max_output_bytes=section.max_output_bytes)

    def describe(self) -> str:
        return (f"cpu {self.cpu_s}s/process, wall {self.wall_s}s/run, address space {self.memory_mb} MiB/process, "
                f"{self.max_processes} processes, files {self.file_size_mb} MiB, work dir {self.work_mb} MiB tmpfs, "
                f"{self.test_timeout_s}s/test, output read back {self.max_output_bytes} bytes; no network, "
                "own pid/mount/IPC/UTS namespaces, read-only root without host files, no privileges")


@dataclass
class TestResult:
    passed: bool
    detail: str = ""


@dataclass
class RunResult:
    tests: list[TestResult]
    """One per test, in order; a test without a result (the harness died or ran out of time) failed."""
    timed_out: bool
    """The run hit its wall-clock limit and was killed."""
    exit_code: int | None
    stderr: str
    """The sandbox's own stderr (harness start-up failures), truncated."""

    @property
    def pass_rate(self) -> float:
        return sum(t.passed for t in self.tests) / len(self.tests) if self.tests else 0.0


class SandboxUnavailable(RuntimeError):
    """This host cannot run the sandbox; the message says what is missing and how to get it."""


class Sandbox:
    def __init__(self, limits: SandboxLimits, *, python: str | None = None, max_concurrency: int = 8) -> None:
        """`python`: the interpreter that runs programs (default: this one's base installation); its
        installation prefix is bound read-only into every run."""
        self.limits = limits
        self.python = os.path.realpath(python or sys.executable)
        if not os.access(self.python, os.X_OK):
            raise ValueError(f"sandbox python {self.python!r} is not an executable file")
        self.prefix = sys.base_prefix if python is None else str(Path(self.python).parents[1])
        unshare = shutil.which("unshare")
        if unshare is None:
            raise SandboxUnavailable("the code sandbox needs `unshare` (Debian/Ubuntu package util-linux) on PATH")
        self.as_root = os.geteuid() == 0
        self._unshare = [unshare, *([] if self.as_root else ["--user", "--map-root-user"]), "--mount", "--net",
                         "--pid", "--ipc", "--uts", "--fork", "--kill-child"]
        binds = [p for p in _SYSTEM_BINDS if os.path.lexists(p)]
        if not any(self.prefix == b or self.prefix.startswith(b + "/") for b in binds):
            binds.append(self.prefix)
        self._binds = binds
        self._uids: queue.SimpleQueue[int] = queue.SimpleQueue()
        for _ in range(max_concurrency):
            self._uids.put(next(_UIDS))
        self._harness = (_HERE / "sandbox_harness.py").read_text()

    @property
    def isolation(self) -> str:
        return ("an unprivileged uid per concurrent run" if self.as_root else
                "a user namespace per run, its root without capabilities (the reward server is not root)")

    def run(self, program: str, tests: list[str | dict[str, str]]) -> RunResult:
        """Run `program` against `tests` (see `sandbox_harness` for the two kinds) in a fresh sandbox."""
        uid = self._uids.get()
        try:
            return self._run(program, tests, uid)
        finally:
            self._uids.put(uid)

    def _run(self, program: str, tests: list, uid: int) -> RunResult:
        limits, nonce = self.limits, secrets.token_hex(16)
        job = {"program": program, "harness": self._harness, "python": self.python, "binds": self._binds,
               "limits": {"uid": uid if self.as_root else None, "cpu_s": limits.cpu_s, "memory_mb": limits.memory_mb,
                          "max_processes": limits.max_processes, "file_size_mb": limits.file_size_mb,
                          "work_mb": limits.work_mb},
               "spec": {"nonce": nonce, "tests": tests, "test_timeout_s": limits.test_timeout_s,
                        "max_output_bytes": limits.max_output_bytes}}
        root = tempfile.mkdtemp(prefix="rlmesh-sandbox-")
        try:
            proc = subprocess.Popen(
                [*self._unshare, sys.executable, "-I", "-S", str(_HERE / "sandbox_init.py"), root],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
            try:
                proc.stdin.write(json.dumps(job).encode())
                proc.stdin.close()
            except BrokenPipeError:  # it failed to start; its stderr says why
                pass
            stdout, stderr, timed_out = _read_bounded(proc, time.monotonic() + limits.wall_s,
                                                      limits.max_output_bytes)
            if timed_out:
                os.killpg(proc.pid, signal.SIGKILL)
            exit_code = proc.wait()
            proc.stdout.close()
            proc.stderr.close()
        finally:
            os.rmdir(root)  # the tmpfs was mounted in the run's own mount namespace: here it is empty
        results: dict[int, TestResult] = {}
        prefix = nonce + " "
        for line in stdout.decode("utf-8", "replace").splitlines():
            if line.startswith(prefix):
                index, passed, detail = (line[len(prefix):].split(" ", 2) + [""])[:3]
                results.setdefault(int(index), TestResult(passed == "1", detail))
        missing = "no result: the run timed out" if timed_out else "no result: the program ended the test harness"
        return RunResult([results.get(i, TestResult(False, missing)) for i in range(len(tests))], timed_out,
                         None if timed_out else exit_code, stderr.decode("utf-8", "replace"))

    def check(self) -> float:
        """Run a probe program that checks the isolation; returns its seconds. Raises `SandboxUnavailable`
        naming what does not hold (so a reward server never serves an unsandboxed code environment)."""
        probes = {
            "holds no privileges (chroot is refused)": "import os\ntry:\n    os.chroot('/')\n"
                                                        "    raise AssertionError('chroot worked')\n"
                                                        "except PermissionError:\n    pass",
            "has no network": "import socket\ntry:\n    socket.create_connection(('10.255.255.1', 80), 1)\n"
                              "    raise AssertionError('connected')\nexcept OSError as e:\n"
                              "    assert 'connected' not in str(e)",
            "cannot see the host's /etc/passwd": "import os; assert not os.path.exists('/etc/passwd')",
            f"cannot see this process's directory {_HERE}": f"import os; assert not os.path.exists({str(_HERE)!r})",
            "can write its work directory": "open('probe.txt', 'w').write('x')",
        }
        t0 = time.monotonic()
        result = self.run("", list(probes.values()))
        failed = [f"{what} ({r.detail})" for what, r in zip(probes, result.tests) if not r.passed]
        if failed:
            how = ("as root" if self.as_root else "in a user namespace (not root: unprivileged user namespaces must be "
                   "enabled, or run the reward server as root)")
            raise SandboxUnavailable(f"the code sandbox does not work on this host {how}: a probe run failed: "
                                     f"{'; '.join(failed)}; sandbox stderr: {result.stderr.strip()[-500:]!r}. It "
                                     "needs util-linux `unshare` and permission to create namespaces (in a container: "
                                     "--cap-add SYS_ADMIN or a seccomp profile allowing unshare)")
        return time.monotonic() - t0


def _read_bounded(proc: subprocess.Popen, deadline: float, max_bytes: int) -> tuple[bytes, bytes, bool]:
    """Read the process's stdout and stderr until both close or `deadline`; keep at most `max_bytes`
    of each (the rest is read and dropped, so a chatty program cannot block on a full pipe nor fill
    this process's memory). Returns (stdout, stderr, timed_out)."""
    kept = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    with selectors.DefaultSelector() as sel:
        for stream in kept:
            os.set_blocking(stream.fileno(), False)
            sel.register(stream, selectors.EVENT_READ)
        while sel.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return bytes(kept[proc.stdout]), bytes(kept[proc.stderr]), True
            for key, _ in sel.select(remaining):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf = kept[key.fileobj]
                buf += chunk[:max(0, max_bytes - len(buf))]
    return bytes(kept[proc.stdout]), bytes(kept[proc.stderr]), False
