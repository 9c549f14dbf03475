"""Start-up: wall time from launching `rlmesh up` on the demo config to its first trained step, less
the SFT warm start's own time, with a breakdown of when each part was ready.

It can time two source trees side by side (`--before DIR`, e.g. a `git worktree add` of an older
commit sharing this checkout's .venv by path, and `--after DIR`, default this checkout), in
interleaved rounds so both see the same load, and prints the after ÷ before ratio. Each tree runs
with its own code: a shim directory of symlinks on PYTHONPATH maps the `rlmesh.*` packages to it
(the editable install maps them to the checkout it was installed from).

Caches: `--cache cold` gives every run fresh, empty vLLM / inductor / triton / rlmesh cache
directories; `--cache warm` gives each tree one cache directory, fills it with a run that is not
counted, and times the runs after it. The OS page cache is not dropped (a shared machine).

The SFT time is the SFT process's lifetime (seen by polling the process tree every 50 ms); the first
step and the v0 evaluation come from metrics.jsonl (millisecond stamps), the rest from the services'
logs (second stamps).
Run: python bench/startup.py --before /tmp/startup-before --rounds 2 --cache cold [--json out.json]"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Where each `rlmesh.<name>` package lives in a checkout (pyproject's package-dir). Since the package
# root moved to entrypoints/ its modules sit at the root; older trees kept the root in proto/rlmesh/.
PACKAGES = {"learner": "learner", "reward_server": "reward_server", "rollout_server": "rollout_server",
            "services": "services"}
# (event, log file, pattern): the first line of the log matching the pattern.
LOG_EVENTS = [
    ("valkey ready", "up.out", r"embedded valkey serving"),
    ("reward serving", "logs/reward.log", r"reward server on port"),
    ("rollout vLLM engine up", "logs/rollout-0.log", r"vLLM engine ready"),
    ("rollout registered", "logs/rollout-0.log", r"registered (with learner )?as rollout-0"),
    ("learner serving", "logs/learner.log", r"learner control plane on port"),
    ("v0 weights in rollout", "logs/rollout-0.log", r"serving prompts|readiness: SERVING"),
]
SERVICE = re.compile(r"rlmesh(?:\.entrypoints)?\.cli (sft|tiny-model|reward|learner|rollout)\b")


def shim(tree: Path, where: Path) -> Path:
    """A directory whose `rlmesh` package is `tree`'s code (symlinks), to put first on PYTHONPATH."""
    pkg = where / "rlmesh"
    pkg.mkdir(parents=True)
    old_layout = (tree / "proto" / "rlmesh" / "__init__.py").exists()
    root = tree / "proto" / "rlmesh" if old_layout else tree / "entrypoints"
    for entry in root.iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    folders = {**PACKAGES, "entrypoints": "entrypoints"} if old_layout else {**PACKAGES, "v1": "proto/rlmesh/v1"}
    for name, folder in folders.items():
        (pkg / name).symlink_to(tree / folder)
    return where


def _log_time(line: str, day: str) -> float | None:
    m = re.search(r"\b(\d\d:\d\d:\d\d)\b", line)
    return datetime.strptime(f"{day} {m.group(1)}", "%Y-%m-%d %H:%M:%S").timestamp() if m else None


