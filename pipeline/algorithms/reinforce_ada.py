"""Reinforce-Ada: adaptive per-prompt sampling under the log objective.

Paper: "Reinforce-Ada: An Adaptive Sampling Framework under Non-linear RL
Objectives" (Xiong, Ye, Liao, Dong et al.).

What lives here:

Reinforce-Ada-Seq (Algorithm 2, §3.2)
    ``exit_condition``        lines 8–9: the POS and BALANCE exit rules.
    ``pool_statistics``       lines 16–17 and §3.2: per-prompt counts, r̄_x and
                              p̂ = N_pos / N over the *whole* pool (the exit rule
                              and the Ada-EMA update consume the counts).
    ``balanced_downsample``   line 18: keep n per prompt, ≥ n/2 of each outcome
                              when available, filled from the other side
                              (registered as sample selector ``balanced``).
Reinforce-Ada-Est (Algorithm 1, §3.1)
    ``ema_beta_update``       Ada-EMA: N_tot ← λN_tot + n, N_pos ← λN_pos + k;
    ``ema_beta_estimate``     p̂ = (N_pos + α)/(N_tot + α + β) (the run's counters
                              live in ``PromptStatsStore``).
    ``ada_est_budgets``       line 5: N_x ∝ 1/√(p̂+ε) in [N_min, N_max], Σ N_x =
                              N_total exactly; Appendix B.1 rule ∝ √((1−p)/p);
                              Appendix C.2 implicit weighting ∝ 1/(p̂+ε).
Appendix D
    ``expected_samples``      exact expected sampling cost of the sequential
                              rules with per-round batches and a cap.
    ``pool_zero_variance_probability``  the chance that a prompt's whole pool
                              has one outcome: what no number of rounds rescues.

The advantages themselves are ``advantages.global_baseline_advantages``
(registered ``global_baseline``), given the whole pool via ``pool_rewards``:
``weight="none"`` is Algorithm 2 line 19 (A = r − r̄_x), ``"inv_mean"`` the §3.2
estimator with the re-introduced 1/p̂ weight, ``"inv_sqrt_mean"`` Algorithm 1
lines 14–16 (A = (r − r̄_x)/√(r̄_x + ε)), ``"bernoulli_std"`` the authors'
released Seq code (GRPO's normalisation with the pool's mean and std,
(r − p̂)/√(p̂(1 − p̂)) for binary rewards). Compute them on the pool *before*
``balanced_downsample``, which passes them through unchanged.

Outcomes are binary: a response is *correct* when ``reward > success_threshold``
(default 0, which serves both the {0, 1} and the {−1, +1} reward conventions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from pipeline.algorithms.segments import check_group_ids, group_counts, group_sum

__all__ = [
    "PoolStatistics",
    "ada_est_budgets",
    "allocate_proportional_budgets",
    "balanced_downsample",
    "ema_beta_estimate",
    "ema_beta_update",
    "exit_condition",
    "expected_samples",
    "pool_statistics",
    "pool_zero_variance_probability",
]

ExitRule = Literal["pos", "balance"]


def _require_finite(name: str, tensor: torch.Tensor) -> None:
    if tensor.numel() and not bool(torch.isfinite(tensor).all()):
        raise ValueError(f"{name} contains non-finite values")


def _check_samples(rewards: torch.Tensor, group_ids: torch.Tensor, num_groups: int | None) -> int:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (S,), got shape {tuple(rewards.shape)}")
    if group_ids.shape != rewards.shape:
        raise ValueError(
            f"group_ids {tuple(group_ids.shape)} and rewards {tuple(rewards.shape)} differ in shape"
        )
    _require_finite("rewards", rewards)
    return check_group_ids(group_ids, num_groups)


# ---------------------------------------------------------------------------
# Reinforce-Ada-Seq (Algorithm 2)
# ---------------------------------------------------------------------------


def exit_condition(
    *,
    num_correct: torch.Tensor,
    num_incorrect: torch.Tensor,
    rule: ExitRule,
    k_pos: int,
    k_neg: int = 0,
) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
    """Algorithm 2 lines 8–9: which prompts leave the active set after a round.

    ``num_correct``/``num_incorrect`` are the cumulative per-prompt counts
    ``(P,)`` of the pool so far. ``rule="pos"`` (Reinforce-Ada-Seq-Pos) exits
    once ``num_correct ≥ k_pos``; ``rule="balance"`` (Seq-Balance) once
    ``num_correct ≥ k_pos`` and ``num_incorrect ≥ k_neg``. Returns the
    ``(P,)`` bool ``exit_mask``; the caller also deactivates every prompt once
    the round cap (N_max) is reached.
    """
    if num_correct.shape != num_incorrect.shape or num_correct.dim() != 1:
        raise ValueError(
            "num_correct and num_incorrect must be 1-D (P,) of the same shape, got "
            f"{tuple(num_correct.shape)} and {tuple(num_incorrect.shape)}"
        )
    if k_pos < 0 or k_neg < 0:
        raise ValueError(f"k_pos and k_neg must be ≥ 0, got {k_pos} and {k_neg}")
    if rule == "pos":
        exit_mask = num_correct >= k_pos
    elif rule == "balance":
        exit_mask = (num_correct >= k_pos) & (num_incorrect >= k_neg)
    else:
        raise ValueError(f"unknown exit rule {rule!r}; choose 'pos' or 'balance'")
    num_prompts = exit_mask.numel()
    metrics: dict[str, float | torch.Tensor] = {
        "ada/exit_fraction": float(exit_mask.sum()) / num_prompts if num_prompts else 0.0,
    }
    return exit_mask, metrics


@dataclass(frozen=True, slots=True)
class PoolStatistics:
    """Per-prompt statistics of the whole sampled pool (before down-sampling).

    All fields are ``(G,)``. ``mean_reward`` is r̄_x of Algorithm 2 line 17 and
    ``pass_rate`` is p̂ = N_pos / N of §3.2; they coincide for {0, 1} rewards.
    An empty group has ``num_samples == 0`` and mean/pass rate 0.
    """

    num_samples: torch.Tensor  # (G,) int64
    num_correct: torch.Tensor  # (G,) int64
    mean_reward: torch.Tensor  # (G,) float64
    pass_rate: torch.Tensor  # (G,) float64

    @property
    def num_incorrect(self) -> torch.Tensor:
        return self.num_samples - self.num_correct


def pool_statistics(
    *,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    num_groups: int | None = None,
    success_threshold: float = 0.0,
) -> tuple[PoolStatistics, dict[str, float | torch.Tensor]]:
    """Global (pool-level) statistics of Algorithm 2 lines 16–17 and §3.2.

    Call this on *every* response sampled for a prompt, before down-sampling:
    the point of the sequential pool is that its baseline is computed from
    many more samples than the n kept for the update. Statistics are in
    float64 so that a pool of hundreds of {0, 1} rewards gives an exact mean.
    """
    num_groups = _check_samples(rewards, group_ids, num_groups)
    correct = (rewards > success_threshold).to(torch.float64)
    counts = group_counts(group_ids, num_groups)  # (G,)
    reward_sums = group_sum(rewards.to(torch.float64), group_ids, num_groups)  # (G,)
    correct_sums = group_sum(correct, group_ids, num_groups)  # (G,)
    denominators = counts.clamp(min=1).to(torch.float64)
    stats = PoolStatistics(
        num_samples=counts,
        num_correct=correct_sums.round().to(torch.int64),
        mean_reward=reward_sums / denominators,
        pass_rate=correct_sums / denominators,
    )
    nonempty = counts > 0
    metrics: dict[str, float | torch.Tensor] = {
        "ada/pool_size_mean": float(counts[nonempty].double().mean()) if bool(nonempty.any()) else 0.0,
        "ada/pool_size_max": float(counts.max()) if num_groups else 0.0,
        "ada/pool_pass_rate_mean": float(stats.pass_rate[nonempty].mean()) if bool(nonempty.any()) else 0.0,
    }
    return stats, metrics


def balanced_downsample(
    *,
    advantages: torch.Tensor,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    num_keep: int,
    generator: torch.Generator,
    num_groups: int | None = None,
    success_threshold: float = 0.0,
) -> tuple[tuple[torch.Tensor, torch.Tensor], dict[str, float | torch.Tensor]]:
    """Balanced down-sampling of each prompt's pool, Algorithm 2 line 18.

    Keeps ``num_keep`` (n) responses per prompt: ⌊n/2⌋ incorrect and the rest
    correct when both sides have enough; when one side is short, all of it is
    kept and the other side fills the remaining slots. For odd n the extra slot
    goes to the correct side. A pool no larger than n is kept whole. Which
    members of a side are kept is uniform at random, drawn from ``generator``.

    The advantages are returned unchanged (D³S-style): they must already be the
    pool-level ones (``global_baseline`` over the whole pool), which is what
    keeps the global baseline after the static-batch down-sampling of §3.2.
    Returns ``((keep_mask, advantages), metrics)`` with ``keep_mask`` ``(S,)``.
    """
    num_groups = _check_samples(rewards, group_ids, num_groups)
    if advantages.shape != rewards.shape:
        raise ValueError(
            f"advantages {tuple(advantages.shape)} and rewards {tuple(rewards.shape)} differ in shape"
        )
    if isinstance(num_keep, bool) or not isinstance(num_keep, int) or num_keep < 1:
        raise ValueError(f"num_keep must be an int ≥ 1, got {num_keep!r}")
    if not isinstance(generator, torch.Generator):
        raise ValueError("balanced down-sampling draws from a torch.Generator; got none (seed one for reproducibility)")
    num_samples = rewards.numel()
    if num_samples == 0:
        return (torch.zeros(0, dtype=torch.bool, device=rewards.device), advantages), {}
    device = rewards.device
    correct = (rewards > success_threshold).long()  # (S,)
    num_correct = group_sum(correct, group_ids, num_groups)  # (G,)
    num_incorrect = group_counts(group_ids, num_groups) - num_correct  # (G,)

    quota_incorrect = torch.clamp(num_incorrect, max=num_keep // 2)
    quota_correct = torch.minimum(num_correct, num_keep - quota_incorrect)
    quota_incorrect = torch.minimum(num_incorrect, num_keep - quota_correct)
    # Segment s = 2·group + outcome: quota of incorrect at even, correct at odd ids.
    quotas = torch.stack([quota_incorrect, quota_correct], dim=1).reshape(-1)  # (2G,)
    segments = group_ids.long() * 2 + correct  # (S,)

    # Random rank of each sample inside its segment: order by random key, then
    # stable-sort by segment so members of a segment are contiguous and in
    # random order; rank = position − first position of the segment.
    keys = torch.rand(num_samples, generator=generator, device=generator.device, dtype=torch.float64)
    by_key = torch.argsort(keys.to(device))
    order = by_key[torch.argsort(segments[by_key], stable=True)]  # (S,)
    segment_sizes = torch.bincount(segments, minlength=2 * num_groups)  # (2G,)
    segment_starts = torch.cumsum(segment_sizes, 0) - segment_sizes  # (2G,)
    sorted_segments = segments[order]
    ranks = torch.empty_like(order)
    ranks[order] = torch.arange(num_samples, device=device) - segment_starts[sorted_segments]
    keep_mask = ranks < quotas[segments]  # (S,)

    kept_per_group = quota_correct + quota_incorrect  # (G,)
    nonempty = (num_correct + num_incorrect) > 0
    num_nonempty = int(nonempty.sum())
    mixed = (quota_correct > 0) & (quota_incorrect > 0)
    metrics: dict[str, float | torch.Tensor] = {
        "balanced/kept_fraction": float(keep_mask.sum()) / num_samples,
        "balanced/kept_pass_rate": float(correct[keep_mask].double().mean()) if bool(keep_mask.any()) else 0.0,
        "balanced/mixed_group_fraction": float(mixed.sum()) / num_nonempty if num_nonempty else 0.0,
        "balanced/short_group_fraction": (
            float((nonempty & (kept_per_group < num_keep)).sum()) / num_nonempty if num_nonempty else 0.0
        ),
    }
    return (keep_mask, advantages), metrics


# ---------------------------------------------------------------------------
# Reinforce-Ada-Est (Algorithm 1)
# ---------------------------------------------------------------------------


def ema_beta_update(
    *,
    num_total: torch.Tensor,
    num_positive: torch.Tensor,
    prompt_ids: torch.Tensor,
    num_samples: torch.Tensor,
    num_correct: torch.Tensor,
    decay: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ada-EMA update of §3.1: N_tot ← λ·N_tot + n, N_pos ← λ·N_pos + k.

    ``num_total``/``num_positive`` are the ``(D,)`` per-prompt counters of the
    whole dataset; ``prompt_ids``/``num_samples``/``num_correct`` are ``(B,)``
    for the prompts encountered in this step. The decay is applied once per
    encounter — only to the prompts in the batch, which is how the paper states
    it ("before integrating new data"). A prompt listed twice in one batch is
    one encounter with summed counts. Returns new tensors (inputs untouched).
    """
    if not (0.0 < decay <= 1.0):
        raise ValueError(f"decay λ must lie in (0, 1], got {decay}")
    if not (prompt_ids.shape == num_samples.shape == num_correct.shape) or prompt_ids.dim() != 1:
        raise ValueError("prompt_ids, num_samples and num_correct must be 1-D (B,) of one shape")
    num_prompts = num_total.numel()
    if prompt_ids.numel():
        if int(prompt_ids.min()) < 0 or int(prompt_ids.max()) >= num_prompts:
            raise ValueError(f"prompt ids must lie in [0, {num_prompts}), got {prompt_ids.tolist()[:8]}…")
        if bool((num_correct < 0).any()) or bool((num_correct > num_samples).any()):
            raise ValueError("num_correct must lie in [0, num_samples]")
    ids = prompt_ids.long()
    touched = torch.zeros(num_prompts, dtype=torch.bool, device=num_total.device)
    touched[ids] = True
    scale = torch.where(touched, torch.full_like(num_total, decay), torch.ones_like(num_total))
    new_total = (num_total * scale).index_add(0, ids, num_samples.to(num_total.dtype))
    new_positive = (num_positive * scale).index_add(0, ids, num_correct.to(num_positive.dtype))
    return new_total, new_positive


