"""DEPO ("Difficulty-Estimated Policy Optimization"): §3.1.2 losses, §3 / §3.2 filter."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.algorithms.depo import (
    depo_estimator_loss,
    depo_filter,
    difficulty_bce_loss,
    distill_bce_loss,
    filter_precision_recall,
    observed_zero_variance,
    pairwise_ranking_loss,
    perplexity_targets,
    zero_variance_log_prob,
)

# ---------------------------------------------------------------------------
# float64 loop references from the paper's formulas
# ---------------------------------------------------------------------------


def ref_bce(logits: list[float], targets: list[float]) -> float:
    """−[A log σ(Â) + (1 − A) log(1 − σ(Â))], averaged."""
    total = 0.0
    for z, a in zip(logits, targets):
        s = 1.0 / (1.0 + math.exp(-z))
        total += -(a * math.log(s) + (1 - a) * math.log(1 - s))
    return total / len(logits)


def ref_rank(scores: list[float], targets: list[float], margin: float) -> float:
    """(1/|Q|) Σ max(0, m − (Â_i − Â_j)) over pairs with A_i > A_j (i easier)."""
    hinges = [
        max(0.0, margin - (scores[i] - scores[j]))
        for i in range(len(scores))
        for j in range(len(scores))
        if targets[i] > targets[j]
    ]
    return sum(hinges) / len(hinges) if hinges else 0.0


# ---------------------------------------------------------------------------
# L_DE, L_distill, L_rank
# ---------------------------------------------------------------------------


def test_bce_hand_case():
    # Â = 0 → σ = 1/2 → loss = log 2 = 0.693147 for any A.
    # Â = ln 3 → σ = 3/4; A = 3/4 → −(0.75·ln 0.75 + 0.25·ln 0.25) = 0.215762 + 0.346574 = 0.562335.
    logits = torch.tensor([0.0, math.log(3.0)], dtype=torch.float64)
    loss, _ = difficulty_bce_loss(logits=logits, mean_rewards=torch.tensor([0.25, 0.75], dtype=torch.float64))
    assert float(loss) == pytest.approx((0.693147 + 0.562335) / 2, abs=1e-6)


def test_bce_losses_match_loop_reference_and_gradient():
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(32, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    targets = torch.rand(32, generator=gen, dtype=torch.float64)
    loss, _ = difficulty_bce_loss(logits=logits, mean_rewards=targets)
    assert float(loss.detach()) == pytest.approx(ref_bce(logits.tolist(), targets.tolist()), rel=1e-12)
    loss.backward()
    # §3.1.2: ∂L_BCE/∂Â = σ(Â) − A (per sample; /B for the batch mean).
    torch.testing.assert_close(logits.grad, (torch.sigmoid(logits) - targets).detach() / 32)
    distill, _ = distill_bce_loss(logits=logits.detach(), perplexity_targets=targets)
    assert float(distill) == pytest.approx(float(loss.detach()))


def test_bce_is_stable_for_large_logits_and_rejects_bad_targets():
    loss, _ = difficulty_bce_loss(logits=torch.tensor([60.0, -60.0]), mean_rewards=torch.tensor([1.0, 0.0]))
    assert torch.isfinite(loss) and float(loss) < 1e-20
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        difficulty_bce_loss(logits=torch.zeros(2), mean_rewards=torch.tensor([0.5, 1.5]))
    with pytest.raises(ValueError, match="non-finite"):
        difficulty_bce_loss(logits=torch.tensor([0.0, float("nan")]), mean_rewards=torch.tensor([0.5, 0.5]))
    with pytest.raises(ValueError, match="empty"):
        difficulty_bce_loss(logits=torch.zeros(0), mean_rewards=torch.zeros(0))


def test_perplexity_targets_hand_case_and_masking():
    # Row 0: counted log-probs −1 and −3 → mean −2 → P = e^{−2} = 0.135335 (the −inf is masked out).
    # Row 1: a single counted token with log-prob 0 → PPL 1 → P = 1.
    logprobs = torch.tensor([[-1.0, -3.0, float("-inf")], [0.0, -5.0, -5.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    targets, _ = perplexity_targets(token_logprobs=logprobs, token_mask=mask)
    torch.testing.assert_close(targets, torch.tensor([0.135335, 1.0], dtype=torch.float64), atol=1e-6, rtol=0)


def test_perplexity_targets_edge_cases():
    with pytest.raises(ValueError, match="no unmasked"):
        perplexity_targets(token_logprobs=torch.zeros(2, 3), token_mask=torch.tensor([[1, 0, 0], [0, 0, 0]]))
    with pytest.raises(ValueError, match="non-finite"):
        perplexity_targets(token_logprobs=torch.tensor([[float("nan"), -1.0]]), token_mask=torch.ones(1, 2))
    # Targets are batch-independent: the same row gives the same target in any batch.
    gen = torch.Generator().manual_seed(1)
    logprobs = -torch.rand(5, 7, generator=gen) * 4
    mask = torch.ones(5, 7)
    full, _ = perplexity_targets(token_logprobs=logprobs, token_mask=mask)
    alone, _ = perplexity_targets(token_logprobs=logprobs[2:3], token_mask=mask[2:3])
    torch.testing.assert_close(full[2:3], alone)
    assert bool(((full > 0) & (full <= 1)).all())


def test_ranking_loss_hand_case():
    # Scores Â = [0, 1, 0.5, 0.2], targets A = [0.9, 0.1, 0.5, 0.5], m = 0.5.
    # Pairs with A_i > A_j: (0,1) 0.5 − (0 − 1) = 1.5; (0,2) 0.5 − (0 − 0.5) = 1.0;
    # (0,3) 0.5 − (0 − 0.2) = 0.7;
    # (2,1) 0.5 − (0.5 − 1) = 1.0; (3,1) 0.5 − (0.2 − 1) = 1.3. Pair (2,3) has equal targets: excluded.
    # Mean = 5.5/5 = 1.1.
    loss, metrics = pairwise_ranking_loss(
        scores=torch.tensor([0.0, 1.0, 0.5, 0.2]), mean_rewards=torch.tensor([0.9, 0.1, 0.5, 0.5]), margin=0.5
    )
    assert float(loss) == pytest.approx(1.1)
    assert metrics["depo/rank_pairs"] == 5.0


def test_ranking_loss_matches_loop_reference():
    gen = torch.Generator().manual_seed(2)
    scores = torch.randn(24, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, 9, (24,), generator=gen).double() / 8  # avg@8 values, many ties
    loss, _ = pairwise_ranking_loss(scores=scores, mean_rewards=targets, margin=0.3)
    assert float(loss) == pytest.approx(ref_rank(scores.tolist(), targets.tolist(), 0.3), rel=1e-12)


def test_ranking_loss_direction_agrees_with_bce_target():
    """A gradient step on L_rank raises the score of the prompt with the higher observed reward."""
    scores = torch.tensor([0.0, 0.0], requires_grad=True)
    loss, _ = pairwise_ranking_loss(scores=scores, mean_rewards=torch.tensor([0.875, 0.125]), margin=1.0)
    loss.backward()
    assert scores.grad.tolist() == [-1.0, 1.0]  # descent pushes the easier prompt (index 0) up
    # Once it leads by the margin, no penalty.
    loss, _ = pairwise_ranking_loss(
        scores=torch.tensor([1.5, 0.0]), mean_rewards=torch.tensor([0.875, 0.125]), margin=1.0
    )
    assert float(loss) == 0.0


def test_ranking_loss_without_pairs_is_zero_and_connected():
    scores = torch.tensor([0.3, -0.2], requires_grad=True)
    loss, metrics = pairwise_ranking_loss(scores=scores, mean_rewards=torch.tensor([0.5, 0.5]), margin=1.0)
    assert float(loss.detach()) == 0.0 and metrics["depo/rank_pairs"] == 0.0
    loss.backward()
    assert scores.grad.tolist() == [0.0, 0.0]
    single, _ = pairwise_ranking_loss(scores=torch.tensor([1.0]), mean_rewards=torch.tensor([0.3]), margin=1.0)
    assert float(single) == 0.0


def test_total_loss_weights():
    gen = torch.Generator().manual_seed(3)
    adv = torch.randn(10, generator=gen, dtype=torch.float64)
    ppl = torch.randn(10, generator=gen, dtype=torch.float64)
    rewards = torch.randint(0, 5, (10,), generator=gen).double() / 4
    ppl_targets = torch.rand(10, generator=gen, dtype=torch.float64)
    loss, metrics = depo_estimator_loss(
        advantage_logits=adv, perplexity_logits=ppl, mean_rewards=rewards, perplexity_targets=ppl_targets
    )
    expected = (
        ref_bce(adv.tolist(), rewards.tolist())
        + 0.5 * ref_bce(ppl.tolist(), ppl_targets.tolist())
        + 3.0 * ref_rank(adv.tolist(), rewards.tolist(), 0.1)
    )
    assert float(loss) == pytest.approx(expected, rel=1e-12)
    assert float(metrics["depo/loss"]) == pytest.approx(expected, rel=1e-12)


# ---------------------------------------------------------------------------
# Zero-variance probability and the filter
# ---------------------------------------------------------------------------


def test_zero_variance_probability_hand_case():
    # G = 8: p = 0.9 → 0.9^8 + 0.1^8 = 0.43046721 + 1e-8 = 0.43046722; p = 0.5 → 2·0.5^8 = 0.0078125.
    got = zero_variance_log_prob(group_size=8, pass_rate=torch.tensor([0.9, 0.5, 0.0, 1.0], dtype=torch.float64)).exp()
    torch.testing.assert_close(got, torch.tensor([0.43046722, 0.0078125, 1.0, 1.0], dtype=torch.float64))
    # A group of one always has zero variance.
    assert zero_variance_log_prob(group_size=1, pass_rate=torch.tensor([0.37])).tolist() == [0.0]


def test_zero_variance_log_prob_large_group_and_logit_path():
    # G = 2000, p = 1/2: the direct formula underflows to 0 (log = −inf); log space gives ln 2 − 2000 ln 2.
    got = zero_variance_log_prob(group_size=2000, pass_rate=torch.tensor([0.5], dtype=torch.float64))
    assert float(got) == pytest.approx(math.log(2) - 2000 * math.log(2), rel=1e-12)
    # Logits keep precision near p = 1 where 1 − σ(Â) rounds to 0:
    # Â = 40 → log P ≈ G·log σ(Â) ≈ −G·e^{−40}.
    via_logits = zero_variance_log_prob(group_size=16, pass_rate_logits=torch.tensor([40.0]))
    assert float(via_logits) == pytest.approx(-16 * math.exp(-40), rel=1e-9)
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(50, generator=gen, dtype=torch.float64) * 3
    torch.testing.assert_close(
        zero_variance_log_prob(group_size=8, pass_rate_logits=logits),
        zero_variance_log_prob(group_size=8, pass_rate=torch.sigmoid(logits)),
    )
    with pytest.raises(ValueError, match="exactly one"):
        zero_variance_log_prob(group_size=8)
    with pytest.raises(ValueError, match="non-finite"):
        zero_variance_log_prob(group_size=8, pass_rate_logits=torch.tensor([float("nan")]))


@settings(max_examples=200, deadline=None)
@given(p=st.floats(0.0, 1.0), group=st.integers(1, 64))
def test_zero_variance_probability_properties(p, group):
    """Matches the direct formula; symmetric in p ↔ 1 − p; between 2·0.5^G (at p = 1/2) and 1."""
    log_prob = float(zero_variance_log_prob(group_size=group, pass_rate=torch.tensor([p], dtype=torch.float64)))
    assert math.exp(log_prob) == pytest.approx(p**group + (1 - p) ** group, rel=1e-9, abs=1e-300)
    mirrored = float(zero_variance_log_prob(group_size=group, pass_rate=torch.tensor([1 - p], dtype=torch.float64)))
    assert log_prob == pytest.approx(mirrored, rel=1e-9, abs=1e-12)
    assert (1 - group) * math.log(2) - 1e-9 <= log_prob <= 1e-12


def test_filter_warmup_and_threshold():
    pass_rate = torch.tensor([0.9, 0.95, 0.5, 0.02], dtype=torch.float64)
    # G = 8: P(zero var) = [0.4305, 0.6634, 0.0078, 0.8508] → threshold 0.5 drops prompts 1 and 3.
    keep, metrics = depo_filter(pass_rate=pass_rate, group_size=8, threshold=0.5, step=99, warmup_steps=100)
    assert keep.tolist() == [True, True, True, True] and metrics["depo/filter_ratio"] == 0.0
    assert metrics["depo/filter_active"] == 0.0
    keep, metrics = depo_filter(pass_rate=pass_rate, group_size=8, threshold=0.5, step=100, warmup_steps=100)
    assert keep.tolist() == [True, False, True, False]
    assert metrics["depo/filter_ratio"] == 0.5 and metrics["depo/filter_active"] == 1.0
    logits = torch.logit(pass_rate)
    keep_logits, _ = depo_filter(pass_rate_logits=logits, group_size=8, threshold=0.5, step=100, warmup_steps=100)
    assert keep_logits.tolist() == keep.tolist()
    with pytest.raises(ValueError, match="threshold"):
        depo_filter(pass_rate=pass_rate, group_size=8, threshold=0.0, step=0, warmup_steps=0)


def test_observed_zero_variance_and_precision_recall():
    # Groups: 0 → {1, 1} zero var; 1 → {0, 1} mixed; 2 → {0} group of one: zero var; 3 → empty: not.
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0])
    group_ids = torch.tensor([0, 0, 1, 1, 2])
    zero_var = observed_zero_variance(rewards=rewards, group_ids=group_ids, num_groups=4)
    assert zero_var.tolist() == [True, False, True, False]
    # Filtered {0, 1}: TP = 1 (group 0), FP = 1 (group 1), FN = 1 (group 2) → precision 1/2, recall 1/2.
    filtered = torch.tensor([True, True, False, False])
    metrics = filter_precision_recall(filtered_mask=filtered, zero_variance_mask=zero_var)
    assert metrics["depo/filter_precision"] == 0.5 and metrics["depo/filter_recall"] == 0.5
    assert metrics["depo/filter_false_positive"] == 1.0 and metrics["depo/filter_false_negative"] == 1.0
    # Nothing filtered: precision undefined (NaN), recall 0.
    metrics = filter_precision_recall(filtered_mask=torch.zeros(4, dtype=torch.bool), zero_variance_mask=zero_var)
    assert math.isnan(metrics["depo/filter_precision"]) and metrics["depo/filter_recall"] == 0.0
    with pytest.raises(ValueError, match="non-finite"):
        observed_zero_variance(rewards=torch.tensor([float("nan")]), group_ids=torch.tensor([0]))
