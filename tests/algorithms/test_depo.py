"""DEPO ("Difficulty-Estimated Policy Optimization"): §3.1.2 losses, zero-variance labels, calibration, drop rule."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.algorithms.depo import (
    depo_drop_decision,
    depo_estimator_loss,
    difficulty_bce_loss,
    distill_bce_loss,
    filter_precision_recall,
    fit_platt_scaling,
    observed_zero_variance,
    pairwise_ranking_loss,
    perplexity_targets,
    zero_variance_bce_loss,
    zero_variance_log_prob,
    zero_variance_logit,
    zero_variance_targets,
    zero_variance_targets_from_counts,
)
from pipeline.config import DEPO_RANK_MARGIN

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


def sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z))


def ref_rank(scores: list[float], targets: list[float], margin: float) -> float:
    """(1/|Q|) Σ max(0, m·(A_i − A_j) − (σ(Â_i) − σ(Â_j))) over pairs with A_i > A_j (i easier)."""
    hinges = [
        max(0.0, margin * (targets[i] - targets[j]) - (sigmoid(scores[i]) - sigmoid(scores[j])))
        for i in range(len(scores))
        for j in range(len(scores))
        if targets[i] > targets[j]
    ]
    return sum(hinges) / len(hinges) if hinges else 0.0


def ref_all_equal(rewards: list[float], group_size: int) -> float:
    """The share of G-subsets of ``rewards`` that are all equal, by enumerating them."""
    subsets = list(itertools.combinations(range(len(rewards)), group_size))
    return sum(len({rewards[i] for i in subset}) == 1 for subset in subsets) / len(subsets)


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
    # Scores Â = [0, ln 3, −ln 3, 0] → p̂ = [1/2, 3/4, 1/4, 1/2]; targets A = [0.9, 0.1, 0.5, 0.5]; m = 0.5.
    # Pairs with A_i > A_j, hinge max(0, m·(A_i − A_j) − (p̂_i − p̂_j)):
    # (0,1) 0.4 − (−0.25) = 0.65; (0,2) 0.2 − 0.25 → 0; (0,3) 0.2 − 0 = 0.2;
    # (2,1) 0.2 − (−0.5) = 0.7; (3,1) 0.2 − (−0.25) = 0.45. Pair (2,3) has equal targets: excluded.
    # Mean = (0.65 + 0 + 0.2 + 0.7 + 0.45) / 5 = 0.4; 4 of 5 pairs violated.
    loss, metrics = pairwise_ranking_loss(
        scores=torch.tensor([0.0, math.log(3.0), -math.log(3.0), 0.0], dtype=torch.float64),
        mean_rewards=torch.tensor([0.9, 0.1, 0.5, 0.5], dtype=torch.float64), margin=0.5,
    )
    assert float(loss) == pytest.approx(0.4, abs=1e-12)
    assert metrics["depo/rank_pairs"] == 5.0 and metrics["depo/rank_violation_fraction"] == pytest.approx(0.8)


def test_ranking_loss_matches_loop_reference():
    gen = torch.Generator().manual_seed(2)
    scores = torch.randn(24, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, 9, (24,), generator=gen).double() / 8  # avg@8 values, many ties
    for margin in (0.0, 0.3, 1.0):
        loss, _ = pairwise_ranking_loss(scores=scores, mean_rewards=targets, margin=margin)
        assert float(loss) == pytest.approx(ref_rank(scores.tolist(), targets.tolist(), margin), rel=1e-12, abs=1e-15)


def test_ranking_margin_widens_predictions_that_collapsed_to_the_mean():
    """At a p̂ spread of 0.025 the hinge is still active for labels 0.3 or more apart.

    The paper's constant margin m = 0.1 logit is met at that spread (logit 0.5125 − logit 0.4875
    = 0.1), so it gave no gradient to widen predictions that had collapsed to the batch mean.
    """
    scores = torch.logit(torch.tensor([0.5125, 0.4875], dtype=torch.float64)).requires_grad_()
    for label_gap in (0.3, 0.5, 1.0):
        labels = torch.tensor([0.5 + label_gap / 2, 0.5 - label_gap / 2], dtype=torch.float64)
        loss, metrics = pairwise_ranking_loss(scores=scores, mean_rewards=labels, margin=0.5)
        # 0.5·gap − 0.025 > 0: e.g. 0.125 at a gap of 0.3.
        assert float(loss.detach()) == pytest.approx(0.5 * label_gap - 0.025, abs=1e-12)
        assert metrics["depo/rank_violation_fraction"] == 1.0
        # The same at the configured default margin, the one runs train with.
        at_default, _ = pairwise_ranking_loss(scores=scores.detach(), mean_rewards=labels, margin=DEPO_RANK_MARGIN)
        assert float(at_default) > 0.05
    loss.backward()
    assert scores.grad[0] < 0 < scores.grad[1]  # descent pushes the easier prompt up, the harder one down
    # Once the predictions are half as far apart as the labels, no penalty.
    wide = torch.logit(torch.tensor([0.75, 0.25], dtype=torch.float64))
    loss, _ = pairwise_ranking_loss(scores=wide, mean_rewards=torch.tensor([1.0, 0.0], dtype=torch.float64),
                                    margin=0.5)
    assert float(loss) == 0.0
    with pytest.raises(ValueError, match="margin"):
        pairwise_ranking_loss(scores=wide, mean_rewards=torch.tensor([1.0, 0.0]), margin=1.5)


def test_ranking_loss_direction_agrees_with_bce_target():
    """A gradient step on L_rank raises the score of the prompt with the higher observed reward."""
    scores = torch.tensor([0.0, 0.0], requires_grad=True)
    loss, _ = pairwise_ranking_loss(scores=scores, mean_rewards=torch.tensor([0.875, 0.125]), margin=1.0)
    loss.backward()
    # ∂/∂Â_0 of −σ(Â_0) at 0 is −σ'(0) = −1/4.
    assert scores.grad.tolist() == [-0.25, 0.25]  # descent pushes the easier prompt (index 0) up


def test_ranking_loss_without_pairs_is_zero_and_connected():
    scores = torch.tensor([0.3, -0.2], requires_grad=True)
    loss, metrics = pairwise_ranking_loss(scores=scores, mean_rewards=torch.tensor([0.5, 0.5]), margin=1.0)
    assert float(loss.detach()) == 0.0 and metrics["depo/rank_pairs"] == 0.0
    loss.backward()
    assert scores.grad.tolist() == [0.0, 0.0]
    single, _ = pairwise_ranking_loss(scores=torch.tensor([1.0]), mean_rewards=torch.tensor([0.3]), margin=1.0)
    assert float(single) == 0.0


def test_zero_variance_bce_skips_unknown_labels():
    logits = torch.tensor([0.0, math.log(3.0), 5.0], dtype=torch.float64, requires_grad=True)
    # Known: BCE(0, 1) = ln 2; BCE(ln 3, 0) = −ln(1/4) = ln 4. Unknown third row left out.
    loss, metrics = zero_variance_bce_loss(logits=logits, targets=torch.tensor([1.0, 0.0, math.nan],
                                                                               dtype=torch.float64))
    assert float(loss.detach()) == pytest.approx((math.log(2) + math.log(4)) / 2, abs=1e-12)
    assert metrics["depo/zero_variance_labels"] == 2.0
    loss.backward()
    assert logits.grad[2] == 0.0
    none_known, metrics = zero_variance_bce_loss(logits=logits.detach(), targets=torch.full((3,), math.nan,
                                                                                          dtype=torch.float64))
    assert float(none_known) == 0.0 and metrics["depo/zero_variance_labels"] == 0.0
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        zero_variance_bce_loss(logits=logits.detach(), targets=torch.tensor([0.5, 1.5, 0.0], dtype=torch.float64))


def test_total_loss_weights():
    gen = torch.Generator().manual_seed(3)
    adv = torch.randn(10, generator=gen, dtype=torch.float64)
    ppl = torch.randn(10, generator=gen, dtype=torch.float64)
    zero_variance = torch.randn(10, generator=gen, dtype=torch.float64)
    rewards = torch.randint(0, 5, (10,), generator=gen).double() / 4
    ppl_targets = torch.rand(10, generator=gen, dtype=torch.float64)
    zero_variance_labels = ((rewards == 0) | (rewards == 1)).double()
    loss, metrics = depo_estimator_loss(
        advantage_logits=adv, perplexity_logits=ppl, mean_rewards=rewards, perplexity_targets=ppl_targets,
        distill_weight=0.5, rank_weight=3.0, margin=0.5, zero_variance_logits=zero_variance,
        zero_variance_targets=zero_variance_labels, zero_variance_weight=2.0,
    )
    expected = (
        ref_bce(adv.tolist(), rewards.tolist())
        + 0.5 * ref_bce(ppl.tolist(), ppl_targets.tolist())
        + 3.0 * ref_rank(adv.tolist(), rewards.tolist(), 0.5)
        + 2.0 * ref_bce(zero_variance.tolist(), zero_variance_labels.tolist())
    )
    assert float(loss) == pytest.approx(expected, rel=1e-12)
    assert float(metrics["depo/loss"]) == pytest.approx(expected, rel=1e-12)
    without, metrics = depo_estimator_loss(
        advantage_logits=adv, perplexity_logits=ppl, mean_rewards=rewards, perplexity_targets=ppl_targets,
        distill_weight=0.5, rank_weight=3.0, margin=0.5, zero_variance_logits=None, zero_variance_targets=None,
        zero_variance_weight=2.0,
    )
    assert float(without) == pytest.approx(expected - 2.0 * ref_bce(zero_variance.tolist(),
                                                                      zero_variance_labels.tolist()), rel=1e-12)
    assert "depo/loss_zero_variance" not in metrics
    with pytest.raises(ValueError, match="both"):
        depo_estimator_loss(advantage_logits=adv, perplexity_logits=ppl, mean_rewards=rewards,
                            perplexity_targets=ppl_targets, distill_weight=0.5, rank_weight=3.0, margin=0.5,
                            zero_variance_logits=zero_variance, zero_variance_targets=None, zero_variance_weight=1.0)


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


# ---------------------------------------------------------------------------
# Zero-variance labels
# ---------------------------------------------------------------------------


def test_zero_variance_targets_hand_case():
    # G = 2. Group 0: rewards {1, 1, 1, 0} → (C(3,2) + C(1,2)) / C(4,2) = 3/6 = 0.5.
    # Group 1: {1, 1} → 1 (the group itself is all equal). Group 2: {0, 1} → 0.
    # Group 3: {0} with n = 1 < G → unknown (NaN). Group 4: empty → unknown. Group 5: {0.5, 0.5, 0.5} → 1.
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.5])
    group_ids = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2, 3, 5, 5, 5])
    got = zero_variance_targets(rewards=rewards, group_ids=group_ids, group_size=2, num_groups=6)
    assert got.dtype == torch.float64
    assert got[[0, 1, 2, 5]].tolist() == [0.5, 1.0, 0.0, 1.0]
    assert math.isnan(got[3]) and math.isnan(got[4])


def test_zero_variance_targets_match_subset_enumeration():
    gen = torch.Generator().manual_seed(5)
    for group_size in (1, 2, 3, 5):
        sizes = torch.randint(group_size, 9, (12,), generator=gen)
        rewards = torch.randint(0, 3, (int(sizes.sum()),), generator=gen).double() / 2  # rewards 0, 0.5, 1
        group_ids = torch.repeat_interleave(torch.arange(12), sizes)
        got = zero_variance_targets(rewards=rewards, group_ids=group_ids, group_size=group_size)
        for group in range(12):
            members = rewards[group_ids == group].tolist()
            assert float(got[group]) == pytest.approx(ref_all_equal(members, group_size), abs=1e-15)


def test_zero_variance_targets_edge_cases():
    # A group of one at G = 1, and an all-equal group at n = G, are exactly 1.0 (no 1 − 1e-16 rounding).
    assert zero_variance_targets(rewards=torch.tensor([0.3]), group_ids=torch.tensor([0]), group_size=1).tolist() == [
        1.0]
    ones = zero_variance_targets(rewards=torch.ones(64), group_ids=torch.zeros(64, dtype=torch.long), group_size=64)
    assert ones.tolist() == [1.0]
    # Fewer samples than G: a mixed group is a certain 0, an all-equal one tells nothing.
    short = zero_variance_targets(rewards=torch.tensor([0.0, 1.0, 1.0, 1.0]), group_ids=torch.tensor([0, 0, 1, 1]),
                                  group_size=8)
    assert short[0] == 0.0 and math.isnan(short[1])
    # Rewards compare exactly, as observed_zero_variance does: 1e-17 is not 0.
    noise = zero_variance_targets(rewards=torch.tensor([0.0, 1e-17], dtype=torch.float64),
                                  group_ids=torch.tensor([0, 0]), group_size=2)
    assert noise.tolist() == [0.0]
    with pytest.raises(ValueError, match="non-finite"):
        zero_variance_targets(rewards=torch.tensor([math.nan]), group_ids=torch.tensor([0]), group_size=1)
    with pytest.raises(ValueError, match="group_size"):
        zero_variance_targets(rewards=torch.tensor([1.0]), group_ids=torch.tensor([0]), group_size=0)


def test_zero_variance_targets_from_counts_match_the_rewards_version():
    # k = 8 samples, G = 4: c = 8 → 1; c = 0 → 1; c = 6 → C(6,4)/C(8,4) = 15/70; c = 2 → 15/70; c = 4 → 2/70.
    got = zero_variance_targets_from_counts(num_samples=torch.tensor([8, 8, 8, 8, 8, 3, 3]),
                                            num_correct=torch.tensor([8, 0, 6, 2, 4, 3, 1]), group_size=4)
    assert got[:5].tolist() == pytest.approx([1.0, 1.0, 15 / 70, 15 / 70, 2 / 70], abs=1e-15)
    assert math.isnan(got[5]) and got[6] == 0.0  # 3 < G samples: all equal unknown, mixed a certain 0
    rewards = torch.tensor([1.0] * 6 + [0.0] * 2)
    from_rewards = zero_variance_targets(rewards=rewards, group_ids=torch.zeros(8, dtype=torch.long), group_size=4)
    assert from_rewards.tolist() == [got[2].item()]
    with pytest.raises(ValueError, match="counts"):
        zero_variance_targets_from_counts(num_samples=torch.tensor([4]), num_correct=torch.tensor([5]), group_size=2)


def test_zero_variance_logit_is_a_residual_on_the_point_estimate():
    # p̂ = 3/4 at G = 2: P = 9/16 + 1/16 = 10/16 → logit ln(10/6); a head of 0.5 adds 0.5.
    head = torch.tensor([0.0, 0.5], dtype=torch.float64, requires_grad=True)
    reward = torch.tensor([math.log(3.0), math.log(3.0)], dtype=torch.float64, requires_grad=True)
    got = zero_variance_logit(head_logits=head, pass_rate_logits=reward, group_size=2)
    assert got.tolist() == pytest.approx([math.log(10 / 6), math.log(10 / 6) + 0.5], abs=1e-12)
    got.sum().backward()
    assert head.grad.tolist() == [1.0, 1.0] and reward.grad is None  # L_ZV does not move the reward head
    # float64 reference over a range of p̂ and G: σ(Ẑ) with a zero head is p̂^G + (1 − p̂)^G.
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(64, generator=gen, dtype=torch.float64) * 3
    for group_size in (2, 4, 8, 16):
        zero = zero_variance_logit(head_logits=torch.zeros(64, dtype=torch.float64), pass_rate_logits=logits,
                                   group_size=group_size)
        expected = [sigmoid(z) ** group_size + (1 - sigmoid(z)) ** group_size for z in logits.tolist()]
        assert torch.sigmoid(zero).tolist() == pytest.approx(expected, rel=1e-9, abs=1e-12)
    # A group of one is certain (P = 1, logit +∞) and a huge G near impossible: both capped at ±40, finite.
    edge = zero_variance_logit(head_logits=torch.zeros(2, dtype=torch.float64),
                               pass_rate_logits=torch.zeros(2, dtype=torch.float64), group_size=1)
    assert edge.tolist() == [40.0, 40.0]
    large = zero_variance_logit(head_logits=torch.zeros(1, dtype=torch.float64),
                                pass_rate_logits=torch.zeros(1, dtype=torch.float64), group_size=2000)
    assert large.tolist() == [-40.0]
    with pytest.raises(ValueError, match="non-finite"):
        zero_variance_logit(head_logits=torch.zeros(1), pass_rate_logits=torch.tensor([math.nan]), group_size=4)


def test_a_mixed_class_has_more_zero_variance_than_its_mean_pass_rate_says():
    """Jensen: half always solved, half solved at 1/2 → p̄ = 0.75, point estimate 0.10, truth ≈ 0.5 at G = 8."""
    point = float(zero_variance_log_prob(group_size=8, pass_rate=torch.tensor([0.75], dtype=torch.float64)).exp())
    assert point == pytest.approx(0.75**8 + 0.25**8, rel=1e-12)
    truth = 0.5 * 1.0 + 0.5 * float(zero_variance_log_prob(group_size=8, pass_rate=torch.tensor(
        [0.5], dtype=torch.float64)).exp())
    assert truth == pytest.approx(0.5 + 0.5 * 2 / 256, rel=1e-12) and truth > 4.9 * point


# ---------------------------------------------------------------------------
# Calibration and the drop rule
# ---------------------------------------------------------------------------


def test_platt_scaling_is_the_regularised_maximum_likelihood():
    gen = torch.Generator().manual_seed(6)
    z = torch.randn(20_000, generator=gen, dtype=torch.float64) * 2
    labels = (torch.rand(20_000, generator=gen, dtype=torch.float64) < torch.sigmoid(2.0 * z - 1.0)).double()
    slope, intercept = fit_platt_scaling(logits=z, targets=labels)
    assert slope == pytest.approx(2.0, abs=0.1) and intercept == pytest.approx(-1.0, abs=0.1)
    # First-order conditions of the likelihood with Platt's smoothed targets, in float64.
    positives, negatives = float(labels.sum()), float((1 - labels).sum())
    t = labels * (positives + 1) / (positives + 2) + (1 - labels) / (negatives + 2)
    residual = torch.sigmoid(slope * z + intercept) - t
    assert abs(float((residual * z).sum())) < 1e-4 and abs(float(residual.sum())) < 1e-4


def test_platt_scaling_hand_case_and_edges():
    # Constant logits: the slope stays 0 (ridge) and P is the smoothed base rate. Labels [1, 1, 1, 0]:
    # N₊ = 3, N₋ = 1 → targets 4/5 (×3) and 1/3 → mean (2.4 + 1/3)/4 = 0.683333…
    slope, intercept = fit_platt_scaling(logits=torch.zeros(4, dtype=torch.float64),
                                         targets=torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=torch.float64))
    assert slope == pytest.approx(0.0, abs=1e-9) and 1 / (1 + math.exp(-intercept)) == pytest.approx(
        (2.4 + 1 / 3) / 4, abs=1e-6)
    # Perfectly separated labels still give finite parameters (Platt's prior).
    slope, intercept = fit_platt_scaling(logits=torch.tensor([-2.0, -1.0, 1.0, 2.0]),
                                         targets=torch.tensor([0.0, 0.0, 1.0, 1.0]))
    assert math.isfinite(slope) and math.isfinite(intercept) and slope > 0
    with pytest.raises(ValueError, match="finite"):
        fit_platt_scaling(logits=torch.tensor([0.0, math.inf]), targets=torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="finite"):
        fit_platt_scaling(logits=torch.tensor([0.0, 1.0]), targets=torch.tensor([0.0, math.nan]))
    with pytest.raises(ValueError, match="non-empty"):
        fit_platt_scaling(logits=torch.zeros(0), targets=torch.zeros(0))


def ref_drop(prob: list[float], filter_ratio: float, threshold: float) -> list[bool]:
    """Drop the ⌊ratio·C⌋ most likely candidates above the threshold; ties keep the earlier one first."""
    cap = math.floor(round(filter_ratio * len(prob), 9))
    order = sorted(range(len(prob)), key=lambda i: (-prob[i], i))
    chosen = {i for i in order[:cap] if prob[i] > threshold}
    return [i in chosen for i in range(len(prob))]


def test_drop_decision_hand_case():
    prob = torch.tensor([0.9, 0.95, 0.3, 0.6, 0.95, 0.55], dtype=torch.float64)
    # Cap ⌊0.5·6⌋ = 3: the three most likely are 1 and 4 (0.95, tie: index order) and 0 (0.9).
    drop, metrics = depo_drop_decision(zero_variance_prob=prob, filter_ratio=0.5, threshold=0.5)
    assert drop.tolist() == [True, True, False, False, True, False]
    assert metrics["depo/filter_ratio"] == 0.5 and metrics["depo/above_threshold_fraction"] == pytest.approx(5 / 6)
    # Threshold 0.92: only the two at 0.95 qualify, under the cap.
    drop, _ = depo_drop_decision(zero_variance_prob=prob, filter_ratio=0.5, threshold=0.92)
    assert drop.tolist() == [False, True, False, False, True, False]
    # Threshold 0: by filter ratio alone. Ratio 0 drops nothing; ratio 1 drops everything above the threshold.
    assert depo_drop_decision(zero_variance_prob=prob, filter_ratio=1 / 3, threshold=0.0)[0].tolist() == [
        False, True, False, False, True, False]
    assert not depo_drop_decision(zero_variance_prob=prob, filter_ratio=0.0, threshold=0.0)[0].any()
    assert depo_drop_decision(zero_variance_prob=prob, filter_ratio=1.0, threshold=0.58)[0].tolist() == [
        True, True, False, True, True, False]


def test_drop_decision_matches_loop_reference():
    gen = torch.Generator().manual_seed(7)
    for _ in range(50):
        size = int(torch.randint(1, 40, (1,), generator=gen))
        prob = (torch.randint(0, 11, (size,), generator=gen).double() / 10)  # many ties
        ratio, threshold = float(torch.rand(1, generator=gen)), float(torch.rand(1, generator=gen)) * 0.99
        drop, _ = depo_drop_decision(zero_variance_prob=prob, filter_ratio=ratio, threshold=threshold)
        assert drop.tolist() == ref_drop(prob.tolist(), ratio, threshold)


def test_drop_decision_edge_cases():
    # 0.29 · 100 is 28.999999999999996 in floating point; the cap is still 29.
    drop, _ = depo_drop_decision(zero_variance_prob=torch.ones(100, dtype=torch.float64), filter_ratio=0.29,
                                 threshold=0.5)
    assert int(drop.sum()) == 29
    # A float-noise probability (1e-17, e.g. 1 − (1 − 1e-17)) is not above any positive threshold; it is the
    # least likely candidate after exact zeros when dropping by ratio alone.
    noise = torch.tensor([1e-17, 0.0, 0.7], dtype=torch.float64)
    assert depo_drop_decision(zero_variance_prob=noise, filter_ratio=1.0, threshold=1e-9)[0].tolist() == [
        False, False, True]
    assert depo_drop_decision(zero_variance_prob=noise, filter_ratio=2 / 3, threshold=0.0)[0].tolist() == [
        True, False, True]
    # A certain zero-variance group (P = 1, a group of one) is dropped first; an empty batch drops nothing.
    assert depo_drop_decision(zero_variance_prob=torch.tensor([0.6, 1.0]), filter_ratio=0.5,
                              threshold=0.5)[0].tolist() == [False, True]
    empty, metrics = depo_drop_decision(zero_variance_prob=torch.zeros(0), filter_ratio=0.5, threshold=0.5)
    assert empty.numel() == 0 and metrics["depo/filter_ratio"] == 0.0
    with pytest.raises(ValueError, match="finite"):
        depo_drop_decision(zero_variance_prob=torch.tensor([0.5, math.nan]), filter_ratio=0.5, threshold=0.5)
    with pytest.raises(ValueError, match="finite"):
        depo_drop_decision(zero_variance_prob=torch.tensor([1.5]), filter_ratio=0.5, threshold=0.5)
    with pytest.raises(ValueError, match="filter_ratio"):
        depo_drop_decision(zero_variance_prob=torch.tensor([0.5]), filter_ratio=1.5, threshold=0.5)
    with pytest.raises(ValueError, match="threshold"):
        depo_drop_decision(zero_variance_prob=torch.tensor([0.5]), filter_ratio=0.5, threshold=1.0)


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
    # Soft labels count fractionally: drops with labels 1 and 0.5 → precision 0.75; recall 1.5 / 2.
    soft = filter_precision_recall(filtered_mask=torch.tensor([True, True, False]),
                                   zero_variance_mask=torch.tensor([1.0, 0.5, 0.5], dtype=torch.float64))
    assert soft["depo/filter_precision"] == 0.75 and soft["depo/filter_recall"] == 0.75
