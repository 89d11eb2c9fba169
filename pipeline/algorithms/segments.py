"""Ragged-group reductions over a flat sample axis.

A batch of ``S`` samples is split into groups (the responses to one prompt) by
``group_ids``: an int64 ``(S,)`` tensor with values in ``0..num_groups-1``.
Groups may have different sizes and their members need not be contiguous.
Every function here is vectorized with ``index_add``/``scatter`` so that the
cost is O(S) regardless of the number of groups.

``num_groups`` defaults to ``group_ids.max() + 1``; pass it explicitly when a
trailing group may be empty (its statistics are then zero) or to avoid the
device sync of ``.max()``.

Reductions run in the dtype of ``values``; callers that need exact statistics
for float16/bfloat16 data should upcast first.
"""

from __future__ import annotations

import torch

__all__ = [
    "all_finite",
    "broadcast",
    "check_group_ids",
    "count_true",
    "group_counts",
    "group_max",
    "group_mean",
    "group_min",
    "group_std",
    "group_sum",
    "num_groups_of",
    "positions_in_sorted_groups",
    "run_min",
    "run_sum",
]


def check_group_ids(group_ids: torch.Tensor, num_groups: int | None = None) -> int:
    """Validate ``group_ids`` and return the number of groups.

    Raises ``ValueError`` for a wrong dtype/shape or ids outside ``0..num_groups-1``.
    """
    if group_ids.dim() != 1:
        raise ValueError(f"group_ids must be 1-D (S,), got shape {tuple(group_ids.shape)}")
    if group_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    if group_ids.numel() == 0:
        return 0 if num_groups is None else num_groups
    lowest = int(group_ids.min())
    highest = int(group_ids.max())
    if lowest < 0:
        raise ValueError(f"group_ids must be non-negative, found {lowest}")
    if num_groups is None:
        return highest + 1
    if highest >= num_groups:
        raise ValueError(f"group id {highest} is out of range for num_groups={num_groups}")
    return num_groups


def num_groups_of(group_ids: torch.Tensor, num_groups: int | None = None) -> int:
    """``num_groups`` if given, else ``group_ids.max() + 1`` (0 for an empty batch)."""
    if num_groups is not None:
        return num_groups
    return int(group_ids.max()) + 1 if group_ids.numel() else 0


def group_counts(group_ids: torch.Tensor, num_groups: int | None = None) -> torch.Tensor:
    """Members per group, int64 ``(G,)``."""
    num_groups = num_groups_of(group_ids, num_groups)
    return torch.bincount(group_ids.long(), minlength=num_groups)[:num_groups]


def group_sum(
    values: torch.Tensor, group_ids: torch.Tensor, num_groups: int | None = None
) -> torch.Tensor:
    """Per-group sum of ``values`` ``(S, ...)`` → ``(G, ...)``; differentiable."""
    num_groups = num_groups_of(group_ids, num_groups)
    out = values.new_zeros((num_groups, *values.shape[1:]))
    return out.index_add(0, group_ids.long(), values)


def group_mean(
    values: torch.Tensor, group_ids: torch.Tensor, num_groups: int | None = None
) -> torch.Tensor:
    """Per-group mean ``(G, ...)``; an empty group has mean 0."""
    num_groups = num_groups_of(group_ids, num_groups)
    sums = group_sum(values, group_ids, num_groups)
    counts = group_counts(group_ids, num_groups).to(sums.dtype)
    counts = counts.view(num_groups, *([1] * (values.dim() - 1)))
    return sums / counts.clamp(min=1)


def group_std(
    values: torch.Tensor,
    group_ids: torch.Tensor,
    num_groups: int | None = None,
    *,
    unbiased: bool = False,
) -> torch.Tensor:
    """Per-group standard deviation ``(G, ...)``.

    Computed from deviations around the group mean (two passes), not from
    E[x²] − E[x]², which cancels catastrophically for rewards with a large
    offset. ``unbiased=False`` divides by n (population std), ``True`` by n − 1.
    Groups with too few members (0, or 1 when unbiased) get std 0.
    """
    num_groups = num_groups_of(group_ids, num_groups)
    means = group_mean(values, group_ids, num_groups)
    deviations = values - means[group_ids.long()]
    sq_sums = group_sum(deviations * deviations, group_ids, num_groups)
    counts = group_counts(group_ids, num_groups).to(sq_sums.dtype)
    dof = counts - 1 if unbiased else counts
    dof = dof.view(num_groups, *([1] * (values.dim() - 1)))
    variance = torch.where(dof > 0, sq_sums / dof.clamp(min=1), torch.zeros_like(sq_sums))
    return variance.sqrt()


