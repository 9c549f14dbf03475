"""Exact-answer arithmetic: the completion (surrounding whitespace aside) must be exactly the
integer in metadata["answer"]. `correct` is the environment's correctness signal (what held-out
accuracy reports); `answer_in_text` says, for diagnosis, whether the first integer in the
completion was right even when the format was not."""

from __future__ import annotations

from rlmesh.services.domain.scoring import as_int, score_integer
from rlmesh.reward_server.environments.base import ScoreInput, ScoreOutput


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
        expected = as_int(answer)
        if expected is None:
            return ScoreOutput(error=f"metadata.answer={answer!r} is not an integer")
        # A completion without the right number is wrong, not unscorable: reward 0, trained on.
        verdict = score_integer(item.completion, expected)
        return ScoreOutput(reward=verdict.correct, components={"correct": verdict.correct, "exact": verdict.correct,
                                                               "answer_in_text": verdict.answer_in_text})
