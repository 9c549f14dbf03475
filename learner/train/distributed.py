"""The learner as a distributed job: joining torchrun's process group, and the command channel
by which rank 0 (the controller) tells the other ranks which collective to run next.

Every rank runs the same sequence of collectives in the same order: rank 0 announces a command
(a small pickled tuple over a dedicated gloo group, so it works beside NCCL training too), then
every rank runs it. Only rank 0 talks to gRPC, Redis and the rollout servers."""

from __future__ import annotations

import logging
import os
import signal
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rlmesh.services.ports import free_port

log = logging.getLogger(__name__)


def die_with_launcher() -> None:
    """torchrun starts each rank in a process session of its own, so a launcher that is SIGKILLed
    (the OOM killer, or `rlmesh up` giving up on a learner) would leave its ranks training beside
    the job that replaces it. On Linux the kernel kills this rank when its parent dies."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return
    import ctypes

    pr_set_pdeathsig = 1
    if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL) != 0:
        log.warning("could not ask to die with torchrun's launcher (prctl errno %d)", ctypes.get_errno())
    if os.getppid() == 1:  # the launcher died before the call
        os._exit(1)


def init_distributed() -> tuple[int, int]:
    """Join torchrun's group when launched by it (RANK set); otherwise a world of one. Picks
    LOCAL_RANK's GPU where there are GPUs."""
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if "RANK" in os.environ:
            die_with_launcher()
            rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            # torchrun's agent keeps one store across elastic restarts: without a key prefix per
            # attempt, restarted ranks read the dead attempt's addresses and never connect.
            agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                                  is_master=not agent_store and rank == 0, timeout=timedelta(minutes=10))
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            dist.init_process_group(backend, store=dist.PrefixStore(f"rlmesh/attempt{attempt}", store), rank=rank,
                                    world_size=world_size)
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


class CommandChannel:
    """Rank 0 -> all ranks: (command, payload) broadcasts. A no-op in a world of one."""

    def __init__(self) -> None:
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # Followers wait here while rank 0 waits on rollouts: a long timeout, not the default 30 min.
        self._group = dist.new_group(backend="gloo", timeout=timedelta(days=7)) if self.world_size > 1 else None

    def announce(self, command: str, payload: Any = None) -> None:
        assert self.rank == 0, "only the controller announces"
        if self._group is not None:
            dist.broadcast_object_list([command, payload], src=0, group=self._group)

    def receive(self) -> tuple[str, Any]:
        box: list[Any] = [None, None]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0], box[1]
