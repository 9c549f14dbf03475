"""What observing the mesh costs: the demo (examples/arithmetic_grpo.yaml through `rlmesh up`) with
everything observable on against everything off, same seed and steps, side by side.

On: `logging.trackers=[jsonl,tensorboard,wandb,mlflow]` (W&B offline, MLflow to a file store),
`logging.metrics_port=0` with every service's /metrics scraped every 5 s (as a Prometheus would),
`logging.format=json`, `logging.trace_file=true`, and OTLP/HTTP trace export
(`OTEL_EXPORTER_OTLP_ENDPOINT`) to a receiver this script runs, which decodes every span it is sent.
Off: metrics.jsonl only (always written), no metrics port, text logs, no traces. `--sides off,on,on-noprom`
adds an ablation: everything on but the Prometheus endpoints (no `logging.metrics_port`, so no vLLM engine
stats and no scraping either); `on-sampled` is everything on with one prompt group in ten traced
(`logging.trace_sample_ratio=0.1`).

Measured: the RL loop time, first to last training step from metrics.jsonl (start-up and the SFT warm
start excluded). Both sides start from one shared SFT warm start (made once, by `rlmesh sft`, with the
demo's settings), so the runs spend no time on SFT; the seed changes the RL run. Off and on alternate
per seed (off first on even seeds) so both see the same load; the load average is printed with each run.
Run: python bench/observability_overhead.py [--seeds 0,1,2 --steps 100] [--json out.json]"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
CONFIG = REPO / "examples/arithmetic_grpo.yaml"
ON = ["logging.trackers=[jsonl,tensorboard,wandb,mlflow]", "logging.metrics_port=0", "logging.format=json",
      "logging.trace_file=true"]
OFF = ["logging.trackers=[jsonl]", "logging.format=text", "logging.trace_file=false"]
SIDES = {"off": OFF, "on": ON, "on-noprom": [o for o in ON if not o.startswith("logging.metrics_port")],
         "on-sampled": [*ON, "logging.trace_sample_ratio=0.1"]}


class Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP trace endpoint (`POST /v1/traces`, protobuf) that decodes and counts the spans."""

    def __init__(self) -> None:
        self.num_spans = 0
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:  # noqa: N802
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        request = ExportTraceServiceRequest.FromString(self.rfile.read(int(self.headers["Content-Length"])))
        n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        with self.server.lock:
            self.server.num_spans += n
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args) -> None:
        pass


def scrape(run_dir: Path, stop: threading.Event, counts: dict[str, int]) -> None:
    """GET every service's /metrics every 5 s (ports from `<run_dir>/metrics_ports/`), as Prometheus would."""
    while not stop.wait(5.0):
        for path in (run_dir / "metrics_ports").glob("*.json"):
            try:
                port = json.loads(path.read_text())
                with urllib.request.urlopen(f"http://{port['host']}:{port['port']}/metrics", timeout=5) as r:
                    r.read()
                counts[path.stem] = counts.get(path.stem, 0) + 1
            except (OSError, ValueError, KeyError):
                pass  # a service starting, restarting or gone


