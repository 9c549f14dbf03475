"""Reward-tier throughput against the environment called in-process, side by side.

baseline: `ArithmeticEnvironment.score` called directly on batches of B items.
measured: the same items through the reward server's gRPC API (a real `RewardService` in its own
          process on loopback, batched `Score`, C calls in flight), and through one remote hop (a
          second server that serves no environment itself and proxies `arithmetic` to the first,
          registered with RegisterEnvironment).
Prints scored items/s of each and the ratios. Run: python bench/reward_throughput.py
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rlmesh.reward_server.environments.arithmetic import ArithmeticEnvironment  # noqa: E402
from rlmesh.reward_server.environments.base import ScoreInput  # noqa: E402
from rlmesh.v1 import common_pb2, reward_pb2, reward_pb2_grpc  # noqa: E402
from rlmesh.services.ports import free_port  # noqa: E402


def _problem(i: int) -> tuple[str, str, str]:
    a, b = i % 10, i % 7
    right = i % 3 != 0  # a mix of right and wrong answers
    return f"{a}+{b}=", str(a + b if right else a + b + 1), str(a + b)


def in_process(num_items: int, batch: int) -> tuple[int, float, float]:
    env = ArithmeticEnvironment()
    batches = []
    for start in range(0, num_items, batch):
        batches.append([ScoreInput(str(i), [{"role": "user", "content": _problem(i)[0]}], _problem(i)[1],
                                   {"answer": _problem(i)[2]}) for i in range(start, min(start + batch, num_items))])
    env.score(batches[0])  # warm-up
    t0 = time.monotonic()
    total = sum(sum(o.reward for o in env.score(b)) for b in batches)
    return num_items, time.monotonic() - t0, total


async def through_grpc(address: str, num_items: int, batch: int, concurrency: int) -> tuple[int, float, float]:
    from rlmesh.services.grpc_client import make_channel

    requests = []
    for start in range(0, num_items, batch):
        items = []
        for i in range(start, min(start + batch, num_items)):
            prompt, completion, answer = _problem(i)
            item = reward_pb2.ScoreItem(id=str(i), env_name="arithmetic", completion=completion,
                                        prompt=[common_pb2.ChatMessage(role="user", content=prompt)])
            item.env_metadata.update({"answer": answer})
            items.append(item)
        requests.append(reward_pb2.ScoreRequest(items=items))
    async with make_channel(address, default_timeout_s=120) as channel:
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        await stub.Score(requests[0])  # warm-up (connection, first call)
        queue = list(reversed(requests))
        total = 0.0

        async def client() -> None:
            nonlocal total
            while queue:
                reply = await stub.Score(queue.pop())
                errors = [r.error for r in reply.results if r.error]
                assert not errors, errors[:3]
                total += sum(r.reward for r in reply.results)

        t0 = time.monotonic()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return num_items, time.monotonic() - t0, total


async def serve(port: int, remote: str | None) -> None:
    """One reward server; with `remote`, it serves nothing itself and proxies arithmetic there."""
    from rlmesh.reward_server.service import RewardService
    from rlmesh.services.grpc_server import start_server

    service = RewardService(builtin=[] if remote else None)
    if remote:
        await service.register_remote("arithmetic", remote)
    server = await start_server([(reward_pb2_grpc.add_RewardServiceServicer_to_server, service,
                                  "rlmesh.v1.RewardService")], port=port)
    await server.serve_forever(grace_s=1.0)


def _start(port: int, remote: str | None = None) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--serve", str(port)] + (["--remote", remote] if remote else [])
    return subprocess.Popen(cmd, cwd=REPO)


async def measure(num_items: int, batch: int, concurrency: int) -> dict[str, tuple[int, float, float]]:
    from rlmesh.services.grpc_client import wait_for_serving

    env_port, front_port = free_port(), free_port()
    procs = [_start(env_port)]
    try:
        await wait_for_serving(f"127.0.0.1:{env_port}", what="reward server", timeout_s=60)
        procs.append(_start(front_port, remote=f"127.0.0.1:{env_port}"))
        await wait_for_serving(f"127.0.0.1:{front_port}", what="front reward server", timeout_s=60)
        direct = await through_grpc(f"127.0.0.1:{env_port}", num_items, batch, concurrency)
        hop = await through_grpc(f"127.0.0.1:{front_port}", num_items, batch, concurrency)
        return {"direct": direct, "hop": hop}
    finally:
        for p in procs:
            p.terminate()
            p.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=20000, help="items scored per measured path")
    parser.add_argument("--batch", type=int, default=256, help="items per Score call (and per in-process batch)")
    parser.add_argument("--concurrency", type=int, default=4, help="Score calls in flight")
    parser.add_argument("--json", help="also write the results here (for bench/run_all.py)")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--remote", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        import uvloop

        uvloop.run(serve(args.serve, args.remote))
        return

    import uvloop

    base = in_process(args.items, args.batch)
    grpc_paths = uvloop.run(measure(args.items, args.batch, args.concurrency))
    assert base[2] == grpc_paths["direct"][2] == grpc_paths["hop"][2], "every path must score the same"
    rows = [("in-process ArithmeticEnvironment.score", base),
            ("reward server, gRPC Score (loopback)", grpc_paths["direct"]),
            ("reward server -> remote server (1 hop)", grpc_paths["hop"])]
    base_rate = base[0] / base[1]
    print(f"\n{'path':<40}{'items':>8}{'seconds':>10}{'items/s':>12}{'vs in-process':>15}")
    for name, (items, seconds, _) in rows:
        rate = items / seconds
        print(f"{name:<40}{items:>8}{seconds:>10.2f}{rate:>12.0f}{rate / base_rate:>15.3f}")
    direct_rate = grpc_paths["direct"][0] / grpc_paths["direct"][1]
    hop_rate = grpc_paths["hop"][0] / grpc_paths["hop"][1]
    print(f"ratio (gRPC / in-process): {direct_rate / base_rate:.3f}; (1 remote hop / in-process): "
          f"{hop_rate / base_rate:.3f}; (1 remote hop / direct gRPC): {hop_rate / direct_rate:.2f}  "
          f"[{args.items} items, batches of {args.batch}, {args.concurrency} calls in flight]")
    if args.json:
        import json

        def row(measured: float, baseline: float) -> dict:
            return {"measured": measured, "baseline": baseline, "ratio": measured / baseline}

        Path(args.json).write_text(json.dumps({
            "gRPC Score vs the environment in-process": row(direct_rate, base_rate),
            "one remote hop vs the environment in-process": row(hop_rate, base_rate),
            "one remote hop vs direct gRPC Score": row(hop_rate, direct_rate),
        }, indent=2))


if __name__ == "__main__":
    main()
