"""Packing token sequences into padded tensors for the training backend."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Sequence:
    """One training sequence: prompt + completion tokens and per-completion-token data."""

    prompt_ids: list[int]
    completion_ids: list[int]
    loss_mask: list[bool]
    behaviour_logprobs: list[float] = field(default_factory=list)
    advantage: float = 0.0
    group_key: str = ""
    reward: float = 0.0


@dataclass
class MicroBatch:
    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    # Aligned with targets input_ids[:, 1:]; shape [B, T-1].
    loss_mask_BT: torch.Tensor
    behaviour_logprobs_BT: torch.Tensor
    advantages_B: torch.Tensor
    old_logprobs_BT: torch.Tensor | None = None
    ref_logprobs_BT: torch.Tensor | None = None
    # Each row's index in the step's whole batch (empty for a padding micro-batch).
    seq_index_B: list[int] = field(default_factory=list)
    # Normaliser shared by every micro-batch of a step (tokens or sequences in the whole step).
    num_loss_tokens_in_step: float = 1.0
    num_seqs_in_step: float = 1.0
    # Filler that keeps every rank's collective count equal; contributes nothing to the loss.
    is_padding: bool = False


def pack(seqs: list[Sequence], pad_id: int) -> MicroBatch:
    max_len = max(len(s.prompt_ids) + len(s.completion_ids) for s in seqs)
    b = len(seqs)
    input_ids = torch.full((b, max_len), pad_id, dtype=torch.long)
    attention = torch.zeros((b, max_len), dtype=torch.long)
    loss_mask = torch.zeros((b, max_len - 1), dtype=torch.float32)
    behaviour = torch.zeros((b, max_len - 1), dtype=torch.float32)
    for i, s in enumerate(seqs):
        ids = s.prompt_ids + s.completion_ids
        n_p, n_c = len(s.prompt_ids), len(s.completion_ids)
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention[i, : len(ids)] = 1
        # Target position t predicts token t+1: completion token j sits at target n_p - 1 + j.
        loss_mask[i, n_p - 1 : n_p - 1 + n_c] = torch.tensor(s.loss_mask, dtype=torch.float32)
        if s.behaviour_logprobs:
            behaviour[i, n_p - 1 : n_p - 1 + n_c] = torch.tensor(s.behaviour_logprobs)
    advantages = torch.tensor([s.advantage for s in seqs], dtype=torch.float32)
    return MicroBatch(input_ids, attention, loss_mask, behaviour, advantages)


def padding_micro(pad_id: int) -> MicroBatch:
    micro = pack([Sequence([pad_id], [pad_id], [False])], pad_id)
    micro.is_padding = True
    return micro


def budget_groups(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices into `lengths`, grouped into micro-batches of at most `max_tokens` padded tokens
    (rows x the longest row): longest first, so each micro-batch holds similar lengths and pads
    little. A sequence longer than the budget gets a micro-batch of its own."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        # Sorted longest first: the group's first row sets its padded length.
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def plan_step(seqs: list[Sequence], size: int, pad_id: int, rank: int = 0, world_size: int = 1,
              max_tokens: int = 0) -> list[MicroBatch]:
    """This rank's micro-batches of one optimizer step over `seqs` (the whole step's batch).

    Ranks take contiguous equal shares; every rank gets the same number of micro-batches (padded
    with empty ones), and every micro-batch carries the whole step's normalisers, so the summed
    gradient over ranks equals the single-rank step's. `size` sequences per micro-batch in order,
    or with `max_tokens` > 0, micro-batches by padded-token budget over length-sorted sequences
    (`budget_groups`); every rank plans every rank's share (all see the whole batch), so all agree
    on the count without communicating."""
    num_tokens = float(sum(sum(1 for m in s.loss_mask if m) for s in seqs)) or 1.0
    per_rank = -(-len(seqs) // world_size)

    def share(r: int) -> list[list[int]]:
        indices = list(range(r * per_rank, min((r + 1) * per_rank, len(seqs))))
        if not max_tokens:
            return [indices[i : i + size] for i in range(0, len(indices), size)]
        lengths = [len(seqs[i].prompt_ids) + len(seqs[i].completion_ids) for i in indices]
        return [[indices[j] for j in group] for group in budget_groups(lengths, max_tokens)]

    if max_tokens:
        num_micro = max(max(len(share(r)) for r in range(world_size)), 1)
    else:
        num_micro = max(-(-per_rank // size), 1)
    micros = []
    for group in share(rank):
        micro = pack([seqs[i] for i in group], pad_id)
        micro.seq_index_B = group
        micros.append(micro)
    micros += [padding_micro(pad_id) for _ in range(num_micro - len(micros))]
    for m in micros:
        m.num_loss_tokens_in_step = num_tokens
        m.num_seqs_in_step = float(len(seqs))
    return micros
