"""D³S: Dynamic Dual-Level Down-Sampling.

Paper: "Learning More with Less: A Dynamic Dual-Level Down-Sampling Framework
for Efficient Policy Optimization" (Wang, Yang et al.).

What is implemented here, equation by equation:

* Eq. 6 (sample level, intra-group, "D¹S"): per group, keep the ``N_s`` rollouts
  whose group-normalised advantages have the largest variance →
  ``d3s_intra_select`` (the ``d3s_intra`` sample selector of ``pipeline.rl.methods``).
* Eq. 7 (sample level, cross-group, "D¹S w/Cross"): the same arg-max over the
  pooled advantages of the whole batch, ``N = B·N_s`` samples, no
  re-normalisation → ``d3s_cross_select`` (the ``d3s_cross`` sample selector).
* The arg-max itself (Sec. 3.1, after Xu et al. 2025, PODS): the optimal subset
  of size ``n`` is the ``i`` largest plus the ``n − i`` smallest values for some
  ``i`` → ``max_variance_subset`` (shared with ``pods.py``).
* Eq. 8 (token level): keep the top K% of the selected samples' response tokens
  by ``|A_{i,t}|·H_{i,t}`` → ``d3s_topk_token_weights``
  (the ``d3s_topk`` token weighting).
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

from pipeline.algorithms.segments import (
    all_finite,
    check_group_ids,
    count_true,
    group_counts,
    group_sum,
    positions_in_sorted_groups,
)

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

# Entropy and advantages of these dtypes are ranked on float32 keys (_ranking_keys).
_FLOAT32_KEY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# A pool of at least this many keys is bracketed from a strided sample of about
# _BRACKET_SAMPLE_SIZE keys before the exact selection (_kth_largest).
_BRACKET_MIN_POOL = 1 << 17
_BRACKET_SAMPLE_SIZE = 16384
# Half-width of the bracket in binomial standard deviations of the sample rank:
# a random layout misses it with probability ~1e-4 (then the exact fallback runs).
_BRACKET_STDS = 4.0


def _num_tokens_to_keep(num_valid: torch.Tensor, keep_ratio: float) -> torch.Tensor:
    """``ceil(K·n)`` per pool, at least 1 when ``n > 0``, never more than ``n``; int64."""
    num_keep = torch.ceil(num_valid.to(torch.float64) * keep_ratio - _CEIL_SLACK).long()
    return torch.minimum(num_keep.clamp(min=1), num_valid)


def _ranking_keys(
    *,
    entropy: torch.Tensor,
    rows: torch.Tensor | None,
    abs_advantages: torch.Tensor,
    valid_mask: torch.Tensor,
) -> torch.Tensor:
    """``(R, T)`` ranking keys ``|A_i|·H_{i,t}`` of the selected ``rows``, −inf off the valid tokens.

    The reference key is the float64 product. For float32 (and 16-bit) inputs it
    is exact (24 + 24 significand bits fit in 53), so the float32 product — its
    correctly rounded value — is a non-decreasing function of it: comparing float32
    keys can merge reference keys into ties but never reorders them. The same holds
    for the clamp to the finite range, which also keeps every valid key above the
    −inf of the padding. Ties that matter are re-ranked on the reference keys by
    ``_break_ties``, so the selection is the float64 one.

    Everything happens in one fresh buffer (the gathered rows), which is also where
    the entropy is checked: fresh (B, T)-sized memory is the dominant cost on CPU.
    """
    if entropy.dtype in _FLOAT32_KEY_DTYPES and abs_advantages.dtype in _FLOAT32_KEY_DTYPES:
        key_dtype = torch.float32
    else:
        key_dtype = torch.float64
    if rows is None:
        keys = entropy.to(key_dtype, copy=True)  # (R, T)
    else:
        keys = entropy.index_select(0, rows).to(key_dtype)
    largest = torch.finfo(key_dtype).max
    needs_clamp = True
    if keys.numel():
        lowest, highest = torch.aminmax(keys)
        if bool(torch.isfinite(lowest) & torch.isfinite(highest)):
            # No product can overflow: skip the clamp pass.
            bound = float(torch.maximum(-lowest, highest)) * float(abs_advantages.max())
            needs_clamp = not bound < largest
        elif not all_finite(keys, valid_mask):
            raise ValueError("entropy contains non-finite values on response tokens")
    keys.mul_(abs_advantages.to(key_dtype)[:, None])
    if needs_clamp:
        keys.clamp_(-largest, largest)
    return torch.where(valid_mask, keys, keys.new_tensor(float("-inf")), out=keys)


def _kth_largest(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k``-th largest entry (1 ≤ k ≤ numel) of a flat tensor without NaN, and candidates.

    ``candidates`` holds every entry ≥ the answer (and maybe some below it), so
    counts and sums over the top of ``values`` can be taken on it instead of on
    ``values``. A large pool is bracketed first: two order statistics of a
    strided sample straddle the expected rank, the entries above the lower one
    become the candidates (a few percent more than k), and the exact selection
    runs on the entries between the two. A bracket that misses (a layout that
    fools the stride) falls back to selecting over everything, so the answer
    never depends on the sample.
    """
    num_values = values.numel()
    if num_values >= _BRACKET_MIN_POOL:
        # An odd stride: one that divides the row length would sample the same columns.
        stride = (num_values // _BRACKET_SAMPLE_SIZE) | 1
        sample = values[::stride].contiguous()
        num_sample = sample.numel()
        expected_rank = k * num_sample / num_values  # rank from the top within the sample
        half_width = _BRACKET_STDS * math.sqrt(expected_rank * (1 - expected_rank / num_sample)) + 2
        top_rank = math.floor(expected_rank - half_width)
        bottom_rank = math.ceil(expected_rank + half_width)
        if bottom_rank <= num_sample:
            lower = torch.kthvalue(sample, num_sample - bottom_rank + 1).values
            # −inf would make all padding a candidate.
            candidates = values[values >= lower] if bool(lower > float("-inf")) else values[:0]
            if candidates.numel() >= k:
                inside = candidates
                if top_rank >= 1:
                    upper = torch.kthvalue(sample, num_sample - top_rank + 1).values
                    inside = candidates[candidates <= upper]
                rank_inside = k - (candidates.numel() - inside.numel())  # rank from the top inside
                if rank_inside >= 1:  # else more than k entries lie above the bracket
                    return torch.kthvalue(inside, inside.numel() - rank_inside + 1).values, candidates
                return torch.kthvalue(candidates, candidates.numel() - k + 1).values, candidates
    return torch.kthvalue(values, num_values - k + 1).values, values


def _pool_thresholds(
    *, keys: torch.Tensor, row_pools: torch.Tensor, num_pools: int, num_keep: torch.Tensor
) -> torch.Tensor:
    """Per pool, the ``num_keep``-th largest key (+inf where nothing is kept); ``(U,)``.

    ``keys`` ``(R, T)`` with −inf padding; pool ``u`` is the rows with ``row_pools == u``.
    Every pool is laid out as one padded row of its rows' keys for one batched topk.
    """
    num_rows, num_cols = keys.shape
    order = torch.sort(row_pools, stable=True).indices  # (R,)
    sorted_pools = row_pools[order]
    slot = positions_in_sorted_groups(sorted_pools, num_pools)  # (R,) row's place in its pool
    max_rows = int(slot.max()) + 1
    if max_rows == 1 and num_pools == num_rows:  # one row per pool (scope="sample")
        laid_out = keys.index_select(0, order)
    else:
        laid_out = keys.new_full((num_pools, max_rows, num_cols), float("-inf"))
        laid_out[sorted_pools, slot] = keys[order]
        laid_out = laid_out.view(num_pools, max_rows * num_cols)
    max_keep = int(num_keep.max())
    top = torch.topk(laid_out, max_keep, dim=1).values  # (U, max_keep) descending
    kth = top.gather(1, (num_keep - 1).clamp(min=0)[:, None]).squeeze(1)
    return torch.where(num_keep > 0, kth, float("inf"))


def _break_ties(
    *,
    keys: torch.Tensor,
    row_thresholds: torch.Tensor,
    row_pools: torch.Tensor,
    num_pools: int,
    num_keep: torch.Tensor,
    entropy: torch.Tensor,
    rows: torch.Tensor | None,
    abs_advantages: torch.Tensor,
) -> torch.Tensor:
    """The kept ``(R, T)`` mask when more keys equal a pool's threshold than places remain.

    Keys above the threshold are kept; the tied ones are ranked by their float64
    reference key (``_ranking_keys``: float32 keys may tie where float64 ones
    differ), then by flat index, and fill the remaining places of their pool.
    ``entropy`` is the full ``(B, T)`` input; ``rows`` maps key rows to its rows.
    """
    num_cols = keys.shape[1]
    above = keys > row_thresholds[:, None]  # (R, T)
    tied = keys == row_thresholds[:, None]
    places_left = num_keep - group_sum(count_true(above, dim=1), row_pools, num_pools)  # (U,)
    tied_at = tied.view(-1).nonzero().squeeze(1)  # (m,) ascending flat index
    tied_rows = torch.div(tied_at, num_cols, rounding_mode="floor")
    entropy_rows = tied_rows if rows is None else rows.index_select(0, tied_rows)
    entropy_at = entropy_rows * num_cols + (tied_at - tied_rows * num_cols)
    reference = (
        entropy.reshape(-1).index_select(0, entropy_at).to(torch.float64)
        * abs_advantages.to(torch.float64).index_select(0, tied_rows)
    )
    order = torch.sort(reference, descending=True, stable=True).indices  # index order among equals
    order = order[torch.sort(row_pools[tied_rows[order]], stable=True).indices]
    sorted_pools = row_pools[tied_rows[order]]
    rank = positions_in_sorted_groups(sorted_pools, num_pools)
    keep = above.view(-1)
    keep[tied_at[order[rank < places_left[sorted_pools]]]] = True
    return above


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
        the key is the float64 product ``|A_i|·H_{i,t}`` and its ties go to the
        lower row-major index (the selection is computed on float32 keys where
        that gives the same set, see ``_ranking_keys``).
        ``d3s/kept_token_score_mean`` averages the kept keys as ranked (float32
        for float32 inputs).
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
    if sample_keep_mask is not None and sample_keep_mask.shape != (num_rows,):
        raise ValueError(
            f"sample_keep_mask must be (B,) = ({num_rows},), got {tuple(sample_keep_mask.shape)}"
        )

    with torch.no_grad():
        # Only the selected rows take part: gather them once instead of masking (B, T).
        rows = None if sample_keep_mask is None else sample_keep_mask.bool().nonzero().squeeze(1)  # (R,)
        if rows is not None and rows.numel() == num_rows:
            rows = None
        valid_mask = response_mask.bool()
        row_advantages = advantages.detach()
        if rows is not None:
            valid_mask = valid_mask.index_select(0, rows)  # (R, T)
            row_advantages = row_advantages.index_select(0, rows)
        row_valid = count_true(valid_mask, dim=1)  # (R,)
        if not all_finite(row_advantages, row_valid > 0):
            raise ValueError("advantages of selected responses contain non-finite values")
        abs_advantages = row_advantages.abs()
        keys = _ranking_keys(
            entropy=entropy.detach(), rows=rows, abs_advantages=abs_advantages, valid_mask=valid_mask
        )

        num_selected = keys.shape[0]
        if scope == "batch":
            row_pools = torch.zeros(num_selected, dtype=torch.int64, device=keys.device)
            num_pools = 1
        elif scope == "group":
            row_pools = group_ids.long() if rows is None else group_ids.long().index_select(0, rows)
            num_pools = check_group_ids(row_pools)
        else:
            row_pools = torch.arange(num_selected, device=keys.device)
            num_pools = num_selected
        pool_valid = group_sum(row_valid, row_pools, num_pools)  # (U,)
        num_keep = _num_tokens_to_keep(pool_valid, keep_ratio)
        num_kept = num_keep.sum()
        num_valid = pool_valid.sum()
        if int(num_kept) == 0:
            row_weights = keys.zero_()
            kept_key_sum = torch.zeros((), dtype=torch.float64, device=keys.device)
        else:
            keep = None  # (R, T) bool, when a mask is needed at all
            if num_pools == 1:
                # Counts and the kept-key sum come from the candidates, not from more passes
                # over the keys; every key tied with the threshold equals it, so the sum holds
                # whichever of them the tie-break keeps.
                threshold, candidates = _kth_largest(keys.view(-1), int(num_keep[0]))
                row_thresholds = threshold.expand(num_selected)
                above = candidates > threshold
                kept_key_sum = (
                    torch.where(above, candidates, 0.0).sum(dtype=torch.float64)
                    + (num_kept - count_true(above)) * threshold.to(torch.float64)
                )
                straddle = not torch.equal(count_true(candidates >= threshold), num_kept)
            else:
                row_thresholds = _pool_thresholds(
                    keys=keys, row_pools=row_pools, num_pools=num_pools, num_keep=num_keep
                )[row_pools]  # (R,)
                keep = keys >= row_thresholds[:, None]
                straddle = not torch.equal(group_sum(count_true(keep, dim=1), row_pools, num_pools), num_keep)
            if straddle:
                keep = _break_ties(
                    keys=keys, row_thresholds=row_thresholds, row_pools=row_pools,
                    num_pools=num_pools, num_keep=num_keep, entropy=entropy.detach(), rows=rows,
                    abs_advantages=abs_advantages,
                )
            if num_pools > 1:
                kept_key_sum = torch.where(keep, keys, 0.0).sum(dtype=torch.float64)
            if keep is None:
                # The keys at or above the threshold are exactly the kept ones: the keys buffer
                # becomes the 0/1 weights in place, with no mask in between.
                row_weights = keys.ge_(row_thresholds[:, None])
            else:
                # A bool → float cast is slow; the uint8 view of the mask casts fast.
                row_weights = keys.copy_(keep.view(torch.uint8))
        row_weights = row_weights.to(entropy.dtype)  # (R, T)
        if rows is None:
            weights = row_weights
        else:
            weights = entropy.new_zeros(num_rows, num_cols).index_copy_(0, rows, row_weights)
    metrics: dict[str, float | torch.Tensor] = {
        "d3s/num_kept_tokens": num_kept,
        "d3s/num_valid_tokens": num_valid,
        "d3s/kept_token_ratio": num_kept / num_valid.clamp(min=1),
        "d3s/kept_token_score_mean": kept_key_sum / num_kept.clamp(min=1),
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
