"""`make bench`: every benchmark under bench/, one table. Each benchmark runs both sides of its
comparison in one invocation; this collects their JSON results, prints one table (measured,
baseline, ratio, target), and writes it to bench/results/table.json and bench/results/table.png.
`--real-model` runs the performance issue's rows 1-5 on the real-model demo instead (about two hours
on 2 cores; `make bench BENCH_ARGS=--real-model`).
Run: python bench/run_all.py [--skip async_vs_sync] [--only NAMES] [--real-model [--seeds 0,1,2]]"""

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
        row = (what + "; rlmesh missed the target", nan, trl["time_to_target_s"] or nan, nan, goal, "s")
    elif trl["time_to_target_s"] is None:
        bound = trl["final_step_time_s"]
        row = (what + "; TRL missed it within its cap (ratio is a lower bound)", ours["time_to_target_s"], bound,
               bound / ours["time_to_target_s"], goal, "s")
    else:
        row = (what, ours["time_to_target_s"], trl["time_to_target_s"], r["ratio"], goal, "s")
    return [row, *_row_first_step(r)]


def _row_first_step(r: dict) -> list[tuple]:
    """Launch to the first trained step, rlmesh's over TRL's (building its trainer and its first step)."""
    ours, trl = r["rlmesh"].get("first_step"), r["trl"].get("first_step")
    if not ours or not trl:
        return []
    return [("launch -> first trained step: rlmesh vs TRL (trainer built + first step)", ours["total_s"],
             trl["total_s"], ours["total_s"] / trl["total_s"], "<= 0.5", "s")]


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


DEMO, MODEL = "examples/smollm2_grpo.yaml", "models/smollm2-135m-instruct"


def real_model_benches(dtype: str, seeds: list[int]) -> dict[str, tuple[str, list[str], object]]:
    """The performance issue's rows 1-5 on the real-model demo (its config, model, batch and the dtype
    `rlmesh up` chooses on this machine): label -> (script, args, reader)."""
    benches = {
        "learner_throughput": ("learner_throughput", ["--model", MODEL, "--dtype", dtype, "--groups", "8", "--n", "8",
                                                      "--prompt-len", "64", "--completion-len", "128",
                                                      "--micro-batch-size", "8", "--steps", "4"], lambda r: [
            (f"row 2: learner step vs plain PyTorch loop (SmolLM2-135M, {dtype}, 8 x 8, 1 thread each)",
             r["learner_1rank"]["tokens_per_s"], r["plain"]["tokens_per_s"], r["ratio_vs_plain"], ">= 0.95", "train tok/s"),
            (f"row 2: learner MFU ({r['learner_1rank']['flops_per_s'] / 1e9:.0f} of "
             f"{r['peak_flops_1thread'] / 1e9:.0f} GFLOP/s, one-thread {dtype} matmul peak); plain loop as baseline",
             r["learner_1rank"]["mfu"], r["plain"]["mfu"], r["learner_1rank"]["mfu"], "—", "fraction")]),
        "rollout_throughput": ("rollout_throughput", ["--model", MODEL, "--dtype", dtype, "--groups", "16", "--n", "8",
                                                      "--max-tokens", "192"], lambda r: [
            (f"row 3: rollout server vs raw vLLM, the server's executor (SmolLM2-135M, {dtype}, 16 x 8, the demo's sampling)",
             r["mesh_tokens_per_s"], r["raw_tokens_per_s"], r["ratio"], ">= 0.95", "gen tok/s"),
            ("row 3 (reference): raw vLLM, its default executor vs the server's", r["raw_default_executor_tokens_per_s"],
             r["raw_tokens_per_s"], r["raw_default_executor_tokens_per_s"] / r["raw_tokens_per_s"], "—", "gen tok/s")]),
        "weight_update": ("weight_update", ["--sizes", MODEL, "--dtype", dtype, "--lora", "", "--rounds", "5",
                                            "--digests", "blake3", "--snapshot", "on"], lambda r: [
            row for v in r.values() for row in (
                (f"row 4: weight update ({v['mib']:.0f} MiB {dtype}) vs raw gloo broadcast + vLLM's own reload",
                 v["update_s"], v["raw_s"] + v["engine_reload_s"], v["engine_ratio"], "<= 1.15", "s"),
                ("row 4, paired: each round's update vs that round's raw broadcast + reload (median)",
                 v["update_s"], v["raw_s"] + v["engine_reload_s"], v["paired_engine_ratio"], "<= 1.15", "s"),
                (f"row 4: what the training step waits for (the snapshot) vs raw broadcast",
                 v["send_s"], v["raw_s"], v["send_ratio"], "<= 1.3", "s"))]),
    }
    for seed in seeds:
        benches[f"trl_vs_rlmesh_seed{seed}"] = ("trl_vs_rlmesh", [
            "--config", DEMO, "--seed", str(seed), "--target", "0.30", "--goal", "3", "--trl-max-s", "600"],
            lambda r, seed=seed: [(f"row 1, seed {seed}: " + row[0], *row[1:]) for row in _rows_trl(r)])
    benches["placement"] = ("placement", ["--runs", "split:0,split:1,split:2,shared:0", "--seed", "0", "--steps", "6"],
                            _rows_placement)
    return benches


