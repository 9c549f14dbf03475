"""Credit per turn for multi-turn episodes: an advantage for each turn's sampled tokens, from the
rewards the environment gave turn by turn (`Turn.reward`, a step's reward), instead of one
advantage for the whole episode.

Every sample is a list of turns; a single-turn sample is one turn holding its reward. A sample's
turn rewards are made to sum to its reward: what the turns do not account for (an episode-level
reward, the `penalize` reward of a failed episode) goes to its last turn. Turn t's return is
G_t = r_t + γ r_{t+1} + γ² r_{t+2} + … (`algorithm.credit.discount`).

- `turn`: the returns of every turn of every sample of the group are compared as one set, with the
  algorithm's own group-relative formula (`group_advantages`: GRPO's (G − mean) / std, Dr. GRPO's
  G − mean, RLOO's leave-one-out), so a turn is credited for what followed it against the group's
  other turns. With γ = 1 and only a final reward, each episode's turns share their episode's
  return, as in episode-level credit.
- `turn_state`: the episode's group-relative advantage, plus `state_weight` × the advantage of the
  turn's return among the turns of the group taken from the same state — the same context tokens
  before the turn (the first turns of a prompt's episodes when the environment opens them alike,
  and any later turns that met the same observations). A turn whose state no other turn shares
  gets the episode's advantage alone. This is the step-grouped estimator of GiGPO (Feng et al.,
  2025), with exact-match states.

The advantages of a sample's environment tokens are 0; they are out of the loss mask anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlmesh.learner.train.algorithms.advantages import group_advantages
from rlmesh.v1 import common_pb2
from rlmesh.services.config import CreditSection, default

CREDITS = ("episode", "turn", "turn_state")


@dataclass(frozen=True)
class TurnSpan:
    """One turn of a sample: its sampled tokens `completion[start:start + length]` and its reward."""

    start: int
    length: int
    reward: float


def turn_spans(sample: common_pb2.Sample) -> list[TurnSpan]:
    """The sample's turns, their rewards summing to the sample's reward (the rest on the last turn)."""
    if not sample.turns:
        return [TurnSpan(0, len(sample.completion.token_ids), sample.reward)]
    spans = [TurnSpan(t.start, t.num_sampled_tokens, t.reward) for t in sample.turns]
    rest = sample.reward - sum(s.reward for s in spans)
    last = spans[-1]
    spans[-1] = TurnSpan(last.start, last.length, last.reward + rest)
    return spans


def returns(rewards: list[float], discount: float) -> list[float]:
    """G_t = r_t + discount * G_{t+1}."""
    out, running = [0.0] * len(rewards), 0.0
    for t in range(len(rewards) - 1, -1, -1):
        running = rewards[t] + discount * running
        out[t] = running
    return out


def turn_advantages(group: common_pb2.TrajectoryGroup, samples: list[common_pb2.Sample], algorithm: str,
                    credit: str, *, discount: float = default(CreditSection, "discount"),
                    state_weight: float = default(CreditSection, "state_weight")) -> list[list[float]]:
    """Each of `samples`' (the group's valid ones) per-completion-token advantages under `credit`
    (`turn` or `turn_state`, see the module docstring)."""
    if credit not in ("turn", "turn_state"):
        raise ValueError(f"unknown credit {credit!r}; choose one of {', '.join(CREDITS)}")
    spans = [turn_spans(s) for s in samples]
    rets = [returns([span.reward for span in sample_spans], discount) for sample_spans in spans]
    flat = [(i, t) for i, sample_spans in enumerate(spans) for t in range(len(sample_spans))]
    per_turn: dict[tuple[int, int], float] = {}
    if credit == "turn":
        adv = group_advantages(torch.tensor([rets[i][t] for i, t in flat], dtype=torch.float64), algorithm)
        per_turn = {key: float(a) for key, a in zip(flat, adv.tolist())}
    else:
        episode = group_advantages(torch.tensor([s.reward for s in samples], dtype=torch.float64), algorithm)
        by_state: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        prompt = tuple(group.prompt_token_ids)
        for i, t in flat:
            state = prompt + tuple(samples[i].completion.token_ids[: spans[i][t].start])
            by_state.setdefault(state, []).append((i, t))
        for members in by_state.values():
            step = (group_advantages(torch.tensor([rets[i][t] for i, t in members], dtype=torch.float64), algorithm)
                    if len(members) > 1 else torch.zeros(1, dtype=torch.float64))
            for (i, t), a in zip(members, step.tolist()):
                per_turn[(i, t)] = float(episode[i]) + state_weight * float(a)
    out = []
    for i, sample in enumerate(samples):
        tokens = [0.0] * len(sample.completion.token_ids)
        for t, span in enumerate(spans[i]):
            tokens[span.start: span.start + span.length] = [per_turn[(i, t)]] * span.length
        out.append(tokens[: len(sample.completion.token_ids)])
    return out
