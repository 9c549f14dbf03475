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
    token_advantages: list[float] | None = None
    """Per completion token (per-turn credit); None: `advantage` for every token."""


@dataclass
class MicroBatch:
    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    # Aligned with targets input_ids[:, 1:]; shape [B, T-1].
    loss_mask_BT: torch.Tensor
    behaviour_logprobs_BT: torch.Tensor
    advantages_B: torch.Tensor
    old_logprobs_BT: torch.Tensor | None = None
    # Per token, aligned with loss_mask_BT, where some sequence has per-token advantages; else None.
    advantages_BT: torch.Tensor | None = None
    ref_logprobs_BT: torch.Tensor | None = None
    # Each row's index in the step's whole batch (empty for a padding micro-batch).
    seq_index_B: list[int] = field(default_factory=list)
    # Normaliser shared by every micro-batch of a step (tokens or sequences in the whole step).
    num_loss_tokens_in_step: float = 1.0
    num_seqs_in_step: float = 1.0
    # Filler that keeps every rank's collective count equal; contributes nothing to the loss.
    is_padding: bool = False
    # The same rows with each prompt once (`pack_shared`); None: the forward runs on input_ids_BT.
    shared: SharedPrompts | None = None


@dataclass
class SharedPrompts:
    """A micro-batch's forward input with each prompt written once: a row holds a prompt and then
    completions of it, each completion attending to the prompt and causally to itself only, with
    positions restarting after the prompt, so every completion token sees what it would see in a row
    of its own. `src_N` picks, from the logits kept (positions `keep_K` of each row, flattened
    [R, K]), the logit that predicts each completion token (`targets_N`); `dst_N` is where that
    logprob goes in the [B, T-1] layout of the micro-batch's own tensors (flattened)."""

    input_ids_RL: torch.Tensor
    position_ids_RL: torch.Tensor
    mask_R1LL: torch.Tensor  # bool, True: may attend
    keep_K: torch.Tensor
    src_N: torch.Tensor
    dst_N: torch.Tensor
    targets_N: torch.Tensor
    segments: SegmentLayout | None = None  # the same rows by segment (`backends.shared_attention`)


@dataclass
class SegmentLayout:
    """Where each segment's queries and keys sit in the flattened [R * L] row positions.
    q_index_SQ / k_index_SK are padded with position 0; q_valid_SQ marks the real queries;
    mask_S1QK is True where a query may attend (a padded query attends to its first key only)."""

    q_index_SQ: torch.Tensor
    q_valid_SQ: torch.Tensor
    k_index_SK: torch.Tensor
    mask_S1QK: torch.Tensor

    def to(self, device: torch.device) -> SegmentLayout:
        return SegmentLayout(*(t.to(device) for t in (self.q_index_SQ, self.q_valid_SQ, self.k_index_SK, self.mask_S1QK)))


def build_layout(width: int, rows: list[tuple[int, list[int]]]) -> SegmentLayout:
    """The layout of rows `width` tokens wide, each given as (prompt length, completion lengths in
    order), laid out as `batch.pack_shared` writes them: the prompt, then each completion."""
    segments: list[tuple[list[int], list[int], int]] = []  # (query positions, key positions, prefix keys)
    for r, (n_p, completions) in enumerate(rows):
        base = r * width
        prompt = list(range(base, base + n_p))
        segments.append((prompt, prompt, 0))
        start = base + n_p
        for n_c in completions:
            own = list(range(start, start + n_c))
            segments.append((own, prompt + own, n_p))
            start += n_c
    q_max = max(len(q) for q, _, _ in segments)
    k_max = max(len(k) for _, k, _ in segments)
    s = len(segments)
    q_index = torch.zeros(s, q_max, dtype=torch.long)
    q_valid = torch.zeros(s, q_max, dtype=torch.bool)
    k_index = torch.zeros(s, k_max, dtype=torch.long)
    mask = torch.zeros(s, 1, q_max, k_max, dtype=torch.bool)
    for i, (q, k, prefix) in enumerate(segments):
        n_q = len(q)
        q_index[i, :n_q] = torch.tensor(q)
        q_valid[i, :n_q] = True
        k_index[i, : len(k)] = torch.tensor(k)
        mask[i, 0, :n_q, :prefix] = True  # the prompt, seen whole by a completion
        mask[i, 0, :n_q, prefix: prefix + n_q] = torch.ones(n_q, n_q, dtype=torch.bool).tril()
        mask[i, 0, n_q:, 0] = True  # padded queries: one key, so no row of the softmax is empty
    return SegmentLayout(q_index, q_valid, k_index, mask)


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
    micro = MicroBatch(input_ids, attention, loss_mask, behaviour, advantages)
    if any(s.token_advantages is not None for s in seqs):
        micro.advantages_BT = advantages[:, None].repeat(1, max_len - 1)
        for i, s in enumerate(seqs):
            if s.token_advantages is not None:
                n_p = len(s.prompt_ids)
                micro.advantages_BT[i, n_p - 1: n_p - 1 + len(s.token_advantages)] = torch.tensor(s.token_advantages)
    return micro


