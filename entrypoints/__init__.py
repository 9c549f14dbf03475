"""rlmesh: an asynchronous actor-learner mesh for RL post-training of language models.

The Python API, over the same functions as the `rlmesh` command:
    rlmesh.train(config, reward_fn=..., callbacks=[...], **overrides) -> RunResult   (`rlmesh up`)
    rlmesh.sft(config, output=...), rlmesh.dpo(config, output=...), rlmesh.export(run_dir, output=...)
    rlmesh.Callback, rlmesh.StopTraining, rlmesh.RunResult
This folder, entrypoints/, is the package root: beside this facade live the `rlmesh` command
(rlmesh.cli), the local launcher (rlmesh.up) and the API's implementation (rlmesh.api), the only
modules that import every tier. The wire contracts are `rlmesh.v1`. Importing rlmesh is light: the API module loads on first use of
one of its names, and torch and vLLM only in the processes that train and generate."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlmesh.api import Callback, RunResult, StopTraining, dpo, export, sft, train

__all__ = ["Callback", "RunResult", "StopTraining", "dpo", "export", "sft", "train"]


def __getattr__(name: str) -> Any:
    # PEP 562: the API's names resolve on first access (rlmesh.api imports nothing heavy).
    if name in __all__:
        from rlmesh import api

        value = getattr(api, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'rlmesh' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
