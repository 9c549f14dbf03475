"""Asynchronous vs synchronous GRPO on the demo task: the same config, seed and steps through
`rlmesh up`, with max_staleness = 0 (synchronous, on-policy), 1, 2 and 4.

For each run: RL loop time (first to last training step), time from the first step to the first
held-out evaluation at or above --target, final held-out accuracy, the learner's idle fraction
(loop time not spent in its training step or weight broadcast) and each rollout server's (time its
vLLM engine had no request in flight, or was paused for a weight update). Prints the speed-up of each k
over k=0 at equal step count. Run: python bench/async_vs_sync.py [--ks 0,1,2,4 --seeds 0 --steps 60]"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def run(k: int, seed: int, steps: int, eval_every: int, extra: list[str], out: Path,
        config: str = "examples/arithmetic_grpo.yaml", label: str = "") -> dict:
    run_dir = out / f"{label}k{k}-seed{seed}"
    cmd = [sys.executable, "-m", "rlmesh.cli", "up", "-c", str(REPO / config),
           "--run-dir", str(run_dir), "logging.progress=false", f"algorithm.max_staleness={k}", f"run.seed={seed}",
           f"learner.num_steps={steps}", f"learner.eval_every={eval_every}", *extra]
    subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return {"k": k, "seed": seed, "label": label, **read_run(run_dir)}


def read_run(run_dir: Path) -> dict:
    """A finished run's timings and accuracies, from its metrics.jsonl."""
    from rlmesh.learner.trackers.metrics import read_metrics

    rows = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    start, end = train[0]["time"] - train[0]["step_s"], train[-1]["time"]
    loop_s = end - start
    busy = sum(r["train_s"] + r.get("broadcast_s", 0.0) for r in train)
    # Each rollout server's engine-busy clock (sent with its heartbeats, so it may read 0 at the first
    # step): its idle fraction over the span from the first step record where it reads, to the last.
    i0 = next((i for i, r in enumerate(train) if any(r.get("rollout_busy_s", {}).values())), 0)
    first, last = train[i0].get("rollout_busy_s", {}), train[-1].get("rollout_busy_s", {})
    span = train[-1]["time"] - train[i0]["time"]
    rollout_idle = {gid: max(0.0, 1 - (last[gid] - first[gid]) / span) for gid in last if gid in first and span > 0}
    # Engine-busy seconds per trained step over that span, all generators together (groups dropped by
    # dynamic sampling included: they are part of what a trained step costs).
    gen_per_step = sum(last[g] - first[g] for g in last if g in first) / max(len(train) - 1 - i0, 1)
    # The steps of that span, for per-phase sums that compare with its generation figure.
    span_steps = train[i0 + 1:] or train
    return {"loop_s": loop_s, "gen_busy_per_step_s": gen_per_step,
            "trained_tokens": sum(r["num_tokens"] for r in train),
            "evals": [(r["time"] - start, r["accuracy"]) for r in evals],
            "final_accuracy": evals[-1]["accuracy"], "first_accuracy": evals[0]["accuracy"],
            "learner_idle_frac": max(0.0, 1 - busy / loop_s), "rollout_idle_frac": rollout_idle,
            "median_train_s": statistics.median(r["train_s"] for r in train),
            "median_step_s": statistics.median(r["step_s"] for r in train),
            "span_step_s": statistics.mean(r["step_s"] for r in span_steps),
            "span_train_s": statistics.mean(r["train_s"] for r in span_steps),
            "span_broadcast_s": statistics.mean(r.get("broadcast_s", 0.0) for r in span_steps)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ks", default="0,1,2,4")
    p.add_argument("--seeds", default="0")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--target", type=float, default=0.9, help="held-out accuracy for time-to-target")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("overrides", nargs="*", help="extra rlmesh overrides for every run")
    args = p.parse_args()
    out = Path(tempfile.mkdtemp(prefix="rlmesh-async-"))
    results = [run(int(k), int(s), args.steps, args.eval_every, args.overrides, out)
               for s in args.seeds.split(",") for k in args.ks.split(",")]
    for r in results:
        hit = [t for t, acc in r["evals"] if acc >= args.target]
        r["time_to_target_s"] = hit[0] if hit else None
    print(f"\n{'k':>2} {'seed':>4} {'loop s':>7} {'to target s':>11} {'acc first->final':>16} {'learner idle':>12} "
          f"{'step s':>7} {'train s':>7} {'rollout idle':>12}")
    for r in results:
        ttt = f"{r['time_to_target_s']:.0f}" if r["time_to_target_s"] is not None else "never"
        print(f"{r['k']:>2} {r['seed']:>4} {r['loop_s']:7.1f} {ttt:>11} {r['first_accuracy']:7.2f} -> "
              f"{r['final_accuracy']:.2f} {r['learner_idle_frac']:12.2f} {r['median_step_s']:7.2f} "
              f"{r['median_train_s']:7.2f} "
              f"{' '.join(f'{v:.2f}' for v in r['rollout_idle_frac'].values()) or '-':>12}")
    sync = {r["seed"]: r["loop_s"] for r in results if r["k"] == 0}
    for k in sorted({r["k"] for r in results if r["k"] != 0}):
        ratios = [sync[r["seed"]] / r["loop_s"] for r in results if r["k"] == k and r["seed"] in sync]
        if ratios:
            print(f"speed-up of k={k} over k=0 (loop time, same steps): mean {statistics.mean(ratios):.2f}x "
                  f"over {len(ratios)} seed(s)   (target >= 1.6x)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
