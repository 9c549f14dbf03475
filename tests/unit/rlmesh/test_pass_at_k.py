"""The pass@k estimator against a direct count over every k-subset of the n completions."""

import itertools
import random

import pytest

from rlmesh.services.domain.pass_at_k import mean_pass_at_k, pass_at_k


def _by_count(n: int, c: int, k: int) -> float:
    solved = [i < c for i in range(n)]
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(solved[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8, 10])
def test_matches_a_direct_count_over_all_k_subsets(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(_by_count(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_1_is_the_fraction_correct_and_large_n_stays_finite():
    rng = random.Random(0)
    for _ in range(50):
        n = rng.randint(1, 64)
        c = rng.randint(0, n)
        assert pass_at_k(n, c, 1) == pytest.approx(c / n)
    assert 0.0 < pass_at_k(10_000, 3, 100) < 1.0  # C(10000, 100) overflows a float; the product does not
    assert pass_at_k(10_000, 0, 100) == 0.0 and pass_at_k(10_000, 9_950, 100) == 1.0
    assert mean_pass_at_k([(4, 0), (4, 4)], 2) == pytest.approx(0.5)


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 8)
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(4, 5, 1)
