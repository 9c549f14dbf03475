"""Episode-level against per-turn credit on the multi-turn tool-use demo (examples/tool_use_grpo.yaml):
the same config, seeds and steps through `rlmesh up`, one run per (seed, credit), one after another.

The calculator rewards the episode's first `add` call whose result is the answer with a turn reward
(`data.tool_call_reward`, 0.5 here) beside the final answer's 1, so both arms see the same rewards and
differ only in how they become advantages (`algorithm.credit.assign`: `episode` gives every sampled
token the episode's advantage, `turn` each turn its return's, `turn_state` adds same-state groups to the
episode's). For each run: held-out greedy accuracy (the calculator's `correct`) at every evaluation,
the tool-call accuracy on held-out episodes (correct `add` calls / calls), tool calls per held-out
episode, and the run's wall time. Prints one row per run and each credit's mean over seeds.

Run: python bench/turn_credit.py [--seeds 0,1,2 --credits episode,turn --tool-call-reward 0.5] [KEY=VALUE ...]
(about 7 minutes a run on 2 cores: the SFT warm start, then 20 RL steps)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = "examples/tool_use_grpo.yaml"


def run(seed: int, credit: str, tool_call_reward: float, extra: list[str], out: Path) -> dict:
    run_dir = out / f"{credit}-seed{seed}"
    cmd = [sys.executable, "-m", "rlmesh.cli", "up", "-c", str(REPO / CONFIG), "--run-dir", str(run_dir),
           "logging.progress=false", f"run.seed={seed}", f"algorithm.credit.assign={credit}",
           f"data.tool_call_reward={tool_call_reward}", *extra]
    started = time.monotonic()
    with open(out / f"{credit}-seed{seed}.log", "w") as log:
        done = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"{credit} seed {seed}: rlmesh up exited {done.returncode}; see {log.name}")
    return {"seed": seed, "credit": credit, "wall_s": time.monotonic() - started, "run_dir": str(run_dir),
            **read_run(run_dir)}


def read_run(run_dir: Path) -> dict:
    """Held-out accuracy per evaluation and the last evaluation's tool use, from metrics.jsonl."""
    from rlmesh.learner.trackers.metrics import read_metrics

    evals = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "eval"]
    if not evals:
        raise SystemExit(f"{run_dir}: no evaluation in metrics.jsonl")
    first, last = evals[0], evals[-1]

    def tool_accuracy(record: dict) -> float | None:
        calls = record.get("num_tool_calls_mean", 0.0)
        return record.get("correct_tool_calls_mean", 0.0) / calls if calls else None

    return {"accuracy": [(r["version"], r["accuracy"]) for r in evals],
            "first_accuracy": first["accuracy"], "final_accuracy": last["accuracy"],
            "first_tool_accuracy": tool_accuracy(first), "final_tool_accuracy": tool_accuracy(last),
            "first_tool_calls": first.get("num_tool_calls_mean"), "final_tool_calls": last.get("num_tool_calls_mean")}


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--credits", default="episode,turn", help="algorithm.credit.assign values to compare")
    p.add_argument("--tool-call-reward", type=float, default=0.5, help="data.tool_call_reward for every run")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("overrides", nargs="*", help="extra rlmesh overrides for every run")
    args = p.parse_args()
    os.environ["PYTHONPATH"] = str(REPO)
    out = Path(tempfile.mkdtemp(prefix="rlmesh-turn-credit-"))
    print(f"runs and their logs under {out}", flush=True)
    results = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for credit in args.credits.split(","):
            results.append(run(seed, credit, args.tool_call_reward, args.overrides, out))
            r = results[-1]
            print(f"{credit:>10} seed {seed}: held-out {r['first_accuracy']:.3f} -> {r['final_accuracy']:.3f} "
                  f"tool-call accuracy {_fmt(r['final_tool_accuracy'])} in {r['wall_s'] / 60:.1f} min", flush=True)
    print(f"\n{'credit':>10} {'seed':>4} {'held-out first->final':>22} {'by version':>40} "
          f"{'tool-call acc':>13} {'calls/episode':>13} {'min':>5}")
    for r in results:
        curve = " ".join(f"{v}:{a:.2f}" for v, a in r["accuracy"])
        print(f"{r['credit']:>10} {r['seed']:>4} {r['first_accuracy']:10.3f} -> {r['final_accuracy']:.3f} {curve:>40} "
              f"{_fmt(r['final_tool_accuracy']):>13} {_fmt(r['final_tool_calls']):>13} {r['wall_s'] / 60:5.1f}")
    for credit in args.credits.split(","):
        mine = [r for r in results if r["credit"] == credit]
        gain = statistics.mean(r["final_accuracy"] - r["first_accuracy"] for r in mine)
        tools = [r["final_tool_accuracy"] for r in mine if r["final_tool_accuracy"] is not None]
        print(f"{credit:>10} mean over {len(mine)} seed(s): final held-out {statistics.mean(r['final_accuracy'] for r in mine):.3f} "
              f"({gain * 100:+.1f} points), tool-call accuracy {_fmt(statistics.mean(tools) if tools else None)}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
