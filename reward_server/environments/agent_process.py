"""The agent launcher: `python -m rlmesh.reward_server.environments.agent_process module:function
SERVER_PID`. It imports the agent once, then forks one process per episode, so an episode starts in
milliseconds however long the agent's imports take (the OpenAI Agents SDK takes ~3 s of CPU here).

Spoken over stdin/stdout, one JSON object a line:
- launcher -> server, once: `{"ready": true}` after the import, or `{"fatal": "..."}` and exit;
- server -> launcher: `{"id", "task", "answer", "log", "env"}` starts an episode: the child reads the
  task ({"prompt", "metadata"}) from `task`, runs with `env` added to its environment (the episode's
  OPENAI_BASE_URL and OPENAI_API_KEY, and TMPDIR, its own temporary directory), writes whatever it
  prints to `log` and its answer ({"reward", "components", "turn_rewards"}) to `answer`;
- launcher -> server: `{"id", "pid"}` when the episode's process started, `{"id", "exit"}` when it ended.

Each episode's process is a session (process group) of its own, so the server kills an agent with what
it started. If the server goes, however it went, the launcher kills every episode and exits; an episode
whose launcher is gone exits too. Module-level code of the agent runs once, in the launcher, without
the episode's variables: an agent reads OPENAI_BASE_URL / OPENAI_API_KEY when it runs (as the openai
client and the Agents SDK do when the client is made inside the function)."""

from __future__ import annotations

import asyncio
import gc
import inspect
import json
import os
import random
import select
import signal
import sys
import tempfile
import traceback

from rlmesh.reward_server.environments.base import load_callable
from rlmesh.reward_server.function_workers import exit_with_parent

_POLL_S = 0.2


def main() -> None:
    path, server = sys.argv[1], int(sys.argv[2])
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # an import's prints go to the log, never into replies

    def send(obj: dict) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    try:
        agent = load_callable(path)
    except BaseException as err:  # noqa: BLE001 - any failure to import is the launcher's answer
        send({"fatal": f"{type(err).__name__}: {err}\n{traceback.format_exc()[-1500:]}"})
        sys.exit(1)
    # What the import made is moved out of the collector's reach: episodes forked from here neither
    # scan it nor, by touching its objects' headers, copy the pages it sits on.
    gc.freeze()
    send({"ready": True})
    children: dict[int, int] = {}  # pid -> episode id
    pending = b""
    stdin = sys.stdin.fileno()
    # An episode's end wakes the loop at once (SIGCHLD through a pipe), not at the next poll.
    woken, wake = os.pipe()
    os.set_blocking(wake, False)
    signal.set_wakeup_fd(wake)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
        if os.getppid() != server:  # the server is gone: its episodes go with it
            _kill_all(children)
            os._exit(1)
        readable, _, _ = select.select([stdin, woken], [], [], _POLL_S)
        if woken in readable:
            os.read(woken, 4096)
        if stdin in readable:
            chunk = os.read(stdin, 65536)
            if not chunk:  # the server closed the pipe: stop
                _kill_all(children)
                return
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                request = json.loads(line)
                out.flush()
                pid = os.fork()
                if pid == 0:
                    out.close()
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    os.close(woken)
                    os.close(wake)
                    _episode(agent, request, os.getppid())
                children[pid] = request["id"]
                send({"id": request["id"], "pid": pid})
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            send({"id": children.pop(pid), "exit": os.waitstatus_to_exitcode(status)})


def _episode(agent, request: dict, launcher: int) -> None:
    """The forked episode process: never returns."""
    code = 1
    try:
        os.setsid()
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.environ.update(request["env"])
        tempfile.tempdir = None  # the episode's TMPDIR, not a directory the launcher's imports cached
        random.seed()  # forked episodes must not share the launcher's random stream
        exit_with_parent(launcher, with_group=True)
        with open(request["task"]) as f:
            task = json.load(f)
        result = agent(task["prompt"], task["metadata"])
        if inspect.isawaitable(result):
            result = asyncio.run(_awaited(result))
        answer = result if isinstance(result, dict) else {"reward": result}
        with open(request["answer"], "w") as f:
            f.write(json.dumps(answer, default=repr) + "\n")
        code = 0
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) and err.code else 1
        print(f"the agent called sys.exit({err.code!r})", file=sys.stderr)
    except BaseException:  # noqa: BLE001 - whatever the agent raised ends its episode, named in the log
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _kill_all(children: dict[int, int]) -> None:
    for pid in children:
        kill_episode(pid)


def kill_episode(pid: int) -> None:
    """SIGKILL an episode's process with its group (the process alone if it has not made its group yet)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


async def _awaited(awaitable):
    return await awaitable


if __name__ == "__main__":
    main()
