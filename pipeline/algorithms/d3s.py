"""D³S: Dynamic Dual-Level Down-Sampling.

Paper: /work/shared/papers/d3s-dynamic-dual-level-down-sampling.txt, "Learning More
with Less: A Dynamic Dual-Level Down-Sampling Framework for Efficient Policy
Optimization" (Wang, Yang et al.).

What is implemented here, equation by equation:

* Eq. 6 (sample level, intra-group, "D¹S"): per group, keep the ``N_s`` rollouts
  whose group-normalised advantages have the largest variance →
  ``d3s_intra_select`` (registered ``SAMPLE_SELECTORS["d3s_intra"]``).
* Eq. 7 (sample level, cross-group, "D¹S w/Cross"): the same arg-max over the
  pooled advantages of the whole batch, ``N = B·N_s`` samples, no
  re-normalisation → ``d3s_cross_select`` (``SAMPLE_SELECTORS["d3s_cross"]``).
* The arg-max itself (Sec. 3.1, after Xu et al. 2025, PODS): the optimal subset
  of size ``n`` is the ``i`` largest plus the ``n − i`` smallest values for some
  ``i`` → ``max_variance_subset`` (shared with ``pods.py``).
* Eq. 8 (token level): keep the top K% of the selected samples' response tokens
  by ``|A_{i,t}|·H_{i,t}`` → ``d3s_topk_token_weights``
  (``TOKEN_WEIGHTS["d3s_topk"]``).
* Eq. 9 (dynamic schedule): ``[N_s, K](p) = (1 − p)[N_init, K_init] + p[N_final, K_final]``
  → ``schedule_value_at``, ``num_keep_at``, ``keep_ratio_at`` and ``D3SSchedule``.
  Defaults are Table 6: G = 32, N 8 → 32, K 5% → 20%.
* Sec. 4.1 / App. D.1 ablation variants (D¹S, D¹S-C, D²S, D³S, D³S-I) →
  ``D3S_VARIANTS``.
* Sec. 4.6 sample usefulness rate (SUR) → ``d3s/sample_usefulness_rate`` metric.

Careful choices where the paper is ambiguous (each is repeated where it is made):

* Variance is the population variance (divide by n); for a fixed subset size
  the arg-max is the same as with n − 1.
* Ties are broken deterministically: samples are ordered by (value, index), so
  among equal values a higher index counts as "larger"; among equally good
  splits the one with the fewest top elements wins. With binary rewards ties
  are the norm (every correct answer of a group shares one advantage), and the
  index order then favours batch positions; ``random_ties=True`` replaces the
  index by a permutation drawn from the selector's ``generator`` (still
  reproducible from its seed).
* Lemma 1 (some N-subset of standardized A has Var ≥ 1) holds for the
  Bessel-corrected variance: the sample variance is a U-statistic, so its mean
  over all N-subsets equals the full set's. For the population variance it is
  false (A = [-1, -1, 1, 1], N = 3 gives at most 8/9): App. B.3's Eq. 44 is an
  inequality (≥), not an identity. The selector does not depend on this: for a
  fixed N both variances have the same arg-max.
* Eq. 7 keeps ``N = Σ_g min(N_s, |g|)`` samples, which equals the paper's
  ``B·N_s`` whenever every group has at least ``N_s`` members and is exactly the
  number the intra-group selector would keep on ragged groups.
* Eq. 8 ranks "across all selected samples" (Sec. 3.2: a single pool over
  ``y_{i,t} ∈ Ŝ``), so ``scope="batch"`` is the default. Sec. 3.3 says K is "the
  proportion of retained tokens within each sample", so ``scope="sample"`` (and
  ``"group"``) are offered as options.
* The token count is ``ceil(K·n)`` over the n valid tokens of the pool, at least
  1 when n > 0; ties in the key are broken by the lower flat index (row-major).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Literal

import torch

from pipeline.algorithms.registry import SAMPLE_SELECTORS, TOKEN_WEIGHTS
from pipeline.algorithms.segments import check_group_ids, group_counts, group_sum

__all__ = [
    "check_num_keep",
    "D3SSchedule",
    "D3SVariant",
    "D3S_VARIANTS",
    "d3s_cross_select",
    "d3s_intra_select",
    "d3s_topk_token_weights",
    "d3s_variant",
    "draw_tie_break_key",
    "keep_ratio_at",
    "max_variance_subset",
    "num_keep_at",
    "sample_selection_metrics",
    "schedule_value_at",
]

# ``ceil(K·n)`` must not jump to the next integer because K·n came out as
# 2.0000000000000004 in floating point; real counts never sit this close above
# an integer for the batch sizes we train with.
_CEIL_SLACK = 1e-6

TokenScope = Literal["batch", "group", "sample"]


# --------------------------------------------------------------------------- #
# Sample level: Eq. 6 / Eq. 7                                                   #
# --------------------------------------------------------------------------- #


def _check_sample_inputs(
    values: torch.Tensor, group_ids: torch.Tensor, num_groups: int | None, name: str
) -> int:
    if values.dim() != 1:
        raise ValueError(f"{name} must be 1-D (S,), got shape {tuple(values.shape)}")
    if group_ids.shape != values.shape:
        raise ValueError(
            f"group_ids {tuple(group_ids.shape)} must have the shape of "
            f"{name} {tuple(values.shape)}"
        )
    if not values.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {values.dtype}")
    if not bool(torch.isfinite(values).all()):
        raise ValueError(f"{name} contains non-finite values (nan/inf)")
    return check_group_ids(group_ids, num_groups)


def max_variance_subset(
    values: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    num_keep: int | torch.Tensor,
    num_groups: int | None = None,
    tie_break_key: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per group, the subset of ``min(num_keep, |g|)`` members with the largest variance.

    Implements the arg-max of D³S Eq. 6 (and Eq. 7 with a single group); the
    structure of the solution — the ``i`` largest plus the ``n − i`` smallest
    values for some ``0 ≤ i ≤ n`` — is the result of Xu et al. (2025, PODS) that
    D³S Sec. 3.1 adopts. For every group we sort once and scan all ``i`` with
    prefix sums of the centred values and their squares: O(S log S) for the
    sort plus O(G·max_n) for the scan, with no Python loop over groups.

    Args:
        values: ``(S,)`` the quantity whose variance is maximised (advantages
            for D³S, rewards for PODS).
        group_ids: int64 ``(S,)`` in ``0..num_groups-1``; groups may be ragged
            and non-contiguous.
        num_keep: subset size per group, an int or an int ``(G,)`` tensor;
            groups smaller than it keep all their members.
        num_groups: number of groups (defaults to ``group_ids.max() + 1``).
        tie_break_key: optional ``(S,)`` distinct integers ordering equal
            values (default: the sample index).

    Returns:
        ``keep_mask`` bool ``(S,)``.

    Ties: members are ordered by (value, tie_break_key), so among equal values
    the higher key counts as larger, and among splits with the same variance the
    one with the fewest "largest" elements is taken (``argmax`` returns the
    first maximum). The result is therefore a deterministic function of the
    inputs. Variance is computed in float64 regardless of the input dtype.
    """
    num_groups = _check_sample_inputs(values, group_ids, num_groups, "values")
    num_samples = values.numel()
    device = values.device
    keep_mask = torch.zeros(num_samples, dtype=torch.bool, device=device)
    if num_samples == 0 or num_groups == 0:
        return keep_mask

    counts = group_counts(group_ids, num_groups)  # (G,)
    if isinstance(num_keep, torch.Tensor):
        if num_keep.shape != (num_groups,):
            raise ValueError(
                f"num_keep tensor must have shape ({num_groups},), got {tuple(num_keep.shape)}"
            )
        if bool((num_keep < 0).any()):
            raise ValueError("num_keep must be non-negative")
        group_keep = torch.minimum(num_keep.to(device=device, dtype=torch.int64), counts)
    else:
        if num_keep < 0:
            raise ValueError(f"num_keep must be non-negative, got {num_keep}")
        group_keep = counts.clamp(max=int(num_keep))  # (G,)

    x = values.detach().to(torch.float64)
    ids = group_ids.long()
    # Lexicographic (group, value, key) order from stable sorts.
    if tie_break_key is None:
        by_key = torch.arange(num_samples, device=device)
    else:
        if tie_break_key.shape != values.shape:
            raise ValueError(
                f"tie_break_key must have shape {tuple(values.shape)}, "
                f"got {tuple(tie_break_key.shape)}"
            )
        by_key = torch.sort(tie_break_key, stable=True).indices
    by_value = by_key[torch.sort(x[by_key], stable=True).indices]
    order = by_value[torch.sort(ids[by_value], stable=True).indices]  # (S,)
    sorted_ids = ids[order]
    starts = torch.cumsum(counts, 0) - counts  # (G,)
    position = torch.arange(num_samples, device=device) - starts[sorted_ids]  # (S,)

    # Centring per group keeps E[x²] − E[x]² from cancelling when values carry
    # a large common offset (raw rewards in PODS).
    group_means = group_sum(x, ids, num_groups) / counts.clamp(min=1)
    centred = x[order] - group_means[sorted_ids]
    max_size = int(counts.max())
    padded = torch.zeros(num_groups, max_size, dtype=torch.float64, device=device)
    padded[sorted_ids, position] = centred
    zero_col = torch.zeros(num_groups, 1, dtype=torch.float64, device=device)
    prefix = torch.cat([zero_col, torch.cumsum(padded, 1)], 1)  # (G, max_size + 1)
    prefix_sq = torch.cat([zero_col, torch.cumsum(padded * padded, 1)], 1)

    max_keep = int(group_keep.max())
    num_top = torch.arange(max_keep + 1, device=device)  # (I,) candidate i
    num_bottom = group_keep[:, None] - num_top[None, :]  # (G, I)
    feasible = num_bottom >= 0
    bottom_end = num_bottom.clamp(min=0)
    top_start = (counts[:, None] - num_top[None, :]).clamp(min=0)
    group_end = counts[:, None].expand_as(top_start)

    def subset_sum(table: torch.Tensor) -> torch.Tensor:
        return (
            table.gather(1, bottom_end)
            + table.gather(1, group_end)
            - table.gather(1, top_start)
        )

    size = group_keep[:, None].to(torch.float64).clamp(min=1)
    mean = subset_sum(prefix) / size
    variance = subset_sum(prefix_sq) / size - mean * mean  # (G, I)
    variance = torch.where(feasible, variance, torch.full_like(variance, float("-inf")))
    best_top = variance.argmax(dim=1)  # (G,)

    num_bottom_best = (group_keep - best_top)[sorted_ids]
    top_begin = (counts - best_top)[sorted_ids]
    keep_sorted = (position < num_bottom_best) | (position >= top_begin)
    keep_mask[order] = keep_sorted
    assert int(keep_mask.sum()) == int(group_keep.sum())
    return keep_mask


