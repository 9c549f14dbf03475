"""Exact-answer arithmetic: the first integer in the completion must equal metadata["answer"]."""

from __future__ import annotations

import re

from reward_server.environments.base import ScoreInput, ScoreOutput

_INT = re.compile(r"-?\d+")


class ArithmeticEnvironment:
    name = "arithmetic"
    description = "exact integer answer; reward 1 if the first integer equals metadata.answer"

    def score(self, items: list[ScoreInput]) -> list[ScoreOutput]:
        return [self._score_one(item) for item in items]

    @staticmethod
    def _score_one(item: ScoreInput) -> ScoreOutput:
        answer = item.metadata.get("answer")
        if answer is None:
            return ScoreOutput(error="metadata has no 'answer' field; the prompt group must carry env_metadata.answer")
        try:
            expected = int(str(answer).strip())
        except ValueError:
            return ScoreOutput(error=f"metadata.answer={answer!r} is not an integer")
        match = _INT.search(item.completion)
        if match is None:
            # A completion without a number is wrong, not unscorable: reward 0, trained on.
            return ScoreOutput(reward=0.0, components={"correct": 0.0, "has_answer": 0.0})
        correct = float(int(match.group()) == expected)
        return ScoreOutput(reward=correct, components={"correct": correct, "has_answer": 1.0})
