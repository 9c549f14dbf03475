"""Core placement and asynchrony on this machine, on the real-model demo (examples/smollm2_grpo.yaml):
the same seed and steps through `rlmesh up` for each (placement, max_staleness) asked for.

Placements (2 cores):
  split   one core per tier: vLLM on core 0, the learner on core 1 (one torch thread each)
  shared  both cores to both tiers: vLLM's two OpenMP threads on cores 0-1, the learner on 0-1 with
          two torch threads; at k=0 only one phase runs at a time, so each phase has both cores

Each run reports its RL loop time and milliseconds per trained token (answers shrink as the model
learns, so runs compare per token), median step and training time, the rollout engine's busy seconds per
trained step (groups dropped by dynamic sampling included) and held-out accuracy first -> final. From
each run's own per-phase times it computes the step time its placement allows (the bound):
  split,  k=0   gen(1 core) + train(1 core) + update      (the phases take turns)
  split,  k>=1  max(gen(1 core), train(1 core) + update)  (they overlap on their own cores)
  shared, k=0   gen(2 cores) + train(2 cores) + update
  shared, k>=1  (gen(1 core) + train(1 core)) / 2 + update at best (two cores' work, perfectly packed;
                phases from the split runs)
and prints measured ÷ bound for each run.

Run: python bench/placement.py [--runs split:0,split:1,split:2,shared:0 --seed 0 --steps 6]"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.async_vs_sync import read_run, run  # noqa: E402

CONFIG = "examples/smollm2_grpo.yaml"
PLACEMENTS = {
    "split": ["rollout.cpu_cores=0", "learner.cpu_cores=1", "learner.torch_threads=1"],
    "shared": ["rollout.cpu_cores=0-1", "learner.cpu_cores=0-1", "learner.torch_threads=2"],
}


def bound(r: dict, results: list[dict]) -> float | None:
    """The step time run `r`'s placement allows, from per-phase seconds per step measured in the run
    itself, over the steps after the engine's busy clock first reads (generation: its busy seconds
    per step; training and the update: their mean). A shared placement at k >= 1 cannot time its
    phases apart, so it takes them from the split runs (one core each)."""
    gen, train, u = r["gen_busy_per_step_s"], r["span_train_s"], r["span_broadcast_s"]
    if r["placement"] == "split":
        return gen + train + u if r["k"] == 0 else max(gen, train + u)
    if r["k"] == 0:
        return gen + train + u
    split = [x for x in results if x["placement"] == "split"]
    if not split:
        return None
    return (statistics.median(x["gen_busy_per_step_s"] for x in split)
            + statistics.median(x["span_train_s"] for x in split)) / 2 + u


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="split:0,split:1,split:2,shared:0",
                    help="comma-separated placement:max_staleness pairs, run in this order")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--config", default=CONFIG)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--reread", metavar="DIR", help="report the runs already in DIR (a previous invocation's "
                    "rlmesh-placement-* directory) instead of running")
    ap.add_argument("overrides", nargs="*", help="extra rlmesh overrides for every run")
    args = ap.parse_args()
    if args.reread:
        results = []
        for run_dir in sorted(Path(args.reread).glob("*-k*-seed*"), key=lambda d: d.stat().st_mtime):
            placement, k, seed = re.fullmatch(r"(\w+)-k(\d+)-seed(\d+)", run_dir.name).groups()
            if not (run_dir / "summary.json").is_file():
                continue  # not finished
            results.append({"placement": placement, "k": int(k), "seed": int(seed), **read_run(run_dir)})
        report(results)
        return
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
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps({"config": args.config, "seed": args.seed, "steps": args.steps,
                                               "runs": results}, indent=2))


def report(results: list[dict]) -> None:
    print(f"\n{'placement':>9} {'k':>2} {'loop s':>7} {'ms/token':>8} {'step s':>7} {'bound s':>7} {'step/bound':>10} "
          f"{'train s':>7} {'gen busy/step':>13} {'learner idle':>12} {'acc first->final':>16}")
    for r in results:
        b = bound(r, results)
        r["bound_step_s"] = b
        r["ms_per_trained_token"] = 1000 * r["loop_s"] / max(r["trained_tokens"], 1)
        b_txt, ratio_txt = (f"{b:.1f}", f"{r['span_step_s'] / b:.2f}") if b else ("-", "-")
        print(f"{r['placement']:>9} {r['k']:>2} {r['loop_s']:7.0f} {r['ms_per_trained_token']:8.0f} {r['span_step_s']:7.1f} "
              f"{b_txt:>7} {ratio_txt:>10} "
              f"{r['span_train_s']:7.1f} {r['gen_busy_per_step_s']:13.1f} {r['learner_idle_frac']:12.2f} "
              f"{r['first_accuracy']:7.3f} -> {r['final_accuracy']:.3f}")
    best = min(results, key=lambda r: r["ms_per_trained_token"])
    print(f"\nfastest per trained token: {best['placement']} k={best['k']} ({best['ms_per_trained_token']:.0f} ms)")


if __name__ == "__main__":
    main()