def group_max(
    values: torch.Tensor, group_ids: torch.Tensor, num_groups: int | None = None
) -> torch.Tensor:
    """Per-group max of a 1-D ``values`` ``(S,)`` → ``(G,)``; an empty group gets −inf."""
    num_groups = num_groups_of(group_ids, num_groups)
    out = values.new_full((num_groups,), float("-inf"))
    return out.scatter_reduce(0, group_ids.long(), values, reduce="amax", include_self=True)


def group_min(
    values: torch.Tensor, group_ids: torch.Tensor, num_groups: int | None = None
) -> torch.Tensor:
    """Per-group min of a 1-D ``values`` ``(S,)`` → ``(G,)``; an empty group gets +inf."""
    num_groups = num_groups_of(group_ids, num_groups)
    out = values.new_full((num_groups,), float("inf"))
    return out.scatter_reduce(0, group_ids.long(), values, reduce="amin", include_self=True)


def broadcast(per_group: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Give every sample its group's value: ``(G, ...)`` → ``(S, ...)``."""
    return per_group[group_ids.long()]


def positions_in_sorted_groups(sorted_group_ids: torch.Tensor, num_groups: int) -> torch.Tensor:
    """0-based position of each member inside its group, for ``group_ids`` already sorted.

    ``sorted_group_ids`` ``(S,)`` must be non-decreasing (members of a group
    contiguous, e.g. after a stable sort by group); returns int64 ``(S,)``.
    """
    counts = group_counts(sorted_group_ids, num_groups)  # (G,)
    starts = torch.cumsum(counts, 0) - counts
    return torch.arange(sorted_group_ids.numel(), device=sorted_group_ids.device) - starts[sorted_group_ids.long()]


def all_finite(values: torch.Tensor, mask: torch.Tensor | None = None) -> bool:
    """Whether ``values`` is finite wherever ``mask`` is True (everywhere without a mask).

    One ``aminmax`` decides the usual case (finite everywhere; NaN propagates to
    both ends); only when it fails — padding may legitimately hold NaN or ±inf —
    is the exact, masked check run. The fast path reads the tensor once and
    allocates nothing, where ``isfinite(values).all()`` writes a bool tensor of
    the input's size.
    """
    if values.numel() == 0:
        return True
    lowest, highest = torch.aminmax(values.detach())
    if bool(torch.isfinite(lowest) & torch.isfinite(highest)):
        return True
    finite = torch.isfinite(values.detach())
    if mask is not None:
        finite = finite | ~mask
    return bool(finite.all())


def run_sum(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Sums of consecutive runs: ``values`` ``(n,)`` split into runs of ``lengths`` ``(R,)`` → ``(R,)``.

    For data already ordered by segment (e.g. the valid tokens of each row in
    row-major order) this is one sequential pass, cheaper than the scattered
    ``index_add`` of ``group_sum``. An empty run sums to 0. No gradient.
    """
    assert int(lengths.sum()) == values.numel(), "run lengths must cover values exactly"
    if lengths.numel() == 0:
        return values.new_zeros(0)
    return torch.segment_reduce(values.detach(), "sum", lengths=lengths)


def run_min(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Minima of consecutive runs, like ``run_sum``; an empty run gets +inf. No gradient."""
    assert int(lengths.sum()) == values.numel(), "run lengths must cover values exactly"
    if lengths.numel() == 0:
        return values.new_zeros(0)
    return torch.segment_reduce(values.detach(), "min", lengths=lengths)


def count_true(mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """int64 number of True entries of a bool ``mask`` (along ``dim``).

    Sums the uint8 view with an int32 accumulator: ``mask.sum()`` first copies
    the mask to int64, which costs several times the count itself.
    """
    as_bytes = mask.view(torch.uint8)
    counts = as_bytes.sum(dtype=torch.int32) if dim is None else as_bytes.sum(dim=dim, dtype=torch.int32)
    return counts.long()
