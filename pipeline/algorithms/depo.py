"""DEPO: the difficulty estimator's losses, its zero-variance labels and calibration, and the drop rule.

Paper: "Difficulty-Estimated Policy Optimization" (Zhao, Jiang, Liu, Zeng,
Liu, Wang, Luo). The estimator model itself lives in ``pipeline/estimator/``; this module
holds only pure functions.

§3.1.2 training objective, L = L_DE + w_distill·L_distill + w_rank·L_rank
(w_distill = 0.5, w_rank = 3 in §4.1), plus winnow's zero-variance term:
    ``difficulty_bce_loss``     L_DE: BCE-with-logits of Â against avg@k.
    ``perplexity_targets``      the "normalized PPL" target P of L_distill.
    ``distill_bce_loss``        L_distill: BCE-with-logits of P̂ against P.
    ``pairwise_ranking_loss``   L_rank: mean hinge max(0, m·(A_i − A_j) − (σ(Â_i) − σ(Â_j))).
    ``zero_variance_bce_loss``  L_ZV: BCE-with-logits of Ẑ against P(all G rewards equal).
    ``depo_estimator_loss``     the weighted sum.
§3 / §3.2 filtering ("samples with non-zero estimated advantages are employed ... those
with zero advantage are filtered out", Figure 2; the paper gives no number):
    ``zero_variance_logit``     Ẑ = the third head + logit of the point estimate below.
    ``zero_variance_targets``   the observed label: the fraction of G-subsets of a group's
                                rewards that are all equal (NaN where the group cannot tell).
    ``zero_variance_targets_from_counts``  the same from (samples, correct) counts.
    ``fit_platt_scaling``       P(all G equal) = σ(a·Ẑ + b) fitted on out-of-sample labels.
    ``depo_drop_decision``      the operating point: drop the candidates whose calibrated
                                P(all G equal) exceeds a threshold, at most a filter ratio of them.
    ``zero_variance_log_prob``  the point estimate log(p̂^G + (1−p̂)^G) the head corrects
                                (it understates a mixed class: E[p^G + (1−p)^G] ≥
                                p̄^G + (1−p̄)^G by Jensen).
    ``observed_zero_variance``, ``filter_precision_recall``: how well the drops matched the
                                groups that really had zero variance.

Orientation: the estimator's score Â is a logit whose sigmoid is trained
towards the observed mean reward, so a *higher* score means an *easier* prompt
(higher pass rate). The paper's ranking-loss paragraph says the opposite
("the score for the harder question i [must] exceed the score for the easier
question j"); taken literally that would fight L_DE. We rank in the direction
consistent with the BCE target: for every pair with reward_i > reward_j the
easier prompt i must out-score j.

Why a zero-variance head on top of p̂^G + (1 − p̂)^G: a prompt class whose members are
half always-solved and half solved at p = 1/2 has p̄ = 0.75, so the point estimate says
0.75^8 + 0.25^8 = 0.10 at G = 8, while half its groups are all-equal. Text that cannot
tell the members apart cannot fix p̂, but a head trained on the all-equal event itself
learns the class's 0.5 (BCE is a proper scoring rule). The head is a residual on the
point estimate's logit (``zero_variance_logit``), which is already right for a class with
one pass rate, and Platt scaling on the pre-rollout predictions corrects what is left.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pipeline.algorithms.segments import check_group_ids, group_max, group_min

__all__ = [
    "depo_drop_decision",
    "depo_estimator_loss",
    "difficulty_bce_loss",
    "distill_bce_loss",
    "filter_precision_recall",
    "fit_platt_scaling",
    "observed_zero_variance",
    "pairwise_ranking_loss",
    "perplexity_targets",
    "zero_variance_bce_loss",
    "zero_variance_log_prob",
    "zero_variance_logit",
    "zero_variance_targets",
    "zero_variance_targets_from_counts",
]


def _check_pair(name: str, logits: torch.Tensor, targets: torch.Tensor) -> None:
    if logits.dim() != 1 or logits.shape != targets.shape:
        raise ValueError(
            f"{name}: logits {tuple(logits.shape)} and targets {tuple(targets.shape)} must be 1-D (B,) of one shape"
        )
    if logits.numel() == 0:
        raise ValueError(f"{name}: empty batch")
    if not bool(torch.isfinite(logits).all()):
        raise ValueError(f"{name}: logits contain non-finite values")
    if not bool(torch.isfinite(targets).all()):
        raise ValueError(f"{name}: targets contain non-finite values")
    if bool(((targets < 0) | (targets > 1)).any()):
        raise ValueError(f"{name}: targets must lie in [0, 1]")


def difficulty_bce_loss(
    *, logits: torch.Tensor, mean_rewards: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
    """L_DE = −[A log σ(Â) + (1 − A) log(1 − σ(Â))], batch mean (§3.1.2).

    ``logits`` Â ``(B,)``; ``mean_rewards`` A ``(B,)`` is the avg@k of the
    actor's rollouts for each prompt (soft targets in [0, 1]). Computed with
    ``binary_cross_entropy_with_logits`` (log-sum-exp form, stable for |Â| ≫ 1).
    """
    _check_pair("difficulty_bce_loss", logits, mean_rewards)
    loss = F.binary_cross_entropy_with_logits(logits, mean_rewards.to(logits.dtype))
    return loss, {"depo/loss_de": loss.detach()}


def perplexity_targets(
    *, token_logprobs: torch.Tensor, token_mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
    """The "normalized PPL" target of L_distill: P = 1/PPL = exp(mean token log-prob).

    The paper says only that PPL values are normalised before the BCE. We use
    the inverse perplexity of the actor on the question tokens — the geometric
    mean of the token probabilities — because it lies in (0, 1] by
    construction, needs no batch or running statistics (a prompt's target does
    not depend on what else is in the batch, so the target is the same on every
    data-parallel rank and across resumes), and is monotone in PPL: higher P =
    the actor finds the question more familiar, the same "higher = easier"
    orientation as the L_DE target.

    ``token_logprobs``/``token_mask`` are ``(B, T)``: the actor's log-probs of
    the question tokens and which of them count. A row with no counted token
    has no perplexity and raises ``ValueError``, as does a non-finite counted
    log-prob. Returns ``(targets (B,), metrics)`` without gradient.
    """
    if token_logprobs.dim() != 2 or token_mask.shape != token_logprobs.shape:
        raise ValueError(
            f"token_logprobs {tuple(token_logprobs.shape)} and token_mask {tuple(token_mask.shape)} "
            "must be 2-D (B, T) of one shape"
        )
    mask = token_mask.bool()
    num_tokens = mask.sum(dim=1)  # (B,)
    if bool((num_tokens == 0).any()):
        empty = torch.nonzero(num_tokens == 0).flatten().tolist()
        raise ValueError(f"perplexity_targets: rows {empty[:8]} have no unmasked question token")
    logprobs = token_logprobs.detach().to(torch.float64)
    if not bool(torch.isfinite(logprobs[mask]).all()):
        raise ValueError("perplexity_targets: non-finite log-prob on an unmasked token")
    masked = torch.where(mask, logprobs, torch.zeros_like(logprobs))  # (B, T)
    mean_logprob = masked.sum(dim=1) / num_tokens  # (B,)
    targets = torch.exp(mean_logprob).clamp(max=1.0).to(token_logprobs.dtype)
    metrics: dict[str, float | torch.Tensor] = {
        "depo/log_ppl_mean": float(-mean_logprob.mean()),
        "depo/ppl_target_mean": float(targets.double().mean()),
    }
    return targets, metrics


def distill_bce_loss(
    *, logits: torch.Tensor, perplexity_targets: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
    """L_distill = −[P log σ(P̂) + (1 − P) log(1 − σ(P̂))], batch mean (§3.1.2)."""
    _check_pair("distill_bce_loss", logits, perplexity_targets)
    loss = F.binary_cross_entropy_with_logits(logits, perplexity_targets.to(logits.dtype))
    return loss, {"depo/loss_distill": loss.detach()}


def pairwise_ranking_loss(
    *, scores: torch.Tensor, mean_rewards: torch.Tensor, margin: float
) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
    """L_rank = (1/|Q|) Σ_{(i,j)∈Q} max(0, m·(A_i − A_j) − (σ(Â_i) − σ(Â_j))) over all pairs in the batch.

    Q holds every ordered pair with A_i > A_j (i easier, by observed avg@k); pairs with
    equal targets carry no ordering and are excluded. Direction: see the module docstring.

    The margin is a fraction of the observed gap, in pass-rate space. The paper's hinge
    max(0, m − (Â_i − Â_j)) with a constant m (§3.1.2 gives no value) is satisfied once the
    scores are m apart: at m = 0.1 logit that is a pass-rate spread of 0.025 around 1/2,
    so it cannot pull predictions that collapsed to the batch mean apart — the effect the
    paper credits the loss with ("significantly increases the standard deviation of the
    predicted scores"). Scaled to the label gap, the hinge stays active until the
    predicted pass rates are at least m times as far apart as the observed ones: labels
    0.2 and 0.8 at m = 0.5 need p̂ 0.3 apart. ``margin`` in [0, 1]; m = 1 asks for the
    full observed spread, which noisy avg@k labels overstate.

    With no pair (B < 2 or all targets equal) the loss is an exact zero that still
    depends on ``scores`` (so the graph stays connected). Vectorised as a (B, B) matrix.
    """
    if not (0.0 <= margin <= 1.0):
        raise ValueError(f"margin must lie in [0, 1] (a fraction of the observed pass-rate gap), got {margin}")
    _check_pair("pairwise_ranking_loss", scores, mean_rewards)
    targets = mean_rewards.to(scores.dtype)
    predicted = torch.sigmoid(scores)  # (B,)
    pair_mask = targets[:, None] > targets[None, :]  # (B, B): row i easier than column j
    required = margin * (targets[:, None] - targets[None, :])  # (B, B)
    hinge = torch.clamp(required - (predicted[:, None] - predicted[None, :]), min=0.0)  # (B, B)
    num_pairs = int(pair_mask.sum())
    total = torch.where(pair_mask, hinge, torch.zeros_like(hinge)).sum()
    loss = total / max(num_pairs, 1)
    violated = int((pair_mask & (hinge > 0)).sum())
    metrics: dict[str, float | torch.Tensor] = {
        "depo/loss_rank": loss.detach(),
        "depo/rank_pairs": float(num_pairs),
        "depo/rank_violation_fraction": violated / num_pairs if num_pairs else 0.0,
    }
    return loss, metrics


def zero_variance_bce_loss(
    *, logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
    """L_ZV = BCE-with-logits of the zero-variance logit Ẑ against P(all G rewards equal), over known labels.

    ``targets`` ``(B,)`` from ``zero_variance_targets`` (soft labels in [0, 1]); NaN marks
    a prompt whose group cannot tell (fewer than G samples, all equal) and is left out of
    the mean. With no known label the loss is an exact zero connected to ``logits``.
    """
    if logits.dim() != 1 or logits.shape != targets.shape:
        raise ValueError(f"zero_variance_bce_loss: logits {tuple(logits.shape)} and targets "
                         f"{tuple(targets.shape)} must be 1-D (B,) of one shape")
    if not bool(torch.isfinite(logits).all()):
        raise ValueError("zero_variance_bce_loss: logits contain non-finite values")
    known = ~torch.isnan(targets)
    if bool(torch.isinf(targets).any()) or bool(((targets[known] < 0) | (targets[known] > 1)).any()):
        raise ValueError("zero_variance_bce_loss: targets must lie in [0, 1] (NaN: unknown)")
    num_known = int(known.sum())
    if num_known == 0:
        loss = logits.sum() * 0.0
    else:
        loss = F.binary_cross_entropy_with_logits(logits[known], targets[known].to(logits.dtype))
    return loss, {"depo/loss_zero_variance": loss.detach(), "depo/zero_variance_labels": float(num_known)}


def depo_estimator_loss(
    *,
    advantage_logits: torch.Tensor,
    perplexity_logits: torch.Tensor,
    mean_rewards: torch.Tensor,
    perplexity_targets: torch.Tensor,
    distill_weight: float,
    rank_weight: float,
    margin: float,
    zero_variance_logits: torch.Tensor | None,
    zero_variance_targets: torch.Tensor | None,
    zero_variance_weight: float,
) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
    """L = L_DE + w_distill·L_distill + w_rank·L_rank + w_ZV·L_ZV (§3.1.2; weights 0.5 and 3 from §4.1).

    ``advantage_logits`` Â and ``perplexity_logits`` P̂ are the two heads' outputs ``(B,)``;
    ``mean_rewards`` is avg@k and ``perplexity_targets`` is from ``perplexity_targets``. The
    ranking loss acts on Â (``margin``: see ``pairwise_ranking_loss``). L_ZV is winnow's: the
    third head's Ẑ against ``zero_variance_targets`` (both, or both None to leave it out).
    The paper has no such term; it is what the drop rule reads.
    """
    if (zero_variance_logits is None) != (zero_variance_targets is None):
        raise ValueError("give both zero_variance_logits and zero_variance_targets, or neither")
    loss_de, metrics_de = difficulty_bce_loss(logits=advantage_logits, mean_rewards=mean_rewards)
    loss_distill, metrics_distill = distill_bce_loss(logits=perplexity_logits, perplexity_targets=perplexity_targets)
    loss_rank, metrics_rank = pairwise_ranking_loss(scores=advantage_logits, mean_rewards=mean_rewards, margin=margin)
    loss = loss_de + distill_weight * loss_distill + rank_weight * loss_rank
    metrics_zero_variance: dict[str, float | torch.Tensor] = {}
    if zero_variance_logits is not None and zero_variance_targets is not None:
        loss_zero_variance, metrics_zero_variance = zero_variance_bce_loss(logits=zero_variance_logits,
                                                                           targets=zero_variance_targets)
        loss = loss + zero_variance_weight * loss_zero_variance
    with torch.no_grad():
        predicted = torch.sigmoid(advantage_logits)
    metrics: dict[str, float | torch.Tensor] = {
        **metrics_de,
        **metrics_distill,
        **metrics_rank,
        **metrics_zero_variance,
        "depo/loss": loss.detach(),
        "depo/predicted_pass_rate_mean": predicted.mean(),
        "depo/predicted_pass_rate_std": predicted.std(correction=0),
        "depo/pass_rate_mae": (predicted - mean_rewards.to(predicted.dtype)).abs().mean(),
    }
    return loss, metrics


def zero_variance_log_prob(
    *,
    group_size: int,
    pass_rate: torch.Tensor | None = None,
    pass_rate_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """log P(zero variance) = log(p̂^G + (1 − p̂)^G) for G independent {0, 1} rewards.

    Give exactly one of ``pass_rate`` (p̂ in [0, 1]) or ``pass_rate_logits``
    (the estimator's Â, p̂ = σ(Â)); the logit path uses log σ(Â) and
    log σ(−Â) and so keeps full precision for p̂ near 0 or 1. Evaluated as
    logaddexp(G·log p̂, G·log(1 − p̂)), which neither underflows for large G nor
    loses the smaller term. A group of one always has zero variance (log 1 = 0).
    Returns float64 ``(B,)``.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be ≥ 1, got {group_size}")
    if (pass_rate is None) == (pass_rate_logits is None):
        raise ValueError("give exactly one of pass_rate or pass_rate_logits")
    if pass_rate_logits is not None:
        logits = pass_rate_logits.detach().to(torch.float64)
        if not bool(torch.isfinite(logits).all()):
            raise ValueError("pass_rate_logits contain non-finite values")
        log_p, log_q = F.logsigmoid(logits), F.logsigmoid(-logits)
    else:
        assert pass_rate is not None
        p = pass_rate.detach().to(torch.float64)
        if not bool(torch.isfinite(p).all()) or bool(((p < 0) | (p > 1)).any()):
            raise ValueError("pass_rate must be finite and lie in [0, 1]")
        log_p, log_q = torch.log(p), torch.log1p(-p)
    if group_size == 1:
        # p + (1 − p) = 1 exactly; logaddexp would leave a rounding residue of ~1e-17.
        return torch.zeros_like(log_p)
    return torch.logaddexp(group_size * log_p, group_size * log_q)


# σ(40) = 1 − 4e-18: past this a zero-variance logit is certain in float64, and a finite cap keeps
# BCE-with-logits finite for a group of one (P = 1 exactly, logit +∞).
_MAX_ZERO_VARIANCE_LOGIT = 40.0


def zero_variance_logit(*, head_logits: torch.Tensor, pass_rate_logits: torch.Tensor, group_size: int) -> torch.Tensor:
    """Ẑ = head + logit(p̂^G + (1 − p̂)^G): the zero-variance head as a residual on the point estimate; ``(B,)``.

    ``pass_rate_logits`` Â enter without gradient, so L_ZV never bends the reward head away
    from the avg@k it is trained on. The point estimate is exact for a class of prompts that
    share one pass rate, so a zero head (its initialisation) starts from it; for a class that
    mixes easy and hard prompts it understates P(all G equal) (Jensen, module docstring) and
    the head learns the difference from the observed labels. Computed in float64 from
    ``zero_variance_log_prob`` (log space, no underflow at large G), capped at ±40, and returned
    in ``head_logits``' dtype with ``head_logits``' gradient.
    """
    if head_logits.shape != pass_rate_logits.shape or head_logits.dim() != 1:
        raise ValueError(f"head_logits {tuple(head_logits.shape)} and pass_rate_logits "
                         f"{tuple(pass_rate_logits.shape)} must be 1-D (B,) of one shape")
    log_prob = zero_variance_log_prob(group_size=group_size, pass_rate_logits=pass_rate_logits.detach())  # (B,)
    prior = (log_prob - torch.log(-torch.expm1(log_prob))).clamp(-_MAX_ZERO_VARIANCE_LOGIT, _MAX_ZERO_VARIANCE_LOGIT)
    return head_logits + prior.to(device=head_logits.device, dtype=head_logits.dtype)


def _all_equal_fraction(value_counts: list[int], group_size: int) -> float:
    """Σ_v C(n_v, G) / C(n, G): the share of G-subsets of the group whose rewards are all equal, or NaN.

    Exact integer binomials and one correctly rounded division, so an all-equal group
    gives exactly 1.0 and a group of one at G = 1 too (no 1 − 1e-16 from log-gammas).
    """
    total = sum(value_counts)
    if total >= group_size:
        return sum(math.comb(count, group_size) for count in value_counts) / math.comb(total, group_size)
    # Fewer than G samples: two distinct rewards already make every G-group mixed; one value tells nothing.
    return 0.0 if len(value_counts) > 1 else math.nan


def zero_variance_targets(
    *, rewards: torch.Tensor, group_ids: torch.Tensor, group_size: int, num_groups: int | None = None
) -> torch.Tensor:
    """The observed label of P(all G rewards equal) for each group: ``(P,)`` float64, NaN where unknown.

    A group of n samples with n_v of them at reward v gives Σ_v C(n_v, G) / C(n, G): the
    fraction of its G-subsets that are all equal. At n = G that is 1 for an all-equal group
    and 0 otherwise (the event itself); for n > G (Reinforce-Ada rounds, E3 budgets) it is
    the unbiased U-statistic of p^G + (1 − p)^G, with lower variance than using any one
    G-subset. With n < G a mixed group is a certain 0 and an all-equal one is unknown
    (NaN), as is an empty group. Rewards are compared exactly, as ``observed_zero_variance``
    does; a reward of 1e-17 differs from 0. Raises ``ValueError`` for non-finite rewards
    or ``group_size < 1``.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be ≥ 1, got {group_size}")
    if rewards.dim() != 1 or rewards.shape != group_ids.shape:
        raise ValueError("rewards and group_ids must be 1-D (S,) of one shape")
    if rewards.numel() and not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards contain non-finite values")
    num_groups = check_group_ids(group_ids, num_groups)
    counts: list[dict[float, int]] = [{} for _ in range(num_groups)]
    for group, reward in zip(group_ids.tolist(), rewards.double().tolist()):
        counts[group][reward] = counts[group].get(reward, 0) + 1
    return torch.tensor([_all_equal_fraction(list(by_value.values()), group_size) for by_value in counts],
                        dtype=torch.float64)


def zero_variance_targets_from_counts(
    *, num_samples: torch.Tensor, num_correct: torch.Tensor, group_size: int
) -> torch.Tensor:
    """``zero_variance_targets`` for binary rewards given as counts ``(P,)``: (C(c, G) + C(n − c, G)) / C(n, G).

    For a curation's k graded samples per prompt (``winnow train-estimator``) evaluated at
    the run's G. NaN where unknown (see ``zero_variance_targets``).
    """
    if group_size < 1:
        raise ValueError(f"group_size must be ≥ 1, got {group_size}")
    if num_samples.shape != num_correct.shape or num_samples.dim() != 1:
        raise ValueError("num_samples and num_correct must be 1-D (P,) of one shape")
    samples, correct = num_samples.tolist(), num_correct.tolist()
    if any(c < 0 or c > n or int(n) != n or int(c) != c for n, c in zip(samples, correct)):
        raise ValueError("counts must be integers with 0 ≤ num_correct ≤ num_samples")
    return torch.tensor([_all_equal_fraction([count for count in (int(c), int(n - c)) if count], group_size)
                         for n, c in zip(samples, correct)], dtype=torch.float64)


def fit_platt_scaling(*, logits: torch.Tensor, targets: torch.Tensor, max_iterations: int = 100) -> tuple[float, float]:
    """Slope a and intercept b of P = σ(a·z + b), fitted by regularised maximum likelihood; float64.

    Platt, "Probabilistic outputs for support vector machines" (1999), with the Newton
    iteration, backtracking line search and ridge of Lin, Lin and Weng, "A note on Platt's
    probabilistic outputs for support vector machines" (2007), Algorithm 1. ``targets`` are
    soft labels in [0, 1] (``zero_variance_targets``; leave unknown ones out); Platt's
    prior shrinks them to y·(N₊+1)/(N₊+2) + (1 − y)/(N₋+2), so a window without a
    single positive still gives finite parameters. Constant ``logits`` give slope 0 (the
    ridge), i.e. the smoothed base rate. Costs O(N) per iteration; N is a calibration
    window of a few hundred predictions.
    """
    if logits.dim() != 1 or logits.shape != targets.shape or logits.numel() == 0:
        raise ValueError(f"fit_platt_scaling: logits {tuple(logits.shape)} and targets {tuple(targets.shape)} "
                         "must be non-empty 1-D (N,) of one shape")
    z = logits.detach().to(torch.float64)
    y = targets.detach().to(torch.float64)
    if not bool(torch.isfinite(z).all()) or not bool(torch.isfinite(y).all()):
        raise ValueError("fit_platt_scaling: logits and targets must be finite (leave unknown labels out)")
    if bool(((y < 0) | (y > 1)).any()):
        raise ValueError("fit_platt_scaling: targets must lie in [0, 1]")
    positives, negatives = float(y.sum()), float((1 - y).sum())
    high, low = (positives + 1.0) / (positives + 2.0), 1.0 / (negatives + 2.0)
    t = y * high + (1 - y) * low  # (N,)
    ridge, min_step, tolerance = 1e-12, 1e-10, 1e-5

    def objective(a: float, b: float) -> float:
        f = a * z + b
        return float((F.softplus(f) - t * f).sum())

    a, b = 0.0, math.log((positives + 1.0) / (negatives + 1.0))
    value = objective(a, b)
    for _ in range(max_iterations):
        p = torch.sigmoid(a * z + b)
        residual, curvature = p - t, p * (1 - p)
        g_a, g_b = float((residual * z).sum()), float(residual.sum())
        if abs(g_a) < tolerance and abs(g_b) < tolerance:
            break
        h_aa = float((curvature * z * z).sum()) + ridge
        h_bb = float(curvature.sum()) + ridge
        h_ab = float((curvature * z).sum())
        determinant = h_aa * h_bb - h_ab * h_ab
        d_a = -(h_bb * g_a - h_ab * g_b) / determinant
        d_b = -(-h_ab * g_a + h_aa * g_b) / determinant
        decrease = g_a * d_a + g_b * d_b
        step = 1.0
        while step >= min_step:
            candidate = objective(a + step * d_a, b + step * d_b)
            if candidate < value + 1e-4 * step * decrease:
                a, b, value = a + step * d_a, b + step * d_b, candidate
                break
            step /= 2.0
        else:
            break  # no decrease along the Newton direction: at the optimum up to rounding
    return a, b


def depo_drop_decision(
    *, zero_variance_prob: torch.Tensor, filter_ratio: float, threshold: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """DEPO's pre-rollout drop rule (§3, Figure 2) at an operating point: ``(drop_mask (C,) bool, metrics)``.

    A candidate is dropped when its calibrated probability that all G rollouts get the
    same reward exceeds ``threshold``, and at most ⌊filter_ratio·C⌋ candidates are dropped
    (the most likely zero-variance first; ties keep the earlier candidate). With calibrated
    probabilities every dropped prompt is more likely than ``threshold`` to be a wasted
    group, so the expected precision of the drops exceeds it; the cap is the paper's
    operating point, whose filter ratio "stabilizes at approximately 50%" (§4.3, Figure 6)
    and whose accuracy falls once a heavier ranking weight pushes it past that (Figure 7).
    ``threshold = 0`` drops by filter ratio alone (a quantile of the batch).

    The warm-up of §3.2 (no filtering for the first n steps) is the caller's: it still
    evaluates this rule on warm-up steps to measure precision and recall where every
    candidate's outcome is observed. ``zero_variance_prob`` must be finite and in [0, 1];
    ``depo/filter_ratio`` is the fraction of candidates dropped (the paper's §4.3 definition).
    """
    if not (0.0 <= filter_ratio <= 1.0):
        raise ValueError(f"filter_ratio must lie in [0, 1], got {filter_ratio}")
    if not (0.0 <= threshold < 1.0):
        raise ValueError(f"threshold must lie in [0, 1), got {threshold}")
    if zero_variance_prob.dim() != 1:
        raise ValueError(f"zero_variance_prob must be 1-D (C,), got {tuple(zero_variance_prob.shape)}")
    prob = zero_variance_prob.detach().to(torch.float64)
    if not bool(torch.isfinite(prob).all()) or bool(((prob < 0) | (prob > 1)).any()):
        raise ValueError("zero_variance_prob must be finite and lie in [0, 1]")
    num_candidates = prob.numel()
    # round() first: 0.29·100 is 28.999999999999996 in floating point, and the cap is 29.
    cap = math.floor(round(filter_ratio * num_candidates, 9))
    eligible = prob > threshold  # (C,)
    order = torch.sort(prob, descending=True, stable=True).indices  # (C,) most likely zero-variance first
    rank = torch.empty_like(order)
    rank[order] = torch.arange(num_candidates)
    drop_mask = eligible & (rank < cap)
    metrics = {
        "depo/filter_ratio": float(drop_mask.sum()) / num_candidates if num_candidates else 0.0,
        "depo/above_threshold_fraction": float(eligible.sum()) / num_candidates if num_candidates else 0.0,
        "depo/zero_variance_prob_mean": float(prob.mean()) if num_candidates else 0.0,
    }
    return drop_mask, metrics


def observed_zero_variance(
    *, rewards: torch.Tensor, group_ids: torch.Tensor, num_groups: int | None = None
) -> torch.Tensor:
    """Which groups' rollouts all got the same reward: ``(G,)`` bool.

    A group of one counts as zero-variance; an empty group (no rollout) does not.
    """
    if rewards.dim() != 1 or rewards.shape != group_ids.shape:
        raise ValueError("rewards and group_ids must be 1-D (S,) of one shape")
    if rewards.numel() and not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards contain non-finite values")
    num_groups = check_group_ids(group_ids, num_groups)
    return group_max(rewards, group_ids, num_groups) == group_min(rewards, group_ids, num_groups)


def filter_precision_recall(
    *, filtered_mask: torch.Tensor, zero_variance_mask: torch.Tensor
) -> dict[str, float]:
    """Precision and recall of the filter against observed zero-variance groups.

    Both are ``(B,)`` over prompts whose rollouts were actually observed (e.g. warm-up
    steps, or audited prompts the filter would have dropped). ``zero_variance_mask`` is
    bool (all rewards equal) or a soft label in [0, 1] (``zero_variance_targets``: the
    share of G-subsets that are all equal), which counts fractionally.
    precision = Σ(filtered · zero-var) / |filtered|, recall = Σ(filtered · zero-var) / Σ zero-var;
    an empty denominator gives NaN (undefined, rather than a flattering 0 or 1). Returns
    plain floats for estimator reports.
    """
    if filtered_mask.shape != zero_variance_mask.shape or filtered_mask.dim() != 1:
        raise ValueError("filtered_mask and zero_variance_mask must be 1-D (B,) of one shape")
    filtered = filtered_mask.bool()
    zero_var = zero_variance_mask.to(torch.float64)
    if not bool(torch.isfinite(zero_var).all()) or bool(((zero_var < 0) | (zero_var > 1)).any()):
        raise ValueError("zero_variance_mask must be bool or lie in [0, 1] (leave unknown labels out)")
    true_positive = float(zero_var[filtered].sum())
    num_filtered = int(filtered.sum())
    num_zero_var = float(zero_var.sum())
    return {
        "depo/filter_precision": true_positive / num_filtered if num_filtered else math.nan,
        "depo/filter_recall": true_positive / num_zero_var if num_zero_var else math.nan,
        "depo/filter_true_positive": true_positive,
        "depo/filter_false_positive": num_filtered - true_positive,
        "depo/filter_false_negative": num_zero_var - true_positive,
    }