def _population_variance(values: torch.Tensor) -> torch.Tensor:
    if values.numel() == 0:
        return values.new_zeros(())
    centred = values - values.mean()
    return (centred * centred).mean()


def sample_selection_metrics(
    *,
    advantages: torch.Tensor,
    keep_mask: torch.Tensor,
    group_ids: torch.Tensor,
    num_groups: int,
    prefix: str,
) -> dict[str, float | torch.Tensor]:
    """Metrics of a sample selection (shared with PODS); all values are detached.

    ``sample_usefulness_rate`` is the SUR of D³S Sec. 4.6: among the groups with
    at least one kept sample, the share whose kept samples carry a non-zero
    advantage; ``input_usefulness_rate`` is the same rate before selection (the
    share of groups with non-zero advantage variance, what GRPO trains on).
    ``selected_adv_var``/``selected_adv_abs_mean`` pool all kept samples.
    """
    adv = advantages.detach().to(torch.float64)
    kept = adv[keep_mask]
    keep_f = keep_mask.to(torch.float64)
    nonzero_f = (adv != 0).to(torch.float64)
    kept_per_group = group_sum(keep_f, group_ids, num_groups)  # (G,)
    useful_kept_per_group = group_sum(keep_f * nonzero_f, group_ids, num_groups)
    nonzero_per_group = group_sum(nonzero_f, group_ids, num_groups)
    present = group_counts(group_ids, num_groups) > 0
    contributing = kept_per_group > 0
    num_contributing = contributing.sum().clamp(min=1)
    num_present = present.sum().clamp(min=1)
    num_samples = max(adv.numel(), 1)
    return {
        f"{prefix}/num_kept_samples": keep_mask.sum(),
        f"{prefix}/kept_sample_ratio": keep_f.sum() / num_samples,
        f"{prefix}/sample_usefulness_rate": (
            (contributing & (useful_kept_per_group > 0)).sum() / num_contributing
        ),
        f"{prefix}/input_usefulness_rate": (present & (nonzero_per_group > 0)).sum() / num_present,
        f"{prefix}/selected_adv_var": _population_variance(kept),
        f"{prefix}/selected_adv_abs_mean": kept.abs().mean() if kept.numel() else adv.new_zeros(()),
    }


