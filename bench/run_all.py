"""`make bench`: every benchmark under bench/, one table. Each benchmark runs both sides of its
comparison in one invocation; this collects their JSON results, prints one table (measured,
baseline, ratio, target), and writes it to bench/results/table.json and bench/results/table.png.
Run: python bench/run_all.py [--skip async_vs_sync] [--quick]"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "results"

# name -> (script args, how to read a row from its JSON: (measured, baseline, ratio, target, unit, what))
BENCHES = {
    "rollout_throughput": ([], lambda r: [("rollout server vs raw vLLM", r["mesh_tokens_per_s"], r["raw_tokens_per_s"],
                                           r["ratio"], ">= 0.95", "tok/s")]),
    "prefix_caching": ([], lambda r: [("prefix caching on vs off (600-token shared prompt, n=8)", r["off_s"] / r["gain"],
                                       r["off_s"], r["gain"], "> 1 (gain)", "s")]),
    "learner_throughput": ([], lambda r: [
        ("learner step (1 rank) vs plain PyTorch loop", r["learner_1rank"]["tokens_per_s"], r["plain"]["tokens_per_s"],
         r["ratio_vs_plain"], ">= 0.9", "train tok/s"),
        ("learner 2 ranks vs 1 rank (step time)", r["learner_2rank"]["step_s"], r["learner_1rank"]["step_s"],
         r["two_over_one_step_time"], "< 1 on >= 4 cores", "s")]),
    "weight_update": ([], lambda r: [(f"weight update vs raw gloo broadcast ({size}, {v['params'] / 1e6:.1f}M params)",
                                      v["update_s"], v["raw_s"], v["ratio"], "<= 1.25", "s") for size, v in r.items()]
                      + [(f"weight update vs raw broadcast + vLLM's own reload ({size})", v["update_s"],
                          v["raw_s"] + v["engine_reload_s"], v["engine_ratio"], "—", "s")
                         for size, v in r.items() if "engine_ratio" in v]),
    "queue_headroom": ([], lambda r: [("queue capacity vs needed at measured rollout rate", r["groups_per_s"],
                                       r["needed_groups_per_s"], r["ratio"], ">= 10", "groups/s")]),
    "reward_throughput": ([], None),
    "async_vs_sync": ([], None),
    "observability_overhead": ([], lambda r: [(f"everything observable on vs off (demo RL loop time, {r['steps']} steps, "
                                               f"{len(r['runs']) // 2} seeds)", r["on_mean_s"], r["off_mean_s"],
                                               r["ratio"], "<= 1.05", "s")]),
    "trl_vs_rlmesh": ([], None),
    "long_generation": ([], None),
    # Side by side with an older commit: `python bench/startup.py --before <git worktree of it>`.
    "startup": ([], lambda r: [("start-up: rlmesh up -> first trained step, SFT excluded", r["after"]["startup_s"],
                                r.get("before", {}).get("startup_s", float("nan")), r.get("ratio", float("nan")),
                                "<= 0.5 x before", "s")]),
}


def _rows_async(r: list[dict]) -> list[tuple]:
    sync = {x["seed"]: x["loop_s"] for x in r if x["k"] == 0}
    rows = []
    for k in sorted({x["k"] for x in r if x["k"] != 0}):
        runs = [x for x in r if x["k"] == k and x["seed"] in sync]
        if runs:
            loop = sum(x["loop_s"] for x in runs) / len(runs)
            base = sum(sync[x["seed"]] for x in runs) / len(runs)
            rows.append((f"async k={k} vs sync k=0 (RL loop time, same steps)", loop, base, base / loop, ">= 1.6", "s"))
    return rows


def _rows_trl(r: dict) -> list[tuple]:
    """Wall time from launch to the target held-out accuracy; ratio = TRL's time / rlmesh's (a lower
    bound when TRL missed the target within its cap, NaN when rlmesh missed it)."""
    ours, trl = r["rlmesh"], r["trl"]
    what = f"time to {r['target']:.2f} held-out acc: rlmesh vs TRL GRPOTrainer ({trl['generation']} generation)"
    nan, goal = float("nan"), f">= {r.get('goal', 3):g}"
    if ours["time_to_target_s"] is None:
        return [(what + "; rlmesh missed the target", nan, trl["time_to_target_s"] or nan, nan, goal, "s")]
    if trl["time_to_target_s"] is None:
        bound = trl["final_step_time_s"]
        return [(what + "; TRL missed it within its cap (ratio is a lower bound)", ours["time_to_target_s"], bound,
                 bound / ours["time_to_target_s"], goal, "s")]
    return [(what, ours["time_to_target_s"], trl["time_to_target_s"], r["ratio"], goal, "s")]


def _rows_long(r: dict) -> list[tuple]:
    """Mean time to the target over the seeds (NaN where a seed missed it): TRL vs the best rlmesh
    setting, synchronous (k=0) vs the best asynchronous one."""
    means, s, nan = r["summary"]["mean_time_to_target_s"], r["summary"], float("nan")
    n, rows = len(r["seeds"]), []
    best = s.get("best_rlmesh")
    if "trl" in means:
        ours = means.get(best) if best else None
        rows.append((f"long generations (reasoning demo, {n} seeds): best rlmesh ({best}) vs TRL, time to target",
                     ours or nan, means["trl"] or nan, s.get("trl_over_rlmesh", nan), ">= 3", "s"))
    if "k0" in means:
        fast = means.get(s.get("best_async")) if s.get("best_async") else None
        rows.append((f"long generations ({n} seeds): best async ({s.get('best_async')}) vs sync k=0, time to target",
                     fast or nan, means["k0"] or nan, s.get("sync_over_async", nan), ">= 2", "s"))
    return rows


def _rows_reward(r: dict) -> list[tuple]:
    return [(f"reward server: {name}", v["measured"], v["baseline"], v["ratio"], v.get("target", ""), "items/s")
            for name, v in r.items() if isinstance(v, dict) and "ratio" in v]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--skip", default="", help="comma-separated benchmarks to leave out")
    p.add_argument("--only", default="", help="comma-separated benchmarks to run (default: all)")
    args = p.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    skip, only = set(filter(None, args.skip.split(","))), set(filter(None, args.only.split(",")))
    rows, failures = [], []
    for name, (extra, reader) in BENCHES.items():
        script = REPO / "bench" / f"{name}.py"
        if name in skip or (only and name not in only) or not script.is_file():
            continue
        out = OUT / f"{name}.json"
        print(f"== {name}", flush=True)
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, str(script), "--json", str(out), *extra], cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
        if proc.returncode != 0:
            failures.append(name)
            continue
        result = json.loads(out.read_text())
        reader = reader or {"async_vs_sync": _rows_async, "reward_throughput": _rows_reward,
                             "trl_vs_rlmesh": _rows_trl, "long_generation": _rows_long}[name]
        rows += [(*row, name, time.monotonic() - t0) for row in reader(result)]
    table = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
             f"{platform.python_implementation()} {platform.python_version()}",
             "rows": [dict(zip(("what", "measured", "baseline", "ratio", "target", "unit", "bench"), r)) for r in rows],
             "failed": failures}
    (OUT / "table.json").write_text(json.dumps(table, indent=2))
    print(f"\n{'comparison':72s} {'measured':>10s} {'baseline':>10s} {'ratio':>7s}  target")
    for r in table["rows"]:
        print(f"{r['what']:72s} {r['measured']:10.3g} {r['baseline']:10.3g} {r['ratio']:7.2f}  {r['target']}")
    if failures:
        print(f"failed: {', '.join(failures)}")
    _plot(table, OUT / "table.png")
    print(f"table: {OUT / 'table.json'}, chart: {OUT / 'table.png'}")


def _plot(table: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = table["rows"]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.2))
    ax.barh([r["what"] for r in rows], [r["ratio"] for r in rows], color="#4477aa")
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("ratio (measured / baseline, as each row defines it)")
    ax.set_title(f"rlmesh benchmarks, {table['date']}, {table['machine']}")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
