"""The rollout server's side of the weight-update protocol (`services.weights.base.PROTOCOL_VERSION`), in one
place: join the learner's transfer group, apply an update (pause, receive, load as the new version, report
the received digests, resume), and follow a large group's updates announced on Valkey. The servicer
delegates its weight RPCs here and only turns the errors into gRPC statuses."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from rlmesh.rollout_server.generator import VLLMGenerator
from rlmesh.services.weights.announce import follow_updates
from rlmesh.services.weights.base import PROTOCOL_VERSION, Receiver, check_protocol
from rlmesh.v1 import rollout_pb2

log = logging.getLogger(__name__)

PAUSE_MODES = ("keep", "wait", "abort")


def _log_death(task: asyncio.Task) -> None:
    """A follower that dies says so (the learner then drops this server at its next update's deadline)."""
    if not task.cancelled() and task.exception() is not None:
        log.error("following announced weight updates stopped: %r", task.exception(), exc_info=task.exception())


class WeightUpdates:
    def __init__(self, generator: VLLMGenerator, receiver: Receiver,
                 on_weights: Callable[[int], None] | None = None, queue=None) -> None:
        self.generator = generator
        # The weight transport's receiving side (built from weight_sync; this server's vLLM engine uses it).
        self.receiver = receiver
        # Called with the new version after each completed update (the server marks itself ready).
        self.on_weights = on_weights
        # The run's Valkey client: with it this server follows a large group's announced updates.
        self.queue = queue
        self.weights_digest = ""  # digest of the last weights received; empty until the first update
        self.digest_algorithm = ""  # the algorithm of the last update
        self._following: asyncio.Task | None = None

    async def join(self, request: rollout_pb2.InitWeightTransferRequest) -> rollout_pb2.InitWeightTransferResponse:
        """Join the group `request` forms. Raises PermissionError for a group that is not the configured
        learner's, ValueError for a malformed request, ProtocolMismatch for a learner of another protocol
        version (all before anything is dialled)."""
        init_info = self.receiver.init_info(request)
        check_protocol(request.protocol_version, "the learner")
        await self.generator.init_weight_transfer(init_info, request.group_epoch)
        if self._following is not None:  # the previous group's announcements are over
            self._following.cancel()
            self._following = None
        follow = bool(request.announce_stream and request.report_stream and len(request.announce_public_key) == 32
                      and request.report_key and self.queue is not None)
        if follow:
            self._following = asyncio.create_task(follow_updates(self.queue, request, self.apply),
                                                  name="announced-weight-updates")
            self._following.add_done_callback(_log_death)
        return rollout_pb2.InitWeightTransferResponse(
            digest_algorithms=getattr(self.receiver, "digest_algorithms", ("sha256",)), announced_updates=follow,
            protocol_version=PROTOCOL_VERSION)

    async def apply(self, request: rollout_pb2.UpdateWeightsRequest) -> rollout_pb2.UpdateWeightsResponse:
        """One whole update, called or announced. Raises ValueError for a malformed request (before
        anything pauses)."""
        if not request.tensors:
            raise ValueError("UpdateWeights lists no tensors")
        mode = request.pause_mode or "keep"
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode={request.pause_mode!r}: use {', '.join(PAUSE_MODES)}")
        update_info = self.receiver.update_info(request)
        generator = self.generator
        await generator.pause(mode)
        await generator.start_weight_update()
        await generator.update_weights(update_info)
        await generator.finish_weight_update(request.version)
        received = await generator.received_digests()
        self.weights_digest = received[0] if received else ""
        self.digest_algorithm = request.digest_algorithm or "sha256"
        if self.on_weights is not None:
            self.on_weights(request.version)
        await generator.resume()
        return rollout_pb2.UpdateWeightsResponse(
            num_tensors=len(request.tensors), weights_digest=self.weights_digest, received_digests=received,
            digest_algorithm=self.digest_algorithm, busy_seconds=generator.busy.seconds)
