"""Weight update: how long from the learner's new version to a rollout server serving it, against
a raw torch.distributed broadcast of the same bytes.

measured: the learner's real broadcaster (gloo transport) into a real `rlmesh rollout` (vLLM), the
          single-call update (one UpdateWeights per server carrying pause, start, receive, the worker's
          load, finish, resume) with the digest verified, once per digest algorithm
          (`--digests blake3,xxh3,sha256`: the default, the fast non-cryptographic one, and what an older peer gets), with
          weight_sync.snapshot on and off (`--snapshot on,off`; rows `<digest>/snapshot` and
          `<digest>/direct`). Two times: `send` (what the learner's next training step waits for:
          `WeightBroadcaster.send` returns once the weights are copied into the snapshot and the
          control call is out, or without a snapshot once the bytes are sent) and `update` (until
          `settled()`: transfer done, every server replied, digest checked).
baseline: a plain gloo broadcast of the same buckets (same layout, same bytes, two in flight, no
          digest on either side) from this process to a second plain process on the same machine
          (a fresh process stands in for the vLLM worker). Both keep their buffers across rounds, as
          the mesh does; the receiver exits after the last update (until 2026-12-06, during it).
engine:   vLLM's own layerwise reload of the same weights from memory, nothing else running: what the
          engine costs per update whatever the transport (`bench/engine_reload.py`). Timed inside
          vLLM's engine as the rollout server runs it (rollout.cpu_cores "auto", the server's executor,
          `vllm_engine.executor_args`: on a CPU the model in vLLM's engine-core process, its threads
          unbound), the ratio's baseline, resident beside the server and reloaded once per round
          between the raw broadcast and the updates (`paired_engine_ratio`: each round's update over
          that round's raw broadcast plus reload); and, after, in a process of its own on every core
          ("alone"). Each update's row says how the server loaded it (`loads`: "direct" or "layerwise",
          from the server's log line for that version).
passes:   each extra pass over the bytes alone (a copy on one thread, each digest as the transport
          takes it): on one host both ends share the cores, so the update cannot cost less than the
          raw broadcast plus these passes spread over the cores.
Rows: the tiny demo model and a locally built Qwen2 of >= 100M parameters (full weights), and a LoRA
adapter (`--lora 100m:16`: the learner's FSDP2 + peft backend in this process, learner.lora.rank 16,
streaming only the adapter to a rollout server serving it with vLLM's LoRA). Run:
python bench/weight_update.py [--sizes tiny,100m --lora 100m:16 --rounds 3 --digests blake3,sha256 --snapshot on,off]"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SERVED_CORES = "auto"
"""The rollout server's rollout.cpu_cores here, and the placement of the engine-reload baseline."""
LOADED = re.compile(r"weights v(\d+) loaded \(([^)]*)\)")
"""The rollout server's line for each update (`VLLMGenerator.finish_weight_update`): version, load."""
SIZES = {"tiny": dict(), "100m": dict(hidden_size=1024, num_layers=9, num_heads=16, num_kv_heads=4,
                                      intermediate_size=2816)}

RAW_RECEIVER = """
import json, sys
import torch
from rlmesh.services.weights.base import Rendezvous
from rlmesh.services.weights.gloo import join_group, receive
from rlmesh.services.weights.wire import TensorMeta, WireBuffers
spec = json.load(open(sys.argv[1]))
metas = [TensorMeta(m[0], m[1], tuple(m[2])) for m in spec["metas"]]
ticket = Rendezvous("127.0.0.1", spec["port"], spec["prefix"], bytes.fromhex(spec["secret"]))
group = join_group(ticket, 1, 2, 300)
buffers = WireBuffers()  # kept across rounds, like a rollout worker's
for _ in range(spec["rounds"]):
    for _ in receive(group, metas, into=buffers):
        pass
# Exit only when told: torch's teardown beside the last timed update would slow it.
group.broadcast(torch.zeros(1), 0).wait()
"""

