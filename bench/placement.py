"""Core placement and asynchrony on this machine, on the real-model demo (examples/smollm2_grpo.yaml):
the same seed and steps through `rlmesh up` for each (placement, max_staleness) asked for.

Placements (2 cores):
  split   one core per tier: vLLM on core 0, the learner on core 1 (one torch thread each)
  shared  both cores to both tiers: vLLM's two OpenMP threads on cores 0-1, the learner on 0-1 with
          two torch threads; at k=0 only one phase runs at a time, so each phase has both cores

Each run reports its RL loop time, median step and training time, the rollout engine's busy seconds per
trained step (groups dropped by dynamic sampling included) and held-out accuracy first -> final. From
those per-phase times it computes the step time each placement allows (the bound):
  split,  k=0   gen(1 core) + train(1 core) + update      (the phases take turns)
  split,  k>=1  max(gen(1 core), train(1 core) + update)  (they overlap on their own cores)
  shared, k=0   gen(2 cores) + train(2 cores) + update
  shared, k>=1  (gen(1 core) + train(1 core)) / 2 + update at best (two cores' work, perfectly packed)
and prints measured ÷ bound for each run.

Run: python bench/placement.py [--runs split:0,split:1,split:2,shared:0 --seed 0 --steps 6]"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.async_vs_sync import run  # noqa: E402

CONFIG = "examples/smollm2_grpo.yaml"
PLACEMENTS = {
    "split": ["rollout.cpu_cores=0", "learner.cpu_cores=1", "learner.torch_threads=1"],
    "shared": ["rollout.cpu_cores=0-1", "learner.cpu_cores=0-1", "learner.torch_threads=2"],
}


def bounds(results: list[dict]) -> dict[str, float]:
    """Per-phase seconds per step, as measured: generation and training on one core (split runs)
    and on two (the shared k=0 run), and the weight update."""
    split = [r for r in results if r["placement"] == "split"]
    shared0 = [r for r in results if r["placement"] == "shared" and r["k"] == 0]
    phases = {"update": statistics.median(r["median_broadcast_s"] for r in results)}
    if split:
        phases["gen1"] = statistics.median(r["gen_busy_per_step_s"] for r in split)
        phases["train1"] = statistics.median(r["median_train_s"] for r in split)
    if shared0:
        phases["gen2"] = shared0[0]["gen_busy_per_step_s"]
        phases["train2"] = shared0[0]["median_train_s"]
    return phases


def bound(placement: str, k: int, p: dict[str, float]) -> float | None:
    u = p["update"]
    if placement == "split" and "gen1" in p:
        return p["gen1"] + p["train1"] + u if k == 0 else max(p["gen1"], p["train1"] + u)
    if placement == "shared" and k == 0 and "gen2" in p:
        return p["gen2"] + p["train2"] + u
    if placement == "shared" and k > 0 and "gen1" in p:
        return (p["gen1"] + p["train1"]) / 2 + u
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="split:0,split:1,split:2,shared:0",
                    help="comma-separated placement:max_staleness pairs, run in this order")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--config", default=CONFIG)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("overrides", nargs="*", help="extra rlmesh overrides for every run")
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="rlmesh-placement-"))
    results = []
    for spec in args.runs.split(","):
        placement, _, k = spec.partition(":")
        if placement not in PLACEMENTS or not k.isdigit():
            ap.error(f"--runs: {spec!r} is not placement:k with placement one of {sorted(PLACEMENTS)}")
        t0 = time.time()
        # No evaluation between the first and the last step (eval_every beyond num_steps); the
        # checkpoint only at the end.
        r = run(int(k), args.seed, args.steps, args.steps + 1,
                [*PLACEMENTS[placement], "checkpoint.every_n_steps=0", *args.overrides], out,
                config=args.config, label=f"{placement}-")
        r.update(placement=placement, started=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t0)),
                 wall_s=time.time() - t0)
        results.append(r)
        print(f"{placement} k={k}: loop {r['loop_s']:.0f} s, step {r['median_step_s']:.1f} s, "
              f"accuracy {r['first_accuracy']:.3f} -> {r['final_accuracy']:.3f}", flush=True)
    phases = bounds(results)
    print("\nmeasured per-step phases (s): " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()))
    print(f"{'placement':>9} {'k':>2} {'loop s':>7} {'step s':>7} {'bound s':>7} {'step/bound':>10} "
          f"{'train s':>7} {'gen busy/step':>13} {'learner idle':>12} {'acc first->final':>16}")
    for r in results:
        b = bound(r["placement"], r["k"], phases)
        r["bound_step_s"] = b
        b_txt, ratio_txt = (f"{b:.1f}", f"{r['median_step_s'] / b:.2f}") if b else ("-", "-")
        print(f"{r['placement']:>9} {r['k']:>2} {r['loop_s']:7.0f} {r['median_step_s']:7.1f} "
              f"{b_txt:>7} {ratio_txt:>10} "
              f"{r['median_train_s']:7.1f} {r['gen_busy_per_step_s']:13.1f} {r['learner_idle_frac']:12.2f} "
              f"{r['first_accuracy']:7.3f} -> {r['final_accuracy']:.3f}")
    best = min(results, key=lambda r: r["median_step_s"])
    print(f"\nfastest step: {best['placement']} k={best['k']} ({best['median_step_s']:.1f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": args.config, "seed": args.seed, "steps": args.steps,
                                               "phases": phases, "runs": results}, indent=2))


if __name__ == "__main__":
    main()
