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

reasoning-gym is imported on first use, so a reward server without it (`rlmesh[envs]`) serves every
other environment and answers these items with an error saying what to install. The scorers are
reasoning-gym's code, run in this process on the reward server's worker threads (each call bounded
by `reward.env_timeout_s`); a few parse the answer with Python's `eval` (`binary_matrix`, for one)."""

from __future__ import annotations

import math
import numbers
import threading
from collections.abc import Callable
from typing import Any

from rlmesh.reward_server.environments.base import ScoreInput, ScoreOutput
from rlmesh.services.domain.tasks import read_reasoning_gym_metadata

Scorer = Callable[[str | None, dict[str, Any]], Any]


class ReasoningGymEnvironment:
    name = "reasoning_gym"
    description = ("reasoning-gym's own scorer for metadata.dataset on the last <answer></answer> of the completion; "
                   "reward = its score, components correct (score 1) and format")

    def __init__(self) -> None:
        self._scorers: dict[str, Scorer] = {}  # at most one per registered dataset name
        self._lock = threading.Lock()

    def score(self, items: list[ScoreInput]) -> list[ScoreOutput]:
        return [self._score_one(item) for item in items]

    def scorer(self, dataset: str) -> Scorer:
        """The dataset's scorer, made once; ValueError for an unknown name or a missing reasoning-gym."""
        with self._lock:
            if dataset not in self._scorers:
                try:
                    from reasoning_gym.factory import DATASETS, get_score_answer_fn
                except ImportError as err:
                    raise ValueError(f"reasoning-gym is not installed on this reward server ({err}); "
                                     "pip install 'rlmesh[envs]'") from None
                if dataset not in DATASETS:
                    raise ValueError(f"metadata.dataset={dataset[:80]!r} is not a reasoning-gym dataset")
                self._scorers[dataset] = get_score_answer_fn(dataset)
            return self._scorers[dataset]

    def _score_one(self, item: ScoreInput) -> ScoreOutput:
        try:
            dataset, entry = read_reasoning_gym_metadata(item.metadata)
            score_answer = self.scorer(dataset)
        except ValueError as err:
            return ScoreOutput(error=f"reasoning_gym: {err}")
        from reasoning_gym.utils import extract_answer  # importable: the scorer was

        answer = extract_answer(item.completion)
        try:
            score = score_answer(answer, entry)
        except Exception as err:  # reasoning-gym's code on a stranger's entry: any failure is this item's
            return ScoreOutput(error=f"reasoning_gym: {dataset}'s scorer raised {type(err).__name__}: {str(err)[:200]}")
        if not isinstance(score, numbers.Real) or not math.isfinite(score):
            return ScoreOutput(error=f"reasoning_gym: {dataset}'s scorer returned {score!r:.80}, not a finite number")
        return ScoreOutput(reward=float(score), components={"correct": float(score == 1), "format": float(answer is not None)})
