"""Weight update: how long from the learner's new version to a rollout server serving it, against
a raw torch.distributed broadcast of the same bytes.

measured: the learner's real broadcaster (gloo transport) into a real `rlmesh rollout` (vLLM):
          PauseGeneration -> StartWeightUpdate -> UpdateWeights + bucketed send -> FinishWeightUpdate
          (vLLM's layerwise reload) -> digest verification -> ResumeGeneration, once per digest
          algorithm (`--digests blake3,sha256`: the default, and what an older peer gets).
baseline: a plain gloo broadcast of the same buckets (same layout, same bytes, two in flight, no
          digest on either side) from this process to a second plain process on the same machine
          (the vLLM worker process cannot be reused for it, so a fresh process stands in).
For the tiny demo model and a locally built Qwen2 of >= 100M parameters (no LoRA adapter row: the
learner trains full weights only). Run:
python bench/weight_update.py [--sizes tiny,100m --rounds 3 --digests blake3,sha256]"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SIZES = {"tiny": dict(), "100m": dict(hidden_size=1024, num_layers=9, num_heads=16, num_kv_heads=4,
                                      intermediate_size=2816)}

RAW_RECEIVER = """
import json, sys
from rlmesh.services.weights.base import Rendezvous
from rlmesh.services.weights.gloo import join_group, receive
from rlmesh.services.weights.wire import TensorMeta
spec = json.load(open(sys.argv[1]))
metas = [TensorMeta(m[0], m[1], tuple(m[2])) for m in spec["metas"]]
ticket = Rendezvous("127.0.0.1", spec["port"], spec["prefix"], bytes.fromhex(spec["secret"]))
group = join_group(ticket, 1, 2, 300)
for _ in range(spec["rounds"]):
    for _ in receive(group, metas):
        pass
"""


def raw_broadcaster(named, rounds: int, tmp: Path):
    """A plain gloo broadcast to a second process, ready to send `rounds` times: (send, close)."""
    from rlmesh.services.config import WeightSyncSection
    from rlmesh.services.weights.base import build_sender
    from rlmesh.services.weights.wire import describe, flat_buckets

    transport = build_sender(WeightSyncSection(timeout_s=300))
    metas = describe(named)
    ticket = transport.rendezvous(99)
    spec = tmp / "raw.json"
    spec.write_text(json.dumps({"port": ticket.master_port, "prefix": ticket.prefix, "secret": ticket.secret.hex(),
                                "rounds": rounds,
                                "metas": [[m.name, m.dtype, list(m.shape)] for m in metas]}))
    child = subprocess.Popen([sys.executable, "-c", RAW_RECEIVER, str(spec)], cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    transport.form_group(99, 2)

    def plain_send() -> None:
        in_flight = None
        for flat in flat_buckets(iter(named), metas):
            work = transport.group.broadcast(flat, 0)
            if in_flight is not None:
                in_flight.wait()
            in_flight = work
        in_flight.wait()

    def timed_send() -> float:
        t0 = time.perf_counter()
        plain_send()
        return time.perf_counter() - t0

    return timed_send, lambda: child.wait(timeout=120)


async def mesh_broadcast(model_dir: Path, named, rounds: int, tmp: Path, digests: list[str]
                         ) -> tuple[list[float], dict[str, list[dict]]]:
    """Each round: one raw broadcast, then one update per digest algorithm (interleaved, so a
    change in the machine's load hits both sides alike)."""
    from bench.harness import rollout_harness
    from rlmesh.learner.broadcast import WeightBroadcaster, WeightSource
    from rlmesh.services.config import WeightSyncSection
    from rlmesh.services.weights.base import build_sender

    async def run_torch(fn, *args):
        return await asyncio.to_thread(fn, *args)

    async with rollout_harness(model_dir, tmp, rollout={"max_model_len": 128, "kv_cache_gib": 1}) as h:
        raw_send, raw_close = raw_broadcaster(named, rounds + 1, tmp)
        source, version = WeightSource.of(named), 0
        senders = {algorithm: build_sender(WeightSyncSection(timeout_s=300, digest_algorithm=algorithm))
                   for algorithm in digests}
        raw, out = [], {algorithm: [] for algorithm in digests}
        for r in range(rounds + 1):  # round 0 warms up (and forms each group) and is not counted
            t = await asyncio.to_thread(raw_send)
            if r:
                raw.append(t)
            for algorithm in digests:
                # A rollout server is in one weight group at a time: each algorithm's learner
                # re-forms its group (InitWeightTransfer, not timed) before its update.
                sync = WeightSyncSection(timeout_s=300, digest_algorithm=algorithm)
                broadcaster = WeightBroadcaster(h.membership, sync, senders[algorithm], run_torch)
                broadcaster.epoch = version  # a fresh epoch each time
                await broadcaster._rebuild()
                assert broadcaster.digest_algorithm == algorithm
                version += 1
                metrics = await broadcaster.broadcast(version, source)
                assert broadcaster.verified_versions[-1] == version
                if r:
                    out[algorithm].append(metrics)
        raw_close()
        return raw, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="tiny,100m")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--digests", default="blake3,sha256", help="weight_sync.digest_algorithm values to measure")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import torch

    from rlmesh.learner.devtools.tiny_model import write_tiny_model
    from rlmesh.services.config import TinyModelSection

    results, load_before = {}, os.getloadavg()
    for size in args.sizes.split(","):
        tmp = Path(tempfile.mkdtemp(prefix=f"rlmesh-wu-{size}-"))
        model_dir = write_tiny_model(TinyModelSection(**SIZES[size]), tmp / "model", seed=0)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(1.001)
        named = list(model.state_dict().items())
        num_params = sum(t.numel() for _, t in named)
        mib = sum(t.numel() * t.element_size() for _, t in named) / 2**20
        raw, by_digest = asyncio.run(mesh_broadcast(model_dir, named, args.rounds, tmp, args.digests.split(",")))
        raw_s = sorted(raw)[len(raw) // 2]
        for algorithm, mesh in by_digest.items():
            total_s = sorted(m["broadcast_s"] for m in mesh)[len(mesh) // 2]
            send_s = sorted(m["broadcast_send_s"] for m in mesh)[len(mesh) // 2]
            phases = {k.removeprefix("broadcast_").removesuffix("_s"): sorted(m[k] for m in mesh)[len(mesh) // 2]
                      for k in mesh[0] if k.startswith("broadcast_") and k.endswith("_s") and k != "broadcast_s"}
            results[f"{size}/{algorithm}"] = {"params": num_params, "mib": mib, "raw_s": raw_s, "update_s": total_s,
                                              "send_s": send_s, "ratio": total_s / raw_s, "phases_s": phases}
        del model, named
    print(f"\n{'model/digest':14s} {'params':>10s} {'MiB':>7s} {'raw bcast s':>12s} {'update s':>9s} {'(send s)':>9s} "
          f"{'ratio':>6s}")
    for size, r in results.items():
        print(f"{size:14s} {r['params']:>10,d} {r['mib']:7.0f} {r['raw_s']:12.3f} {r['update_s']:9.3f} "
              f"{r['send_s']:9.3f} {r['ratio']:6.2f}")
    for size, r in results.items():
        print(f"{size}: median phases (s): " + ", ".join(f"{k} {v:.4f}" for k, v in r["phases_s"].items()))
    print("update = new version -> serving it (control RPCs + transfer + load into vLLM + digest check); "
          "target ratio <= 1.25")
    print(f"load average (1, 5, 15 min) at start {load_before}, at end {os.getloadavg()} on {os.cpu_count()} cores")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
