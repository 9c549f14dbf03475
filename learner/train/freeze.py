"""`learner.freeze`: parameters that stay as loaded while the rest of the model trains."""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def freeze(model: torch.nn.Module, patterns: list[str]) -> None:
    """Set requires_grad=False on every parameter whose name (as the Hugging Face model names it)
    one of `patterns` matches (re.search). A tied output layer is the embedding under a second name:
    freezing either freezes both. Raises ValueError when a pattern matches no parameter or when
    nothing would be left to train."""
    if not patterns:
        return
    named = list(model.named_parameters(remove_duplicate=False))
    frozen: set[str] = set()
    for pattern in map(re.compile, patterns):
        hits = {name for name, _ in named if pattern.search(name)}
        if not hits:
            sample = ", ".join(name for name, _ in named[:4])
            raise ValueError(f"learner.freeze: {pattern.pattern!r} matches no parameter of this model "
                             f"(its names look like {sample}, ...); fix the pattern or drop it")
        frozen |= hits
    for name, param in named:
        if name in frozen:
            param.requires_grad_(False)
    if not any(p.requires_grad for _, p in named):
        raise ValueError(f"learner.freeze={patterns!r} freezes every parameter: nothing would train")
    count = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    names = sorted(frozen)
    log.info("learner.freeze: %d parameter tensors frozen (%.1f M of %.1f M values): %s", len(names),
             count / 1e6, total / 1e6, ", ".join(names[:6]) + (" ..." if len(names) > 6 else ""))
