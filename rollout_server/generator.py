"""vLLM AsyncLLM wrapper: samples `n` completions for a prompt group with token ids, sampled-token
logprobs and the policy versions each sample spans, and applies in-place weight updates."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import gc
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rlmesh.services.domain.chat import PromptCodec, as_dicts, make_codec
from rlmesh.v1 import common_pb2
from rlmesh.services.affinity import pin_to_cores

if TYPE_CHECKING:
    from rlmesh.rollout_server.lora import ServedAdapter
    from rlmesh.services.config import PromptSection, RolloutSection

log = logging.getLogger(__name__)


@dataclass
class Generation:
    """What one vLLM request sampled."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str
    min_version: int
    max_version: int


RPC_DIR_PREFIX = "rlmesh-vllm-"


def remove_orphaned_rpc_dirs(tmp: Path) -> list[Path]:
    """A server killed outright (SIGKILL, OOM) cannot remove its socket directory: the next server
    to start removes each one of this user's whose server (the pid written in it) is gone. A
    directory whose pid is alive, or that has none, is left alone. Returns what was removed."""
    removed = []
    for d in tmp.glob(RPC_DIR_PREFIX + "*"):
        try:
            if d.is_symlink() or d.stat().st_uid != os.getuid():
                continue
            pid = int((d / "pid").read_text())
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
        except (OSError, ValueError):  # no pid file, unreadable, or a live process of another user
            continue
    return removed


