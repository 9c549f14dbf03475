"""The whole mesh through `rlmesh up` under mutual TLS (`rlmesh tls-init` certificates): every
channel (rollout -> learner, learner -> rollout weight RPCs, rollout -> reward) passes its tier's
policy, the run trains and verifies every broadcast, and neither the run's token nor the embedded
queue's password (read from a running service's environment) is in any file of the run directory."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.security]
REPO = Path(__file__).resolve().parents[2]


def _service_environ(root: int, name: str) -> dict[str, str]:
    for child in psutil.Process(root).children(recursive=True):
        try:
            if name in " ".join(child.cmdline()):
                return child.environ()
        except psutil.NoSuchProcess:
            continue
    return {}


def test_a_run_under_mutual_tls_trains_and_leaves_no_secret_in_the_run_directory(tmp_path):
    certs, run_dir = tmp_path / "certs", tmp_path / "run"
    subprocess.run([sys.executable, "-m", "rlmesh.entrypoints.cli", "tls-init", "--output", str(certs)], check=True,
                   cwd=REPO, capture_output=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RLMESH_TOKEN", "RLMESH_QUEUE_PASSWORD")}
    out = (tmp_path / "up.out").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlmesh.entrypoints.cli", "up", "-c", "examples/arithmetic_grpo.yaml",
         "--run-dir", str(run_dir), "logging.progress=false", "learner.num_steps=3", "sft.num_steps=30",
         "data.num_eval=8", "learner.groups_per_step=4", f"network.tls.cert_file={certs}/{{tier}}.crt",
         f"network.tls.key_file={certs}/{{tier}}.key", f"network.tls.ca_file={certs}/ca.crt"],
        stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    secrets: dict[str, str] = {}
    deadline = time.monotonic() + 900
    while proc.poll() is None and time.monotonic() < deadline:
        if not secrets:
            secrets = {k: v for k, v in _service_environ(proc.pid, " learner ").items()
                       if k in ("RLMESH_TOKEN", "RLMESH_QUEUE_PASSWORD")}
        time.sleep(0.5)
    if proc.poll() is None:
        proc.kill()
    output = (tmp_path / "up.out").read_text(errors="replace")
    assert proc.wait(timeout=30) == 0, output[-4000:]
    # 4: the SFT weights (version 0, sent to rollout servers that started on the pre-SFT model) and 3 steps
    assert "4 broadcasts verified by digest; rollout weights == learner weights" in output
    logs = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("*.log"))
    assert "PERMISSION_DENIED" not in logs and "UNAUTHENTICATED" not in logs
    assert set(secrets) == {"RLMESH_TOKEN", "RLMESH_QUEUE_PASSWORD"}, "the services got both secrets"
    for name, secret in secrets.items():
        holding = [str(p) for p in run_dir.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
        assert holding == [], f"{name} written to {holding}"