def raw_broadcaster(named, rounds: int, tmp: Path):
    """A plain gloo broadcast to a second process, ready to send `rounds` times: (send, close)."""
    import torch

    from rlmesh.services.config import WeightSyncSection
    from rlmesh.services.weights import build_sender
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
    flats = list(flat_buckets(iter(named), metas))  # flattened once: the baseline moves bytes, nothing else

    def plain_send() -> None:
        in_flight = None
        for flat in flats:
            work = transport.group.broadcast(flat, 0)
            if in_flight is not None:
                in_flight.wait()
            in_flight = work
        in_flight.wait()

    def timed_send() -> float:
        t0 = time.perf_counter()
        plain_send()
        return time.perf_counter() - t0

    def close() -> None:  # after every round of both sides: the receiver exits now
        transport.group.broadcast(torch.zeros(1), 0).wait()
        child.wait(timeout=120)

    return timed_send, close


async def mesh_broadcast(model_dir: Path, named, source, rounds: int, tmp: Path, digests: list[str],
                         config: dict | None = None, snapshots: tuple[bool, ...] = (True, False),
                         dtype: str = "float32", reload_round: Callable[[], float] | None = None,
                         ) -> tuple[list[float], dict[str, list[dict]], list[float]]:
    """Each round: one raw broadcast of `named`, one `reload_round()` if given (vLLM's own reload in
    an engine of its own), then one update of `source` (the same bytes) per digest algorithm and
    snapshot setting (interleaved, so a change in the machine's load hits all sides alike; each
    setting keeps its broadcaster, so a snapshot's buffers are reused). Each update's `send_s` is
    what the learner's training step waits for (`WeightBroadcaster.send`); `update_s` runs until
    `settled()`: every server has loaded, finished and resumed, digest checked; `load`: how the
    server loaded it (its log line for the version). Returns (raw, updates by setting, reloads)."""
    from bench.harness import rollout_harness
    from rlmesh.learner.rl.broadcast import WeightBroadcaster
    from rlmesh.services.config import WeightSyncSection
    from rlmesh.services.weights import build_sender

    async def run_torch(fn, *args):
        return await asyncio.to_thread(fn, *args)

    async with rollout_harness(model_dir, tmp, rollout={"max_model_len": 128, "kv_cache_gib": 1, "dtype": dtype,
                                                           "cpu_cores": SERVED_CORES},
                               config=config) as h:
        raw_send, raw_close = raw_broadcaster(named, rounds + 1, tmp)
        version = 0
        broadcasters = {}
        for algorithm in digests:
            sender = build_sender(WeightSyncSection(timeout_s=300, digest_algorithm=algorithm))
            for snapshot in snapshots:
                sync = WeightSyncSection(timeout_s=300, digest_algorithm=algorithm, snapshot=snapshot)
                label = f"{algorithm}/{'snapshot' if snapshot else 'direct'}"
                broadcasters[label] = WeightBroadcaster(h.membership, sync, sender, run_torch)
        raw, out, reloads = [], {label: [] for label in broadcasters}, []
        for r in range(rounds + 1):  # round 0 warms up (and forms each group) and is not counted
            t = await asyncio.to_thread(raw_send)
            if r:
                raw.append(t)
            if reload_round is not None:
                t = await asyncio.to_thread(reload_round)
                await asyncio.sleep(0.2)  # the reloading engine's threads stop spinning before the updates
                if r:
                    reloads.append(t)
            for label, broadcaster in broadcasters.items():
                algorithm = broadcaster.cfg.digest_algorithm
                # A rollout server is in one weight group at a time: each setting's learner
                # re-forms its group (InitWeightTransfer, not timed) before its update.
                broadcaster.epoch = version  # a fresh epoch each time
                await broadcaster._rebuild()
                assert broadcaster.digest_algorithm == algorithm
                version += 1
                t0 = time.perf_counter()
                metrics = await broadcaster.send(version, source)
                send_s = time.perf_counter() - t0
                metrics.update(await broadcaster.settled())
                update_s = time.perf_counter() - t0
                assert broadcaster.verified_versions[-1] == version
                if r:
                    out[label].append({**metrics, "send_s": send_s, "update_s": update_s, "version": version})
        raw_close()
        loads = dict(LOADED.findall((tmp / "rollout.log").read_text(errors="replace")))
        for mesh in out.values():
            for m in mesh:
                m["load"] = loads.get(str(m["version"]), "not logged")
        return raw, out, reloads


