"""E3 ("Enhancing Efficiency and Exploration in Reinforcement Learning for LLMs"): Algorithm 1, §4.1 ranks, Eq. 4, Eq. 5."""

from __future__ import annotations

import json
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.algorithms.e3 import (
    TemperatureScheduler,
    annealed_target_entropy,
    difficulty_ranks,
    e3_budget_bounds,
    e3_rollout_budgets,
    entropy_temperature_update,
    rank_numerators,
)
from tests.oracles.estimators import RankTracker

# ---------------------------------------------------------------------------
# Loop references written from the paper
# ---------------------------------------------------------------------------


def ref_algorithm1(k: list[float], group: int, g_min: int, g_max: int) -> list[int]:
    """Algorithm 1 step by step (with step 4 capped at G_max, as documented)."""
    num = len(k)
    total = num * group
    budgets = [g_min] * num
    remaining = total - num * g_min
    k_sum = sum(k)
    for i in range(num):
        share = math.floor(remaining * (k[i] / k_sum)) if k_sum > 0 else 0
        budgets[i] = min(budgets[i] + share, g_max)
    remaining = total - sum(budgets)
    for i in sorted(range(num), key=lambda i: (-k[i], i)):  # descending k, greedy to G_max
        give = min(remaining, g_max - budgets[i])
        budgets[i] += give
        remaining -= give
    assert remaining == 0
    return budgets


def ref_ranks(averages: list[float]) -> list[float]:
    """rank 1 = highest average; tied averages share the mean of their ranks; k = rank/|D|."""
    num = len(averages)
    out = []
    for a in averages:
        greater = sum(1 for b in averages if b > a)
        equal = sum(1 for b in averages if b == a)
        out.append((greater + (equal + 1) / 2) / num)
    return out


def ref_eq4(tau: float, entropy: float, target: float, vocab: int) -> float:
    alpha = target / entropy
    return tau * (1 + tau * math.log(alpha) / (math.log(vocab) + math.log(math.log(vocab))))


def ref_eq5(t: int, h_init: float, eta: float, t_anneal: int, t_max: int) -> float:
    return h_init * (eta + (1 - eta) * 0.5 * (1 + math.cos(math.pi * (t - t_anneal) / (t_max - t_anneal))))


# ---------------------------------------------------------------------------
# Algorithm 1
# ---------------------------------------------------------------------------


def test_algorithm1_hand_case():
    # B = 4, G = 8 → N_total = 32; G_min = 4 → N_rem = 16; Σk = 2.5.
    # Shares 16·k/2.5 = [1.6, 3.2, 4.8, 6.4] → floors [1, 3, 4, 6] → G = [5, 7, 8, 10] (sum 30).
    # Leftover 2 goes greedily to the hardest prompt (k = 1): 10 → 12 = G_max.
    budgets, _ = e3_rollout_budgets(
        difficulty=torch.tensor([0.25, 0.5, 0.75, 1.0]), group_size=8, min_budget=4, max_budget=12
    )
    assert budgets.tolist() == [5, 7, 8, 12]


def test_algorithm1_caps_step4_at_gmax():
    # k = (1, 0.01), G = 8, G_min = 4, G_max = 10: N_rem = 8, step 4 gives 4 + ⌊7.92⌋ = 11 > G_max.
    # Capped at 10; the leftover 2 cannot go to the (full) hardest prompt, so the other gets 4 + 2.
    budgets, _ = e3_rollout_budgets(difficulty=torch.tensor([1.0, 0.01]), group_size=8, min_budget=4, max_budget=10)
    assert budgets.tolist() == [10, 6]


def test_algorithm1_matches_loop_reference():
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        num = int(torch.randint(1, 64, (1,), generator=gen))
        k = (torch.randint(1, num + 1, (num,), generator=gen).double() / num)  # ranks with ties
        group = int(torch.randint(2, 16, (1,), generator=gen))
        g_min = int(torch.randint(0, group + 1, (1,), generator=gen))
        g_max = group + int(torch.randint(0, 10, (1,), generator=gen))
        got, _ = e3_rollout_budgets(difficulty=k, group_size=group, min_budget=g_min, max_budget=g_max)
        assert got.tolist() == ref_algorithm1(k.tolist(), group, g_min, g_max)