def ema_beta_estimate(
    *,
    num_total: torch.Tensor,
    num_positive: torch.Tensor,
    prior_alpha: float,
    prior_beta: float,
) -> torch.Tensor:
    """p̂ = (N_pos + α) / (N_tot + α + β), §3.1 (posterior mean under Beta(α, β))."""
    return (num_positive + prior_alpha) / (num_total + prior_alpha + prior_beta)


def allocate_proportional_budgets(
    *,
    weights: torch.Tensor,
    total: int,
    min_budget: int,
    max_budget: int,
) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
    """Integer budgets N_x ∝ w_x, clipped to [N_min, N_max], summing to ``total``.

    Two stages. (1) The real allocation x_x = clip(c·w_x, N_min, N_max) with the
    scale c solved exactly: Σ_x clip(c·w_x, ·) is piecewise linear and
    non-decreasing in c with breakpoints N_min/w_x and N_max/w_x, so c is found
    by bisection over the sorted breakpoints and linear interpolation inside the
    bracketing segment (O(B log B)). Weights enter only through their ratios
    to the largest one, floored at 1e-200. (2) Largest-remainder rounding:
    ⌊x_x⌋, then one extra sample to each of the ``total − Σ⌊x⌋`` prompts with
    the largest fractional part (ties: larger weight, then lower index), so
    |N_x − x_x| < 1, N_x is non-decreasing in w_x, and Σ N_x = total exactly.
    ``metrics["budget/scale"]`` is c in units of the largest weight.

    Infeasible targets raise ``ValueError``: ``total < B·N_min`` cannot be met
    without breaking the lower bound, and ``total`` above the largest reachable
    sum (B·N_max, less N_max − N_min for each zero-weight prompt, which stays at
    N_min) cannot be met without breaking the upper bound or proportionality.
    """
    if weights.dim() != 1:
        raise ValueError(f"weights must be 1-D (B,), got shape {tuple(weights.shape)}")
    _require_finite("weights", weights)
    if bool((weights < 0).any()):
        raise ValueError("weights must be non-negative")
    if min_budget < 0 or max_budget < min_budget:
        raise ValueError(f"need 0 ≤ min_budget ≤ max_budget, got [{min_budget}, {max_budget}]")
    raw = weights.to(torch.float64)
    num_prompts = raw.numel()
    positive = raw > 0
    max_weight = float(raw.max()) if bool(positive.any()) else 1.0
    # Proportionality is scale-free: normalising by the largest weight and
    # flooring the relative weight of positive entries at 1e-200 keeps every
    # breakpoint N/w (and the scale c) finite for subnormal inputs.
    w = torch.where(positive, (raw / max_weight).clamp(min=1e-200), raw)
    num_positive = int(positive.sum())
    lowest = num_prompts * min_budget
    highest = (num_prompts - num_positive) * min_budget + num_positive * max_budget
    if not (lowest <= total <= highest):
        raise ValueError(
            f"target total {total} is infeasible for {num_prompts} prompts with budgets in "
            f"[{min_budget}, {max_budget}] ({num_prompts - num_positive} of them with zero weight): "
            f"reachable totals are [{lowest}, {highest}]"
        )
    lo, hi = float(min_budget), float(max_budget)
    if total == lowest:
        real = torch.full_like(w, lo)
        scale = 0.0
    else:
        wp = w[positive]
        candidates = torch.sort(torch.cat([lo / wp, hi / wp])).values  # (2P,)

        def allocated(c: float) -> float:
            # A sum of non-negative terms: no cancellation however far apart
            # the weights are (prefix-sum differences lose the small ones).
            return float((c * w).clamp(lo, hi).sum())

        # f(candidates[0]) = B·N_min < total ≤ f(candidates[-1]): bisect for the
        # first breakpoint where f reaches total (O(log B) evaluations of O(B)).
        left, right = 0, candidates.numel() - 1
        while right - left > 1:
            middle = (left + right) // 2
            if allocated(float(candidates[middle])) >= total:
                right = middle
            else:
                left = middle
        c0, c1 = float(candidates[left]), float(candidates[right])
        f0, f1 = allocated(c0), allocated(c1)
        # f is linear between consecutive breakpoints, so interpolation is exact.
        scale = c1 if f1 <= f0 else c0 + (total - f0) * (c1 - c0) / (f1 - f0)
        real = (scale * w).clamp(lo, hi)
    base = torch.floor(real).clamp(lo, hi)
    remainder = total - int(base.sum())
    eligible = base < hi
    assert 0 <= remainder <= int(eligible.sum()), (remainder, int(eligible.sum()))
    fractions = torch.where(eligible, real - base, torch.full_like(real, -1.0))
    # Tie-break on the raw weights: flooring may have made distinct weights equal.
    order = torch.argsort(raw, descending=True, stable=True)
    order = order[torch.argsort(fractions[order], descending=True, stable=True)]
    budgets = base.to(torch.int64)
    budgets[order[:remainder]] += 1
    assert int(budgets.sum()) == total
    metrics: dict[str, float | torch.Tensor] = {
        "budget/min": float(budgets.min()) if num_prompts else 0.0,
        "budget/max": float(budgets.max()) if num_prompts else 0.0,
        "budget/mean": float(budgets.double().mean()) if num_prompts else 0.0,
        "budget/at_max_fraction": float((budgets == max_budget).sum()) / num_prompts if num_prompts else 0.0,
        # c with N_x ≈ clip(c·weights_x / max(weights), N_min, N_max) (relative units stay finite)
        "budget/scale": scale,
    }
    return budgets.to(weights.device), metrics