def check_num_keep(num_keep: int) -> int:
    """A per-group subset size ``N_s``: a Python/NumPy int of at least 1."""
    if isinstance(num_keep, bool):
        raise ValueError(f"num_keep (N_s) must be an int, got {num_keep!r}")
    try:
        num_keep = operator.index(num_keep)
    except TypeError:
        raise ValueError(f"num_keep (N_s) must be an int, got {num_keep!r}") from None
    if num_keep < 1:
        raise ValueError(f"num_keep (N_s) must be at least 1, got {num_keep}")
    return num_keep


def draw_tie_break_key(
    values: torch.Tensor, *, random_ties: bool, generator: torch.Generator | None
) -> torch.Tensor | None:
    """``None`` (order equal values by index) or a random permutation from ``generator``."""
    if not random_ties:
        return None
    if generator is None:
        raise ValueError("random_ties=True needs a torch.Generator for reproducible ties")
    return torch.randperm(values.numel(), generator=generator, device=generator.device).to(
        values.device
    )


@SAMPLE_SELECTORS.register("d3s_intra")
def d3s_intra_select(
    *,
    advantages: torch.Tensor,
    rewards: torch.Tensor | None,
    group_ids: torch.Tensor,
    num_keep: int,
    generator: torch.Generator | None = None,
    num_groups: int | None = None,
    random_ties: bool = False,
) -> tuple[tuple[torch.Tensor, torch.Tensor], dict[str, float | torch.Tensor]]:
    """D³S Eq. 6 (D¹S): per group, the ``num_keep`` samples of maximal Var(A).

    ``advantages`` ``(S,)`` are the group-normalised advantages computed over
    the *full* group (Eq. 2) before selection; they are returned unchanged, as
    the paper keeps the full-group estimate. Groups smaller than ``num_keep``
    keep every member. ``rewards`` is part of the ``SAMPLE_SELECTORS``
    contract and unused. Equal advantages are ordered by sample index, or by a
    permutation drawn from ``generator`` when ``random_ties`` is set.

    Returns ``((keep_mask (S,) bool, advantages (S,)), metrics)``;
    ``d3s/selected_adv_var`` is the variance of all kept advantages pooled.
    """
    del rewards
    num_keep = check_num_keep(num_keep)
    num_groups = _check_sample_inputs(advantages, group_ids, num_groups, "advantages")
    keep_mask = max_variance_subset(
        advantages,
        group_ids,
        num_keep=num_keep,
        num_groups=num_groups,
        tie_break_key=draw_tie_break_key(advantages, random_ties=random_ties, generator=generator),
    )
    metrics = sample_selection_metrics(
        advantages=advantages,
        keep_mask=keep_mask,
        group_ids=group_ids,
        num_groups=num_groups,
        prefix="d3s",
    )
    return (keep_mask, advantages), metrics