def _rows_placement(r: dict) -> list[tuple]:
    """Each run's measured step against the step its placement allows (its bound)."""
    return [(f"row 5: {x['placement']} k={x['k']}: step vs its bound ({x['ms_per_trained_token']:.0f} "
             f"ms/trained token, acc {x['first_accuracy']:.2f} -> {x['final_accuracy']:.2f})",
             x["span_step_s"], x["bound_step_s"] or float("nan"), x["span_step_s"] / x["bound_step_s"]
             if x["bound_step_s"] else float("nan"), "~1", "s") for x in r["runs"]]


def _row1_mean(rows: list[tuple]) -> list[tuple]:
    """The means over seeds of row 1's TRL / rlmesh (the issue's goal is on the mean) and of its
    launch -> first trained step ratio."""
    out = []
    for key, what, goal in (("time to", "TRL / rlmesh, time to the target", ">= 3"),
                            ("launch -> first", "rlmesh / TRL, launch -> first trained step", "<= 0.5")):
        ratios = [r[3] for r in rows if r[0].startswith("row 1, seed") and key in r[0]]
        if len(ratios) >= 2:
            out.append((f"row 1: mean of {what}, over {len(ratios)} seeds", float("nan"), float("nan"),
                        sum(ratios) / len(ratios), goal, "", "trl_vs_rlmesh", 0.0))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--skip", default="", help="comma-separated benchmarks to leave out")
    p.add_argument("--only", default="", help="comma-separated benchmarks to run (default: all)")
    p.add_argument("--real-model", action="store_true",
                   help=f"the performance issue's rows 1-5 on the real-model demo ({DEMO}, {MODEL}, the dtype "
                        "`rlmesh up` chooses here; about two hours on 2 cores) instead of the default set")
    p.add_argument("--seeds", default="0,1,2", help="--real-model: row 1's seeds")
    args = p.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    skip, only = set(filter(None, args.skip.split(","))), set(filter(None, args.only.split(",")))
    rows, failures = [], []
    if args.real_model:
        sys.path.insert(0, str(REPO))
        from rlmesh.services.precision import resolve_param_dtype

        benches = real_model_benches(resolve_param_dtype("auto"), [int(x) for x in args.seeds.split(",")])
    else:
        benches = {name: (name, extra, reader) for name, (extra, reader) in BENCHES.items()}
    for name, (script_name, extra, reader) in benches.items():
        script = REPO / "bench" / f"{script_name}.py"
        if name in skip or (only and name not in only) or not script.is_file():
            continue
        out = OUT / f"{name}.json"
        print(f"== {name} ({time.strftime('%H:%M:%S', time.gmtime())} UTC, load {os.getloadavg()[0]:.1f})", flush=True)
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, str(script), "--json", str(out), *extra], cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
        if proc.returncode != 0:
            failures.append(name)
            continue
        reader = reader or {"async_vs_sync": _rows_async, "reward_throughput": _rows_reward,
                             "trl_vs_rlmesh": _rows_trl, "long_generation": _rows_long}[name]
        try:
            rows += [(*row, name, time.monotonic() - t0) for row in reader(json.loads(out.read_text()))]
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:  # the JSON stays in bench/results/
            print(f"{name}: its result {out} could not be read into the table ({type(e).__name__}: {e})")
            failures.append(name)
        print(f"== {name} took {time.monotonic() - t0:.0f} s (load {os.getloadavg()[0]:.1f})", flush=True)
    rows += _row1_mean(rows) if args.real_model else []
    table = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
             f"{platform.python_implementation()} {platform.python_version()}", "cpu": _cpu_model(),
             "commit": _commit(), "suite": "real-model" if args.real_model else "default",
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


def _cpu_model() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


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