def ada_est_budgets(
    *,
    pass_rate: torch.Tensor,
    total: int,
    min_budget: int,
    max_budget: int,
    rule: Literal["log", "reinforce_baseline", "implicit"] = "log",
    eps: float = 1e-6,
) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
    """Reinforce-Ada-Est budget allocation (Algorithm 1 line 5; Appendices B.1, C.2).

    ``rule="log"``: N_x ∝ 1/√(p̂_x + ε), the hybrid split of the 1/p weight of
    the log objective (the other 1/√p̂ is the ``inv_sqrt_mean`` weight of ``global_baseline``).
    ``rule="reinforce_baseline"``: N_x ∝ √((1 − p̂_x)/(p̂_x + ε)), the
    variance-optimal allocation for Reinforce with baseline (Appendix B.1,
    Eq. 7); a prompt with p̂ = 1 gets weight 0 and therefore N_min.
    ``rule="implicit"``: N_x ∝ 1/(p̂_x + ε), the implicit weighting of
    Appendix C.2 (w_sample = 1/p, w_grad = 1): the whole 1/p weight of the log
    objective (§2.2, "allocating n_i ∝ 1/p_i") goes into the sample count, so
    the advantage carries none — pair it with ``global_baseline`` and
    ``weight="none"``. C.2 reports its batch-level reward eventually falling
    (hard prompts take the budget); ``min_budget`` is what keeps easy prompts
    sampled.
    Integerisation and infeasibility are as in ``allocate_proportional_budgets``
    (where the paper says "Σ N_x ≈ N_total", this hits it exactly).
    """
    if pass_rate.dim() != 1:
        raise ValueError(f"pass_rate must be 1-D (B,), got shape {tuple(pass_rate.shape)}")
    _require_finite("pass_rate", pass_rate)
    if bool(((pass_rate < 0) | (pass_rate > 1)).any()):
        raise ValueError("pass_rate must lie in [0, 1]")
    if eps <= 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    p = pass_rate.to(torch.float64)
    if rule == "log":
        weights = torch.rsqrt(p + eps)
    elif rule == "reinforce_baseline":
        weights = torch.sqrt((1.0 - p) / (p + eps))
    elif rule == "implicit":
        weights = 1.0 / (p + eps)
    else:
        raise ValueError(f"unknown allocation rule {rule!r}; choose 'log', 'reinforce_baseline' or 'implicit'")
    return allocate_proportional_budgets(
        weights=weights, total=total, min_budget=min_budget, max_budget=max_budget
    )


