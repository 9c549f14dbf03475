"""vLLM's own layerwise reload of a model's weights from memory, nothing else running: what the
engine costs per update whatever the transport (on a CPU: each layer materialized, loaded, and its
GEMM weights repacked for oneDNN). The baseline `bench/weight_update.py` adds to the raw broadcast.

`EngineReload` keeps one engine resident and reloads on each `round()`, so the weight-update
benchmark can time the reload in the same rounds as the raw broadcast and the update (the three
then meet the same state of the machine); `engine_reload` runs a fixed number of rounds back to back."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCRIPT = """
import glob, json, os, sys, time
model_dir, dtype, placement = sys.argv[1], sys.argv[2], sys.argv[3]
if placement == "alone":  # the worker in this process, unbound: every core of the machine
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
else:  # vLLM's engine as a rollout server runs it (rollout.cpu_cores: VLLM_CPU_OMP_THREADS_BIND; its executor)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = placement
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # the functions below run in the worker
from vllm import LLM
from rlmesh.rollout_server.vllm_engine import executor_args


def prepare(worker, model_dir, dtype):
    import torch
    from safetensors.torch import load_file
    worker.bench_named = [(k, v.to(getattr(torch, dtype)).mul(1.001))
                          for f in sorted(glob.glob(model_dir + "/*.safetensors")) for k, v in load_file(f).items()]
    return {"threads": torch.get_num_threads(), "cores": sorted(os.sched_getaffinity(0))}


def reload_once(worker):
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    runner = worker.model_runner
    t0 = time.perf_counter()
    initialize_layerwise_reload(runner.model)
    runner.model.load_weights(iter(worker.bench_named))
    finalize_layerwise_reload(runner.model, runner.model_config)
    return time.perf_counter() - t0


llm = LLM(model=model_dir, max_model_len=128, enforce_eager=True, dtype=dtype,
          **({} if placement == "alone" else executor_args()))
if placement == "alone":
    worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    call = lambda fn, *args: fn(worker, *args)
else:
    call = lambda fn, *args: llm.collective_rpc(fn, args=args)[0]
info = call(prepare, model_dir, dtype)
call(reload_once)  # warms up
print("READY " + json.dumps(info), flush=True)
for _ in sys.stdin:  # one reload per line
    print("RELOAD " + json.dumps(call(reload_once)), flush=True)
"""


class EngineReload:
    """A vLLM engine of `model_dir`, resident in a process of its own, that reloads the model's
    weights (the same bytes each time, from memory) once per `round()`. `placement`: the cores as
    the rollout server gives them to vLLM (its rollout.cpu_cores, e.g. "auto"), with the server's
    executor, timed where the model runs (on a CPU, vLLM's engine-core process); or "alone": the
    model in that process, unbound, on every core. `info`: {"threads", "cores"} where it runs."""

    def __init__(self, model_dir: Path, dtype: str, placement: str, timeout_s: float = 600.0) -> None:
        self.placement, self.timeout_s = placement, timeout_s
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(model_dir), dtype, placement], cwd=REPO,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     env={**os.environ, "PYTHONPATH": str(REPO)})
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self.info = json.loads(self._expect("READY "))
        except BaseException:
            self.close()
            raise

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _expect(self, prefix: str) -> str:
        while True:
            try:
                line = self._lines.get(timeout=self.timeout_s)
            except queue.Empty:
                line = None
            if line is None:
                self._log.seek(0)
                tail = self._log.read()[-2000:].decode(errors="replace")
                raise RuntimeError(f"the engine-reload baseline ({self.placement}) stopped or hung "
                                   f"(exit {self.proc.poll()}): {tail}")
            if line.startswith(prefix):
                return line.removeprefix(prefix)

    def round(self) -> float:
        """One reload of the whole model: seconds, timed inside the worker."""
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return float(self._expect("RELOAD "))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # the loop ends, then the process
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> EngineReload:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def engine_reload(model_dir: Path, rounds: int, dtype: str, placement: str) -> dict:
    """`rounds` reloads back to back after one to warm up: {"times", "threads", "cores"}."""
    with EngineReload(model_dir, dtype, placement) as engine:
        return {"times": [engine.round() for _ in range(rounds)], **engine.info}
