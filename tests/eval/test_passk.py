import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.eval.passk import avg_at_k, macro_and_weighted, pass_at_k, summarize


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of all k-subsets of n samples (c correct) that contain a correct one."""
    outcomes = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_matches_enumeration_of_all_subsets(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            got = pass_at_k([n], [c], k)[0]
            assert got == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


def test_hand_computed_case():
    # n=4, c=1, k=2: C(3,2)/C(4,2) = 3/6 → pass@2 = 0.5; k=1 → c/n = 0.25.
    assert pass_at_k([4], [1], 2)[0] == pytest.approx(0.5)
    assert pass_at_k([4], [1], 1)[0] == pytest.approx(0.25)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 300), data=st.data())
def test_equals_exact_binomial_ratio(n, data):
    c = data.draw(st.integers(0, n))
    k = data.draw(st.integers(1, n))
    exact = 1.0 - math.comb(n - c, k) / math.comb(n, k)
    assert pass_at_k([n], [c], k)[0] == pytest.approx(exact, abs=1e-9)


def test_vectorized_ragged_problems_and_monotone_in_k():
    n = np.array([32, 32, 16, 8])
    c = np.array([0, 32, 3, 7])
    values = [pass_at_k(n, c, k) for k in (1, 2, 4, 8)]
    assert values[0].tolist() == pytest.approx([0.0, 1.0, 3 / 16, 7 / 8])
    for smaller, larger in zip(values, values[1:]):
        assert np.all(larger >= smaller - 1e-15)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="at least 4 samples"):
        pass_at_k([3], [1], 4)
    with pytest.raises(ValueError, match=r"\[0, num_samples\]"):
        pass_at_k([3], [5], 1)
    with pytest.raises(ValueError, match="k must be"):
        pass_at_k([3], [1], 0)
    with pytest.raises(ValueError, match="shape"):
        pass_at_k([3, 3], [1], 1)


def test_summary_and_averages():
    summary = summarize([4, 4], [1, 4], ks=[1, 2, 8])
    assert summary == pytest.approx({"pass@1": (0.25 + 1.0) / 2, "pass@2": (0.5 + 1.0) / 2, "avg@n": 0.625})
    assert avg_at_k([4, 2], [1, 2]).tolist() == [0.25, 1.0]
    combined = macro_and_weighted({"a": {"pass@1": 0.2}, "b": {"pass@1": 0.8}}, {"a": 300, "b": 100})
    assert combined["macro"]["pass@1"] == pytest.approx(0.5)
    assert combined["weighted"]["pass@1"] == pytest.approx(0.35)
