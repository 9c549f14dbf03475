"""Per-token estimators of KL(pi || pi_ref) from the logprobs of sampled tokens (Schulman's k1,
k2, k3): with d = log pi(x) - log pi_ref(x) and x ~ pi, k1 = d (unbiased, can be negative),
k2 = d^2 / 2 (biased, low variance), k3 = exp(-d) - 1 + d (unbiased, never negative).

Samples here come from the behaviour policy, possibly a version or two old: a token the policy has
since made unlikely has d << 0 and a k3 of exp(-d), which alone can outweigh the whole step. The
estimate is therefore clamped to [-clamp, clamp] (as verl's low_var_kl does at 10)."""

from __future__ import annotations

import torch


def kl_estimate(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor, estimator: str,
                clamp: float | None = None) -> torch.Tensor:
    """Elementwise estimate, clamped to [-clamp, clamp] where given; differentiable in `logprobs_BT`
    (no gradient where clamped)."""
    d_BT = logprobs_BT - ref_logprobs_BT
    if estimator == "k1":
        kl_BT = d_BT
    elif estimator == "k2":
        kl_BT = 0.5 * d_BT**2
    elif estimator == "k3":
        kl_BT = torch.exp(-d_BT) - 1 + d_BT
    else:
        raise ValueError(f"algorithm.kl.estimator={estimator!r}: choose k1, k2 or k3")
    return kl_BT if clamp is None else kl_BT.clamp(-clamp, clamp)
