"""Attention over shared-prompt rows (`learner.shared_prompt_row_tokens`) by segment, not by row.

A row holds one prompt and then completions of it; under the row's mask each completion attends to
the prompt and causally to itself, so a [L, L] attention over the whole row computes mostly masked
pairs (a row of a 64-token prompt and eight 100-token completions: ~13% of its pairs are used).
Here each segment (the prompt, or one completion) gathers its queries and the keys it may see into a
batch of short rows ([S, H, Q, K]: Q its longest segment, K the prompt plus its longest completion),
SDPA runs on that batch, and the outputs go back to their places in the row. Same values as the
masked row (float sums in another order), a fraction of the work: SmolLM2's learner step on the
demo's batch spent a third of its time in the row attention's backward on a CPU.

Installed over HF's "sdpa" entry of `AttentionInterface` in the learner's process; it acts only
inside `segments(layout)` (the backend's shared-prompt forward) and on layers it can serve exactly
(no sliding window, softcap, sinks or dropout, queries and keys the same row); everything else
goes to HF's own SDPA with the row's mask, as before.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

from rlmesh.learner.train.batch import SegmentLayout

_layout: contextvars.ContextVar[SegmentLayout | None] = contextvars.ContextVar("rlmesh_segments", default=None)


@contextlib.contextmanager
def segments(layout: SegmentLayout | None) -> Iterator[None]:
    """Attention calls inside run by segment over `layout` (None: as HF runs them)."""
    token = _layout.set(layout)
    try:
        yield
    finally:
        _layout.reset(token)


def _servable(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, dropout: float, kwargs: dict) -> bool:
    return (dropout == 0.0 and query.shape[2] == key.shape[2] and getattr(module, "sliding_window", None) is None
            and kwargs.get("sliding_window") is None and kwargs.get("softcap") is None
            and kwargs.get("s_aux") is None and kwargs.get("position_bias") is None and kwargs.get("cache") is None)


def _gather(x_BHLD: torch.Tensor, index_SN: torch.Tensor) -> torch.Tensor:
    """[B, H, L, D] at flattened positions [S, N] -> [S, H, N, D]."""
    b, h, length, d = x_BHLD.shape
    flat = x_BHLD.transpose(1, 2).reshape(b * length, h, d)
    return flat[index_SN.reshape(-1)].view(*index_SN.shape, h, d).transpose(1, 2)


def segment_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      layout: SegmentLayout, scaling: float | None) -> torch.Tensor:
    """HF's attention output ([B, L, H, D]) for rows laid out as `layout` says."""
    b, h, length, d = query.shape
    groups = h // key.shape[1]
    q = _gather(query, layout.q_index_SQ)
    k, v = _gather(key, layout.k_index_SK), _gather(value, layout.k_index_SK)
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if q.device.type == "cpu":
        # CPU's flash-attention backward in bfloat16 took twice its float32 time at these sizes
        # (SmolLM2's heads, 9 segments of 128 x 192: 36 against 19 ms), for a 2% larger forward.
        q, k, v = q.float(), k.float(), v.float()
    out_SHQD = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=layout.mask_S1QK, scale=scaling).to(query.dtype)
    out_ND = out_SHQD.transpose(1, 2)[layout.q_valid_SQ]  # [N, H, D], N: the real queries
    out = out_ND.new_zeros(b * length, h, d).index_put((layout.q_index_SQ[layout.q_valid_SQ],), out_ND)
    return out.view(b, length, h, d)


def install() -> None:
    """Puts the segment path in front of HF's "sdpa" attention, once per process."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if getattr(AttentionInterface._global_mapping.get("sdpa"), "rlmesh_segments", False):
        return

    def sdpa_or_segments(module, query, key, value, attention_mask, scaling: float | None = None, **kwargs):
        dropout = kwargs.pop("dropout", 0.0)  # the attention's dropout (HF passes 0 unless training with it)
        layout = _layout.get()
        if layout is None or not _servable(module, query, key, dropout, kwargs):
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kwargs)
        return segment_attention(module, query, key, value, layout, scaling), None

    sdpa_or_segments.rlmesh_segments = True
    AttentionInterface.register("sdpa", sdpa_or_segments)