# ---------------------------------------------------------------------------
# Appendix D: sampling cost of the sequential rules
# ---------------------------------------------------------------------------


def _sequential_rule(*, rule: ExitRule, k_pos: int, k_neg: int, batch_size: int, max_samples: int) -> int:
    """Validate Algorithm 2's sampling settings; the k_neg the rule reads (POS reads none: 0)."""
    if batch_size < 1 or max_samples < 1:
        raise ValueError(f"batch_size and max_samples must be ≥ 1, got {batch_size}, {max_samples}")
    if k_pos < 0 or k_neg < 0:
        raise ValueError(f"k_pos and k_neg must be ≥ 0, got {k_pos} and {k_neg}")
    if rule == "pos":
        return 0
    if rule != "balance":
        raise ValueError(f"unknown exit rule {rule!r}; choose 'pos' or 'balance'")
    return k_neg


def _pass_probabilities(p: torch.Tensor | float) -> torch.Tensor:
    prob = torch.as_tensor(p, dtype=torch.float64)
    _require_finite("p", prob)
    if bool(((prob < 0) | (prob > 1)).any()):
        raise ValueError("p must lie in [0, 1]")
    return prob


def expected_samples(
    p: torch.Tensor | float,
    *,
    rule: ExitRule = "pos",
    k_pos: int,
    k_neg: int = 0,
    batch_size: int,
    max_samples: int,
) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
    """Exact expected number of responses drawn by Reinforce-Ada-Seq (Appendix D).

    Rounds draw ``batch_size`` responses each (the last round is cut to reach
    ``max_samples`` exactly when it is not a multiple); after each round the
    exit rule of ``exit_condition`` is checked. Both rules are monotone in the
    sample count, so "still active before round r" equals "rule not met after
    n_r = (samples drawn before round r)" and

        E[N] = Σ_r size_r · P(rule not met after n_r samples),

    where with X ~ Binomial(n_r, p) the rule is not met iff X < k_pos or
    n_r − X < k_neg (k_neg = 0 for "pos"); the first round is always drawn. The probability is summed directly
    over the complement region of the binomial pmf (no 1 − x cancellation),
    in float64. For batch_size = 1 and no cap this is the negative-binomial
    mean k_pos/p of §3.2. Cost: O(R · max_samples · |p|) memory.

    Returns ``(expected (…,) float64, metrics)``; ``metrics["unresolved_prob"]``
    is the probability the cap is reached with the rule still unmet.
    """
    k_neg = _sequential_rule(rule=rule, k_pos=k_pos, k_neg=k_neg, batch_size=batch_size, max_samples=max_samples)
    prob = _pass_probabilities(p)
    flat = prob.reshape(-1)  # (P,)

    num_rounds = math.ceil(max_samples / batch_size)
    starts = torch.arange(num_rounds, dtype=torch.float64) * batch_size  # (R,)
    round_sizes = torch.clamp(max_samples - starts, max=float(batch_size))  # (R,)
    counts = torch.cat([starts, torch.tensor([float(max_samples)], dtype=torch.float64)])  # (R+1,)

    j = torch.arange(max_samples + 1, dtype=torch.float64)  # (J,)
    n = counts[:, None]  # (R+1, 1)
    valid = j[None, :] <= n  # (R+1, J)
    n_minus_j = (n - j[None, :]).clamp(min=0)
    log_choose = torch.lgamma(n + 1) - torch.lgamma(j[None, :] + 1) - torch.lgamma(n_minus_j + 1)
    log_pmf = (
        log_choose[:, :, None]
        + torch.xlogy(j[None, :, None], flat[None, None, :])
        + torch.xlogy(n_minus_j[:, :, None], (1.0 - flat)[None, None, :])
    )  # (R+1, J, P)
    unmet = valid & ((j[None, :] < k_pos) | (n_minus_j < k_neg))  # (R+1, J)
    prob_unmet = (torch.exp(log_pmf) * unmet[:, :, None]).sum(dim=1)  # (R+1, P)
    # The rule is checked only at the end of a round: round 1 is always drawn,
    # even when k_pos = k_neg = 0 makes the rule hold vacuously.
    prob_unmet[0] = 1.0
    expected = (round_sizes[:, None] * prob_unmet[:-1]).sum(dim=0)  # (P,)
    unresolved = prob_unmet[-1]
    metrics: dict[str, float | torch.Tensor] = {"unresolved_prob": unresolved.reshape(prob.shape)}
    return expected.reshape(prob.shape), metrics