@settings(max_examples=300, deadline=None)
@given(
    k=st.lists(st.floats(0.0, 1.0, allow_nan=False), min_size=1, max_size=64),
    group=st.integers(1, 32),
    below=st.integers(0, 32),
    above=st.integers(0, 32),
)
def test_algorithm1_conserves_budget_within_bounds(k, group, below, above):
    """§4.1: "the total rollout budget within a batch remains constant", each G_i in [G_min, G_max]."""
    g_min, g_max = max(group - below, 0), group + above
    difficulty = torch.tensor(k, dtype=torch.float64)
    budgets, _ = e3_rollout_budgets(difficulty=difficulty, group_size=group, min_budget=g_min, max_budget=g_max)
    assert int(budgets.sum()) == len(k) * group
    assert bool((budgets >= g_min).all()) and bool((budgets <= g_max).all())
    harder = difficulty[:, None] > difficulty[None, :]
    assert not bool((harder & (budgets[:, None] < budgets[None, :])).any()), "harder ⇒ at least as many rollouts"


def test_algorithm1_exact_step4_hand_case():
    # Ranks (3, 1, 4) of |D| = 5: k = (0.6, 0.2, 0.8), B = 3, G = 8, G_min = 0 → N_rem = 24.
    # Step 4: 24·k/Σk = 24·(3, 1, 4)/8 = (9, 3, 12) exactly, Σ = 24, nothing left for step 6.
    # In float64, 24 · (0.6 / 1.6) = 8.999…, floored to 8, and step 6 hands that rollout to
    # the hardest prompt: (8, 3, 13).
    k = torch.tensor([3 / 5, 1 / 5, 4 / 5], dtype=torch.float64)
    exact, _ = e3_rollout_budgets(difficulty=k, group_size=8, min_budget=0, max_budget=16, rank_denominator=5)
    assert exact.tolist() == [9, 3, 12]
    assert ref_algorithm1([Fraction(3, 5), Fraction(1, 5), Fraction(4, 5)], 8, 0, 16) == [9, 3, 12]
    as_float, _ = e3_rollout_budgets(difficulty=k, group_size=8, min_budget=0, max_budget=16)
    assert as_float.tolist() == [8, 3, 13]  # the float path (no rank_denominator) is unchanged


@settings(max_examples=200, deadline=None)
@given(
    ranks=st.lists(st.integers(1, 80), min_size=1, max_size=48),
    extra=st.integers(0, 40),
    group=st.integers(1, 24),
    below=st.integers(0, 24),
    above=st.integers(0, 24),
    halves=st.booleans(),
)
def test_algorithm1_exact_step4_matches_rational_reference(ranks, extra, group, below, above, halves):
    """With the ranks' denominator, Algorithm 1 equals the step-by-step loop in exact rationals."""
    num_ranked = max(ranks) + extra  # |D|
    # difficulty_ranks gives tied prompts half-integer mean ranks: k = (2·rank − 1)/(2|D|) as well.
    doubled = [2 * r - (1 if halves and i % 2 else 0) for i, r in enumerate(ranks)]
    q = 2 * num_ranked
    k = torch.tensor([n / q for n in doubled], dtype=torch.float64)
    g_min, g_max = max(group - below, 0), group + above
    got, _ = e3_rollout_budgets(difficulty=k, group_size=group, min_budget=g_min, max_budget=g_max,
                                rank_denominator=q)
    assert got.tolist() == ref_algorithm1([Fraction(n, q) for n in doubled], group, g_min, g_max)
    assert int(got.sum()) == len(ranks) * group


def test_rank_numerators_recover_the_fractions_of_difficulty_ranks():
    # Averages with ties → mean ranks 1, 2.5, 2.5, 4 and an unranked prompt at (|D|+1)/(2|D|).
    k, _ = difficulty_ranks(reward_sum=torch.tensor([4.0, 2.0, 2.0, 0.0, 0.0]),
                            num_rollouts=torch.tensor([4, 4, 4, 4, 0]))
    assert rank_numerators(k, rank_denominator=8).tolist() == [2, 5, 5, 8, 5]
    # Large |D|: every k = fl(n/q) still rounds back to n.
    q = 2 * 3_000_017
    n = torch.arange(1, q + 1, 9_973, dtype=torch.int64)
    assert torch.equal(rank_numerators(n.double() / q, rank_denominator=q), n)
    with pytest.raises(ValueError, match="not a multiple of 1/8"):
        rank_numerators(torch.tensor([0.3]), rank_denominator=8)
    for bad in (0, 2.0, True, 2**40):
        with pytest.raises(ValueError, match="rank_denominator"):
            rank_numerators(torch.tensor([0.5]), rank_denominator=bad)
    assert rank_numerators(torch.zeros(0), rank_denominator=4).numel() == 0


