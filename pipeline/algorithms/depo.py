"""DEPO: the difficulty estimator's losses and the pre-rollout filter rule.

Paper: "Difficulty-Estimated Policy Optimization" (Zhao, Jiang, Liu, Zeng,
Liu, Wang, Luo). The estimator model itself lives in ``pipeline/estimator/``; this module
holds only pure functions.

§3.1.2 training objective, L = L_DE + w_distill·L_distill + w_rank·L_rank
(w_distill = 0.5, w_rank = 3 in §4.1):
    ``difficulty_bce_loss``     L_DE: BCE-with-logits of Â against avg@k.
    ``perplexity_targets``      the "normalized PPL" target P of L_distill.
    ``distill_bce_loss``        L_distill: BCE-with-logits of P̂ against P.
    ``pairwise_ranking_loss``   L_rank: mean hinge max(0, m − (Â_i − Â_j)).
    ``depo_estimator_loss``     the weighted sum.
§3 / §3.2 filtering:
    ``zero_variance_log_prob``  log P(all G rewards equal) = log(p̂^G + (1−p̂)^G).
    ``depo_filter``             drop a prompt before rollout when that
                                probability exceeds a threshold; nothing is
                                dropped during the estimator warm-up.
    ``observed_zero_variance``, ``filter_precision_recall``: how well the filter
                                matched the groups that really had zero variance.

Orientation: the estimator's score Â is a logit whose sigmoid is trained
towards the observed mean reward, so a *higher* score means an *easier* prompt
(higher pass rate). The paper's ranking-loss paragraph says the opposite
("the score for the harder question i [must] exceed the score for the easier
question j"); taken literally that would fight L_DE. We rank in the direction
consistent with the BCE target: for every pair with reward_i > reward_j,
penalise max(0, m − (Â_i − Â_j)).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pipeline.algorithms.segments import check_group_ids, group_max, group_min

__all__ = [
    "depo_estimator_loss",
    "depo_filter",
    "difficulty_bce_loss",
    "distill_bce_loss",
    "filter_precision_recall",
    "observed_zero_variance",
    "pairwise_ranking_loss",
    "perplexity_targets",
    "zero_variance_log_prob",
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
    """L_rank = (1/|Q|) Σ_{(i,j)∈Q} max(0, m − (Â_i − Â_j)) over all pairs in the batch.

    Q holds every ordered pair with A_i > A_j (i easier, by observed avg@k);
    pairs with equal targets carry no ordering and are excluded. Direction:
    see the module docstring — the easier prompt must out-score the harder one
    by the margin, matching the L_DE target. With no pair (B < 2 or all targets
    equal) the loss is an exact zero that still depends on ``scores`` (so the
    graph stays connected). Vectorised as a (B, B) matrix; the paper gives no
    margin value.
    """
    if margin < 0:
        raise ValueError(f"margin must be ≥ 0, got {margin}")
    _check_pair("pairwise_ranking_loss", scores, mean_rewards)
    targets = mean_rewards.to(scores.dtype)
    pair_mask = targets[:, None] > targets[None, :]  # (B, B): row i easier than column j
    hinge = torch.clamp(margin - (scores[:, None] - scores[None, :]), min=0.0)  # (B, B)
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


def depo_estimator_loss(
    *,
    advantage_logits: torch.Tensor,
    perplexity_logits: torch.Tensor,
    mean_rewards: torch.Tensor,
    perplexity_targets: torch.Tensor,
    distill_weight: float = 0.5,
    rank_weight: float = 3.0,
    margin: float = 0.1,
) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
    """L = L_DE + w_distill·L_distill + w_rank·L_rank (§3.1.2; weights 0.5 and 3 from §4.1).

    ``advantage_logits`` Â and ``perplexity_logits`` P̂ are the two heads'
    outputs ``(B,)``; ``mean_rewards`` is avg@k and ``perplexity_targets`` is
    from ``perplexity_targets``. The ranking loss acts on Â. The margin default
    0.1 (in logit units) is ours — the paper leaves m unspecified.
    """
    loss_de, metrics_de = difficulty_bce_loss(logits=advantage_logits, mean_rewards=mean_rewards)
    loss_distill, metrics_distill = distill_bce_loss(logits=perplexity_logits, perplexity_targets=perplexity_targets)
    loss_rank, metrics_rank = pairwise_ranking_loss(scores=advantage_logits, mean_rewards=mean_rewards, margin=margin)
    loss = loss_de + distill_weight * loss_distill + rank_weight * loss_rank
    with torch.no_grad():
        predicted = torch.sigmoid(advantage_logits)
    metrics: dict[str, float | torch.Tensor] = {
        **metrics_de,
        **metrics_distill,
        **metrics_rank,
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


def depo_filter(
    *,
    group_size: int,
    threshold: float,
    step: int,
    warmup_steps: int,
    pass_rate: torch.Tensor | None = None,
    pass_rate_logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
    """DEPO pre-rollout filter (§3, Figure 2; warm-up of §3.2).

    A prompt is dropped before rollout when the predicted probability that its
    G rollouts all get the same reward, p̂^G + (1 − p̂)^G, exceeds ``threshold``
    (compared in log space). While ``step < warmup_steps`` nothing is dropped
    (the estimator trains but does not filter: plain GRPO). The paper states
    the criterion as "non-zero estimated advantage" without a number; the
    zero-variance probability makes it a calibrated, group-size-aware test.

    Returns ``(keep_mask (B,) bool, metrics)``; ``depo/filter_ratio`` is the
    fraction of candidate prompts not kept (the paper's §4.3 definition).
    """
    if not (0.0 < threshold <= 1.0):
        raise ValueError(f"threshold must lie in (0, 1], got {threshold}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be ≥ 0, got {warmup_steps}")
    log_prob = zero_variance_log_prob(group_size=group_size, pass_rate=pass_rate, pass_rate_logits=pass_rate_logits)
    active = step >= warmup_steps
    if active:
        keep_mask = log_prob <= math.log(threshold)
    else:
        keep_mask = torch.ones_like(log_prob, dtype=torch.bool)
    num_prompts = keep_mask.numel()
    metrics: dict[str, float | torch.Tensor] = {
        "depo/filter_active": float(active),
        "depo/filter_ratio": float((~keep_mask).sum()) / num_prompts if num_prompts else 0.0,
        "depo/zero_variance_prob_mean": float(log_prob.exp().mean()) if num_prompts else 0.0,
    }
    return keep_mask.to(log_prob.device), metrics


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

    Both masks are ``(B,)`` over prompts whose rollouts were actually observed
    (e.g. warm-up steps, or a shadow evaluation where filtered prompts are
    still rolled out). precision = |filtered ∧ zero-var| / |filtered|,
    recall = |filtered ∧ zero-var| / |zero-var|; an empty denominator gives NaN
    (undefined, rather than a flattering 0 or 1). Returns plain floats for
    estimator reports.
    """
    if filtered_mask.shape != zero_variance_mask.shape or filtered_mask.dim() != 1:
        raise ValueError("filtered_mask and zero_variance_mask must be 1-D (B,) of one shape")
    filtered = filtered_mask.bool()
    zero_var = zero_variance_mask.bool()
    true_positive = int((filtered & zero_var).sum())
    num_filtered = int(filtered.sum())
    num_zero_var = int(zero_var.sum())
    return {
        "depo/filter_precision": true_positive / num_filtered if num_filtered else math.nan,
        "depo/filter_recall": true_positive / num_zero_var if num_zero_var else math.nan,
        "depo/filter_true_positive": float(true_positive),
        "depo/filter_false_positive": float(num_filtered - true_positive),
        "depo/filter_false_negative": float(num_zero_var - true_positive),
    }
