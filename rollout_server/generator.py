"""Sampling from the rollout server's vLLM engine: `n` completions for a prompt group with token ids,
sampled-token logprobs and the policy versions each sample spans (the engine's lifecycle and weight
updates: `vllm_engine.VLLMEngine`)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlmesh.rollout_server.vllm_engine import VLLMEngine
from rlmesh.services.domain.chat import PromptCodec, as_dicts, make_codec
from rlmesh.v1 import common_pb2

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


def rejects(err: BaseException) -> bool:
    """Whether `err` is the request's own fault, so the same prompt group would fail again: a
    message the template cannot render (ValueError), a prompt vLLM refuses (a VLLMClientError: too
    long for the context, bad sampling settings). Such a group is dead-lettered, not retried."""
    if isinstance(err, ValueError):
        return True
    from vllm.exceptions import VLLMClientError

    return isinstance(err, VLLMClientError)


class VLLMGenerator(VLLMEngine):
    """The engine, sampling: prompt groups rendered and sampled token-in/token-out."""

    def __init__(self, model_path: str, cfg: RolloutSection, seed: int, weight_backend: str,
                 adapter: ServedAdapter | None = None, *, placeholder: bool = False,
                 prompt: PromptSection | None = None) -> None:
        super().__init__(model_path, cfg, seed, weight_backend, adapter, placeholder=placeholder)
        self.prompt = prompt  # the run's prompt format (unset: the chat template where there is one)
        self._codec: PromptCodec | None = None
        self._claimed = itertools.count()
        self._entered = asyncio.Event()  # set once the last group to call generate_group has every sample in the engine
        self._entered.set()

    def claim_order(self) -> int:
        """A new vLLM priority, after every one given so far: the engine schedules waiting requests
        lowest first, so a group's samples (an episode's turns) all take the place of its claim, and
        the groups claimed first finish first where rollout.max_num_seqs bounds what runs at once."""
        return next(self._claimed)

    async def start(self) -> None:
        """The tokenizer and the prompt format first: a template the model lacks fails here, before vLLM loads."""
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        log.info("prompt format: %s", self.codec.format)
        await super().start()

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
                           prefilled: asyncio.Event | None = None, priority: int | None = None) -> Generation:
        """One generation from token ids (token-in/token-out): the sampled ids exactly as vLLM
        returned them, their logprobs, and the policy versions they were sampled under. `on_text`,
        if given, gets the text as it is generated, piece by piece; `prefilled`, if given, is set
        when the first token is out (the prompt's KV is computed); `priority`: its group's
        `claim_order` (unset: a new one, behind everything asked for so far)."""
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
                                                  lora_request=lora_request,
                                                  priority=self.claim_order() if priority is None else priority):
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
                     prefilled: asyncio.Event | None = None, priority: int | None = None) -> common_pb2.Sample:
        request_id = f"{group.group_id}-{index}-{uuid.uuid4().hex[:8]}"
        gen = await self.generate_ids(prompt_ids, self.sampling_params(group, index), request_id,
                                      prefilled=prefilled, priority=priority)
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
        priority = self.claim_order()
        # Groups enter the engine in claim order: this one once every sample of the one claimed before
        # it is in. A group that shares its prefill sends its other samples after the first one's
        # first token, and vLLM hands a free place to whatever waits then, lowest priority first; a
        # later group's samples sent meanwhile (the demo's 56 evaluation prompts behind the first
        # step's 8 groups) would take the places, and the earlier group would wait behind them.
        before, entered = self._entered, asyncio.Event()
        self._entered = entered
        try:
            await before.wait()
            if not self.shares_prefill(group.n, len(prompt_ids)):
                tasks = [asyncio.ensure_future(self.sample(group, prompt_ids, i, priority=priority))
                         for i in range(group.n)]
                entered.set()
                return prompt_ids, list(await asyncio.gather(*tasks))
            # Samples started together are prefilled together, each computing the whole prompt (vLLM
            # caches a block once it is computed): start the first, and the rest once its first token
            # is out, so they find the prompt's full blocks cached and compute only the last partial
            # one. On a CPU, where a prompt token costs about what a sampled one does, this removes most
            # of a group's prompt work (8 samples of a 62-token prompt: 496 prompt tokens to 272).
            prefilled = asyncio.Event()
            lead = asyncio.ensure_future(self.sample(group, prompt_ids, 0, prefilled, priority))
            waiter = asyncio.ensure_future(prefilled.wait())
            try:
                await asyncio.wait((lead, waiter), return_when=asyncio.FIRST_COMPLETED)
                if lead.done():  # it ended (or failed) before its first token came out
                    lead.result()
                rest = [asyncio.ensure_future(self.sample(group, prompt_ids, i, priority=priority))
                        for i in range(1, group.n)]
                entered.set()
                samples = await asyncio.gather(lead, *rest)
            finally:
                waiter.cancel()
                lead.cancel()
            return prompt_ids, list(samples)
        finally:
            entered.set()  # a group that failed or was cancelled holds back no later one

    def shares_prefill(self, n: int, prompt_len: int) -> bool:
        """Whether a group's samples after the first wait for its prefill: only where the cache can
        hand them at least one full block of the prompt (the engine's block: rollout.block_size, or
        vLLM's default, 128 tokens on CPU)."""
        return (self.cfg.enable_prefix_caching and n > 1
                and prompt_len >= self.engine.vllm_config.cache_config.block_size)