def row_length(seqs: list[Sequence], row: list[int]) -> int:
    """Tokens of a row of `seqs` sharing one prompt: the prompt once, then every completion."""
    return len(seqs[row[0]].prompt_ids) + sum(len(seqs[i].completion_ids) for i in row)


def shared_rows(seqs: list[Sequence], max_row_tokens: int) -> list[list[int]]:
    """Indices into `seqs`, as packed rows: sequences with the same prompt, in order of first
    appearance, one prompt and as many of its completions as fit in `max_row_tokens` per row (a
    completion that does not fit beside another gets a row of its own)."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i, s in enumerate(seqs):
        by_prompt.setdefault(tuple(s.prompt_ids), []).append(i)
    rows: list[list[int]] = []
    for prompt, members in by_prompt.items():
        row: list[int] = []
        length = len(prompt)
        for i in members:
            n = len(seqs[i].completion_ids)
            if row and length + n > max_row_tokens:
                rows.append(row)
                row, length = [], len(prompt)
            row.append(i)
            length += n
        rows.append(row)
    return rows


def pack_shared(seqs: list[Sequence], rows: list[list[int]], pad_id: int) -> MicroBatch:
    """`pack(seqs)`, plus the forward input with one copy of each row's prompt (`SharedPrompts`);
    `rows` index `seqs`, every row's sequences sharing one prompt."""
    micro = pack(seqs, pad_id)
    t = micro.input_ids_BT.shape[1] - 1  # the [B, T-1] layout's width
    width = max(row_length(seqs, r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    # Padding positions attend to themselves only (a query with nothing to attend to gives NaN).
    mask = torch.eye(width, dtype=torch.bool).repeat(len(rows), 1, 1, 1)
    keep_from = min(len(seqs[r[0]].prompt_ids) for r in rows) - 1
    src, dst, targets = [], [], []
    for r, members in enumerate(rows):
        prompt = seqs[members[0]].prompt_ids
        n_p = len(prompt)
        ids[r, :n_p] = torch.tensor(prompt)
        positions[r, :n_p] = torch.arange(n_p)
        mask[r, 0, :n_p, :n_p] = torch.ones(n_p, n_p, dtype=torch.bool).tril()
        start = n_p
        for i in members:
            c = seqs[i].completion_ids
            n_c = len(c)
            end = start + n_c
            ids[r, start:end] = torch.tensor(c)
            positions[r, start:end] = torch.arange(n_p, n_p + n_c)
            mask[r, 0, start:end, :n_p] = True
            mask[r, 0, start:end, start:end] = torch.ones(n_c, n_c, dtype=torch.bool).tril()
            # Completion token j is predicted by the prompt's last token (j = 0) or by token j - 1.
            predictors = [n_p - 1] + list(range(start, end - 1))
            src += [r * (width - keep_from) + q - keep_from for q in predictors]
            dst += [i * t + n_p - 1 + j for j in range(n_c)]
            targets += c
            start = end
    segments = build_layout(width, [(len(seqs[r[0]].prompt_ids), [len(seqs[i].completion_ids) for i in r]) for r in rows])
    micro.shared = SharedPrompts(ids, positions, mask, torch.arange(keep_from, width), torch.tensor(src),
                                 torch.tensor(dst), torch.tensor(targets, dtype=torch.long), segments)
    return micro


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


def carries_no_gradient(s: Sequence) -> bool:
    """Whether a sequence's advantage is exactly zero at every token (a group whose samples were all
    scored alike): under a policy-gradient loss with no KL term its loss and gradient are zero
    whatever the weights are."""
    if s.token_advantages is not None:
        return not any(s.token_advantages)
    return s.advantage == 0.0


def plan_step(seqs: list[Sequence], size: int, pad_id: int, rank: int = 0, world_size: int = 1,
              max_tokens: int = 0, shared_row_tokens: int = 0, skip_zero_advantage: bool = False) -> list[MicroBatch]:
    """This rank's micro-batches of one optimizer step over `seqs` (the whole step's batch).

    Ranks take contiguous equal shares; every rank gets the same number of micro-batches (padded
    with empty ones), and every micro-batch carries the whole step's normalisers, so the summed
    gradient over ranks equals the single-rank step's. `size` sequences per micro-batch in order,
    or with `max_tokens` > 0, micro-batches by padded-token budget over length-sorted sequences
    (`budget_groups`); every rank plans every rank's share (all see the whole batch), so all agree
    on the count without communicating. With `shared_row_tokens` > 0 the units are shared-prompt
    rows (`shared_rows`, `pack_shared`) instead of sequences: `size` counts a row's sequences and
    `max_tokens` its packed length. With `skip_zero_advantage` (an objective whose loss of a
    zero-advantage sequence is zero: `Objective.skips_zero_advantage`), the sequences that
    `carries_no_gradient` are left out of every micro-batch, no forward or backward spent on them,
    while they still count in the step's normalisers: the same update."""
    num_tokens = float(sum(sum(1 for m in s.loss_mask if m) for s in seqs)) or 1.0
    trained = [i for i, s in enumerate(seqs) if not (skip_zero_advantage and carries_no_gradient(s))]
    per_rank = -(-len(trained) // world_size)

    def share(r: int) -> list[list[list[int]]]:
        """Rank r's micro-batches, each a list of rows of indices into `seqs` (without shared
        prompts a row is one sequence)."""
        indices = trained[r * per_rank : (r + 1) * per_rank]
        if shared_row_tokens:
            rows = [[indices[j] for j in row] for row in shared_rows([seqs[i] for i in indices], shared_row_tokens)]
        else:
            rows = [[i] for i in indices]
        if max_tokens:
            lengths = [row_length(seqs, row) for row in rows]
            return [[rows[j] for j in group] for group in budget_groups(lengths, max_tokens)]
        micros: list[list[list[int]]] = []
        for row in rows:  # in order, up to `size` sequences each (a larger row alone)
            if micros and sum(map(len, micros[-1])) + len(row) <= size:
                micros[-1].append(row)
            else:
                micros.append([row])
        return micros

    plans = [share(r) for r in range(world_size)]
    num_micro = max(max(map(len, plans)), 1)
    micros = []
    for rows in plans[rank]:
        group = [i for row in rows for i in row]
        if shared_row_tokens:
            position = {i: b for b, i in enumerate(group)}
            micro = pack_shared([seqs[i] for i in group], [[position[i] for i in row] for row in rows], pad_id)
        else:
            micro = pack([seqs[i] for i in group], pad_id)
        micro.seq_index_B = group
        micros.append(micro)
    micros += [padding_micro(pad_id) for _ in range(num_micro - len(micros))]
    for m in micros:
        m.num_loss_tokens_in_step = num_tokens
        m.num_seqs_in_step = float(len(seqs))
    return micros