@SAMPLE_SELECTORS.register("d3s_cross")
def d3s_cross_select(
    *,
    advantages: torch.Tensor,
    rewards: torch.Tensor | None,
    group_ids: torch.Tensor,
    num_keep: int,
    generator: torch.Generator | None = None,
    num_groups: int | None = None,
    random_ties: bool = False,
) -> tuple[tuple[torch.Tensor, torch.Tensor], dict[str, float | torch.Tensor]]:
    """D³S Eq. 7 (D¹S w/Cross): ``N`` samples of maximal Var(A) over the whole batch.

    ``num_keep`` is the per-group ``N_s`` of the schedule; the batch keeps
    ``N = Σ_g min(N_s, |g|)`` samples (``B·N_s`` when every group has at least
    ``N_s`` members), chosen by the same largest/smallest rule applied to the
    pooled advantages, so zero-advantage groups are dropped first. The
    advantages were normalised within each group beforehand and are not
    re-normalised (Sec. 3.1: "no additional normalization is applied").
    Ties as in ``d3s_intra_select``.
    """
    del rewards
    num_keep = check_num_keep(num_keep)
    num_groups = _check_sample_inputs(advantages, group_ids, num_groups, "advantages")
    total_keep = int(group_counts(group_ids, num_groups).clamp(max=num_keep).sum())
    pooled_ids = torch.zeros_like(group_ids, dtype=torch.int64)
    keep_mask = max_variance_subset(
        advantages,
        pooled_ids,
        num_keep=total_keep,
        num_groups=1,
        tie_break_key=draw_tie_break_key(advantages, random_ties=random_ties, generator=generator),
    )
    metrics = sample_selection_metrics(
        advantages=advantages,
        keep_mask=keep_mask,
        group_ids=group_ids,
        num_groups=num_groups,
        prefix="d3s",
    )
    return (keep_mask, advantages), metrics


