"""`rlmesh up` as a supervisor: a service that runs out of restarts stops the mesh, named; bad input
at start-up fails fast with its own error. (A crashed service restarted and the run completing is
checked by tests/faults/test_faults.py, where the reward, rollout and learner services are killed.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import pytest

from tests.e2e.test_mesh import REPO, Up, _cmdline

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(300)
def test_a_service_out_of_restarts_stops_the_mesh_and_is_named(tmp_path):
    up = Up(tmp_path / "run", "sft.num_steps=0", "run.max_restarts=0")
    up.wait_for(lambda: "rollout servers loading vLLM" in up.output(), 300, "services to start")
    up.poll_children()
    reward = [p for p in up.seen.values() if " reward " in f" {_cmdline(p)} "]
    assert reward, "reward server process not found"
    reward[0].kill()
    assert up.finish(timeout=60) == 1
    assert "service 'reward' exited with code -9 after 0 restart(s)" in up.output()
    assert not up.leftovers(), f"processes outlived the crash: {up.leftovers()}"


def test_a_missing_model_path_fails_in_seconds_naming_it(tmp_path):
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "rlmesh.cli", "up", "model.type=hf", "model.path=/no/such/model",
                          "sft.num_steps=0", "--run-dir", str(tmp_path / "run")], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0 and "model.path='/no/such/model' does not exist" in out.stderr + out.stdout
    assert time.monotonic() - t0 < 20


def test_a_learner_dying_at_start_up_fails_the_launch_with_its_own_error(tmp_path, tiny_model_dir):
    # A model that passes the launcher's own checks (a supported architecture, a tokenizer) but has no
    # weights: the learner dies loading it.
    model = tmp_path / "no-weights"
    shutil.copytree(tiny_model_dir, model)
    (model / "model.safetensors").unlink()
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "rlmesh.cli", "up", "model.type=hf", f"model.path={model}",
                          "sft.num_steps=0", "--run-dir", str(tmp_path / "run")], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode != 0 and "learner exited while starting" in text, text[-2000:]
    assert "Error" in text.split("learner exited while starting", 1)[1], "the learner's own error is quoted"
    assert time.monotonic() - t0 < 60
