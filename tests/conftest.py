"""Shared fixtures: a real embedded Valkey server and a tiny local model, each built once."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

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


def rlmesh_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlmesh.entrypoints.cli", *args]


@pytest.fixture
def subprocess_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


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