def warm_start(out: Path) -> Path:
    """The demo's SFT warm start, made once, and the demo's config starting from it (no SFT in the runs)."""
    import yaml

    model = out / "sft_model"
    subprocess.run([sys.executable, "-m", "rlmesh.cli", "sft", "-c", str(CONFIG), "--output", str(model)],
                   check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    config = yaml.safe_load(CONFIG.read_text())
    config["model"], config["sft"]["num_steps"] = {"type": "hf", "path": str(model)}, 0
    (out / "demo_from_warm_start.yaml").write_text(yaml.safe_dump(config))
    return out / "demo_from_warm_start.yaml"


def run(side: str, seed: int, steps: int, config: Path, out: Path, receiver: Receiver) -> dict:
    from rlmesh.learner.trackers.metrics import read_metrics

    run_dir = out / f"{side}-seed{seed}"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for key in [k for k in env if k.startswith("OTEL_")]:
        del env[key]
    if side.startswith("on"):
        env.update(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{receiver.server_port}", WANDB_MODE="offline",
                   WANDB_SILENT="true")
    cmd = [sys.executable, "-m", "rlmesh.cli", "up", "-c", str(config), "--run-dir", str(run_dir),
           "logging.progress=false", f"run.seed={seed}", f"learner.num_steps={steps}", *SIDES[side]]
    spans0, load0 = receiver.num_spans, os.getloadavg()[0]
    stop, scrapes = threading.Event(), {}
    scraper = threading.Thread(target=scrape, args=(run_dir, stop, scrapes), daemon=True)
    if any(o.startswith("logging.metrics_port") for o in SIDES[side]):
        scraper.start()
    try:
        subprocess.run(cmd, check=True, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    finally:
        stop.set()
    rows = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    loop_s = train[-1]["time"] - (train[0]["time"] - train[0]["step_s"])
    return {"side": side, "seed": seed, "loop_s": loop_s, "num_steps": len(train),
            "final_accuracy": evals[-1]["accuracy"] if evals else None,
            "median_step_s": statistics.median(r["step_s"] for r in train),
            "spans_received": receiver.num_spans - spans0, "scrapes": scrapes,
            "trace_files": len(list((run_dir / "traces").glob("*.jsonl"))),
            "load_1min_start": load0, "load_1min_end": os.getloadavg()[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=100, help="RL steps per run (the demo's 100)")
    p.add_argument("--sides", default="off,on", help=f"which of {', '.join(SIDES)} to run, each seed")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    out = Path(tempfile.mkdtemp(prefix="rlmesh-obs-"))
    receiver = Receiver()
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    print(f"runs in {out}; load average (1, 5, 15 min) {os.getloadavg()} on {os.cpu_count()} cores", flush=True)
    config = warm_start(out)
    results = []
    sides = args.sides.split(",")
    for i, seed in enumerate(int(s) for s in args.seeds.split(",")):
        for side in sides if i % 2 == 0 else sides[::-1]:
            r = run(side, seed, args.steps, config, out, receiver)
            print(f"{side:>9} seed {seed}: RL loop {r['loop_s']:.1f} s ({r['num_steps']} steps, median step "
                  f"{r['median_step_s']:.2f} s), {r['spans_received']} spans received, scrapes {r['scrapes']}, "
                  f"load {r['load_1min_start']:.1f} -> {r['load_1min_end']:.1f}", flush=True)
            results.append(r)
    receiver.shutdown()
    by = {(r["side"], r["seed"]): r for r in results}
    seeds = sorted({r["seed"] for r in results})
    print(f"\n{'seed':>4} " + " ".join(f"{side + ' loop s':>16} {'load':>5}" for side in sides)
          + "".join(f" {side + '/off':>13}" for side in sides if side != "off"))
    for s in seeds:
        print(f"{s:>4} " + " ".join(f"{by[(side, s)]['loop_s']:16.1f} {by[(side, s)]['load_1min_start']:5.1f}"
                                    for side in sides)
              + "".join(f" {by[(side, s)]['loop_s'] / by[('off', s)]['loop_s']:13.3f}" for side in sides if side != "off"))
    means = {side: statistics.mean(by[(side, s)]["loop_s"] for s in seeds) for side in sides}
    print("mean RL loop time: " + ", ".join(f"{side} {m:.1f} s" for side, m in means.items())
          + "".join(f"; {side} / off {m / means['off']:.3f}" for side, m in means.items() if side != "off")
          + f" (target for on / off: <= 1.05) over {len(seeds)} seed(s); load average now {os.getloadavg()}")
    if args.json:
        on = means.get("on", means[sides[-1]])
        Path(args.json).write_text(json.dumps({"runs": results, "off_mean_s": means["off"], "on_mean_s": on,
                                               "ratio": on / means["off"], "means": means,
                                               "steps": args.steps}, indent=2))


if __name__ == "__main__":
    main()
