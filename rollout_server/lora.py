"""Serving the learner's LoRA adapter (`learner.lora`): vLLM runs the base model with LoRA enabled,
and each weight update brings only the adapter's tensors, over the same gloo group and digest as a
full update.

A new adapter per version, not one overwritten in place: the worker's engine (`ADAPTER_ENGINE`, in
`rlmesh.rollout_server.weight_engine`) writes the received tensors to `<root>/v<version>/` (peft's
adapter files) and the generator sends every *new* request with a fresh `LoRARequest` for that
directory, while requests already running keep the adapter they started with. So each sample is
produced by exactly one version's adapter and records it (no sample spans two versions), and
nothing in vLLM's running batch changes under it; vLLM's own LRU drops adapters no request uses,
and directories beyond the newest `KEEP_VERSIONS` are deleted."""

from __future__ import annotations

import logging
import os
import shutil
from typing import TYPE_CHECKING, Any

from rlmesh.rollout_server.weight_engine import ADAPTER_ENGINE, ROOT_ENV, version_dir
from rlmesh.services.scratch import process_scratch
from rlmesh.services.weights.lora import ADAPTER_WEIGHTS

if TYPE_CHECKING:
    from rlmesh.services.config import LoRASection

log = logging.getLogger(__name__)

ROOT_PREFIX = "rlmesh-lora-"
"""Where a server's adapter directories live: a directory of its own under the temporary directory."""
KEEP_VERSIONS = 8
"""Adapter directories kept: a request paused across updates may still need its adapter loaded."""


class ServedAdapter:
    """The rollout server's side: vLLM's LoRA engine arguments, and the `LoRARequest` new requests
    carry (None until the first adapter arrives: version 0's adapter is zero, i.e. the base model)."""

    engine = ADAPTER_ENGINE

    def __init__(self, cfg: LoRASection) -> None:
        self.cfg = cfg
        # Removed at close; one a killed server left is removed by the next (`services.scratch`).
        self.root = process_scratch(ROOT_PREFIX)
        os.environ[ROOT_ENV] = str(self.root)  # inherited by the worker processes vLLM spawns
        self.request = None
        self._next_id = 0

    def engine_args(self) -> dict[str, Any]:
        # Two adapters in a batch: the new version's, and the one requests paused across the
        # update still run under.
        return {"enable_lora": True, "max_lora_rank": self.cfg.rank, "max_loras": 2, "max_cpu_loras": 4}

    def switch(self, version: int) -> None:
        """New requests use the adapter the worker just wrote for `version`."""
        from vllm.lora.request import LoRARequest

        path = version_dir(self.root, version)
        if not (path / ADAPTER_WEIGHTS).is_file():
            raise RuntimeError(f"weight update v{version} finished but no adapter was written to {path}")
        # A fresh id per update, never reused: the same version number can come again from a learner
        # resumed from an older checkpoint, and vLLM caches adapters by id.
        self._next_id += 1
        self.request = LoRARequest(f"v{version}-{self._next_id}", self._next_id, str(path))
        for old in sorted(self.root.glob("v*"), key=os.path.getmtime)[:-KEEP_VERSIONS]:
            shutil.rmtree(old, ignore_errors=True)
        log.info("serving LoRA adapter v%d (%s)", version, path)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
