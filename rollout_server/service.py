"""RolloutService servicer: protobuf <-> VLLMGenerator calls; the weight RPCs go through the
transport's `Receiver`, so this module names no transport."""

from __future__ import annotations

import asyncio
import logging

import grpc

from rlmesh.rollout_server.generator import VLLMGenerator
from rlmesh.services.weights.announce import follow_updates
from rlmesh.services.weights.base import Receiver
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


def _log_death(task: asyncio.Task) -> None:
    """A follower that dies says so (the learner then drops this server at its next update's deadline)."""
    if not task.cancelled() and task.exception() is not None:
        log.error("following announced weight updates stopped: %r", task.exception(), exc_info=task.exception())


class RolloutService(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(self, generator: VLLMGenerator, generator_id: str, receiver: Receiver, worker=None,
                 on_weights=None, queue=None) -> None:
        self.generator, self.generator_id, self.worker = generator, generator_id, worker
        # The weight transport's receiving side (built from weight_sync; this server's vLLM engine uses it).
        self.receiver = receiver
        # Called with the new version after each completed update (the server marks itself ready).
        self.on_weights = on_weights
        self.weights_digest = ""  # digest of the last weights received; empty until the first update
        self.digest_algorithm = ""  # the algorithm of the update in progress or last received ("" = sha256)
        # The run's Valkey client: with it this server follows a large group's announced updates.
        self.queue = queue
        self._following: asyncio.Task | None = None

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
            init_info = self.receiver.init_info(request)
        except PermissionError as err:
            log.warning("refused InitWeightTransfer from %s: %s", context.peer(), err)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(err))
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        await self.generator.init_weight_transfer(init_info, request.group_epoch)
        if self._following is not None:  # the previous group's announcements are over
            self._following.cancel()
            self._following = None
        follow = bool(request.announce_stream and request.report_stream and len(request.announce_public_key) == 32
                      and request.report_key and self.queue is not None)
        if follow:
            self._following = asyncio.create_task(follow_updates(self.queue, request, self.apply_update),
                                                  name="announced-weight-updates")
            self._following.add_done_callback(_log_death)
        return rollout_pb2.InitWeightTransferResponse(
            digest_algorithms=getattr(self.receiver, "digest_algorithms", ()), combined_pause_resume=True,
            single_call_update=True, announced_updates=follow)

    async def StartWeightUpdate(self, request, context):
        if request.pause_mode:  # the learner's PauseGeneration, folded into this call
            await self.PauseGeneration(rollout_pb2.PauseGenerationRequest(mode=request.pause_mode), context)
        await self.generator.start_weight_update()
        return rollout_pb2.StartWeightUpdateResponse()

    async def UpdateWeights(self, request, context):
        try:
            update_info = self._update_info(request)
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        return await self._update(request, update_info, context)

    async def apply_update(self, request: rollout_pb2.UpdateWeightsRequest) -> rollout_pb2.UpdateWeightsResponse:
        """An announced update (the learner's UpdateWeights without a call); ValueError for a bad request."""
        return await self._update(request, self._update_info(request), None)

    def _update_info(self, request: rollout_pb2.UpdateWeightsRequest):
        if not request.tensors:
            raise ValueError("UpdateWeights lists no tensors")
        if request.HasField("start") and request.start.pause_mode not in ("", "keep", "wait", "abort"):
            raise ValueError(f"start.pause_mode={request.start.pause_mode!r}: use keep, wait or abort")
        return self.receiver.update_info(request)

    async def _update(self, request, update_info, context):
        if request.HasField("start"):  # the learner's StartWeightUpdate, folded into this call
            await self.StartWeightUpdate(request.start, context)
        self.digest_algorithm = request.digest_algorithm or "sha256"
        await self.generator.update_weights(update_info)
        reply = rollout_pb2.UpdateWeightsResponse(num_tensors=len(request.tensors))
        if request.HasField("finish"):  # and its FinishWeightUpdate
            reply.finished.CopyFrom(await self.FinishWeightUpdate(request.finish, context))
        return reply

    async def FinishWeightUpdate(self, request, context):
        await self.generator.finish_weight_update(request.version)
        received = await self.generator.received_digests()
        self.weights_digest = received[0] if received else ""
        if self.on_weights is not None:
            self.on_weights(request.version)
        if request.resume:  # the learner's ResumeGeneration, folded into this call
            await self.generator.resume()
        return rollout_pb2.FinishWeightUpdateResponse(weights_digest=self.weights_digest, received_digests=received,
                                                      digest_algorithm=self.digest_algorithm,
                                                      busy_seconds=self.generator.busy.seconds)

    async def PauseGeneration(self, request, context):
        mode = request.mode or "keep"
        if mode not in ("keep", "wait", "abort"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"mode={mode!r}: use keep, wait or abort")
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
            weights_digest=self.weights_digest if request.include_weights_hash else "",
            weights_digest_algorithm=self.digest_algorithm if request.include_weights_hash else "",
            busy_seconds=self.generator.busy.seconds,
        )