# --------------------------------------------------------------------------- #
# Token level: Eq. 8                                                           #
# --------------------------------------------------------------------------- #


def _single_unit_topk_mask(*, scores: torch.Tensor, valid_mask: torch.Tensor, keep_ratio: float) -> torch.Tensor:
    """``_topk_token_mask`` for one pool (the default batch scope) in O(n) instead of two sorts.

    The k-th largest valid score is found by selection (``kthvalue``); every score
    above it is kept, and among scores equal to it the lowest flat indices fill the
    remaining places — the same set the stable sort would choose.
    """
    valid_scores = scores[valid_mask]  # selection on the valid tokens only: fewer than B·T
    num_valid = valid_scores.numel()
    if num_valid == 0:
        return torch.zeros_like(valid_mask)
    num_keep = min(num_valid, max(1, math.ceil(num_valid * keep_ratio - _CEIL_SLACK)))
    threshold = torch.kthvalue(valid_scores, num_valid - num_keep + 1).values
    above = valid_mask & (scores > threshold)
    tied = valid_mask & (scores == threshold)
    places_left = num_keep - int(above.sum())
    return above | (tied & (torch.cumsum(tied, 0) <= places_left))


def _topk_token_mask(
    *, scores: torch.Tensor, valid_mask: torch.Tensor, unit_ids: torch.Tensor, keep_ratio: float
) -> torch.Tensor:
    """Within each unit, the ``ceil(K·n)`` valid tokens of highest score.

    ``scores``/``valid_mask``/``unit_ids`` are flat ``(B·T,)``. Ties go to the
    lower flat index: a stable descending sort keeps index order among equals.
    """
    num_tokens = scores.numel()
    device = scores.device
    if num_tokens and bool((unit_ids == unit_ids[0]).all()):
        return _single_unit_topk_mask(scores=scores, valid_mask=valid_mask, keep_ratio=keep_ratio)
    ranked = torch.where(valid_mask, scores, torch.full_like(scores, float("-inf")))
    by_score = torch.sort(ranked, descending=True, stable=True).indices
    order = by_score[torch.sort(unit_ids[by_score], stable=True).indices]  # (B·T,)
    sorted_units = unit_ids[order]
    num_units = int(unit_ids.max()) + 1 if num_tokens else 0
    unit_sizes = torch.bincount(unit_ids, minlength=num_units)
    unit_valid = torch.bincount(unit_ids[valid_mask], minlength=num_units)  # (U,)
    starts = torch.cumsum(unit_sizes, 0) - unit_sizes
    rank = torch.arange(num_tokens, device=device) - starts[sorted_units]
    num_keep = torch.ceil(unit_valid.to(torch.float64) * keep_ratio - _CEIL_SLACK).long()
    num_keep = torch.minimum(num_keep.clamp(min=1), unit_valid)
    keep = torch.zeros(num_tokens, dtype=torch.bool, device=device)
    keep[order] = rank < num_keep[sorted_units]
    assert not bool((keep & ~valid_mask).any())
    return keep