def test_algorithm1_edge_cases():
    # Bounds collapsed to G (the first pass): uniform.
    budgets, _ = e3_rollout_budgets(difficulty=torch.tensor([0.1, 0.9, 0.5]), group_size=8, min_budget=8, max_budget=8)
    assert budgets.tolist() == [8, 8, 8]
    # Σk = 0: everything beyond G_min goes greedily (ties by index).
    budgets, _ = e3_rollout_budgets(difficulty=torch.zeros(3), group_size=4, min_budget=2, max_budget=6)
    assert budgets.tolist() == [6, 4, 2]
    budgets, _ = e3_rollout_budgets(difficulty=torch.zeros(0), group_size=4, min_budget=2, max_budget=6)
    assert budgets.numel() == 0
    with pytest.raises(ValueError, match="min_budget ≤ group_size"):
        e3_rollout_budgets(difficulty=torch.ones(2), group_size=4, min_budget=5, max_budget=6)
    with pytest.raises(ValueError, match="non-finite"):
        e3_rollout_budgets(difficulty=torch.tensor([float("nan")]), group_size=4, min_budget=2, max_budget=6)
    with pytest.raises(ValueError, match="non-negative"):
        e3_rollout_budgets(difficulty=torch.tensor([-0.1]), group_size=4, min_budget=2, max_budget=6)
    # The exact path: Σk = 0, one prompt, an empty batch, a k off the 1/q grid.
    budgets, _ = e3_rollout_budgets(difficulty=torch.zeros(3), group_size=4, min_budget=2, max_budget=6,
                                    rank_denominator=4)
    assert budgets.tolist() == [6, 4, 2]
    budgets, _ = e3_rollout_budgets(difficulty=torch.tensor([0.5]), group_size=4, min_budget=2, max_budget=6,
                                    rank_denominator=2)
    assert budgets.tolist() == [4]
    budgets, _ = e3_rollout_budgets(difficulty=torch.zeros(0), group_size=4, min_budget=2, max_budget=6,
                                    rank_denominator=2)
    assert budgets.numel() == 0
    with pytest.raises(ValueError, match="not a multiple"):
        e3_rollout_budgets(difficulty=torch.tensor([0.3, 0.5]), group_size=4, min_budget=2, max_budget=6,
                           rank_denominator=4)


def test_budget_bounds_widen_per_pass_up_to_limits():
    # §4.1 + §5.1: start at G, ±2 per pass, stop at the limits.
    assert e3_budget_bounds(num_completed_passes=0, group_size=8, min_limit=4, max_limit=12) == (8, 8)
    assert e3_budget_bounds(num_completed_passes=1, group_size=8, min_limit=4, max_limit=12) == (6, 10)
    assert e3_budget_bounds(num_completed_passes=2, group_size=8, min_limit=4, max_limit=12) == (4, 12)
    assert e3_budget_bounds(num_completed_passes=5, group_size=8, min_limit=4, max_limit=12) == (4, 12)
    assert e3_budget_bounds(num_completed_passes=1, group_size=8, min_limit=7, max_limit=16, step=3) == (7, 11)
    with pytest.raises(ValueError):
        e3_budget_bounds(num_completed_passes=0, group_size=8, min_limit=9, max_limit=12)


# ---------------------------------------------------------------------------
# Difficulty ranks and RankTracker (§4.1)
# ---------------------------------------------------------------------------


def test_difficulty_ranks_hand_case():
    # Averages [0.9, 0.0, 0.5, 0.0]: descending ranks 1, (3+4)/2, 2, (3+4)/2 → k = rank/4.
    # Prompt 4 was never rolled out → neutral (4+1)/(2·4) = 0.625.
    reward_sum = torch.tensor([9.0, 0.0, 4.0, 0.0, 0.0], dtype=torch.float64)
    num_rollouts = torch.tensor([10, 8, 8, 4, 0])
    k, _ = difficulty_ranks(reward_sum=reward_sum, num_rollouts=num_rollouts)
    torch.testing.assert_close(k, torch.tensor([0.25, 0.875, 0.5, 0.875, 0.625], dtype=torch.float64))


def test_difficulty_ranks_match_loop_reference():
    gen = torch.Generator().manual_seed(1)
    counts = torch.randint(1, 9, (300,), generator=gen)
    sums = torch.minimum(torch.randint(0, 9, (300,), generator=gen), counts).double()  # many ties
    k, _ = difficulty_ranks(reward_sum=sums, num_rollouts=counts)
    expected = ref_ranks((sums / counts.double()).tolist())
    torch.testing.assert_close(k, torch.tensor(expected, dtype=torch.float64))


