"""RolloutService servicer: protobuf <-> VLLMGenerator calls; the weight RPCs are delegated to
`weight_updates.WeightUpdates` (which uses the transport's `Receiver`, so this module names no transport)."""

from __future__ import annotations

import asyncio
import logging

import grpc

from rlmesh.rollout_server.generator import VLLMGenerator
from rlmesh.rollout_server.weight_updates import PAUSE_MODES, WeightUpdates
from rlmesh.services.weights.base import ProtocolMismatch, Receiver
from rlmesh.v1 import rollout_pb2, rollout_pb2_grpc

log = logging.getLogger(__name__)


def request_problem(group, prompt_ids: list[int], cfg) -> str | None:
    """Why a Generate request is over this server's bounds (`rollout.max_n`, `rollout.max_model_len`), if it is."""
    if group.n > cfg.max_n:
        return f"prompt.n={group.n} is over the limit rollout.max_n={cfg.max_n}"
    room = cfg.max_model_len - len(prompt_ids)
    if room < 1:
        return (f"the prompt has {len(prompt_ids)} tokens, leaving no room for a completion within "
                f"rollout.max_model_len={cfg.max_model_len}")
    if group.sampling.HasField("max_tokens") and not 1 <= group.sampling.max_tokens <= room:
        return (f"sampling.max_tokens={group.sampling.max_tokens} must be within 1..{room} (rollout.max_model_len="
                f"{cfg.max_model_len} minus the prompt's {len(prompt_ids)} tokens)")
    return None


class RolloutService(rollout_pb2_grpc.RolloutServiceServicer):
    """Generation here; the weight RPCs are delegated to `WeightUpdates` (no handler calls another)."""

    def __init__(self, generator: VLLMGenerator, generator_id: str, receiver: Receiver, worker=None,
                 on_weights=None, queue=None) -> None:
        self.generator, self.generator_id, self.worker = generator, generator_id, worker
        self.weights = WeightUpdates(generator, receiver, on_weights=on_weights, queue=queue)

    async def Generate(self, request, context):
        if self.generator.placeholder:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this rollout server holds placeholder weights until the "
                                "learner's first broadcast (rlmesh up is still preparing the policy); retry later")
        group = request.prompt
        try:
            prompt_ids = self.generator.prompt_token_ids(group)
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        if group.n < 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"prompt.n={group.n} must be >= 1")
        problem = request_problem(group, prompt_ids, self.generator.cfg)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        tasks = [asyncio.create_task(self.generator.sample(group, prompt_ids, i)) for i in range(group.n)]
        try:
            for done in asyncio.as_completed(tasks):
                yield rollout_pb2.GenerateResponse(sample=await done, prompt_token_ids=prompt_ids)
        finally:
            for t in tasks:
                t.cancel()

    async def InitWeightTransfer(self, request, context):
        try:
            return await self.weights.join(request)
        except (ProtocolMismatch, PermissionError) as err:
            log.warning("refused InitWeightTransfer from %s: %s", context.peer(), err)
            refused = isinstance(err, PermissionError)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED if refused else grpc.StatusCode.FAILED_PRECONDITION,
                                str(err))
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))

    async def UpdateWeights(self, request, context):
        try:
            return await self.weights.apply(request)
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))

    async def PauseGeneration(self, request, context):
        mode = request.mode or "keep"
        if mode not in PAUSE_MODES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"mode={mode!r}: use {', '.join(PAUSE_MODES)}")
        await self.generator.pause(mode)
        return rollout_pb2.PauseGenerationResponse()

    async def ResumeGeneration(self, request, context):
        await self.generator.resume()
        return rollout_pb2.ResumeGenerationResponse()

    async def GetStatus(self, request, context):
        w = self.worker
        return rollout_pb2.RolloutStatusResponse(
            generator_id=self.generator_id, version=self.generator.version, paused=self.generator.paused,
            num_inflight_groups=w.num_inflight if w else 0, num_completed_groups=w.num_completed if w else 0,
            num_generated_tokens=self.generator.num_generated_tokens, group_epoch=self.generator.group_epoch,
            weights_digest=self.weights.weights_digest if request.include_weights_hash else "",
            weights_digest_algorithm=self.weights.digest_algorithm if request.include_weights_hash else "",
            busy_seconds=self.generator.busy.seconds,
        )
