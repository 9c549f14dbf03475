"""What the container tests share: the rlmesh image (and the Debian base, Valkey and Prometheus
images), built once per session from this tree with no registry. The compose stack runs it; the
Slurm test cluster's nodes extend it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

STACK = Path(__file__).resolve().parents[2] / "deploy/docker/stack.sh"


@pytest.fixture(scope="session")
def rlmesh_images() -> None:
    subprocess.run([str(STACK), "images"], check=True, timeout=1800)