def test_rank_tracker_accumulates_ranks_and_round_trips():
    tracker = RankTracker(num_prompts=3)
    assert tracker.difficulty_of(torch.tensor([0, 2])).tolist() == [0.5, 0.5]  # before the first pass
    # Pass 1: prompt 0 solved 2/2, prompt 1 0/2, prompt 2 1/2.
    tracker.update(prompt_ids=torch.tensor([0, 0, 1, 1, 2, 2]), rewards=torch.tensor([1.0, 1, 0, 0, 1, 0]))
    tracker.end_pass()
    expected = torch.tensor([1 / 3, 1.0, 2 / 3], dtype=torch.float64)
    torch.testing.assert_close(tracker.difficulty_of(torch.arange(3)), expected)
    # Cumulative, not per pass: prompt 1 now 4/6 ≈ 0.67 > prompt 2's 1/2 and < prompt 0's 2/2.
    tracker.update(prompt_ids=torch.tensor([1, 1, 1, 1]), rewards=torch.tensor([1.0, 1, 1, 1]))
    tracker.end_pass()
    expected = torch.tensor([1 / 3, 2 / 3, 1.0], dtype=torch.float64)
    torch.testing.assert_close(tracker.difficulty_of(torch.arange(3)), expected)
    assert tracker.num_completed_passes == 2

    state = tracker.state_dict()
    json.dumps({key: value.tolist() for key, value in state.items()})
    fresh = RankTracker(num_prompts=3)
    fresh.load_state_dict(state)
    assert fresh.num_completed_passes == 2
    torch.testing.assert_close(fresh.difficulty, tracker.difficulty)
    torch.testing.assert_close(fresh.reward_sum, tracker.reward_sum)
    with pytest.raises(ValueError, match="shape"):
        RankTracker(num_prompts=4).load_state_dict(state)
    with pytest.raises(ValueError, match="prompt ids"):
        tracker.update(prompt_ids=torch.tensor([3]), rewards=torch.tensor([1.0]))
    with pytest.raises(ValueError, match="non-finite"):
        tracker.update(prompt_ids=torch.tensor([0]), rewards=torch.tensor([float("nan")]))


# ---------------------------------------------------------------------------
# Eq. 4 and Eq. 5
# ---------------------------------------------------------------------------


def test_eq4_hand_case():
    # |V| = 100: ln 100 = 4.605170, ln ln 100 = 1.527180 → denominator 6.132350.
    # τ = 1, H_t = 0.5, H_target = 1 → α = 2, ln α = 0.693147 → τ' = 1 + 0.693147/6.132350 = 1.113031.
    got = entropy_temperature_update(temperature=1.0, entropy=0.5, target_entropy=1.0, vocab_size=100)
    assert got == pytest.approx(1.113031, abs=1e-6)
    # τ = 0.8, α = 1/2: 0.8·0.693147/6.132350 = 0.090425 → τ' = 0.8·(1 − 0.090425) = 0.727660.
    got = entropy_temperature_update(temperature=0.8, entropy=1.0, target_entropy=0.5, vocab_size=100)
    assert got == pytest.approx(0.727660, abs=1e-6)
    assert entropy_temperature_update(temperature=0.7, entropy=0.3, target_entropy=0.3, vocab_size=151_936) == 0.7


def test_eq4_matches_reference_and_rejects_bad_input():
    for tau, h, target, vocab in [(1.0, 0.2, 0.3, 151_936), (1.3, 0.9, 0.4, 32_000), (0.5, 0.05, 0.05, 3)]:
        got = entropy_temperature_update(temperature=tau, entropy=h, target_entropy=target, vocab_size=vocab)
        assert got == pytest.approx(ref_eq4(tau, h, target, vocab), rel=1e-15)
    with pytest.raises(ValueError, match="entropy"):
        entropy_temperature_update(temperature=1.0, entropy=float("nan"), target_entropy=1.0, vocab_size=100)
    with pytest.raises(ValueError, match="entropy"):
        entropy_temperature_update(temperature=1.0, entropy=0.0, target_entropy=1.0, vocab_size=100)
    with pytest.raises(ValueError, match="vocab_size"):
        entropy_temperature_update(temperature=1.0, entropy=1.0, target_entropy=1.0, vocab_size=2)


