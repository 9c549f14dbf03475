"""`rlmesh status RUN_DIR`: a terminal view of a running mesh for people without Grafana — each
tier's health (the standard gRPC health check), the learner's status RPC (version, queues, rollout
servers and their heartbeats), and the last step and evaluation from metrics.jsonl (reward, step
time, staleness, tokens/s). `--once` prints one snapshot; otherwise it redraws every `--every`
seconds until Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from rlmesh.learner.trackers.metrics import read_metrics
from rlmesh.services.config import RunConfig, load_config

HEALTH_NAMES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def run_config(run_dir: Path) -> RunConfig:
    """The run's config as its services saw it (`rlmesh up` resolves the ports it picked)."""
    for name in ("config.resolved.yaml", "config.yaml"):
        if (run_dir / name).is_file():
            return load_config(str(run_dir / name), [])
    raise ValueError(f"{run_dir} holds no config.yaml: is it a run directory (`rlmesh up` prints it)?")


async def _health(address: str, config: RunConfig, tier: str, token: str | None, timeout_s: float) -> str:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from rlmesh.services.auth import TLSFiles
    from rlmesh.services.grpc_client import make_channel, rpc_problem

    tls = TLSFiles.from_config(config.network, tier)
    async with make_channel(address, token=token, tls=tls, peer=tier, default_timeout_s=timeout_s) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                                     timeout=timeout_s)
            return HEALTH_NAMES.get(reply.status, str(reply.status))
        except grpc.aio.AioRpcError as err:
            return f"unreachable ({rpc_problem(err)})"


async def _learner_status(config: RunConfig, token: str | None, timeout_s: float) -> Any:
    """The learner's status reply, or why there is none (a string)."""
    import grpc

    from rlmesh.services.auth import TLSFiles
    from rlmesh.services.grpc_client import make_channel, rpc_problem
    from rlmesh.v1 import learner_pb2, learner_pb2_grpc

    tls = TLSFiles.from_config(config.network, "learner")
    async with make_channel(config.network.learner_address, token=token, tls=tls, peer="learner",
                            default_timeout_s=timeout_s) as channel:
        try:
            return await learner_pb2_grpc.LearnerServiceStub(channel).GetStatus(learner_pb2.LearnerStatusRequest(),
                                                                                 timeout=timeout_s)
        except grpc.aio.AioRpcError as err:
            return rpc_problem(err)


async def snapshot(run_dir: Path, timeout_s: float = 2.0) -> dict[str, Any]:
    """Everything the view shows, as plain data."""
    from rlmesh.services.auth import load_token

    config = run_config(run_dir)
    token = load_token(config.network.token_file, config.network.token_env)
    status = await _learner_status(config, token, timeout_s)
    tiers = {"learner": config.network.learner_address,
             **{f"reward {a}": a for a in config.network.reward_addresses}}
    if not isinstance(status, str):
        tiers.update({f"rollout {g.generator_id}": g.address for g in status.generators})
    names = list(tiers)
    healths = await asyncio.gather(*(_health(tiers[n], config, n.split()[0], token, timeout_s) for n in names))
    scraped = _scrape_learner(run_dir, timeout_s)
    rows = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    return {
        "run_dir": str(run_dir), "num_steps": config.learner.num_steps,
        "health": {n: (tiers[n], h) for n, h in zip(names, healths)},
        "learner": status if isinstance(status, str) else {
            "run_id": status.run_id, "version": status.version, "prompt_queue": status.prompt_queue_depth,
            "trajectory_queue": status.trajectory_queue_depth, "in_flight": status.num_inflight_groups,
            "dropped_stale": status.num_dropped_stale,
            "generators": [(g.generator_id, g.version, round(g.seconds_since_heartbeat, 1)) for g in status.generators]},
        "prometheus": scraped,
        "last_step": train[-1] if train else None,
        "last_eval": evals[-1] if evals else None,
        "done": (run_dir / "summary.json").is_file(),
    }


def _scrape_learner(run_dir: Path, timeout_s: float) -> dict[str, float]:
    """The learner's Prometheus numbers (policy version, queue length and lag per stream) when its
    endpoint is on (`logging.metrics_port`): they need no token."""
    import urllib.request

    from rlmesh.services.prom import read_ports

    learner = read_ports(run_dir).get("learner")
    if learner is None:
        return {}
    try:
        url = f"http://{learner['host']}:{learner['port']}/metrics"
        text = urllib.request.urlopen(url, timeout=timeout_s).read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith(("rlmesh_learner_policy_version ", "rlmesh_queue_", "rlmesh_learner_groups_in_flight ")):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def render(snap: dict[str, Any]) -> str:
    out = [f"rlmesh status  {snap['run_dir']}" + ("  (finished: summary.json)" if snap["done"] else "")]
    out.append("tiers:")
    for name, (address, health) in snap["health"].items():
        out.append(f"  {name:<28} {address:<22} {health}")
    learner = snap["learner"]
    if isinstance(learner, str):
        hint = " (`rlmesh up` made a token for its services: export RLMESH_TOKEN to ask)" \
            if "UNAUTHENTICATED" in learner else ""
        out.append(f"learner status: {learner}{hint}")
    else:
        out.append(f"policy version {learner['version']}/{snap['num_steps']}  in flight {learner['in_flight']} groups  "
                   f"queues: prompts {learner['prompt_queue']}, trajectories {learner['trajectory_queue']}  "
                   f"dropped stale {learner['dropped_stale']}")
        for gid, version, since in learner["generators"]:
            out.append(f"  rollout {gid}: weights v{version}, heartbeat {since}s ago")
    if snap["prometheus"]:
        out.append("learner /metrics: " + "  ".join(f"{k.removeprefix('rlmesh_')} {v:g}"
                                                      for k, v in sorted(snap["prometheus"].items())))
    step = snap["last_step"]
    if step is not None:
        out.append(f"last step v{step['version']}: reward {step['reward_mean']:.3f}  step {step['step_s']:.2f}s "
                   f"(train {step.get('train_s', 0):.2f}s, broadcast {step.get('broadcast_s', 0):.2f}s)  "
                   f"staleness mean {step['staleness_mean']:.2f} max {step['staleness_max']}  "
                   f"{step['tokens_per_s']:.0f} tok/s")
    if snap["last_eval"] is not None:
        ev = snap["last_eval"]
        out.append(f"last eval v{ev['version']}: accuracy {ev.get('accuracy', float('nan')):.3f}")
    return "\n".join(out)


def run_status(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    try:
        if args.once:
            print(render(asyncio.run(snapshot(run_dir, args.timeout))))
            return 0
        while True:
            view = render(asyncio.run(snapshot(run_dir, args.timeout)))
            sys.stdout.write("\x1b[2J\x1b[H" + view + "\n")
            sys.stdout.flush()
            time.sleep(args.every)
    except ValueError as err:
        print(f"rlmesh status: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