@TOKEN_WEIGHTS.register("d3s_topk")
def d3s_topk_token_weights(
    *,
    advantages: torch.Tensor,
    entropy: torch.Tensor,
    logprobs: torch.Tensor | None,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    keep_ratio: float,
    scope: TokenScope = "batch",
    sample_keep_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
    """D³S Eq. 8: 0/1 weights keeping the top ``keep_ratio`` of tokens by ``|A_i|·H_{i,t}``.

    Args:
        advantages: ``(B,)`` per-sample advantage A_i, broadcast over tokens
            (the paper's A_{i,t} for outcome rewards).
        entropy: ``(B, T)`` token entropy H_{i,t} of the policy (Eq. 8, top).
        logprobs: unused; part of the ``TOKEN_WEIGHTS`` contract.
        response_mask: ``(B, T)`` bool, True on response tokens.
        group_ids: int64 ``(B,)`` group of each row (used by ``scope="group"``).
        keep_ratio: K ∈ (0, 1], the fraction of tokens kept (Eq. 9 schedules it).
        scope: the pool the top-K is taken over. ``"batch"`` (default, the
            paper's Eq. 8: one ranking over all tokens of the selected samples),
            ``"group"`` (per prompt) or ``"sample"`` (per response, Sec. 3.3's
            wording "within each sample").
        sample_keep_mask: optional ``(B,)`` bool from the sample selector; rows
            outside it take no part in the ranking and get weight 0. Without it
            every row of the batch is taken to be selected.

    Returns:
        ``(weights (B, T) float in {0, 1} without gradient, metrics)``. Each
        pool keeps ``ceil(K·n)`` of its n valid tokens, at least 1 when n > 0;
        ties in the key go to the lower row-major index.
    """
    del logprobs
    if scope not in ("batch", "group", "sample"):
        raise ValueError(f"scope must be 'batch', 'group' or 'sample', got {scope!r}")
    if not 0.0 < keep_ratio <= 1.0:
        raise ValueError(f"keep_ratio (K) must be in (0, 1], got {keep_ratio}")
    if entropy.dim() != 2:
        raise ValueError(f"entropy must be (B, T), got shape {tuple(entropy.shape)}")
    num_rows, num_cols = entropy.shape
    if response_mask.shape != entropy.shape:
        raise ValueError(
            f"response_mask {tuple(response_mask.shape)} must match entropy {tuple(entropy.shape)}"
        )
    if advantages.shape != (num_rows,):
        raise ValueError(f"advantages must be (B,) = ({num_rows},), got {tuple(advantages.shape)}")
    if group_ids.shape != (num_rows,):
        raise ValueError(f"group_ids must be (B,) = ({num_rows},), got {tuple(group_ids.shape)}")

    valid_mask = response_mask.bool()  # (B, T)
    if sample_keep_mask is not None:
        if sample_keep_mask.shape != (num_rows,):
            raise ValueError(
                f"sample_keep_mask must be (B,) = ({num_rows},), "
                f"got {tuple(sample_keep_mask.shape)}"
            )
        valid_mask = valid_mask & sample_keep_mask.bool()[:, None]
    if not bool(torch.isfinite(advantages[valid_mask.any(dim=1)]).all()):
        raise ValueError("advantages of selected responses contain non-finite values")
    if not bool((torch.isfinite(entropy) | ~valid_mask).all()):
        raise ValueError("entropy contains non-finite values on response tokens")

    with torch.no_grad():
        adv = advantages.detach().to(torch.float64)
        # float64 keeps the product exact enough that ties are true ties; masked-out
        # positions are zeroed (they never rank: _topk_token_mask excludes them).
        scores = torch.where(valid_mask, entropy.detach().to(torch.float64) * adv.abs()[:, None], 0.0)  # (B, T)
        if scope == "batch":
            row_units = torch.zeros(num_rows, dtype=torch.int64, device=entropy.device)
        elif scope == "group":
            row_units = group_ids.long()
        else:
            row_units = torch.arange(num_rows, device=entropy.device)
        unit_ids = row_units[:, None].expand(num_rows, num_cols).reshape(-1)
        keep = _topk_token_mask(
            scores=scores.reshape(-1),
            valid_mask=valid_mask.reshape(-1),
            unit_ids=unit_ids,
            keep_ratio=float(keep_ratio),
        )
        weights = keep.view(num_rows, num_cols).to(entropy.dtype)

        num_valid = valid_mask.sum()
        num_kept = keep.sum()
        kept_score_sum = torch.where(keep, scores.reshape(-1), 0.0).sum()
    metrics: dict[str, float | torch.Tensor] = {
        "d3s/num_kept_tokens": num_kept,
        "d3s/num_valid_tokens": num_valid,
        "d3s/kept_token_ratio": num_kept / num_valid.clamp(min=1),
        "d3s/kept_token_score_mean": (
            kept_score_sum / num_kept if int(num_kept) else scores.new_zeros(())
        ),
    }
    return weights, metrics


# --------------------------------------------------------------------------- #
# Dynamic schedule: Eq. 9                                                      #
# --------------------------------------------------------------------------- #


def _check_progress(progress: float) -> float:
    if not math.isfinite(progress) or not 0.0 <= progress <= 1.0:
        raise ValueError(f"training progress p must be in [0, 1], got {progress}")
    return float(progress)


def schedule_value_at(progress: float, *, init: float, final: float) -> float:
    """D³S Eq. 9: ``(1 − p)·init + p·final`` for training progress ``p ∈ [0, 1]``."""
    progress = _check_progress(progress)
    return (1.0 - progress) * init + progress * final


def num_keep_at(progress: float, *, init: int = 8, final: int = 32) -> int:
    """``N_s(p)`` of Eq. 9 rounded half-up to a sample count (the paper does not say how).

    Half-up (not Python's banker's rounding) keeps the count monotone in ``p``.
    """
    value = schedule_value_at(progress, init=init, final=final)
    return int(math.floor(value + 0.5 + _CEIL_SLACK))


def keep_ratio_at(progress: float, *, init: float = 0.05, final: float = 0.20) -> float:
    """``K(p)`` of Eq. 9: the kept token fraction, linear in ``p``."""
    return schedule_value_at(progress, init=init, final=final)


class D3SSchedule:
    """The D³S dynamic down-sampling schedule (Eq. 9) with its step counter.

    Progress is ``p = min(step / total_steps, 1)``: the paper interpolates over
    the whole run (``total_steps`` is the schedule horizon; pass a smaller one
    to reach the final values earlier and hold them). ``dynamic=False`` freezes
    ``(N_s, K)`` at the initial values, which is how the static ablations D¹S,
    D¹S-C and D²S are run here (the paper does not state their fixed values;
    the aggressive initial ones match its Fig. 3 description of fast early
    convergence followed by overfitting).

    Defaults are the paper's Table 6 (G = 32): N 8 → 32, K 5% → 20%.
    """

    def __init__(
        self,
        *,
        total_steps: int,
        num_keep_init: int = 8,
        num_keep_final: int = 32,
        keep_ratio_init: float = 0.05,
        keep_ratio_final: float = 0.20,
        dynamic: bool = True,
    ) -> None:
        if total_steps < 1:
            raise ValueError(f"total_steps must be at least 1, got {total_steps}")
        if num_keep_init < 1 or num_keep_final < 1:
            raise ValueError(
                f"num_keep_init/final must be at least 1, got {num_keep_init}/{num_keep_final}"
            )
        for name, ratio in (("init", keep_ratio_init), ("final", keep_ratio_final)):
            if not 0.0 < ratio <= 1.0:
                raise ValueError(f"keep_ratio_{name} must be in (0, 1], got {ratio}")
        self.total_steps = total_steps
        self.num_keep_init = num_keep_init
        self.num_keep_final = num_keep_final
        self.keep_ratio_init = keep_ratio_init
        self.keep_ratio_final = keep_ratio_final
        self.dynamic = dynamic
        self.step = 0

    def progress(self) -> float:
        return min(self.step / self.total_steps, 1.0) if self.dynamic else 0.0

    def value_at(self, progress: float) -> tuple[int, float]:
        """``(N_s, K)`` at progress ``p``; a static schedule ignores ``p``."""
        progress = _check_progress(progress)
        if not self.dynamic:
            progress = 0.0
        return (
            num_keep_at(progress, init=self.num_keep_init, final=self.num_keep_final),
            keep_ratio_at(progress, init=self.keep_ratio_init, final=self.keep_ratio_final),
        )

    def current(self) -> tuple[int, float]:
        """``(N_s, K)`` for the current step."""
        return self.value_at(self.progress())

    def update(self) -> None:
        """Advance one optimizer step."""
        self.step += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "total_steps": self.total_steps,
            "num_keep_init": self.num_keep_init,
            "num_keep_final": self.num_keep_final,
            "keep_ratio_init": self.keep_ratio_init,
            "keep_ratio_final": self.keep_ratio_final,
            "dynamic": self.dynamic,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the step; a changed schedule definition is an error, not a silent resume."""
        mine = self.state_dict()
        if set(state) != set(mine):
            raise ValueError(f"D3SSchedule state keys {sorted(state)} != {sorted(mine)}")
        mismatched = sorted(k for k in mine if k != "step" and state[k] != mine[k])
        if mismatched:
            raise ValueError(
                "D3SSchedule checkpoint was written with a different schedule: "
                + ", ".join(f"{k}={state[k]!r} (now {mine[k]!r})" for k in mismatched)
            )
        step = state["step"]
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"D3SSchedule step must be a non-negative int, got {step!r}")
        self.step = step


# --------------------------------------------------------------------------- #
# Variants: Sec. 4.1 and App. D.1                                              #
# --------------------------------------------------------------------------- #


@dataclass(frozen=True, kw_only=True, slots=True)
class D3SVariant:
    """Which D³S levels are on; a variant is a configuration, not a code path."""

    cross_group: bool  # Eq. 7 over the batch (True) or Eq. 6 per group (False)
    token_level: bool  # Eq. 8 top-K token weights
    dynamic_schedule: bool  # Eq. 9; False holds (N_init, K_init)

    @property
    def sample_selector(self) -> str:
        """Name in ``SAMPLE_SELECTORS``."""
        return "d3s_cross" if self.cross_group else "d3s_intra"

    @property
    def token_weighting(self) -> str | None:
        """Name in ``TOKEN_WEIGHTS``, or None when every token is kept."""
        return "d3s_topk" if self.token_level else None


# Sample-level down-sampling is on in every variant. D²S is cross-group: Sec. 4.6
# lists it with D¹S w/Cross among the methods whose SUR rises to ~100%. D³S-I is
# "D³S without cross-group down-sampling" (Fig. 5 caption, App. D.1).
D3S_VARIANTS: dict[str, D3SVariant] = {
    "d1s": D3SVariant(cross_group=False, token_level=False, dynamic_schedule=False),
    "d1s_c": D3SVariant(cross_group=True, token_level=False, dynamic_schedule=False),
    "d2s": D3SVariant(cross_group=True, token_level=True, dynamic_schedule=False),
    "d3s": D3SVariant(cross_group=True, token_level=True, dynamic_schedule=True),
    "d3s_i": D3SVariant(cross_group=False, token_level=True, dynamic_schedule=True),
}


def d3s_variant(name: str) -> D3SVariant:
    """Look up a variant by name; unknown names list the allowed ones."""
    try:
        return D3S_VARIANTS[name]
    except KeyError:
        raise ValueError(
            f"unknown D3S variant {name!r}; choose one of {sorted(D3S_VARIANTS)}"
        ) from None
