"""RolloutService servicer: protobuf <-> VLLMGenerator calls."""

from __future__ import annotations

import asyncio
import logging

import grpc

from rlmesh.v1 import rollout_pb2, rollout_pb2_grpc
from rlmesh.rollout_server.generator import VLLMGenerator

log = logging.getLogger(__name__)


class RolloutService(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(self, generator: VLLMGenerator, generator_id: str, worker=None, on_weights=None,
                 transport: str = "gloo") -> None:
        self.generator, self.generator_id, self.worker = generator, generator_id, worker
        # weight_sync.backend this server's vLLM engine was started with (gloo or nccl).
        self.transport = transport
        # Called with the new version after each completed update (the server marks itself ready).
        self.on_weights = on_weights
        self._rendezvous: dict = {}
        self._store = None
        self.weights_sha256 = ""  # digest of the last weights received; empty until the first update

    async def Generate(self, request, context):
        group = request.prompt
        try:
            prompt_ids = self.generator.prompt_token_ids(group)
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        if group.n < 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"prompt.n={group.n} must be >= 1")
        tasks = [asyncio.create_task(self.generator.sample(group, prompt_ids, i)) for i in range(group.n)]
        try:
            for done in asyncio.as_completed(tasks):
                yield rollout_pb2.GenerateResponse(sample=await done, prompt_token_ids=prompt_ids)
        finally:
            for t in tasks:
                t.cancel()

    async def InitWeightTransfer(self, request, context):
        if request.world_size < 2 or request.rank_offset < 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"world_size={request.world_size} / rank_offset={request.rank_offset}: the learner "
                                "is rank 0, so workers need rank_offset >= 1 and world_size >= 2")
        if request.backend != self.transport:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"backend={request.backend!r}: this server's vLLM engine receives over "
                                f"{self.transport!r}; start learner and rollout servers with the same weight_sync.backend")
        if self.transport == "nccl":
            from rlmesh.services.weights.nccl import worker_init_info

            init_info = worker_init_info(request.master_address, request.master_port, request.rank_offset,
                                         request.world_size)
        else:
            init_info = dict(master_address=request.master_address, master_port=request.master_port,
                             rank_offset=request.rank_offset, world_size=request.world_size,
                             group_epoch=request.group_epoch, timeout_seconds=request.timeout_seconds or 120.0)
        await self.generator.init_weight_transfer(init_info)
        self._rendezvous, self._store = init_info, None
        return rollout_pb2.InitWeightTransferResponse()

    async def StartWeightUpdate(self, request, context):
        await self.generator.start_weight_update()
        return rollout_pb2.StartWeightUpdateResponse()

    async def UpdateWeights(self, request, context):
        if not request.tensors:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "UpdateWeights lists no tensors")
        update_info = dict(
            names=[t.name for t in request.tensors],
            dtype_names=[t.dtype for t in request.tensors],
            shapes=[list(t.shape) for t in request.tensors],
        )
        if self.transport == "gloo":
            update_info["version"] = request.version
        await self.generator.update_weights(update_info)
        return rollout_pb2.UpdateWeightsResponse(num_tensors=len(request.tensors))

    async def FinishWeightUpdate(self, request, context):
        await self.generator.finish_weight_update(request.version)
        if self.transport == "gloo":  # only the gloo engine digests what it received
            self.weights_sha256 = await asyncio.to_thread(self._received_digest, request.version)
        if self.on_weights is not None:
            self.on_weights(request.version)
        return rollout_pb2.FinishWeightUpdateResponse(weights_sha256=self.weights_sha256,
                                                      busy_seconds=self.generator.busy.seconds)

    def _received_digest(self, version: int) -> str:
        """The digest the worker published for the bytes it received (read from the learner's store)."""
        from datetime import timedelta

        import torch.distributed as dist

        r = self._rendezvous
        if self._store is None:  # one client per broadcast group, not one per update
            self._store = dist.TCPStore(r["master_address"], r["master_port"], is_master=False,
                                        timeout=timedelta(seconds=30), wait_for_workers=False)
        from rlmesh.services.weights.gloo import digest_key

        return self._store.get(digest_key(r["group_epoch"], version, r["rank_offset"])).decode()

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
            weights_sha256=self.weights_sha256 if request.include_weights_hash else "",
            busy_seconds=self.generator.busy.seconds,
        )
