"""D³S ("Learning More with Less: A Dynamic Dual-Level Down-Sampling Framework for Efficient Policy Optimization"):
Eq. 6–9, variants, metrics."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.algorithms.d3s import (
    _BRACKET_MIN_POOL,
    _BRACKET_SAMPLE_SIZE,
    D3S_VARIANTS,
    D3SSchedule,
    _kth_largest,
    d3s_cross_select,
    d3s_intra_select,
    d3s_topk_token_weights,
    d3s_variant,
    keep_ratio_at,
    max_variance_subset,
    num_keep_at,
    schedule_value_at,
)
from pipeline.rl.methods import SAMPLE_SELECTORS, TOKEN_WEIGHTS

# --------------------------------------------------------------------------- #
# Reference implementations, straight from the equations (float64 loops)       #
# --------------------------------------------------------------------------- #


def population_var(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return sum((v - mean) ** 2 for v in values) / len(values)


def brute_force_max_var(values: list[float], size: int) -> float:
    """Eq. 6/7 literally: max over all subsets of the given size."""
    subsets = itertools.combinations(range(len(values)), size)
    return max(population_var([values[j] for j in c]) for c in subsets)


def reference_topk(
    scores: list[list[float]], valid: list[list[bool]], units: list[int], keep_ratio: float
) -> list[list[float]]:
    """Eq. 8: per pool, the ceil(K·n) highest |A|·H, ties to the lower flat index."""
    num_cols = len(scores[0])
    weights = [[0.0] * num_cols for _ in scores]
    for unit in set(units):
        pool = [
            (-scores[r][c], r * num_cols + c, r, c)
            for r in range(len(scores))
            if units[r] == unit
            for c in range(num_cols)
            if valid[r][c]
        ]
        if not pool:
            continue
        num_keep = max(1, math.ceil(round(keep_ratio * len(pool), 9)))
        for _, _, r, c in sorted(pool)[:num_keep]:
            weights[r][c] = 1.0
    return weights


def selected_var_per_group(values: torch.Tensor, group_ids: torch.Tensor, keep: torch.Tensor):
    out = {}
    for g in group_ids.unique().tolist():
        kept = values[(group_ids == g) & keep].tolist()
        out[g] = population_var(kept) if kept else 0.0
    return out


# --------------------------------------------------------------------------- #
# Sample level                                                                 #
# --------------------------------------------------------------------------- #


def test_max_variance_hand_computed():
    # Group 0: [0, 1, -1, 2, 0.5, -3], N = 3. Candidates "i largest + 3−i smallest":
    #   i=0 {-3,-1,0}: mean -4/3, var (9+1+0)/3 - 16/9 = 1.556
    #   i=1 {-3,-1,2}: mean -2/3, var 14/3 - 4/9     = 4.222
    #   i=2 {-3,1,2}:  mean 0,    var (9+1+4)/3      = 4.667  <- best
    #   i=3 {0.5,1,2}: var 0.389
    # Group 1: [1, 1, 1] (smaller-or-equal to N) keeps everything.
    values = torch.tensor([0.0, 1.0, -1.0, 2.0, 0.5, -3.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    group_ids = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1, 1])
    keep = max_variance_subset(values, group_ids, num_keep=3)
    assert keep.tolist() == [False, True, False, True, False, True, True, True, True]
    (mask, adv), metrics = d3s_intra_select(
        advantages=values, rewards=None, group_ids=group_ids, num_keep=3, generator=None
    )
    assert torch.equal(mask, keep)
    assert adv is values  # D³S keeps the full-group advantages
    assert metrics["d3s/num_kept_samples"] == 6
    # pooled kept {1,2,-3,1,1,1}: mean 0.5, E[x²] = (1+4+9+3)/6 = 17/6
    assert float(metrics["d3s/selected_adv_var"]) == pytest.approx(17 / 6 - 0.25)
    assert float(metrics["d3s/selected_adv_abs_mean"]) == pytest.approx(9 / 6)


@pytest.mark.parametrize("seed", range(6))
def test_intra_matches_brute_force_on_ragged_groups(seed):
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 9, (5,), generator=gen).tolist()
    group_ids = torch.cat([torch.full((n,), g) for g, n in enumerate(sizes)])
    group_ids = group_ids[torch.randperm(len(group_ids), generator=gen)]  # non-contiguous
    # Small integer grid: plenty of ties.
    values = torch.randint(-3, 4, (len(group_ids),), generator=gen).to(torch.float64) / 2
    num_keep = 3
    keep = max_variance_subset(values, group_ids, num_keep=num_keep)
    got = selected_var_per_group(values, group_ids, keep)
    for g, n in enumerate(sizes):
        members = values[group_ids == g].tolist()
        size = min(num_keep, n)
        assert int(keep[group_ids == g].sum()) == size
        assert got[g] == pytest.approx(brute_force_max_var(members, size), abs=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_cross_matches_brute_force_over_pooled_batch(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    sizes = [4, 3, 5]
    group_ids = torch.cat([torch.full((n,), g) for g, n in enumerate(sizes)])
    values = torch.randn(len(group_ids), generator=gen, dtype=torch.float64)
    (keep, adv), _ = d3s_cross_select(
        advantages=values, rewards=None, group_ids=group_ids, num_keep=2, generator=None
    )
    assert int(keep.sum()) == 2 * len(sizes)  # N = B·N_s
    assert adv is values  # no re-normalisation (Sec. 3.1)
    assert population_var(values[keep].tolist()) == pytest.approx(
        brute_force_max_var(values.tolist(), 6), abs=1e-12
    )


def test_cross_count_on_ragged_groups_is_what_intra_keeps():
    group_ids = torch.tensor([0, 0, 0, 0, 1, 2, 2])
    values = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0, 2.0, -2.0])
    (keep, _), _ = d3s_cross_select(
        advantages=values, rewards=None, group_ids=group_ids, num_keep=3, generator=None
    )
    assert int(keep.sum()) == 3 + 1 + 2


def test_cross_drops_zero_advantage_groups_and_raises_usefulness():
    # Group 0 all correct (A = 0), group 1 mixed: GRPO trains on 1 of 2 useful
    # groups; cross-group selection of N = 2·2 = 4 takes only group 1 (Sec. 4.6).
    advantages = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, -1.0, 1.0, -1.0])
    group_ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    (keep, _), metrics = d3s_cross_select(
        advantages=advantages, rewards=None, group_ids=group_ids, num_keep=2, generator=None
    )
    assert keep.tolist() == [False] * 4 + [True] * 4
    assert float(metrics["d3s/sample_usefulness_rate"]) == 1.0
    assert float(metrics["d3s/input_usefulness_rate"]) == 0.5
    _, intra_metrics = d3s_intra_select(
        advantages=advantages, rewards=None, group_ids=group_ids, num_keep=2, generator=None
    )
    assert float(intra_metrics["d3s/sample_usefulness_rate"]) == 0.5


def test_zero_variance_group_and_group_of_one_are_deterministic():
    values = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.7])
    group_ids = torch.tensor([0, 0, 0, 0, 1])
    keep = max_variance_subset(values, group_ids, num_keep=2)
    # All splits tie at variance 0: the first split (i = 0) keeps the lowest indices.
    assert keep.tolist() == [True, True, False, False, True]
    assert torch.equal(keep, max_variance_subset(values, group_ids, num_keep=2))


def test_ties_among_equal_values_prefer_higher_index_as_larger():
    # Values {1,1,0,0}, N = 2: best subset is one 1 and one 0; the "largest" 1 is
    # the higher-index one, the "smallest" 0 the lower-index one.
    values = torch.tensor([1.0, 0.0, 1.0, 0.0])
    keep = max_variance_subset(values, torch.zeros(4, dtype=torch.int64), num_keep=2)
    assert keep.tolist() == [False, True, True, False]


def test_random_ties_are_reproducible_and_still_optimal():
    # Two groups with the same pass rate: cross-group ties between them are
    # resolved by batch position unless random_ties draws the order.
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0])
    group_ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    kwargs = dict(advantages=advantages, rewards=None, group_ids=group_ids, num_keep=1)
    (fixed, _), _ = d3s_cross_select(**kwargs, generator=None)
    assert fixed.nonzero().flatten().tolist() == [1, 6]  # lowest-index −1, highest-index +1
    masks = set()
    for seed in range(8):
        (keep, _), _ = d3s_cross_select(
            **kwargs, generator=torch.Generator().manual_seed(seed), random_ties=True
        )
        (again, _), _ = d3s_cross_select(
            **kwargs, generator=torch.Generator().manual_seed(seed), random_ties=True
        )
        assert torch.equal(keep, again)
        assert population_var(advantages[keep].tolist()) == pytest.approx(1.0)
        masks.add(tuple(keep.tolist()))
    assert len(masks) > 1
    with pytest.raises(ValueError, match="Generator"):
        d3s_intra_select(**kwargs, generator=None, random_ties=True)


def test_selection_is_permutation_equivariant_for_distinct_values():
    gen = torch.Generator().manual_seed(7)
    values = torch.randn(20, generator=gen, dtype=torch.float64)
    group_ids = torch.arange(20) % 3
    perm = torch.randperm(20, generator=gen)
    keep = max_variance_subset(values, group_ids, num_keep=4)
    keep_perm = max_variance_subset(values[perm], group_ids[perm], num_keep=4)
    assert torch.equal(keep[perm], keep_perm)


def test_large_common_offset_does_not_break_variance():
    # Rewards around 1e8 would cancel catastrophically in E[x²] − E[x]² without centring.
    values = 1e8 + torch.tensor([0.0, 1.0, 2.0, 3.0, 10.0], dtype=torch.float64)
    keep = max_variance_subset(values, torch.zeros(5, dtype=torch.int64), num_keep=2)
    assert keep.tolist() == [True, False, False, False, True]


def test_sample_level_errors():
    ids = torch.tensor([0, 0])
    with pytest.raises(ValueError, match="non-finite"):
        d3s_intra_select(
            advantages=torch.tensor([0.0, float("nan")]), rewards=None, group_ids=ids,
            num_keep=1, generator=None,
        )
    with pytest.raises(ValueError, match="at least 1"):
        d3s_cross_select(
            advantages=torch.zeros(2), rewards=None, group_ids=ids, num_keep=0, generator=None
        )
    with pytest.raises(ValueError, match="shape"):
        max_variance_subset(torch.zeros(3), ids, num_keep=1)
    with pytest.raises(ValueError, match="non-negative"):
        max_variance_subset(torch.zeros(2), torch.tensor([0, -1]), num_keep=1)


def test_empty_batch():
    keep = max_variance_subset(torch.zeros(0), torch.zeros(0, dtype=torch.int64), num_keep=3)
    assert keep.shape == (0,)


def sample_var(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return sum((v - mean) ** 2 for v in values) / (len(values) - 1)


@settings(max_examples=150, deadline=None)
@given(
    raw=st.lists(
        st.floats(min_value=-100, max_value=100, allow_nan=False, allow_infinity=False),
        min_size=2,
        max_size=9,
    ),
    data=st.data(),
)
def test_lemma1_standardized_advantages_have_subset_with_var_at_least_one(raw, data):
    """D³S Lemma 1: for standardized A and 2 ≤ N ≤ M some |A'| = N has Var(A') ≥ 1.

    It holds with the Bessel-corrected variance (the sample variance is a
    U-statistic, so its average over all N-subsets equals the full set's);
    see the population-variance counterexample below.
    """
    values = torch.tensor(raw, dtype=torch.float64)
    std = values.std(unbiased=True)
    if std < 1e-6 * max(1.0, float(values.abs().max())):
        return  # no standardization exists
    standardized = (values - values.mean()) / std
    size = data.draw(st.integers(min_value=2, max_value=len(raw)))
    best = max(
        sample_var([standardized[j].item() for j in c])
        for c in itertools.combinations(range(len(raw)), size)
    )
    assert best >= 1 - 1e-9
    pooled = torch.zeros(len(raw), dtype=torch.int64)
    keep = max_variance_subset(standardized, pooled, num_keep=size)
    assert int(keep.sum()) == size
    assert sample_var(standardized[keep].tolist()) >= 1 - 1e-9
    assert sample_var(standardized[keep].tolist()) == pytest.approx(best, abs=1e-9)


def test_lemma1_fails_for_population_variance():
    # A = [-1, -1, 1, 1] has mean 0 and population variance 1, yet the best
    # 3-subset {-1, -1, 1} has population variance 8/9 < 1: App. B.3's identity
    # n·Var(A'_n) + (a − μ_{n+1})² = (n+1)·Var(A'_{n+1}) is only an inequality.
    # The selector still returns the optimum.
    values = torch.tensor([-1.0, -1.0, 1.0, 1.0], dtype=torch.float64)
    keep = max_variance_subset(values, torch.zeros(4, dtype=torch.int64), num_keep=3)
    assert population_var(values[keep].tolist()) == pytest.approx(8 / 9)
    assert brute_force_max_var(values.tolist(), 3) == pytest.approx(8 / 9)


@settings(max_examples=150, deadline=None)
@given(
    raw=st.lists(st.integers(min_value=-4, max_value=4), min_size=1, max_size=9),
    data=st.data(),
)
def test_selector_equals_brute_force_property(raw, data):
    values = torch.tensor(raw, dtype=torch.float64) / 3
    size = data.draw(st.integers(min_value=1, max_value=len(raw)))
    keep = max_variance_subset(values, torch.zeros(len(raw), dtype=torch.int64), num_keep=size)
    assert population_var(values[keep].tolist()) == pytest.approx(
        brute_force_max_var(values.tolist(), size), abs=1e-12
    )


# --------------------------------------------------------------------------- #
# Token level                                                                  #
# --------------------------------------------------------------------------- #


def test_topk_hand_computed():
    # |A| = [1, 2]; H row0 = [0.5, 0.1, 0.4], row1 = [0.3, 0.0, 0.2] (row1 col2 masked).
    # keys: row0 = [0.5, 0.1, 0.4], row1 = [0.6, 0.0, —]; n = 5 valid tokens,
    # K = 0.5 → ceil(2.5) = 3 tokens: 0.6 (1,0), 0.5 (0,0), 0.4 (0,2).
    advantages = torch.tensor([1.0, -2.0])
    entropy = torch.tensor([[0.5, 0.1, 0.4], [0.3, 0.0, 0.2]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    weights, metrics = d3s_topk_token_weights(
        advantages=advantages, entropy=entropy, logprobs=None, response_mask=mask,
        group_ids=torch.tensor([0, 0]), keep_ratio=0.5,
    )
    assert weights.tolist() == [[1.0, 0.0, 1.0], [1.0, 0.0, 0.0]]
    assert int(metrics["d3s/num_kept_tokens"]) == 3
    assert float(metrics["d3s/kept_token_ratio"]) == pytest.approx(0.6)
    # Per-sample scope: row0 n=3 → 2 tokens, row1 n=2 → 1 token.
    weights, _ = d3s_topk_token_weights(
        advantages=advantages, entropy=entropy, logprobs=None, response_mask=mask,
        group_ids=torch.tensor([0, 0]), keep_ratio=0.5, scope="sample",
    )
    assert weights.tolist() == [[1.0, 0.0, 1.0], [1.0, 0.0, 0.0]]


@pytest.mark.parametrize("scope", ["batch", "group", "sample"])
@pytest.mark.parametrize("keep_ratio", [0.05, 0.2, 0.3, 0.5, 1.0])
def test_topk_matches_reference(scope, keep_ratio):
    gen = torch.Generator().manual_seed(11)
    num_rows, num_cols = 7, 9
    advantages = torch.randint(-2, 3, (num_rows,), generator=gen).to(torch.float64)
    entropy = torch.randint(0, 4, (num_rows, num_cols), generator=gen).to(torch.float64) / 4
    lengths = torch.randint(0, num_cols + 1, (num_rows,), generator=gen)
    mask = torch.arange(num_cols)[None, :] < lengths[:, None]
    group_ids = torch.tensor([0, 0, 1, 1, 1, 2, 2])
    weights, _ = d3s_topk_token_weights(
        advantages=advantages, entropy=entropy, logprobs=None, response_mask=mask,
        group_ids=group_ids, keep_ratio=keep_ratio, scope=scope,
    )
    scores = (advantages.abs()[:, None] * entropy).tolist()
    units = {"batch": [0] * num_rows, "group": group_ids.tolist(), "sample": list(range(num_rows))}
    expected = reference_topk(scores, mask.tolist(), units[scope], keep_ratio)
    assert weights.tolist() == expected


def test_topk_count_rounding():
    entropy = torch.rand(1, 10, generator=torch.Generator().manual_seed(0)) + 0.1
    mask = torch.ones(1, 10, dtype=torch.bool)
    kwargs = dict(advantages=torch.ones(1), entropy=entropy, logprobs=None,
                  response_mask=mask, group_ids=torch.zeros(1, dtype=torch.int64))
    # 0.1 * 3 = 0.30000000000000004 → 3 tokens, not 4.
    assert int(d3s_topk_token_weights(**kwargs, keep_ratio=0.1 * 3)[0].sum()) == 3
    assert int(d3s_topk_token_weights(**kwargs, keep_ratio=0.25)[0].sum()) == 3  # ceil(2.5)
    assert int(d3s_topk_token_weights(**kwargs, keep_ratio=0.01)[0].sum()) == 1  # ceil(0.1)
    assert int(d3s_topk_token_weights(**kwargs, keep_ratio=1e-7)[0].sum()) == 1  # at least one


def test_topk_masks_and_sample_keep_mask():
    entropy = torch.ones(3, 4)
    mask = torch.tensor([[True] * 4, [False] * 4, [True, True, False, False]])
    advantages = torch.tensor([1.0, 5.0, 2.0])
    weights, metrics = d3s_topk_token_weights(
        advantages=advantages, entropy=entropy, logprobs=None, response_mask=mask,
        group_ids=torch.zeros(3, dtype=torch.int64), keep_ratio=1.0,
    )
    assert torch.equal(weights.bool(), mask)  # K = 1 keeps exactly the valid tokens
    # Row 2 dropped by the sample selector: only row 0 competes; ceil(0.5·4) = 2.
    weights, metrics = d3s_topk_token_weights(
        advantages=advantages, entropy=entropy, logprobs=None, response_mask=mask,
        group_ids=torch.zeros(3, dtype=torch.int64), keep_ratio=0.5,
        sample_keep_mask=torch.tensor([True, True, False]),
    )
    assert weights.tolist() == [[1, 1, 0, 0], [0] * 4, [0] * 4]
    assert int(metrics["d3s/num_valid_tokens"]) == 4
    # Nothing valid at all: all zeros, ratio 0.
    weights, metrics = d3s_topk_token_weights(
        advantages=advantages, entropy=entropy, logprobs=None,
        response_mask=torch.zeros(3, 4, dtype=torch.bool),
        group_ids=torch.zeros(3, dtype=torch.int64), keep_ratio=0.5,
    )
    assert weights.sum() == 0 and float(metrics["d3s/kept_token_ratio"]) == 0.0


def test_topk_errors_and_no_grad():
    mask = torch.tensor([[True, False]])
    kwargs = dict(advantages=torch.ones(1), logprobs=None, response_mask=mask,
                  group_ids=torch.zeros(1, dtype=torch.int64))
    # nan under the mask is padding and allowed; on a response token it is an error.
    entropy = torch.tensor([[0.3, float("nan")]], requires_grad=True)
    weights, _ = d3s_topk_token_weights(**kwargs, entropy=entropy, keep_ratio=0.5)
    assert weights.tolist() == [[1.0, 0.0]] and not weights.requires_grad
    with pytest.raises(ValueError, match="non-finite"):
        d3s_topk_token_weights(
            **kwargs, entropy=torch.tensor([[float("inf"), 0.0]]), keep_ratio=0.5
        )
    with pytest.raises(ValueError, match="keep_ratio"):
        d3s_topk_token_weights(**kwargs, entropy=torch.ones(1, 2), keep_ratio=0.0)
    with pytest.raises(ValueError, match="scope"):
        d3s_topk_token_weights(**kwargs, entropy=torch.ones(1, 2), keep_ratio=0.5, scope="row")


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    keep_ratio=st.floats(min_value=0.01, max_value=1.0),
    scope=st.sampled_from(["batch", "group", "sample"]),
)
def test_topk_property_kept_dominate_dropped(seed, keep_ratio, scope):
    gen = torch.Generator().manual_seed(seed)
    advantages = torch.randn(6, generator=gen)
    entropy = torch.rand(6, 8, generator=gen)
    mask = torch.rand(6, 8, generator=gen) < 0.8
    group_ids = torch.tensor([0, 0, 1, 1, 2, 2])
    weights, _ = d3s_topk_token_weights(
        advantages=advantages, entropy=entropy, logprobs=None, response_mask=mask,
        group_ids=group_ids, keep_ratio=keep_ratio, scope=scope,
    )
    scores = advantages.abs()[:, None] * entropy
    units = {
        "batch": torch.zeros(6, dtype=torch.int64), "group": group_ids, "sample": torch.arange(6)
    }
    for unit in units[scope].unique():
        in_pool = mask & (units[scope] == unit)[:, None]
        n = int(in_pool.sum())
        kept = (weights > 0) & in_pool
        assert not bool(((weights > 0) & ~mask).any())
        if n == 0:
            continue
        assert int(kept.sum()) == max(1, math.ceil(round(keep_ratio * n, 9)))
        dropped = in_pool & ~kept
        if bool(dropped.any()):
            assert float(scores[kept].min()) >= float(scores[dropped].max())


# --------------------------------------------------------------------------- #
# Schedule (Eq. 9) and variants                                                #
# --------------------------------------------------------------------------- #


def test_schedule_defaults_are_table6():
    schedule = D3SSchedule(total_steps=100)
    assert schedule.value_at(0.0) == (8, pytest.approx(0.05))
    assert schedule.value_at(1.0) == (32, pytest.approx(0.20))
    assert schedule.value_at(0.5) == (20, pytest.approx(0.125))  # (8+32)/2, (5%+20%)/2
    assert schedule_value_at(0.25, init=8, final=32) == pytest.approx(14.0)
    assert keep_ratio_at(0.25) == pytest.approx(0.0875)


def test_num_keep_rounds_half_up_and_is_monotone():
    assert num_keep_at(0.5, init=8, final=9) == 9  # 8.5 → 9 (banker's rounding would give 8)
    assert num_keep_at(0.5, init=9, final=10) == 10
    counts = [num_keep_at(p / 100, init=8, final=32) for p in range(101)]
    assert counts == sorted(counts) and counts[0] == 8 and counts[-1] == 32


def test_schedule_steps_state_and_horizon():
    schedule = D3SSchedule(total_steps=10)
    for _ in range(5):
        schedule.update()
    assert schedule.current() == (20, pytest.approx(0.125))
    restored = D3SSchedule(total_steps=10)
    restored.load_state_dict(schedule.state_dict())
    assert restored.current() == schedule.current() and restored.step == 5
    for _ in range(20):
        schedule.update()
    assert schedule.current() == (32, pytest.approx(0.20))  # held after the horizon
    with pytest.raises(ValueError, match="different schedule"):
        D3SSchedule(total_steps=20).load_state_dict(restored.state_dict())
    static = D3SSchedule(total_steps=10, dynamic=False)
    static.update()
    assert static.current() == (8, pytest.approx(0.05)) == static.value_at(1.0)
    with pytest.raises(ValueError, match="progress"):
        schedule.value_at(1.5)
    with pytest.raises(ValueError, match="keep_ratio_final"):
        D3SSchedule(total_steps=10, keep_ratio_final=1.5)


def test_variants_are_configurations():
    assert set(D3S_VARIANTS) == {"d1s", "d1s_c", "d2s", "d3s", "d3s_i"}
    d3s = d3s_variant("d3s")
    assert (d3s.cross_group, d3s.token_level, d3s.dynamic_schedule) == (True, True, True)
    d3s_i = d3s_variant("d3s_i")
    assert (d3s_i.cross_group, d3s_i.token_level, d3s_i.dynamic_schedule) == (False, True, True)
    assert d3s_variant("d2s").dynamic_schedule is False and d3s_variant("d2s").cross_group
    assert d3s_variant("d1s").token_weighting is None
    for variant in D3S_VARIANTS.values():
        assert variant.sample_selector in SAMPLE_SELECTORS
        assert variant.token_weighting is None or variant.token_weighting in TOKEN_WEIGHTS
    with pytest.raises(ValueError, match="unknown D3S variant"):
        d3s_variant("d4s")


def stable_sort_topk(scores: torch.Tensor, valid: torch.Tensor, keep_ratio: float) -> torch.Tensor:
    """One pool: the ceil(K·n) highest float64 scores, ties to the lower index, by a stable sort."""
    num_valid = int(valid.sum())
    num_keep = min(num_valid, max(1, math.ceil(num_valid * keep_ratio - 1e-6))) if num_valid else 0
    ranked = torch.where(valid, scores.to(torch.float64), torch.tensor(float("-inf"), dtype=torch.float64))
    reference = torch.zeros_like(valid)
    reference[torch.sort(ranked, descending=True, stable=True).indices[:num_keep]] = True
    return reference


@settings(max_examples=100, deadline=None)
@given(
    values=st.lists(st.integers(0, 4), min_size=1, max_size=120),
    valid_bits=st.lists(st.booleans(), min_size=120, max_size=120),
    keep_ratio=st.floats(0.01, 1.0),
    scope=st.sampled_from(["batch", "group", "sample"]),
)
def test_selection_equals_stable_sort_reference_with_many_ties(values, valid_bits, keep_ratio, scope):
    """Ties in the key go to the lower flat index, in every pool layout."""
    num_cols = 4
    values = values + [0] * (-len(values) % num_cols)
    entropy = torch.tensor(values, dtype=torch.float32).view(-1, num_cols)  # many ties on purpose
    valid = torch.tensor(valid_bits[: entropy.numel()]).view_as(entropy)
    num_rows = entropy.shape[0]
    group_ids = torch.arange(num_rows) // 2
    weights, _ = d3s_topk_token_weights(
        advantages=torch.ones(num_rows), entropy=entropy, logprobs=None, response_mask=valid,
        group_ids=group_ids, keep_ratio=keep_ratio, scope=scope,
    )
    pools = {"batch": torch.zeros(num_rows, dtype=torch.int64), "group": group_ids,
             "sample": torch.arange(num_rows)}[scope]
    for pool in pools.unique():
        rows = pools == pool
        expected = stable_sort_topk(entropy[rows].flatten(), valid[rows].flatten(), keep_ratio)
        assert torch.equal(weights[rows].flatten().bool(), expected)


def test_float32_rounding_ties_are_ranked_by_the_float64_key():
    # Row 1's key |A|·H is larger than row 0's in float64 but both round to the same
    # float32 value; ranking on float32 keys with index tie-breaking would keep row 0.
    x = torch.tensor(3.0, dtype=torch.float32)
    a = torch.tensor(3.0 / 1.7, dtype=torch.float32)
    h = (x / a).reshape(1)
    found = None
    for _ in range(64):
        exact = h.double() * a.double()
        if float(h * a) == float(x) and float(exact) > float(x):
            found = h.clone()
            break
        h = torch.nextafter(h, torch.tensor([10.0]))
    assert found is not None
    entropy = torch.stack([x.reshape(1), found], 0)  # (2, 1)
    weights, _ = d3s_topk_token_weights(
        advantages=torch.stack([torch.tensor(1.0), a]), entropy=entropy, logprobs=None,
        response_mask=torch.ones(2, 1, dtype=torch.bool), group_ids=torch.zeros(2, dtype=torch.int64),
        keep_ratio=0.5,
    )
    assert weights.flatten().tolist() == [0.0, 1.0]


@pytest.mark.parametrize("layout", ["random", "ties", "strided_outliers"])
def test_kth_largest_on_large_pools_equals_sorting(layout, monkeypatch):
    """The sampled bracket never changes the answer, also when the sample is fooled."""
    gen = torch.Generator().manual_seed(4)
    num_values = 2 * _BRACKET_MIN_POOL
    if layout == "random":
        values = torch.rand(num_values, generator=gen)
    elif layout == "ties":
        values = torch.randint(0, 7, (num_values,), generator=gen).float()
    else:  # every stride-th entry is huge: the sample sees only outliers
        values = torch.rand(num_values, generator=gen)
        values[:: (num_values // _BRACKET_SAMPLE_SIZE) | 1] = 100.0
    values[torch.rand(num_values, generator=gen) < 0.3] = float("-inf")  # padding
    num_finite = int(torch.isfinite(values).sum())
    descending = torch.sort(values, descending=True).values
    selected_sizes = []
    kthvalue = torch.kthvalue
    monkeypatch.setattr(torch, "kthvalue", lambda x, k: selected_sizes.append(x.numel()) or kthvalue(x, k))
    for k in (1, 7, num_finite // 10, num_finite // 2, num_finite):
        selected_sizes.clear()
        kth, candidates = _kth_largest(values, k)
        assert float(kth) == float(descending[k - 1])
        # The candidates hold every entry at or above the answer.
        assert int((candidates >= kth).sum()) == int((values >= kth).sum())
        # Random data: the exact selection sees a few percent of the pool; a fooled sample
        # (k beyond the outliers) falls back to the whole pool.
        if layout == "random" and 10 <= k < num_finite:
            assert max(selected_sizes) < num_values // 10
        if layout == "strided_outliers" and k == num_finite // 2:
            assert max(selected_sizes) == num_values


def test_large_batch_pool_matches_stable_sort_reference():
    """Batch scope over > 65k tokens (the bracketed selection) with float32 ties."""
    gen = torch.Generator().manual_seed(9)
    num_rows, num_cols = 2 * _BRACKET_MIN_POOL // 1024, 1024
    entropy = (torch.randint(0, 50, (num_rows, num_cols), generator=gen) / 16).float()
    advantages = torch.randint(-3, 4, (num_rows,), generator=gen).float() / 3
    lengths = torch.randint(0, num_cols + 1, (num_rows,), generator=gen)
    mask = torch.arange(num_cols)[None, :] < lengths[:, None]
    keep_rows = torch.rand(num_rows, generator=gen) < 0.7
    entropy_before = entropy.clone()
    for keep_ratio in (0.05, 0.2, 0.5):
        weights, metrics = d3s_topk_token_weights(
            advantages=advantages, entropy=entropy, logprobs=None, response_mask=mask,
            group_ids=torch.zeros(num_rows, dtype=torch.int64), keep_ratio=keep_ratio,
            sample_keep_mask=keep_rows,
        )
        valid = mask & keep_rows[:, None]
        scores = entropy.double() * advantages.double().abs()[:, None]
        expected = stable_sort_topk(scores.flatten(), valid.flatten(), keep_ratio).view_as(valid)
        assert torch.equal(weights.bool(), expected)
        assert int(metrics["d3s/num_kept_tokens"]) == int(expected.sum())
        assert float(metrics["d3s/kept_token_score_mean"]) == pytest.approx(float(scores[expected].mean()))
    assert torch.equal(entropy, entropy_before)  # the keys are computed in a buffer of their own
