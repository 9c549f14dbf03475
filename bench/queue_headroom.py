"""Queue headroom: trajectory groups/s through the Redis streams (publish -> read -> ack, the real
StreamQueue on a real Valkey) at a realistic size, against the rate the mesh needs at full rollout
throughput.

baseline: the rate the rollout tier produces groups = rollout tokens/s / tokens per group (the
          rollout tokens/s is measured by bench/rollout_throughput.py; pass --rollout-tokens-per-s).
measured: groups/s one producer and one consumer move through a stream, each group a serialized
          TrajectoryGroup of --samples samples x --tokens tokens with logprobs.
Run: python bench/queue_headroom.py [--samples 16 --tokens 1024 --groups 400]"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def make_group(samples: int, tokens: int, rng: random.Random) -> bytes:
    from rlmesh.v1 import common_pb2

    group = common_pb2.TrajectoryGroup(group_id=uuid.uuid4().hex, prompt_token_ids=list(range(64)))
    for i in range(samples):
        ids = [rng.randrange(0, 150000) for _ in range(tokens)]
        group.samples.append(common_pb2.Sample(
            index=i, completion=common_pb2.TokenSequence(token_ids=ids, loss_mask=[True] * tokens),
            logprobs=[-rng.random() * 5 for _ in range(tokens)], min_version=3, max_version=3, reward=1.0))
    return group.SerializeToString()


async def pump(url: str, payloads: list[bytes]) -> float:
    from rlmesh.services.queue import StreamQueue, connect

    q = StreamQueue(connect(url), f"bench:{uuid.uuid4().hex[:6]}", group="learner", max_len=100000)
    await q.ensure_group()
    n = len(payloads)

    async def produce():
        for i, data in enumerate(payloads):
            await q.publish(f"g{i}", data)

    async def consume():
        done = 0
        while done < n:
            entries = await q.read("bench", count=64, block_ms=200)
            await q.ack(*[e.id for e in entries])
            done += len(entries)

    t0 = time.perf_counter()
    await asyncio.gather(produce(), consume())
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--groups", type=int, default=400)
    p.add_argument("--rollout-tokens-per-s", type=float, default=6085.0,
                   help="rollout tier throughput to compare with (bench/rollout_throughput.py's measured value)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    from rlmesh.services.valkey import start_embedded_valkey

    rng = random.Random(0)
    unique = [make_group(args.samples, args.tokens, rng) for _ in range(16)]
    payloads = [unique[i % len(unique)] for i in range(args.groups)]
    server = start_embedded_valkey()
    try:
        elapsed = asyncio.run(pump(server.connection_url, payloads))
    finally:
        server.stop()
    groups_per_s = args.groups / elapsed
    needed = args.rollout_tokens_per_s / (args.samples * args.tokens)
    ratio = groups_per_s / needed
    mb = len(payloads[0]) / 2**20
    print(f"group: {args.samples} samples x {args.tokens} tokens with logprobs = {mb:.2f} MiB serialized")
    print(f"{'path':46s} {'groups/s':>10s}")
    print(f"{'needed at ' + f'{args.rollout_tokens_per_s:.0f} rollout tok/s':46s} {needed:10.2f}")
    print(f"{'stream publish -> read -> ack (1 prod, 1 cons)':46s} {groups_per_s:10.1f}   ({groups_per_s * mb:.0f} MiB/s)")
    print(f"ratio (queue capacity / needed): {ratio:.0f}x   (target >= 10x)")
    gpu_needed = 1e6 / (args.samples * args.tokens)
    print(f"for scale: a rollout tier at 1,000,000 tok/s (a GPU node) needs {gpu_needed:.0f} groups/s: "
          f"{groups_per_s / gpu_needed:.0f}x headroom from one producer/consumer pair")
    if args.json:
        Path(args.json).write_text(json.dumps({"groups_per_s": groups_per_s, "needed_groups_per_s": needed,
                                               "ratio": ratio, "group_mib": mb}, indent=2))


if __name__ == "__main__":
    main()
