"""The wheelhouse server an offline image build reads (deploy/docker/serve_wheels.py, started by
`deploy/docker/stack.sh images` on the engine's bridge gateway for the build's length), tried as a
stranger on that network would: it serves the index and the package files of its directory and
nothing else — no file outside it by any spelling of `..`, no other file in it, no method but GET and
HEAD — and listens on the one address it is given."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from rlmesh.services.ports import free_port

pytestmark = pytest.mark.security
SERVER = Path(__file__).resolve().parents[2] / "deploy" / "docker" / "serve_wheels.py"


def _status(port: int, request: str) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(request.encode())
        return sock.recv(200).split(b"\r\n", 1)[0].decode()


@pytest.fixture
def wheelhouse(tmp_path):
    house = tmp_path / "wheelhouse"
    house.mkdir()
    (house / "demo-1.0-py3-none-any.whl").write_bytes(b"wheel bytes")
    (house / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"local version")
    (house / "notes.txt").write_text("not a package")
    (tmp_path / "secret.whl").write_text("outside the wheelhouse")
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(SERVER), str(house), "127.0.0.1", str(port)],
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
                time.sleep(0.1)
        yield port
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_it_serves_the_index_and_the_package_files(wheelhouse):
    index = urllib.request.urlopen(f"http://127.0.0.1:{wheelhouse}/", timeout=5).read().decode()
    assert "demo-1.0-py3-none-any.whl" in index
    wheel = urllib.request.urlopen(f"http://127.0.0.1:{wheelhouse}/demo-1.0-py3-none-any.whl", timeout=5)
    assert wheel.read() == b"wheel bytes"
    # A local version's "+" arrives percent-encoded, as pip asks for it.
    local = urllib.request.urlopen(f"http://127.0.0.1:{wheelhouse}/torch-2.13.0%2Bcpu-cp311-cp311-manylinux_2_28_x86_64.whl",
                                   timeout=5)
    assert local.read() == b"local version"


@pytest.mark.parametrize("path", ["/../secret.whl", "/..%2fsecret.whl", "/%2e%2e/secret.whl", "//etc/passwd",
                                  "/../../../../etc/passwd", "/notes.txt", "/missing-1.0-py3-none-any.whl",
                                  "/sub/demo-1.0-py3-none-any.whl",
                                  "/%2e%2e%2fsecret.whl", "/..%5csecret.whl"])
def test_a_stranger_gets_nothing_else(wheelhouse, path):
    assert _status(wheelhouse, f"GET {path} HTTP/1.0\r\n\r\n").split()[1] == "404", path


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE"])
def test_it_takes_no_writes(wheelhouse, method):
    status = _status(wheelhouse, f"{method} /evil-1.0-py3-none-any.whl HTTP/1.0\r\nContent-Length: 3\r\n\r\nabc")
    assert status.split()[1] == "501", status


def test_it_listens_only_on_its_address(wheelhouse):
    import psutil

    others = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
              if a.family == socket.AF_INET and not a.address.startswith("127.")]
    if not others:
        pytest.skip("this machine has no IPv4 address but loopback to try")
    for address in others:
        with pytest.raises(OSError):
            socket.create_connection((address, wheelhouse), timeout=2).close()