def run_once(tree: Path, work: Path, name: str, cache: Path, num_steps: int, config: str) -> dict:
    import psutil

    run_dir = work / name
    env = {**os.environ, "PYTHONPATH": f"{shim(tree, work / f'{name}-shim')}{os.pathsep}{tree}",
           "VLLM_CACHE_ROOT": str(cache / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
           "TRITON_CACHE_DIR": str(cache / "triton"), "RLMESH_CACHE_DIR": str(cache / "rlmesh")}
    cmd = [sys.executable, "-m", "rlmesh.cli", "up", "-c", str(tree / config), "--run-dir", str(run_dir),
           "logging.progress=false", f"learner.num_steps={num_steps}", "learner.eval_every=0"]
    day = time.strftime("%Y-%m-%d")
    load = os.getloadavg()[0]
    t0 = time.time()
    out = (work / f"{name}.out").open("wb")
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT)
    seen: dict[int, tuple[str, float]] = {}
    ended: dict[int, float] = {}
    while proc.poll() is None:
        try:
            children = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        alive = set()
        for child in children:
            try:
                if child.pid not in seen and (m := SERVICE.search(" ".join(child.cmdline()))):
                    seen[child.pid] = (m.group(1), child.create_time())
            except psutil.NoSuchProcess:
                continue
            alive.add(child.pid)
        now = time.time()
        for pid in seen:
            if pid not in alive:
                ended.setdefault(pid, now)
        time.sleep(0.05)
    out.close()
    shutil.copy(work / f"{name}.out", run_dir / "up.out")
    if proc.returncode != 0:
        raise SystemExit(f"rlmesh up in {tree} failed (exit {proc.returncode}); see {work / name}.out")
    starts = {}
    for pid, (svc, created) in sorted(seen.items(), key=lambda kv: kv[1][1]):
        starts.setdefault(svc, (created, ended.get(pid)))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first_step = next(r["time"] for r in rows if r["kind"] == "train")
    first_eval = next((r["time"] for r in rows if r["kind"] == "eval"), None)
    sft = starts.get("sft")
    sft_s = (sft[1] - sft[0]) if sft and sft[1] else 0.0
    events = {"launch": 0.0}
    if sft:
        events["SFT start"], events["SFT end"] = sft[0] - t0, sft[1] - t0
    for svc in ("reward", "rollout", "learner"):
        if svc in starts:
            events[f"{svc} process start"] = starts[svc][0] - t0
    for event, file, pattern in LOG_EVENTS:
        path = run_dir / file
        if path.is_file():
            line = next((ln for ln in path.read_text(errors="replace").splitlines() if re.search(pattern, ln)), None)
            stamp = _log_time(line, day) if line else None
            if stamp is not None:
                events[event] = stamp - t0
    if first_eval is not None:
        events["v0 evaluation done"] = first_eval - t0
    events["first trained step"] = first_step - t0
    total = first_step - t0
    return {"tree": str(tree), "name": name, "load_1min": load, "launch_to_first_step_s": total, "sft_s": sft_s,
            "startup_s": total - sft_s, "events_s": dict(sorted(events.items(), key=lambda kv: kv[1]))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--after", default=str(REPO), help="checkout to time (default: this one)")
    p.add_argument("--before", default=None, help="checkout to compare with (e.g. a git worktree of the old commit)")
    p.add_argument("--rounds", type=int, default=1, help="timed runs per tree, interleaved")
    p.add_argument("--cache", choices=["cold", "warm"], default="cold",
                   help="cold: fresh cache directories every run; warm: one per tree, filled by an untimed run first")
    p.add_argument("--num-steps", type=int, default=2, help="learner.num_steps of each run")
    p.add_argument("--config", default="examples/arithmetic_grpo.yaml", help="run config, relative to each tree")
    p.add_argument("--work", default=None, help="directory for the runs (default: a temporary one, kept)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    trees = {"after": Path(args.after).resolve()}
    if args.before:
        trees = {"before": Path(args.before).resolve(), **trees}
    work = Path(args.work or tempfile.mkdtemp(prefix="rlmesh-startup-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"runs in {work}; load average {os.getloadavg()}", flush=True)
    if args.cache == "warm":
        for side, tree in trees.items():
            print(f"== {side}: filling its cache (not timed)", flush=True)
            run_once(tree, work, f"{side}-fill", work / f"cache-{side}", args.num_steps, args.config)
    results: dict[str, list[dict]] = {side: [] for side in trees}
    for i in range(args.rounds):
        for side, tree in trees.items():
            cache = work / f"cache-{side}" if args.cache == "warm" else work / f"cache-{side}-{i}"
            r = run_once(tree, work, f"{side}-{i}", cache, args.num_steps, args.config)
            results[side].append(r)
            print(f"== {side} round {i}: launch -> first step {r['launch_to_first_step_s']:.1f} s, SFT "
                  f"{r['sft_s']:.1f} s, start-up (SFT excluded) {r['startup_s']:.1f} s, load {r['load_1min']:.1f}")
            for event, t in r["events_s"].items():
                print(f"     {t:7.1f} s  {event}")
    summary = {"date": time.strftime("%Y-%m-%d %H:%M"), "cache": args.cache, "rounds": args.rounds, "runs": results}
    for side, rs in results.items():
        summary[side] = {k: sum(r[k] for r in rs) / len(rs) for k in ("startup_s", "sft_s", "launch_to_first_step_s")}
    if "before" in results:
        summary["ratio"] = summary["after"]["startup_s"] / summary["before"]["startup_s"]
        summary["ratio_launch_to_first_step"] = (summary["after"]["launch_to_first_step_s"]
                                                 / summary["before"]["launch_to_first_step_s"])
    print(f"\n{'':8s} {'start-up (SFT excl.)':>22s} {'SFT':>8s} {'launch->step':>14s}")
    for side in results:
        s = summary[side]
        print(f"{side:8s} {s['startup_s']:20.1f} s {s['sft_s']:6.1f} s {s['launch_to_first_step_s']:12.1f} s")
    if "ratio" in summary:
        print(f"after / before: start-up {summary['ratio']:.2f} (target <= 0.5), launch -> first step "
              f"{summary['ratio_launch_to_first_step']:.2f}")
    print(f"load average now {os.getloadavg()}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
