"""Unbiased pass@k and avg@k.

pass@k from n samples of which c are correct (Chen et al. 2021, "Evaluating
Large Language Models Trained on Code", Eq. 1):

    pass@k = E[1 − C(n−c, k) / C(n, k)]

The ratio of binomials is evaluated as the product ∏_{i=n−c+1}^{n} (1 − k/i),
which stays in [0, 1] and never forms a large binomial coefficient. Taking the
first k samples instead (as some peers do) is biased for k < n.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


def pass_at_k(num_samples: np.ndarray | Sequence[int], num_correct: np.ndarray | Sequence[int], k: int) -> np.ndarray:
    """Per-problem unbiased pass@k; inputs are (P,) integer arrays, output (P,) float64."""
    n = np.asarray(num_samples, dtype=np.int64)
    c = np.asarray(num_correct, dtype=np.int64)
    if n.shape != c.shape:
        raise ValueError(f"num_samples {n.shape} and num_correct {c.shape} differ in shape")
    if k < 1:
        raise ValueError(f"k must be ≥ 1, got {k}")
    if np.any(c < 0) or np.any(c > n):
        raise ValueError("num_correct must lie in [0, num_samples]")
    if np.any(n < k):
        raise ValueError(f"pass@{k} needs at least {k} samples per problem; got min {int(n.min())}")
    result = np.ones(n.shape, dtype=np.float64)
    # With fewer than k wrong samples every k-subset contains a correct one.
    undecided = (n - c) >= k
    if np.any(undecided):
        n_u, c_u = n[undecided], c[undecided]
        max_c = int(c_u.max())
        # i runs over n−c+1 … n: offsets 1 … c per problem, padded to the largest c.
        offsets = np.arange(1, max_c + 1, dtype=np.float64)  # (C,)
        denominators = (n_u - c_u)[:, None] + offsets[None, :]  # (P, C)
        factors = np.where(offsets[None, :] <= c_u[:, None], 1.0 - k / denominators, 1.0)
        result[undecided] = 1.0 - np.prod(factors, axis=1)
    return result


def avg_at_k(num_samples: np.ndarray | Sequence[int], num_correct: np.ndarray | Sequence[int]) -> np.ndarray:
    """Per-problem mean accuracy over all its samples (avg@n), (P,) float64."""
    n = np.asarray(num_samples, dtype=np.float64)
    c = np.asarray(num_correct, dtype=np.float64)
    if np.any(n <= 0):
        raise ValueError("every problem needs at least one sample")
    return c / n


def summarize(
    num_samples: Sequence[int], num_correct: Sequence[int], ks: Sequence[int]
) -> dict[str, float]:
    """Benchmark-level pass@k for each k ≤ min n, and avg@n, as plain floats."""
    n = np.asarray(num_samples)
    summary = {f"pass@{k}": float(pass_at_k(n, num_correct, k).mean()) for k in ks if k <= n.min()}
    summary["avg@n"] = float(avg_at_k(n, num_correct).mean())
    return summary


def macro_and_weighted(per_benchmark: Mapping[str, Mapping[str, float]], sizes: Mapping[str, int]) -> dict[str, dict[str, float]]:
    """Macro (unweighted) and problem-count-weighted averages over benchmarks."""
    metrics = sorted(set.intersection(*(set(m) for m in per_benchmark.values()))) if per_benchmark else []
    total = sum(sizes[name] for name in per_benchmark)
    macro = {m: float(np.mean([per_benchmark[b][m] for b in per_benchmark])) for m in metrics}
    weighted = {
        m: float(sum(per_benchmark[b][m] * sizes[b] for b in per_benchmark) / total) for m in metrics
    }
    return {"macro": macro, "weighted": weighted}