def test_eq4_restores_entropy_on_a_low_entropy_softmax():
    """Appendix A's claim: for a low-entropy next-token distribution (one dominant logit over a
    noisy region), Eq. 4 moves the entropy to ≈ α·H. Checked on an explicit softmax over |V| = 32000."""
    gen = torch.Generator().manual_seed(0)
    vocab = 32_000
    logits = torch.randn(vocab, generator=gen, dtype=torch.float64)
    logits[0] = math.log(vocab) + math.log(math.log(vocab)) + 2.0  # Δ ≈ ln N + ln ln N, as the derivation assumes

    def entropy(tau):
        logp = torch.log_softmax(logits / tau, dim=0)
        return float(-(logp.exp() * logp).sum())

    h0 = entropy(1.0)
    assert h0 < 1.0
    for alpha in (0.8, 0.9, 1.1, 1.25):
        tau1 = entropy_temperature_update(temperature=1.0, entropy=h0, target_entropy=alpha * h0, vocab_size=vocab)
        ratio = entropy(tau1) / h0
        assert abs(ratio - alpha) < 0.1 * abs(alpha - 1.0), (alpha, ratio)  # observed: within 2%


def test_eq5_annealing():
    h, eta, t0, t1 = 0.6, 0.9, 288, 480

    def target(step):
        return annealed_target_entropy(step=step, initial_entropy=h, eta=eta, anneal_start=t0, max_steps=t1)

    assert target(t0) == pytest.approx(h)
    assert target(t1) == pytest.approx(eta * h)
    # Midpoint: cos(π/2) = 0 → H·(η + (1 − η)/2) = 0.6·0.95 = 0.57.
    assert target(384) == pytest.approx(0.57)
    for t in (300, 350, 450):
        assert target(t) == pytest.approx(ref_eq5(t, h, eta, t0, t1), rel=1e-15)
    assert target(600) == pytest.approx(eta * h)  # clamped after t_max
    with pytest.raises(ValueError, match="eta"):
        annealed_target_entropy(step=0, initial_entropy=h, eta=1.0, anneal_start=t0, max_steps=t1)


# ---------------------------------------------------------------------------
# TemperatureScheduler
# ---------------------------------------------------------------------------


def _run(scheduler, entropies, start=0):
    return [scheduler.update(entropy=h, step=start + i)[0] for i, h in enumerate(entropies)]


def test_scheduler_matches_loop_reference_with_annealing():
    vocab, t_anneal, t_max, eta = 151_936, 6, 10, 0.9
    entropies = [0.50, 0.45, 0.40, 0.42, 0.47, 0.52, 0.50, 0.48, 0.44, 0.41, 0.39, 0.38]
    scheduler = TemperatureScheduler(vocab_size=vocab, anneal_start=t_anneal, max_steps=t_max, eta=eta)
    got = _run(scheduler, entropies)
    tau, h_init, expected = 1.0, entropies[0], []
    for t, h in enumerate(entropies):
        target = h_init if t < t_anneal else ref_eq5(min(t, t_max), h_init, eta, t_anneal, t_max)
        tau = min(max(ref_eq4(tau, h, target, vocab), 0.1), 2.0)
        expected.append(tau)
    assert got == pytest.approx(expected, rel=1e-14)
    assert got[0] == 1.0  # the first observation defines H_init: α = 1
    assert got[2] > got[1] > 1.0  # entropy below H_init raises τ


def test_scheduler_given_initial_entropy_clamps_and_orders_steps():
    scheduler = TemperatureScheduler(vocab_size=1000, initial_entropy=1.0, min_temperature=0.5, max_temperature=1.05)
    tau, metrics = scheduler.update(entropy=0.01, step=0)  # α = 100 would push τ to ≈ 1.5
    assert tau == 1.05 and metrics["e3/temperature_clamped"] == 1.0
    tau, _ = scheduler.update(entropy=1000.0, step=1)  # α = 1e-3 would push τ negative
    assert tau == 0.5
    with pytest.raises(ValueError, match="steps must increase"):
        scheduler.update(entropy=1.0, step=1)
    with pytest.raises(ValueError, match="entropy"):
        scheduler.update(entropy=float("inf"), step=2)
    with pytest.raises(ValueError, match="together"):
        TemperatureScheduler(vocab_size=1000, anneal_start=5)


def test_scheduler_resume_is_exact():
    entropies = [0.6, 0.55, 0.5, 0.52, 0.58, 0.61, 0.57, 0.5]
    straight = TemperatureScheduler(vocab_size=50_000, anneal_start=4, max_steps=8)
    expected = _run(straight, entropies)

    first = TemperatureScheduler(vocab_size=50_000, anneal_start=4, max_steps=8)
    _run(first, entropies[:3])
    state = json.loads(json.dumps(first.state_dict()))  # plain JSON values only
    resumed = TemperatureScheduler(vocab_size=50_000, anneal_start=4, max_steps=8)
    resumed.load_state_dict(state)
    assert _run(resumed, entropies[3:], start=3) == expected[3:]
    with pytest.raises(ValueError, match="missing"):
        resumed.load_state_dict({"temperature": 1.0})