def pool_zero_variance_probability(
    p: torch.Tensor | float,
    *,
    rule: ExitRule = "balance",
    k_pos: int,
    k_neg: int = 0,
    batch_size: int,
    max_samples: int,
) -> torch.Tensor:
    """Probability that Reinforce-Ada-Seq's whole pool for a prompt of pass rate ``p`` has one outcome.

    Such a pool teaches nothing however it is down-sampled: balanced down-sampling
    (Algorithm 2 line 18) keeps both outcomes whenever the pool has both, so the update
    group is zero-variance exactly when the pool is. Rounds of ``batch_size`` up to
    ``max_samples``, the exit rule checked at each round's end, as in ``expected_samples``.

    A one-outcome pool comes from one path: every sample correct (or every one wrong).
    That path exits at the first round end where the rule holds on it, else at the cap:
    all correct satisfies POS once k_pos are drawn, and BALANCE only when k_neg = 0; all
    wrong satisfies either rule only when k_pos = 0 (and, for BALANCE, k_neg are drawn).
    So P = p^{n₊} + (1 − p)^{n₋}, with n₊ and n₋ those paths' pool sizes. With both
    thresholds ≥ 1, BALANCE never exits on a one-outcome pool: P = p^N + (1 − p)^N at the
    cap N, symmetric in p and 1 − p (the authors' settings, N = 32: 4.7e-10 at p = 1/2, 0.9
    at p = 0.0033). Returns float64 of ``p``'s shape.
    """
    k_neg = _sequential_rule(rule=rule, k_pos=k_pos, k_neg=k_neg, batch_size=batch_size, max_samples=max_samples)
    prob = _pass_probabilities(p)
    round_ends = [min(end, max_samples) for end in range(batch_size, max_samples + batch_size, batch_size)]

    def pool_size(needed: int | None) -> int:
        """Samples drawn on a one-outcome path whose rule holds once ``needed`` are drawn (None: never)."""
        if needed is None:
            return max_samples
        return next((end for end in round_ends if end >= needed), max_samples)

    all_correct = pool_size(k_pos if k_neg == 0 else None)
    all_wrong = pool_size(k_neg if k_pos == 0 else None)
    return prob**all_correct + (1.0 - prob) ** all_wrong
