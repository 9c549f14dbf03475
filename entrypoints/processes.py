"""The processes of a local mesh: each service in its own session (stopping its process group stops
what it started: vLLM's engine, torchrun's ranks), its log file, restarts, and a stop that returns only
once every group is empty. `rlmesh up`, `rlmesh eval` and `rlmesh.train` run their services through it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlmesh.services.config import NetworkSection, RunConfig

log = logging.getLogger("rlmesh.up")


@dataclass
class Service:
    name: str
    proc: subprocess.Popen
    log_path: Path
    argv: list[str]
    launcher: list[str] | None = None
    python: str | None = None  # the interpreter (of another virtualenv); None: this one
    env: dict[str, str] | None = None  # its whole environment; None: this process's and the mesh's extra
    restarts: int = 0
    restart_at: float | None = None  # when a crashed service is due to be started again

    def tail(self, n: int = 25) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


class Mesh:
    def __init__(self, run_dir: Path, env: dict[str, str] | None = None) -> None:
        self.run_dir = run_dir
        self.env = env  # extra environment of every service (e.g. PYTHONPATH for a user's reward function)
        self.services: list[Service] = []
        self.valkey = None
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)

    def spawn(self, name: str, argv: list[str], launcher: list[str] | None = None,
              python: str | None = None, env: dict[str, str] | None = None) -> Service:
        """Start `rlmesh ARGV` (with `python`, an interpreter of another virtualenv, when given; with
        `env` as its whole environment, when given)."""
        log_path = self.run_dir / "logs" / f"{name}.log"
        env = env if env is not None else ({**os.environ, **self.env} if self.env else None)
        # Own session: stopping the service's process group also stops its children (vLLM's engine,
        # torchrun's ranks).
        svc = Service(name, self._popen(argv, launcher, log_path, env, python), log_path, argv, launcher, python, env)
        self.services.append(svc)
        log.info("started %s (pid %d), log: %s", name, svc.proc.pid, log_path)
        return svc

    @staticmethod
    def _popen(argv: list[str], launcher: list[str] | None, log_path: Path,
               env: dict[str, str] | None, python: str | None = None) -> subprocess.Popen:
        cmd = [python or sys.executable, *(launcher or []), "-m", "rlmesh.cli", *argv]
        return subprocess.Popen(cmd, stdout=log_path.open("ab"), stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=os.getcwd(), env=env)

    def pass_secrets(self, config: RunConfig, resolved: RunConfig) -> None:
        """Secrets reach the services through their environment, never through the run directory: a
        random token for this run when none is set, the embedded queue's random password (its server
        started here), and a password written into queue.url (taken out of the URL `resolved` gives
        the services)."""
        import secrets
        from urllib.parse import unquote, urlsplit, urlunsplit

        from rlmesh.services.auth import load_token

        env = dict(self.env or {})
        net = config.network
        if not env.get(net.token_env) and load_token(net.token_file, net.token_env) is None:
            env[net.token_env] = secrets.token_urlsafe(32)
        queue = resolved.queue
        if config.queue.url == "embedded":
            from rlmesh.services.valkey import EMBEDDED_USER, start_embedded_valkey

            password = secrets.token_urlsafe(32)
            self.valkey = start_embedded_valkey(self.run_dir / "valkey", password=password)
            queue.url, queue.username, queue.password_file = self.valkey.connection_url, EMBEDDED_USER, None
            env[queue.password_env] = password
        else:
            parts = urlsplit(queue.url)
            if parts.password is not None and not queue.password_file:
                env[queue.password_env] = unquote(parts.password)
                user = f"{parts.username}@" if parts.username else ""
                queue.url = urlunsplit(parts._replace(netloc=user + parts.netloc.rsplit("@", 1)[1]))
        self.env = env

    def wait_serving(self, network: NetworkSection, ports: dict[str, int]) -> None:
        """Wait until each service named in `ports` ({name: port}) answers its health check; one that
        exits first ends the wait with its log's last lines (SystemExit)."""
        from rlmesh.services.auth import TLSFiles
        from rlmesh.services.grpc_client import ExitedWhileStarting, wait_for_serving

        services = {svc.name: svc for svc in self.services}
        for name, port in ports.items():
            svc = services[name]
            tier = "learner" if name == "learner" else "reward"  # env-* processes are reward servers
            tls = TLSFiles.from_config(network, tier)
            try:
                asyncio.run(wait_for_serving(f"{network.host}:{port}", what=f"{name} server", timeout_s=600,
                                             alive=lambda svc=svc: svc.proc.poll() is None, tls=tls, peer=tier))
            except ExitedWhileStarting:
                raise SystemExit(f"rlmesh up: {name} exited while starting (code {svc.proc.returncode}); last lines "
                                 f"of {svc.log_path}:\n{svc.tail()}") from None

    def restart(self, svc: Service) -> None:
        signal_group(svc.proc, signal.SIGKILL)  # whatever the dead service left behind (vLLM's engine)
        svc.restarts += 1
        svc.restart_at = None
        svc.proc = self._popen(svc.argv, svc.launcher, svc.log_path, svc.env, svc.python)
        log.warning("restarted %s (pid %d, restart %d)", svc.name, svc.proc.pid, svc.restarts)

    def stop(self, grace_s: float = 10.0) -> None:
        for svc in reversed(self.services):
            if svc.proc.poll() is None:
                signal_group(svc.proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for svc in self.services:
            try:
                svc.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0fs; killing it", svc.name, grace_s)
        # Whatever is left in any service's process group (stragglers, engine children) is killed.
        for svc in self.services:
            signal_group(svc.proc, signal.SIGKILL)
            try:
                svc.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        # SIGKILL is delivered asynchronously: return only once every group is empty, so nothing a
        # service started is still exiting after `rlmesh up` (or `rlmesh.train`) has returned.
        deadline = time.monotonic() + 5.0
        while any(group_alive(svc.proc) for svc in self.services) and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.valkey is not None:
            self.valkey.stop()
            self.valkey = None


def group_alive(proc: subprocess.Popen) -> bool:
    try:
        os.killpg(proc.pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Interrupted(KeyboardInterrupt):
    """A stop signal arrived (SIGINT, SIGTERM or SIGHUP); `signum` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def stop_signals_interrupt():
    """While inside: SIGINT, SIGTERM and SIGHUP raise `Interrupted` in the main thread, so that the
    command's `finally` stops every service it started. Explicitly for SIGINT too: a shell starting us
    in the background leaves SIGINT ignored, and Python then installs no handler of its own. Put
    back afterwards (under `rlmesh.train` this is the user's process); only the main thread may set
    handlers, elsewhere nothing changes. Yields `shield()`: from then on, those signals are ignored
    (call it before stopping the services, so a second Ctrl-C cannot cut the stop short)."""
    main = threading.current_thread() is threading.main_thread()
    stop_signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def on_signal(signum, frame):  # noqa: ARG001
        raise Interrupted(signum)

    def shield() -> None:
        if main:
            for sig in stop_signals:
                signal.signal(sig, signal.SIG_IGN)

    previous = {sig: signal.signal(sig, on_signal) for sig in stop_signals} if main else {}
    try:
        yield shield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
