"""Weight update: how long from the learner's new version to a rollout server serving it, against
a raw torch.distributed broadcast of the same bytes.

measured: the learner's real broadcaster (gloo transport) into a real `rlmesh rollout` (vLLM):
          PauseGeneration -> StartWeightUpdate -> UpdateWeights + bucketed send -> FinishWeightUpdate
          (vLLM's layerwise reload) -> digest verification -> ResumeGeneration.
baseline: a plain gloo broadcast of the same buckets (same layout, same bytes) from this process to
          a second plain process on the same machine (the vLLM worker process cannot be reused for
          it, so a fresh process stands in), nothing else.
For the tiny demo model and a locally built Qwen2 of >= 100M parameters. Run:
python bench/weight_update.py [--sizes tiny,100m --rounds 3]"""

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


def raw_broadcast(named, rounds: int, tmp: Path) -> list[float]:
    from rlmesh.services.config import WeightSyncSection
    from rlmesh.services.weights.base import build_sender
    from rlmesh.services.weights.wire import describe

    transport = build_sender(WeightSyncSection(timeout_s=300))
    metas = describe(named)
    ticket = transport.rendezvous(99)
    spec = tmp / "raw.json"
    spec.write_text(json.dumps({"port": ticket.master_port, "prefix": ticket.prefix, "secret": ticket.secret.hex(),
                                "rounds": rounds + 1,
                                "metas": [[m.name, m.dtype, list(m.shape)] for m in metas]}))
    child = subprocess.Popen([sys.executable, "-c", RAW_RECEIVER, str(spec)], cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    transport.form_group(99, 2)
    transport.send(iter(named), metas)  # warm-up
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        transport.send(iter(named), metas)
        times.append(time.perf_counter() - t0)
    child.wait(timeout=120)
    return times


async def mesh_broadcast(model_dir: Path, named, rounds: int, tmp: Path) -> list[dict]:
    from bench.harness import rollout_harness
    from rlmesh.learner.broadcast import WeightBroadcaster, WeightSource
    from rlmesh.services.config import WeightSyncSection
    from rlmesh.services.weights.base import build_sender

    async def run_torch(fn, *args):
        return await asyncio.to_thread(fn, *args)

    async with rollout_harness(model_dir, tmp, rollout={"max_model_len": 128, "kv_cache_gib": 1}) as h:
        sync = WeightSyncSection(timeout_s=300)
        broadcaster = WeightBroadcaster(h.membership, sync, build_sender(sync), run_torch)
        source = WeightSource.of(named)
        await broadcaster.broadcast(1, source)  # forms the group, warms up
        out = []
        for v in range(2, rounds + 2):
            out.append(await broadcaster.broadcast(v, source))
        assert broadcaster.verified_versions[-1] == rounds + 1
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="tiny,100m")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import torch

    from rlmesh.learner.devtools.tiny_model import write_tiny_model
    from rlmesh.services.config import TinyModelSection

    results = {}
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
        raw = raw_broadcast(named, args.rounds, tmp)
        mesh = asyncio.run(mesh_broadcast(model_dir, named, args.rounds, tmp))
        raw_s = sorted(raw)[len(raw) // 2]
        total_s = sorted(m["broadcast_s"] for m in mesh)[len(mesh) // 2]
        send_s = sorted(m["broadcast_send_s"] for m in mesh)[len(mesh) // 2]
        phases = {k.removeprefix("broadcast_").removesuffix("_s"): sorted(m[k] for m in mesh)[len(mesh) // 2]
                  for k in mesh[0] if k.startswith("broadcast_") and k.endswith("_s") and k != "broadcast_s"}
        results[size] = {"params": num_params, "mib": mib, "raw_s": raw_s, "update_s": total_s, "send_s": send_s,
                         "ratio": total_s / raw_s, "phases_s": phases}
        del model, named
    print(f"\n{'model':8s} {'params':>10s} {'MiB':>7s} {'raw bcast s':>12s} {'update s':>9s} {'(send s)':>9s} {'ratio':>6s}")
    for size, r in results.items():
        print(f"{size:8s} {r['params']:>10,d} {r['mib']:7.0f} {r['raw_s']:12.3f} {r['update_s']:9.3f} "
              f"{r['send_s']:9.3f} {r['ratio']:6.2f}")
    for size, r in results.items():
        print(f"{size}: median phases (s): " + ", ".join(f"{k} {v:.4f}" for k, v in r["phases_s"].items()))
    print("update = new version -> serving it (control RPCs + transfer + load into vLLM + digest check); "
          "target ratio <= 1.25")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
