"""pass@k: the chance that at least one of k completions drawn (without replacement) from n sampled
ones is correct, given that c of the n are — the unbiased estimator 1 - C(n-c, k) / C(n, k) of
Chen et al. (2021), computed as a product so that large n neither overflows nor loses precision.
The learner's held-out evaluations (`learner.eval_pass_k`) and `rlmesh eval` both report it."""

from __future__ import annotations

from collections.abc import Iterable


def pass_at_k(n: int, c: int, k: int) -> float:
    """Estimated pass@k of one prompt with `c` correct completions out of `n` sampled."""
    if not (0 <= c <= n) or not (1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct completion
        return 1.0
    # C(n-c, k) / C(n, k) = prod over i in (n-c, n] of (1 - k / i)
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def mean_pass_at_k(counts: Iterable[tuple[int, int]], k: int) -> float:
    """pass@k averaged over prompts, each given as (n sampled, c correct)."""
    values = [pass_at_k(n, c, k) for n, c in counts]
    if not values:
        raise ValueError("pass@k of no prompts")
    return sum(values) / len(values)
