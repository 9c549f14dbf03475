"""The `code` environment through a real reward server (gRPC on loopback): programs run in the real
sandbox (namespaces via `unshare`, an unprivileged uid, rlimits). Correct and incorrect programs
score their pass rate; hostile ones — a fork bomb, an endless loop, a 50 GB allocation, a socket,
reading /etc/passwd or the run directory, writing outside the work directory, escaping the chroot
through a new user namespace, unmounting the read-only binds — score 0 (each test is written so
that it passes only if the attack worked), and the server keeps serving: a good item after each one
still scores 1. The same sandbox also works for a reward server that is not root (user namespaces)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import logging
import socket
import time
import uuid
from dataclasses import asdict
from pathlib import Path

import pytest
import pytest_asyncio
from google.protobuf.struct_pb2 import Struct

from rlmesh.reward_server.environments.code import CodeEnvironment, extract_program
from rlmesh.reward_server.sandbox import Sandbox, SandboxLimits
from rlmesh.reward_server.service import RewardService
from rlmesh.services.config import CodeEnvironmentSection
from rlmesh.services.grpc_client import make_channel
from rlmesh.services.grpc_server import start_server
from rlmesh.v1 import reward_pb2, reward_pb2_grpc
from tests.conftest import REPO

pytestmark = pytest.mark.security

LIMITS = SandboxLimits.from_config(CodeEnvironmentSection(cpu_s=2, wall_s=4.0, test_timeout_s=3.0, memory_mb=512,
                                                          max_processes=16, file_size_mb=4))
GOOD = ("```python\ndef add(a, b):\n    return a + b\n```", ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"])


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def stub():
    service = RewardService(builtin=[], env_timeout_s=20, env_max_concurrency=4)
    service.add_local("code", CodeEnvironment("code", Sandbox(LIMITS, max_concurrency=4)))
    server = await start_server([(reward_pb2_grpc.add_RewardServiceServicer_to_server, service,
                                  "rlmesh.v1.RewardService")], port=0)
    channel = make_channel(f"127.0.0.1:{server.port}", default_timeout_s=30)
    yield reward_pb2_grpc.RewardServiceStub(channel)
    await channel.close()
    await server.stop(0)


async def _score(stub, *items: tuple[str, object]) -> list[reward_pb2.ScoreResult]:
    request = reward_pb2.ScoreRequest()
    for i, (completion, tests) in enumerate(items):
        meta = Struct()
        meta.update({"tests": tests})
        request.items.add(id=f"item-{i}", env_name="code", completion=completion, env_metadata=meta)
    return list((await stub.Score(request)).results)


async def _still_serving(stub) -> None:
    [good] = await _score(stub, GOOD)
    assert not good.error and good.reward == 1.0, good


def test_the_limits_in_force_are_logged(caplog):
    with caplog.at_level(logging.INFO, logger="rlmesh.reward_server.environments.code"):
        CodeEnvironment("code", Sandbox(LIMITS, max_concurrency=1))
    assert "limits in force: cpu 2s/process, wall 4.0s/run, address space 512 MiB/process, 16 processes" \
        in caplog.text, caplog.text


@pytest.mark.asyncio(loop_scope="session")
async def test_correct_partial_and_io_programs_score_their_pass_rate(stub):
    partial = "def add(a, b):\n    return a + b if a > 0 else 7\n"
    echo = "Here is my solution:\n```python\nn = int(input())\nprint(n * 2)\n```\nIt doubles n."
    io_tests = [{"input": "3\n", "output": "6\n"}, {"input": "5\n", "output": "10"}, {"input": "1\n", "output": "3"}]
    good, half, io, raises = await _score(stub, GOOD, (partial, GOOD[1]), (echo, io_tests),
                                          ("def add(a, b):\n    raise RuntimeError('no')", GOOD[1]))
    assert (good.reward, dict(good.components)) == (1.0, {"pass_rate": 1.0, "correct": 1.0, "timed_out": 0.0,
                                                           "test_0": 1.0, "test_1": 1.0})
    assert half.reward == 0.5 and half.components["test_0"] == 1.0 and half.components["test_1"] == 0.0
    assert io.reward == pytest.approx(2 / 3) and io.components["correct"] == 0.0
    assert not raises.error and raises.reward == 0.0


@pytest.mark.asyncio(loop_scope="session")
async def test_items_without_usable_tests_are_per_item_errors(stub):
    missing = reward_pb2.ScoreRequest()
    missing.items.add(id="no-tests", env_name="code", completion="x = 1")
    [result] = (await stub.Score(missing)).results
    assert "no-tests" in result.error and "metadata.tests" in result.error
    bad, as_json = await _score(stub, ("x = 1", [{"input": "1"}]), ("x = 1", json.dumps(["assert x == 1"])))
    assert "metadata.tests[0]" in bad.error and "'input' and 'output'" in bad.error
    assert not as_json.error and as_json.reward == 1.0  # a JSON string of a list is accepted (Parquet columns)


@pytest.mark.asyncio(loop_scope="session")
async def test_a_fork_bomb_scores_zero_while_another_item_is_served(stub):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    t0 = time.monotonic()
    bombed, good = await _score(stub, (bomb + "ok = True", ["assert ok"]), GOOD)
    # Ended by the wall-time kill, or sooner when the CPU limit kills the forking harness.
    assert not bombed.error and bombed.reward == 0.0
    assert good.reward == 1.0  # scored beside the bomb
    assert time.monotonic() - t0 < LIMITS.wall_s + 5
    await _still_serving(stub)


HOSTILE = {
    "endless loop": ("while True:\n    pass\nok = True", ["assert ok"]),
    "50 GB allocation": ("buf = bytearray(50 * 2**30)", ["assert len(buf) == 50 * 2**30"]),
    "reading /etc/passwd": ("data = open('/etc/passwd').read()", ["assert 'root' in data"]),
    "reading the run directory": (f"data = open({str(REPO / 'README.md')!r}).read()", ["assert 'rlmesh' in data"]),
    "listing the host root": ("import os\nnames = os.listdir('/')", ["assert 'work' in names or 'home' in names"]),
    # A chroot is escaped from a new user namespace (chroot again, then `..` past the root): the
    # kernel refuses a chrooted process a new user namespace, and the program holds no capabilities.
    "escaping the chroot": ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                            "assert libc.unshare(0x10000000 | 0x00020000) == 0, 'unshare refused'\n"
                            "os.makedirs('x', exist_ok=True)\nos.chroot('x')\nfor _ in range(20):\n"
                            "    os.chdir('..')\nos.chroot('.')\ndata = open('/etc/passwd').read()",
                            ["assert 'root' in data"]),
    "unmounting the read-only binds": ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                                       "unmounted = libc.umount2(b'/usr', 2) == 0", ["assert unmounted"]),
    "forging results through json.dumps": ("import json, os\njson.dumps = lambda row: '[%d, true, \"\"]' % row[0]\n"
                                            "print('[0, true, \"\"]')\nos.write(1, b'[0, true, \"\"]\\n')",
                                            ["assert False"]),
    "spawning a shell": ("import subprocess\nout = subprocess.run(['sh', '-c', 'cat /etc/hostname'], "
                         "capture_output=True).stdout", ["assert out"]),
}


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("attack", list(HOSTILE))
async def test_hostile_programs_score_zero_and_the_server_keeps_serving(stub, attack):
    [result] = await _score(stub, HOSTILE[attack])
    print(f"{attack}: reward={result.reward} error={result.error!r} components={dict(result.components)}")
    assert result.error or result.reward == 0.0
    await _still_serving(stub)


@pytest.mark.asyncio(loop_scope="session")
async def test_a_socket_cannot_reach_a_server_on_the_host(stub):
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    program = f"import socket\nconn = socket.create_connection(('127.0.0.1', {port}), 2)\nconn.sendall(b'hi')"
    [result] = await _score(stub, (program, ["assert conn"]))
    assert result.reward == 0.0
    with pytest.raises(TimeoutError):
        listener.accept()  # nothing ever connected
    listener.close()
    await _still_serving(stub)


@pytest.mark.asyncio(loop_scope="session")
async def test_writes_outside_the_work_directory_do_not_reach_the_host(stub, tmp_path):
    targets = [f"/tmp/rlmesh-escape-{uuid.uuid4().hex}", str(tmp_path / "escape.txt"), "/escape.txt"]
    program = "import os\nwritten = []\nfor path in " + repr(targets) + ":\n    try:\n" \
              "        open(path, 'w').write('x')\n        written.append(path)\n    except OSError:\n        pass\n" \
              "open('inside.txt', 'w').write('x')\n"
    [result] = await _score(stub, (program, ["assert written", "assert open('inside.txt').read() == 'x'"]))
    assert result.components["test_0"] == 0.0 and result.components["test_1"] == 1.0
    for path in targets:
        assert not os.path.exists(path), path
    await _still_serving(stub)


def test_without_root_the_sandbox_runs_in_a_user_namespace(tmp_path_factory):
    """The reward server as an ordinary user: `unshare --user` instead of a uid switch, same
    isolation. Runs the sandbox module (standard library only) under `setpriv` as nobody."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and util-linux setpriv to become an unprivileged user for the test")
    nobody = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
    pythons = [os.path.realpath(sys.executable), "/usr/bin/python3"]
    python = next((p for p in pythons if os.path.exists(p) and subprocess.run(
        [*nobody, p, "-c", "import ctypes, os, sys; assert os.access(os.path.realpath(sys.executable), os.X_OK)"],
        capture_output=True).returncode == 0), None)
    if python is None:
        pytest.skip(f"no Python that an unprivileged user may run among {pythons}")
    work = Path(tempfile.mkdtemp(prefix="rlmesh-userns-"))
    try:
        for name in ("sandbox.py", "sandbox_init.py", "sandbox_harness.py"):
            shutil.copy(REPO / "reward_server" / name, work / name)
        limits = asdict(SandboxLimits.from_config(CodeEnvironmentSection(wall_s=4, cpu_s=2)))
        script = (f"import json, sys\nsys.path.insert(0, {str(work)!r})\nfrom sandbox import Sandbox, SandboxLimits\n"
                  f"s = Sandbox(SandboxLimits(**{limits!r}))\ns.check()\n"
                  "runs = [s.run(p, t) for p, t in json.loads(sys.stdin.read())]\n"
                  "print(json.dumps([s.isolation, [r.pass_rate for r in runs]]))")
        cases = [GOOD, HOSTILE["reading /etc/passwd"], HOSTILE["escaping the chroot"],
                 HOSTILE["unmounting the read-only binds"], HOSTILE["50 GB allocation"],
                 ("import socket\nconn = socket.create_connection(('127.0.0.1', 22), 1)", ["assert conn"])]
        work.chmod(0o755)
        for path in work.iterdir():
            path.chmod(0o644)
        cases = [(extract_program(program), tests) for program, tests in cases]
        out = subprocess.run([*nobody, python, "-c", script], input=json.dumps(cases), capture_output=True,
                             text=True, timeout=120, env={"PATH": os.environ["PATH"], "HOME": "/tmp"})
        assert out.returncode == 0, out.stderr
        isolation, rates = json.loads(out.stdout)
        assert "user namespace" in isolation
        assert rates == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    finally:
        shutil.rmtree(work)
