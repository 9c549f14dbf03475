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
    """`stack.sh images`, tried twice (its Debian and PyPI downloads can fail once on a flaky
    mirror); a second failure fails every container test with the end of what the build said."""
    for _ in range(2):
        build = subprocess.run([str(STACK), "images"], capture_output=True, text=True, timeout=1800)
        print(build.stdout[-4000:], build.stderr[-4000:], sep="\n")
        if build.returncode == 0:
            return
    tail = " | ".join((build.stdout + build.stderr).strip().splitlines()[-8:])
    pytest.fail(f"deploy/docker/stack.sh images failed twice (exit {build.returncode}): {tail}", pytrace=False)
