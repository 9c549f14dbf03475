"""`reasoning_gym`: completions scored by reasoning-gym's own scorer for the entry's dataset.

The answer is what reasoning-gym's `extract_answer` reads: the text of the completion's last
`<answer>...</answer>` (None without one; the scorer then gives 0). It is scored with
`get_score_answer_fn(dataset)(answer, entry)`, the dataset's `score_answer` under its default config, as
reasoning-gym's own evaluation does. The dataset and entry come from the item's metadata
(`rlmesh.services.domain.tasks.reasoning_gym_metadata`): an unknown dataset, a malformed entry, a
scorer that raises, or a score that is not a finite number is that item's error (never trained on);
the other items go on. The reward is the score (reasoning-gym gives partial credit, e.g. for a
near answer); components: `correct` (score 1: held-out accuracy reads it) and `format` (an
`<answer>` tag was found).

The scorers are reasoning-gym's code run on the model's text, and a few parse it with Python's `eval`
(`binary_matrix`, for one), so they run where user reward functions run: in worker processes with a
clean environment and memory, CPU and wall-clock limits (`rlmesh.reward_server.function_workers`,
`reward.function_*`), started on the first item. The reward server never imports reasoning-gym; a
worker without it (`rlmesh[envs]`) answers every item with an error saying what to install."""

from __future__ import annotations

import math
import numbers
import threading
from collections.abc import Callable
from typing import Any

from rlmesh.reward_server.environments.base import ItemError
from rlmesh.reward_server.environments.function import FunctionEnvironment
from rlmesh.reward_server.function_workers import FunctionWorkerPool, WorkerLimits
from rlmesh.services.config import RewardSection
from rlmesh.services.domain.tasks import read_reasoning_gym_metadata

Scorer = Callable[[str | None, dict[str, Any]], Any]

_SCORERS: dict[str, Scorer] = {}  # in a worker: at most one per registered dataset name


def scorer(dataset: str) -> Scorer:
    """The dataset's scorer, made once per worker; ItemError for an unknown name or a missing reasoning-gym."""
    if dataset not in _SCORERS:
        try:
            from reasoning_gym.factory import DATASETS, get_score_answer_fn
        except ImportError as err:
            raise ItemError(f"reasoning-gym is not installed on this reward server ({err}); "
                            "pip install 'rlmesh[envs]'") from None
        if dataset not in DATASETS:
            raise ItemError(f"metadata.dataset={dataset[:80]!r} is not a reasoning-gym dataset")
        _SCORERS[dataset] = get_score_answer_fn(dataset)
    return _SCORERS[dataset]


def score_item(prompt: list[dict], completion: str, metadata: dict[str, Any]) -> dict[str, float]:
    """One item, in a worker process: {reward, correct, format}, or ItemError saying why not."""
    try:
        dataset, entry = read_reasoning_gym_metadata(metadata)
    except ValueError as err:
        raise ItemError(str(err)) from None
    score_answer = scorer(dataset)
    from reasoning_gym.utils import extract_answer  # importable: the scorer was

    answer = extract_answer(completion)
    try:
        score = score_answer(answer, entry)
    except Exception as err:  # reasoning-gym's code on a stranger's entry: any failure is this item's
        raise ItemError(f"{dataset}'s scorer raised {type(err).__name__}: {str(err)[:200]}") from None
    if not isinstance(score, numbers.Real) or not math.isfinite(score):
        raise ItemError(f"{dataset}'s scorer returned {score!r:.80}, not a finite number")
    return {"reward": float(score), "correct": float(score == 1), "format": float(answer is not None)}


class ReasoningGymEnvironment(FunctionEnvironment):
    """`score_item` behind a worker pool that starts with the first item scored."""

    def __init__(self, limits: WorkerLimits | None = None) -> None:  # noqa: the pool starts on first use
        self.name = "reasoning_gym"
        self.description = ("reasoning-gym's own scorer for metadata.dataset on the last <answer></answer> of the "
                            "completion; reward = its score, components correct (score 1) and format")
        self.limits = limits or WorkerLimits.from_config(RewardSection())
        self._pool: FunctionWorkerPool | None = None
        self._lock = threading.Lock()

    @property
    def workers(self) -> FunctionWorkerPool:
        with self._lock:
            if self._pool is None:
                self._pool = FunctionWorkerPool(self.name, f"{__name__}:score_item", self.limits)
            return self._pool

    def healthy(self) -> str:
        return "" if self._pool is None else self._pool.healthy()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