def pass_costs(nbytes: int, digests: list[str], repeats: int = 3) -> dict[str, float]:
    """Seconds one more pass over `nbytes` costs: a copy on one thread (what the snapshot and the
    receiver's load into the model each do) and each digest as the transport takes it (one per
    side; BLAKE3 on every core, the others on one). Best of `repeats`."""
    import torch

    from rlmesh.services.weights.wire import new_digest

    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {}
    try:
        for name, work in [("copy", lambda: dst.copy_(src))] + [
                (a, lambda a=a: new_digest(a).update(src.view(torch.uint8).numpy())) for a in digests]:
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                work()
                best = min(best, time.perf_counter() - t0)
            out[name] = best
    finally:
        torch.set_num_threads(threads)
    return out


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def summarize(raw: list[float], by_digest: dict[str, list[dict]], **facts) -> dict[str, dict]:
    raw_s, rows = median(raw), {}
    for algorithm, mesh in by_digest.items():
        send_s, update_s = median([m["send_s"] for m in mesh]), median([m["update_s"] for m in mesh])
        phases = {k.removeprefix("broadcast_").removesuffix("_s"): median([m[k] for m in mesh])
                  for k in mesh[0] if k.startswith("broadcast_") and k.endswith("_s") and k != "broadcast_s"}
        rows[algorithm] = {**facts, "raw_s": raw_s, "raw_all_s": raw, "send_s": send_s, "update_s": update_s,
                           "update_all_s": [m["update_s"] for m in mesh], "send_ratio": send_s / raw_s,
                           "ratio": update_s / raw_s, "phases_s": phases,
                           # each round's update over the raw broadcast run just before it (same load)
                           "paired_ratio": median([m["update_s"] / r for m, r in zip(mesh, raw)]),
                           "paired_send_ratio": median([m["send_s"] / r for m, r in zip(mesh, raw)]),
                           "loads": [m["load"] for m in mesh]}
        if "engine_reload_s" in facts:  # over the wire plus what the engine's reload costs on the server's cores
            reloads = facts["engine_reload_all_s"]
            rows[algorithm]["engine_ratio"] = update_s / (raw_s + facts["engine_reload_s"])
            rows[algorithm]["engine_alone_ratio"] = update_s / (raw_s + facts["engine_reload_alone_s"])
            # each round's update over that round's raw broadcast plus that round's reload
            rows[algorithm]["paired_engine_ratio"] = median([m["update_s"] / (r + e)
                                                             for m, r, e in zip(mesh, raw, reloads)])
    return rows


