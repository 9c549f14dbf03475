"""Per-token estimators of KL(pi || pi_ref) from the logprobs of sampled tokens (Schulman's k1,
k2, k3): with d = log pi(x) - log pi_ref(x) and x ~ pi, k1 = d (unbiased, can be negative),
k2 = d^2 / 2 (biased, low variance), k3 = exp(-d) - 1 + d (unbiased, never negative)."""

from __future__ import annotations

import torch


def kl_estimate(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor, estimator: str) -> torch.Tensor:
    """Elementwise estimate; differentiable in `logprobs_BT`."""
    d_BT = logprobs_BT - ref_logprobs_BT
    if estimator == "k1":
        return d_BT
    if estimator == "k2":
        return 0.5 * d_BT**2
    if estimator == "k3":
        return torch.exp(-d_BT) - 1 + d_BT
    raise ValueError(f"algorithm.kl.estimator={estimator!r}: choose k1, k2 or k3")
