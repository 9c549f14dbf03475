"""What the rollout-side benchmarks share: an embedded Valkey, a stand-in learner control plane
(membership only) and real `rlmesh rollout` (and optionally `rlmesh reward`) processes, torn down
on exit."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


@dataclass
class RolloutHarness:
    membership: Any
    queue_url: str
    generator_id: str


@asynccontextmanager
async def rollout_harness(model_dir: Path, tmp: Path, *, rollout: dict | None = None, with_reward: bool = False,
                          rpc_timeout_s: float = 120.0, config: dict | None = None) -> AsyncIterator[RolloutHarness]:
    """Yields once the rollout server has registered with the stand-in learner. `config`: more
    top-level sections of the servers' config (e.g. {"learner": {"lora": ...}} to serve an adapter)."""
    import yaml

    from rlmesh.learner.rl.membership import LearnerService, Membership
    from rlmesh.v1 import learner_pb2, learner_pb2_grpc
    from rlmesh.services.grpc_server import start_server
    from rlmesh.services.ports import free_port
    from rlmesh.services.valkey import start_embedded_valkey

    valkey = start_embedded_valkey()
    membership = Membership(token=None, rpc_timeout_s=rpc_timeout_s)
    learner = await start_server([(learner_pb2_grpc.add_LearnerServiceServicer_to_server,
                                   LearnerService(membership, "bench", learner_pb2.LearnerStatusResponse, lambda: 0),
                                   "rlmesh.v1.LearnerService")], port=0)
    reward_port = free_port()
    cfg = {"model": {"type": "hf", "path": str(model_dir)}, "queue": {"url": valkey.connection_url},
           "network": {"learner_address": f"127.0.0.1:{learner.port}", "reward_address": f"127.0.0.1:{reward_port}"},
           "rollout": rollout or {}, **(config or {})}
    (tmp / "bench.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cli = [sys.executable, "-m", "rlmesh.cli"]
    procs = []
    if with_reward:
        procs.append(subprocess.Popen([*cli, "reward", "-c", str(tmp / "bench.yaml"), "--port", str(reward_port)],
                                      stdout=(tmp / "reward.log").open("wb"), stderr=subprocess.STDOUT, env=env))
    rollout_proc = subprocess.Popen([*cli, "rollout", "-c", str(tmp / "bench.yaml"), "--port", "0",
                                     "--generator-id", "bench"], stdout=(tmp / "rollout.log").open("wb"),
                                    stderr=subprocess.STDOUT, env=env)
    procs.append(rollout_proc)
    try:
        while "bench" not in membership.generators:
            assert rollout_proc.poll() is None, (tmp / "rollout.log").read_text()[-2000:]
            await asyncio.sleep(0.5)
        yield RolloutHarness(membership, valkey.connection_url, "bench")
    finally:
        for p in procs:
            p.terminate()
            p.wait()
        await learner.stop(0)
        valkey.stop()