def configure_vllm_env(cfg: RolloutSection) -> str | None:
    """vLLM-CPU reads these at engine start-up. Returns the socket directory made for vLLM, if one was."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.kv_cache_gib))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cfg.cpu_cores)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # vLLM leaves its ZeroMQ sockets in the base path it is given (/tmp by default, a few per engine
    # start): give it a directory of this server's own, removed when the server exits
    # (`VLLMGenerator.shutdown` removes it; atexit too, for an exit that never shut the engine down).
    rpc = None
    if "VLLM_RPC_BASE_PATH" not in os.environ:
        remove_orphaned_rpc_dirs(Path(tempfile.gettempdir()))
        rpc = os.environ["VLLM_RPC_BASE_PATH"] = tempfile.mkdtemp(prefix=RPC_DIR_PREFIX)
        (Path(rpc) / "pid").write_text(str(os.getpid()))
        atexit.register(shutil.rmtree, rpc, ignore_errors=True)
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
    return rpc


def rejects(err: BaseException) -> bool:
    """Whether `err` is the request's own fault, so the same prompt group would fail again: a
    message the template cannot render (ValueError), a prompt vLLM refuses (a VLLMClientError: too
    long for the context, bad sampling settings). Such a group is dead-lettered, not retried."""
    if isinstance(err, ValueError):
        return True
    from vllm.exceptions import VLLMClientError

    return isinstance(err, VLLMClientError)


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


class VLLMGenerator:
    def __init__(self, model_path: str, cfg: RolloutSection, seed: int, weight_backend: str,
                 adapter: ServedAdapter | None = None, *, placeholder: bool = False,
                 prompt: PromptSection | None = None) -> None:
        self.model_path, self.cfg, self.seed, self.weight_backend = model_path, cfg, seed, weight_backend
        self.prompt = prompt  # the run's prompt format (unset: the chat template where there is one)
        self._codec: PromptCodec | None = None
        # learner.lora: the base model plus the learner's adapter, a new one per version (rollout_server.lora).
        self.adapter = adapter
        # Placeholder weights (`rlmesh up` loads the model from before the SFT warm start while SFT
        # runs) are no version of the learner's: version -1 until its first update, and nothing is served.
        self.placeholder = placeholder
        self.version = -1 if placeholder else 0
        self.group_epoch = -1
        self.paused = False
        self.update_active = False
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
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        log.info("prompt format: %s", self.codec.format)  # a template the model lacks fails here, before vLLM loads
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

    @property
    def codec(self) -> PromptCodec:
        """How this server renders prompts and environment turns (the run's `prompt` section)."""
        if self._codec is None:
            self._codec = make_codec(self.tokenizer, self.prompt)
        return self._codec

    def prompt_token_ids(self, group: common_pb2.PromptGroup) -> list[int]:
        if group.messages and group.prompt_tokens.token_ids:
            raise ValueError(f"group {group.group_id}: set either messages or prompt_tokens, not both")
        if group.prompt_tokens.token_ids:
            return list(group.prompt_tokens.token_ids)
        if not group.messages:
            raise ValueError(f"group {group.group_id}: has neither messages nor prompt_tokens")
        return self.codec.prompt(as_dicts(group.messages), None)

    def sampling_params(self, group: common_pb2.PromptGroup, index: int, *, max_tokens: int | None = None,
                        turn: int = 0):
        """Sampling for sample `index` of `group` (turn `turn` of an episode, capped at `max_tokens`)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        o = group.sampling
        # A seeded group stays reproducible turn by turn, with a different stream per turn.
        seed = o.seed + index + 1_000_003 * turn if o.HasField("seed") else None
        cap = o.max_tokens if o.HasField("max_tokens") else self.cfg.max_tokens
        return SamplingParams(
            n=1,
            temperature=o.temperature if o.HasField("temperature") else self.cfg.temperature,
            top_p=o.top_p if o.HasField("top_p") else self.cfg.top_p,
            top_k=o.top_k if o.HasField("top_k") else 0,
            max_tokens=cap if max_tokens is None else min(cap, max_tokens),
            stop=list(o.stop) or (list(self.prompt.stop) if self.prompt else None) or None,
            seed=seed,
            logprobs=0,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    async def generate_ids(self, prompt_ids: list[int], params, request_id: str,
                           on_text: Callable[[str], Awaitable[None]] | None = None,
                           prefilled: asyncio.Event | None = None) -> Generation:
        """One generation from token ids (token-in/token-out): the sampled ids exactly as vLLM
        returned them, their logprobs, and the policy versions they were sampled under. `on_text`,
        if given, gets the text as it is generated, piece by piece; `prefilled`, if given, is set
        when the first token is out (the prompt's KV is computed)."""
        from vllm.sampling_params import RequestOutputKind

        min_version = self.version
        # With an adapter, the whole sample comes from the adapter it starts with (updates do not
        # swap a running request's adapter): it spans exactly one version.
        lora_request = self.adapter.request if self.adapter else None
        if on_text is not None or prefilled is not None:
            params.output_kind = RequestOutputKind.CUMULATIVE
        final, sent = None, 0
        self.busy.enter()
        try:
            async for out in self.engine.generate({"prompt_token_ids": prompt_ids}, params, request_id,
                                                  lora_request=lora_request):
                final = out
                if prefilled is not None:
                    prefilled.set()
                text = out.outputs[0].text
                if on_text is not None and len(text) > sent:
                    await on_text(text[sent:])
                    sent = len(text)
        finally:
            self.busy.exit()
        completion = final.outputs[0]
        token_ids = list(completion.token_ids)
        logprobs = [step[tok].logprob for tok, step in zip(token_ids, completion.logprobs or [])]
        self.num_generated_tokens += len(token_ids)
        return Generation(token_ids, logprobs, completion.finish_reason or "", completion.text, min_version,
                          min_version if self.adapter else self.version)

    async def sample(self, group: common_pb2.PromptGroup, prompt_ids: list[int], index: int,
                     prefilled: asyncio.Event | None = None) -> common_pb2.Sample:
        request_id = f"{group.group_id}-{index}-{uuid.uuid4().hex[:8]}"
        gen = await self.generate_ids(prompt_ids, self.sampling_params(group, index), request_id,
                                      prefilled=prefilled)
        return common_pb2.Sample(
            index=index,
            completion=common_pb2.TokenSequence(token_ids=gen.token_ids, loss_mask=[True] * len(gen.token_ids)),
            logprobs=gen.logprobs,
            finish_reason=gen.finish_reason,
            min_version=gen.min_version,
            max_version=gen.max_version,
            text=gen.text,
            num_turns=1,
        )

    async def generate_group(self, group: common_pb2.PromptGroup) -> tuple[list[int], list[common_pb2.Sample]]:
        if group.n < 1:
            raise ValueError(f"group {group.group_id}: n={group.n} must be >= 1")
        prompt_ids = self.prompt_token_ids(group)
        if not self.shares_prefill(group.n, len(prompt_ids)):
            samples = await asyncio.gather(*(self.sample(group, prompt_ids, i) for i in range(group.n)))
            return prompt_ids, list(samples)
        # Samples started together are prefilled together, each computing the whole prompt (vLLM
        # caches a block once it is computed): start the first, and the rest once its first token
        # is out, so they find the prompt's full blocks cached and compute only the last partial
        # one. On a CPU, where a prompt token costs about what a sampled one does, this removes most
        # of a group's prompt work (8 samples of a 62-token prompt: 496 prompt tokens to 272).
        prefilled = asyncio.Event()
        lead = asyncio.ensure_future(self.sample(group, prompt_ids, 0, prefilled))
        waiter = asyncio.ensure_future(prefilled.wait())
        try:
            await asyncio.wait((lead, waiter), return_when=asyncio.FIRST_COMPLETED)
            if lead.done():  # it ended (or failed) before its first token came out
                lead.result()
            samples = await asyncio.gather(lead, *(self.sample(group, prompt_ids, i) for i in range(1, group.n)))
        finally:
            waiter.cancel()
            lead.cancel()
        return prompt_ids, list(samples)

    def shares_prefill(self, n: int, prompt_len: int) -> bool:
        """Whether a group's samples after the first wait for its prefill: only where the cache can
        hand them at least one full block of the prompt (the engine's block: rollout.block_size, or
        vLLM's default, 128 tokens on CPU)."""
        return (self.cfg.enable_prefix_caching and n > 1
                and prompt_len >= self.engine.vllm_config.cache_config.block_size)

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

    async def start_weight_update(self) -> None:
        await self._stop_warm_up()
        await self.engine.start_weight_update()
        self.update_active = True

    async def update_weights(self, update_info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self.engine.update_weights(WeightTransferUpdateRequest(update_info=update_info))

    async def received_digests(self) -> list[str]:
        """Digest of the bytes each worker received in the last update, in the algorithm the update
        named ("" where the engine does not digest)."""
        return list(await self.engine.collective_rpc("rlmesh_received_digest"))

    async def finish_weight_update(self, version: int) -> None:
        await self.engine.finish_weight_update(weight_version=str(version))
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
