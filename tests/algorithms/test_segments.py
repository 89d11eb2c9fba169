"""Ragged group reductions against per-group Python loops."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.algorithms import segments


def _loop_groups(values: list[float], ids: list[int], num_groups: int) -> list[list[float]]:
    groups: list[list[float]] = [[] for _ in range(num_groups)]
    for value, gid in zip(values, ids):
        groups[gid].append(value)
    return groups


def _loop_std(members: list[float], unbiased: bool) -> float:
    n = len(members)
    dof = n - 1 if unbiased else n
    if dof <= 0:
        return 0.0
    mean = sum(members) / n
    return math.sqrt(sum((x - mean) ** 2 for x in members) / dof)


ragged_batches = st.integers(min_value=1, max_value=6).flatmap(
    lambda num_groups: st.tuples(
        st.just(num_groups),
        st.lists(st.integers(0, num_groups - 1), min_size=1, max_size=24),
    )
).flatmap(
    lambda pair: st.tuples(
        st.just(pair[0]),
        st.just(pair[1]),
        st.lists(
            st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False),
            min_size=len(pair[1]),
            max_size=len(pair[1]),
        ),
    )
)


@settings(max_examples=60, deadline=None)
@given(ragged_batches)
def test_reductions_match_loop_reference(batch):
    num_groups, ids, values = batch
    group_ids = torch.tensor(ids, dtype=torch.int64)
    tensor = torch.tensor(values, dtype=torch.float64)
    groups = _loop_groups(values, ids, num_groups)

    counts = segments.group_counts(group_ids, num_groups)
    sums = segments.group_sum(tensor, group_ids, num_groups)
    means = segments.group_mean(tensor, group_ids, num_groups)
    std_pop = segments.group_std(tensor, group_ids, num_groups)
    std_unbiased = segments.group_std(tensor, group_ids, num_groups, unbiased=True)
    maxima = segments.group_max(tensor, group_ids, num_groups)
    minima = segments.group_min(tensor, group_ids, num_groups)
    for g, members in enumerate(groups):
        assert int(counts[g]) == len(members)
        assert float(sums[g]) == pytest.approx(sum(members), abs=1e-9)
        expected_mean = sum(members) / len(members) if members else 0.0
        assert float(means[g]) == pytest.approx(expected_mean, abs=1e-9)
        assert float(std_pop[g]) == pytest.approx(_loop_std(members, False), abs=1e-7)
        assert float(std_unbiased[g]) == pytest.approx(_loop_std(members, True), abs=1e-7)
        assert float(maxima[g]) == (max(members) if members else -math.inf)
        assert float(minima[g]) == (min(members) if members else math.inf)


def test_hand_computed_ragged_noncontiguous_groups():
    # group 0 = {2}, group 1 = {1, 3, 5}, group 2 = {4}
    group_ids = torch.tensor([1, 0, 1, 2, 1])
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    assert segments.group_counts(group_ids).tolist() == [1, 3, 1]
    assert segments.group_sum(values, group_ids).tolist() == [2.0, 9.0, 4.0]
    assert segments.group_mean(values, group_ids).tolist() == [2.0, 3.0, 4.0]
    # group 1: deviations (-2, 0, 2) → population var 8/3, sample var 4
    assert segments.group_std(values, group_ids)[1].item() == pytest.approx(math.sqrt(8 / 3))
    assert segments.group_std(values, group_ids, unbiased=True).tolist() == [0.0, 2.0, 0.0]
    assert segments.broadcast(segments.group_mean(values, group_ids), group_ids).tolist() == [3.0, 2.0, 3.0, 4.0, 3.0]


def test_trailing_empty_group_and_multidimensional_values():
    group_ids = torch.tensor([0, 0, 1])
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    means = segments.group_mean(values, group_ids, num_groups=3)
    assert means.tolist() == [[2.0, 3.0], [5.0, 6.0], [0.0, 0.0]]
    assert segments.group_std(values, group_ids, num_groups=3)[2].tolist() == [0.0, 0.0]
    assert segments.group_counts(group_ids, 3).tolist() == [2, 1, 0]


def test_std_is_stable_for_large_offsets():
    # E[x²] − E[x]² would lose all digits here; the two-pass form keeps them.
    values = torch.tensor([1e8 + 1.0, 1e8 - 1.0, 1e8 + 1.0, 1e8 - 1.0], dtype=torch.float64)
    std = segments.group_std(values, torch.zeros(4, dtype=torch.int64))
    assert std.item() == pytest.approx(1.0, rel=1e-9)


def test_group_mean_and_std_are_differentiable():
    group_ids = torch.tensor([0, 1, 0, 1, 1])
    values = torch.randn(5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v: segments.group_mean(v, group_ids), (values,))
    assert torch.autograd.gradcheck(lambda v: segments.group_std(v, group_ids), (values,))


def test_check_group_ids_rejects_bad_input():
    with pytest.raises(ValueError, match="non-negative"):
        segments.check_group_ids(torch.tensor([0, -1]))
    with pytest.raises(ValueError, match="out of range"):
        segments.check_group_ids(torch.tensor([0, 3]), num_groups=3)
    with pytest.raises(ValueError, match="integer"):
        segments.check_group_ids(torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="1-D"):
        segments.check_group_ids(torch.zeros(2, 2, dtype=torch.int64))
    assert segments.check_group_ids(torch.tensor([2, 0])) == 3
    assert segments.check_group_ids(torch.zeros(0, dtype=torch.int64)) == 0


def test_count_true_matches_sum():
    gen = torch.Generator().manual_seed(0)
    mask = torch.rand(7, 300, generator=gen) < 0.3
    assert torch.equal(segments.count_true(mask, dim=1), mask.sum(dim=1))
    assert int(segments.count_true(mask)) == int(mask.sum())
    assert segments.count_true(mask).dtype == torch.int64
    # A strided view (a column slice) counts the same.
    assert torch.equal(segments.count_true(mask[:, ::3], dim=1), mask[:, ::3].sum(dim=1))


def test_all_finite_fast_path_and_masked_fallback():
    values = torch.tensor([[0.5, -2.0, float("nan")], [1.0, float("inf"), 3.0]])
    assert not segments.all_finite(values)
    padding_ok = torch.tensor([[True, True, False], [True, False, True]])
    assert segments.all_finite(values, padding_ok)  # non-finite only under padding
    assert not segments.all_finite(values, torch.ones(2, 3, dtype=torch.bool))
    assert segments.all_finite(torch.zeros(0))
    assert segments.all_finite(torch.tensor([-float("inf")]), torch.tensor([False]))
    assert not segments.all_finite(torch.tensor([1.0, -float("inf")]))


def test_runs_and_positions_against_loops():
    gen = torch.Generator().manual_seed(1)
    lengths = torch.tensor([3, 0, 1, 4])
    values = torch.randn(int(lengths.sum()), generator=gen, dtype=torch.float64)
    chunks = torch.split(values, lengths.tolist())
    assert torch.allclose(segments.run_sum(values, lengths),
                          torch.stack([c.sum() for c in chunks]), rtol=0, atol=1e-12)
    expected_min = [float(c.min()) if c.numel() else float("inf") for c in chunks]
    assert segments.run_min(values, lengths).tolist() == expected_min
    assert segments.run_sum(values[:0], torch.zeros(0, dtype=torch.int64)).numel() == 0
    sorted_ids = torch.tensor([0, 0, 0, 2, 2, 3])
    assert segments.positions_in_sorted_groups(sorted_ids, 4).tolist() == [0, 1, 2, 0, 1, 0]