def lora_row(size: str, rank: int, rounds: int, digests: list[str], snapshots: tuple[bool, ...]) -> dict[str, dict]:
    """The learner with learner.lora (FSDP2 + peft, in this process) pushing its adapter to a rollout
    server serving it (vLLM with LoRA), against a raw broadcast of the same adapter tensors."""
    import torch

    from rlmesh.learner.rl.broadcast import WeightSource
    from rlmesh.learner.devtools.tiny_model import write_tiny_model
    from rlmesh.learner.train.trainer import Trainer
    from rlmesh.services.config import TinyModelSection, load_config

    tmp = Path(tempfile.mkdtemp(prefix=f"rlmesh-wu-lora-{size}-"))
    model_dir = write_tiny_model(TinyModelSection(**SIZES[size]), tmp / "model", seed=0)
    lora = {"rank": rank, "alpha": 2.0 * rank}
    config = load_config(None, ["model.type=hf", f"model.path={model_dir}", "learner.torch_threads=1",
                                f"learner.lora.rank={rank}", f"learner.lora.alpha={lora['alpha']}"])
    trainer = Trainer(config, str(model_dir), pad_id=0)
    torch.manual_seed(0)
    with torch.no_grad():  # a trained adapter's lora_B is not zero (the same bytes either way)
        for name, p in trainer.backend.model.named_parameters():
            if ".lora_B." in name:
                p.add_(0.01)
    model_bytes = sum(p.numel() * p.element_size() for n, p in trainer.backend.model.named_parameters()
                      if ".lora_" not in n)
    source = WeightSource(trainer.weight_metas, trainer.stream_weights)
    t0 = time.perf_counter()
    named = [(n, t.detach().clone()) for n, t in trainer.stream_weights()]
    stream_s = time.perf_counter() - t0  # the learner gathering its adapter out of FSDP2 (part of `send`)
    adapter_bytes = sum(t.numel() * t.element_size() for _, t in named)
    raw, by_digest, _ = asyncio.run(mesh_broadcast(model_dir, named, source, rounds, tmp, digests,
                                                   config={"learner": {"lora": lora}}, snapshots=snapshots))
    facts = {"params": sum(t.numel() for _, t in named), "mib": adapter_bytes / 2**20, "bytes": adapter_bytes,
             "model_bytes": model_bytes, "adapter_fraction": adapter_bytes / model_bytes, "stream_s": stream_s,
             "tensors": len(named)}
    return {f"lora{rank}-{size}/{a}": row for a, row in summarize(raw, by_digest, **facts).items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="tiny,100m",
                   help="full-weight rows: tiny, 100m, or an HF model directory (e.g. models/smollm2-135m-instruct, "
                        "the real-model demo's); '' for none")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the weights' dtype on both sides (the learner sends its compute dtype; the demo's is "
                        "bfloat16 where this machine computes it faster, `rlmesh up` says which)")
    p.add_argument("--lora", default="100m:16", help="LoRA rows as size:rank (comma-separated); '' for none")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--digests", default="blake3,sha256", help="weight_sync.digest_algorithm values to measure")
    p.add_argument("--snapshot", default="on,off", help="weight_sync.snapshot settings to measure (on, off)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import torch

    from bench.engine_reload import EngineReload, engine_reload
    from rlmesh.learner.devtools.tiny_model import write_tiny_model
    from rlmesh.learner.rl.broadcast import WeightSource
    from rlmesh.services.config import TinyModelSection

    digests = args.digests.split(",")
    snapshots = tuple({"on": True, "off": False}[v] for v in args.snapshot.split(","))
    results, load_before = {}, os.getloadavg()
    for size in filter(None, args.sizes.split(",")):
        if size in SIZES:
            tmp = Path(tempfile.mkdtemp(prefix=f"rlmesh-wu-{size}-"))
            model_dir = write_tiny_model(TinyModelSection(**SIZES[size]), tmp / "model", seed=0)
        else:
            model_dir = Path(size).resolve()
            if not (model_dir / "config.json").is_file():
                raise SystemExit(f"--sizes: {size} is neither tiny, 100m nor an HF model directory")
            size = model_dir.name
            tmp = Path(tempfile.mkdtemp(prefix=f"rlmesh-wu-{size}-"))
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype))
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(1.001)
        # What the learner sends: a tied output head is the embedding, sent once (Trainer.not_sent).
        from rlmesh.learner.train.trainer import tied_output_layer
        tied = tied_output_layer(str(model_dir))
        named = [(n, t) for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight")]
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        with EngineReload(model_dir, args.dtype, SERVED_CORES) as engine:  # resident beside the server
            raw, by_digest, reloads = asyncio.run(mesh_broadcast(
                model_dir, named, WeightSource.of(named), args.rounds, tmp, digests, snapshots=snapshots,
                dtype=args.dtype, reload_round=engine.round))
            served = {"times": reloads, **engine.info}
        alone = engine_reload(model_dir, args.rounds, args.dtype, "alone")
        facts = {"params": sum(t.numel() for _, t in named), "mib": nbytes / 2**20, "bytes": nbytes, "dtype": args.dtype,
                 "pass_s": pass_costs(nbytes, digests), "engine_reload_s": median(served["times"]),
                 "engine_reload_all_s": served["times"], "engine_reload_placement": served,
                 "engine_reload_alone_s": median(alone["times"]), "engine_reload_alone": alone}
        results.update({f"{size}/{a}": row for a, row in summarize(raw, by_digest, **facts).items()})
        del model, named
    for spec in filter(None, args.lora.split(",")):
        size, rank = spec.split(":")
        results.update(lora_row(size, int(rank), args.rounds, digests, snapshots))
    print(f"\n{'model/digest/sending':28s} {'params':>11s} {'MiB':>7s} {'raw bcast s':>12s} {'send s':>8s} "
          f"{'update s':>9s} {'send/raw':>9s} {'update/raw':>11s} {'paired send':>12s} {'paired update':>14s}")
    for name, r in results.items():
        print(f"{name:28s} {r['params']:>11,d} {r['mib']:7.1f} {r['raw_s']:12.4f} {r['send_s']:8.4f} "
              f"{r['update_s']:9.4f} {r['send_ratio']:9.2f} {r['ratio']:11.2f} {r['paired_send_ratio']:12.2f} "
              f"{r['paired_ratio']:14.2f}")
    sizes_shown = set()
    for name, r in results.items():
        print(f"{name}: median phases (s): " + ", ".join(f"{k} {v:.4f}" for k, v in r["phases_s"].items())
              + f"; raw rounds {[round(x, 4) for x in r['raw_all_s']]}, updates {[round(x, 4) for x in r['update_all_s']]}")
        if "engine_ratio" in r:
            print(f"{name}: update / (raw broadcast + vLLM's own reload in its engine as the server runs it) "
                  f"{r['engine_ratio']:.2f} (target <= 1.15), paired by round {r['paired_engine_ratio']:.2f}; "
                  f"against the reload alone on every core {r['engine_alone_ratio']:.2f}")
        print(f"{name}: loads " + ", ".join(f"{n} x {k}" for k, n in sorted(Counter(r["loads"]).items())))
        size = name.split("/")[0]
        if "engine_reload_s" in r and size not in sizes_shown:  # facts of the size, shared by its rows
            sizes_shown.add(size)
            placed, alone = r["engine_reload_placement"], r["engine_reload_alone"]
            print(f"{size}: vLLM's own reload of these weights from memory, median: {r['engine_reload_s']:.4f} s in "
                  f"vLLM's engine as the server runs it (rollout.cpu_cores={SERVED_CORES}: {placed['threads']} thread(s) "
                  f"on cores {placed['cores']}; rounds {[round(x, 4) for x in placed['times']]}), "
                  f"{r['engine_reload_alone_s']:.4f} s alone ({alone['threads']} thread(s) on cores {alone['cores']}; "
                  f"rounds {[round(x, 4) for x in alone['times']]})")
            print(f"{size}: one more pass over its {r['mib']:.0f} MiB (s; copy on one thread, BLAKE3 on every "
                  "core): " + ", ".join(f"{k} {v:.4f}" for k, v in r["pass_s"].items()))
        if "model_bytes" in r:
            print(f"{name}: adapter {r['bytes']:,d} bytes = {100 * r['adapter_fraction']:.2f}% of the base model's "
                  f"{r['model_bytes']:,d}; {r['tensors']} tensors, gathered out of FSDP2 in {r['stream_s']:.3f} s")
    print("send = what the training step waits for (WeightBroadcaster.send: control call out and, with "
          "snapshot, the weights copied; direct, the bytes sent); update = until settled (transfer done, every "
          "server loaded, finished, resumed; digest checked): paired = median over "
          "rounds of send or update / that round's raw")
    print(f"load average (1, 5, 15 min) at start {load_before}, at end {os.getloadavg()} on {os.cpu_count()} cores")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
