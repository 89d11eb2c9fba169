"""Evaluation results: bootstrap intervals, ``results.json`` I/O, Markdown tables, run comparison.

Statistics. Every benchmark metric is a mean over problems of a per-problem value:
the unbiased pass@k of ``pipeline.eval.passk`` (Chen et al. 2021, Eq. 1) or avg@n
(``c / n``). Its confidence interval is a percentile bootstrap over problems: the
problems are resampled with replacement ``bootstrap_samples`` times (seeded) and the
interval is the central ``confidence`` mass of the resampled means. Each problem's
value is held fixed, so the interval reflects which problems were drawn, not the
sampling noise within a problem (that noise is already averaged by the unbiased
estimator over ``n`` samples). Averages over benchmarks (macro: unweighted; weighted:
by problem count) get a stratified bootstrap: each benchmark is resampled on its own,
and the average is taken per resample.

Comparison (``compare``). The difference is always run B minus run A. When both runs
evaluated exactly the same problem ids of a benchmark, problems are paired: the
per-problem differences are resampled together, which removes the between-problem
variance both runs share. Otherwise each run is resampled on its own (unpaired).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.errors import UserError
from pipeline.eval.passk import avg_at_k, pass_at_k

__all__ = [
    "AVG_METRIC",
    "RESULTS_FILE",
    "RESULTS_FORMAT",
    "ComparisonRow",
    "ResultsError",
    "average_over_benchmarks",
    "bootstrap_means",
    "compare",
    "derive_seed",
    "format_comparison",
    "format_results_markdown",
    "load_results",
    "metric_names",
    "percentile_interval",
    "per_problem_metrics",
    "summarize_metrics",
]

RESULTS_FILE = "results.json"
RESULTS_FORMAT = "winnow-eval-results/1"
AVG_METRIC = "avg@n"
# Resampled problem indices held in memory at once (int64: 32 MB), whatever the benchmark size.
_MAX_DRAWS_PER_CHUNK = 4_000_000


class ResultsError(UserError):
    """A results file is missing or is not a winnow evaluation result."""


def derive_seed(*parts: object) -> int:
    """A 63-bit seed that depends only on ``parts`` (not on what else was evaluated)."""
    text = "\x1f".join(str(part) for part in parts)
    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)


def metric_names(ks: Sequence[int], num_samples: int) -> list[str]:
    """``pass@k`` for every k ≤ ``num_samples`` (ascending), then ``avg@n``."""
    return [f"pass@{k}" for k in sorted(set(ks)) if k <= num_samples] + [AVG_METRIC]


def per_problem_metrics(
    num_samples: np.ndarray | Sequence[int], num_correct: np.ndarray | Sequence[int], ks: Sequence[int]
) -> tuple[list[str], np.ndarray]:
    """Metric names and per-problem values ``(P, M)``: pass@k for each k ≤ min n, then avg@n."""
    n = np.asarray(num_samples, dtype=np.int64)  # (P,)
    c = np.asarray(num_correct, dtype=np.int64)  # (P,)
    if n.size == 0:
        raise ValueError("per_problem_metrics needs at least one problem")
    names = metric_names(ks, int(n.min()))
    columns = [pass_at_k(n, c, int(name.removeprefix("pass@"))) for name in names[:-1]]
    columns.append(avg_at_k(n, c))
    return names, np.stack(columns, axis=1)  # (P, M)


def bootstrap_means(values: np.ndarray, *, num_resamples: int, rng: np.random.Generator) -> np.ndarray:
    """Means of ``num_resamples`` resamples (with replacement) of the rows of ``values`` ``(P, M)`` → ``(B, M)``."""
    values = np.asarray(values, dtype=np.float64)
    num_problems = values.shape[0]
    if num_problems == 0:
        raise ValueError("cannot bootstrap an empty set of problems")
    means = np.empty((num_resamples, values.shape[1]), dtype=np.float64)
    # Chunks bound memory; each resample is a row of counts, so its mean is one matmul.
    chunk = max(1, _MAX_DRAWS_PER_CHUNK // num_problems)
    for start in range(0, num_resamples, chunk):
        size = min(chunk, num_resamples - start)
        draws = rng.integers(0, num_problems, size=(size, num_problems))  # (b, P)
        offsets = np.arange(size)[:, None] * num_problems
        counts = np.bincount((draws + offsets).ravel(), minlength=size * num_problems).reshape(size, num_problems)
        means[start : start + size] = counts @ values / num_problems
    return means


def percentile_interval(samples: np.ndarray, confidence: float) -> np.ndarray:
    """``(2, M)``: the central ``confidence`` interval of each column of ``samples`` ``(B, M)``."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    tail = (1.0 - confidence) / 2.0
    return np.quantile(samples, [tail, 1.0 - tail], axis=0)


def _metric_entries(names: Sequence[str], point: np.ndarray, boot: np.ndarray | None, confidence: float) -> dict:
    interval = percentile_interval(boot, confidence) if boot is not None else None
    return {
        name: {
            "value": float(point[m]),
            "ci": None if interval is None else [float(interval[0, m]), float(interval[1, m])],
        }
        for m, name in enumerate(names)
    }


def summarize_metrics(
    names: Sequence[str],
    values: np.ndarray,
    *,
    bootstrap_samples: int,
    seed: int,
    confidence: float = 0.95,
) -> tuple[dict[str, dict[str, Any]], np.ndarray | None]:
    """``{metric: {"value", "ci"}}`` of per-problem ``values`` ``(P, M)``, and the bootstrap means.

    The bootstrap means are ``(B, M)``, or ``None`` when ``bootstrap_samples`` is 0 (then ``ci`` is ``None``).
    """
    boot = None
    if bootstrap_samples > 0:
        boot = bootstrap_means(values, num_resamples=bootstrap_samples, rng=np.random.default_rng(seed))
    return _metric_entries(names, values.mean(axis=0), boot, confidence), boot


def average_over_benchmarks(
    parts: Mapping[str, tuple[list[str], np.ndarray, np.ndarray | None]],
    *,
    confidence: float,
) -> dict[str, Any]:
    """Macro and problem-weighted averages with stratified-bootstrap intervals.

    ``parts[benchmark] = (metric names, per-problem values (P, M), bootstrap means (B, M) or None)``;
    metrics missing from any benchmark are left out.
    """
    if not parts:
        return {"benchmarks": [], "num_problems": 0, "macro": {}, "weighted": {}}
    shared = [name for name in next(iter(parts.values()))[0] if all(name in p[0] for p in parts.values())]
    sizes = np.array([values.shape[0] for _, values, _ in parts.values()], dtype=np.float64)  # (K,)
    points = np.stack(
        [values[:, [names.index(m) for m in shared]].mean(axis=0) for names, values, _ in parts.values()]
    )  # (K, M)
    has_boot = all(boot is not None for _, _, boot in parts.values())
    boots = (
        np.stack([boot[:, [names.index(m) for m in shared]] for names, _, boot in parts.values()])
        if has_boot
        else None
    )  # (K, B, M)
    weights = sizes / sizes.sum()
    macro = _metric_entries(shared, points.mean(axis=0), None if boots is None else boots.mean(axis=0), confidence)
    weighted = _metric_entries(
        shared,
        weights @ points,
        None if boots is None else np.einsum("k,kbm->bm", weights, boots),
        confidence,
    )
    return {"benchmarks": list(parts), "num_problems": int(sizes.sum()), "macro": macro, "weighted": weighted}


# --------------------------------------------------------------------------- results files


def load_results(path: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """A ``results.json`` (its path, its run directory, or the already-loaded dict), checked."""
    if isinstance(path, Mapping):
        results = dict(path)
        where = "results"
    else:
        file = Path(path)
        if file.is_dir():
            file = file / RESULTS_FILE
        if not file.is_file():
            raise ResultsError(f"{file} does not exist: not an evaluation run (expected {RESULTS_FILE})")
        try:
            results = json.loads(file.read_text())
        except json.JSONDecodeError as error:
            raise ResultsError(f"{file} is not valid JSON: {error}") from None
        where = str(file)
    if not isinstance(results, dict) or results.get("format") != RESULTS_FORMAT:
        raise ResultsError(f"{where}: not a winnow evaluation result (format {RESULTS_FORMAT!r} expected)")
    for name, entry in results.get("benchmarks", {}).items():
        problems = entry.get("problems", {})
        lengths = {len(problems.get(key, ())) for key in ("id", "n", "c")}
        if len(lengths) != 1:
            raise ResultsError(f"{where}: benchmark {name!r}: problems.id, .n and .c differ in length")
    return results


def _cell(entry: Mapping[str, Any] | None) -> str:
    if entry is None:
        return "—"
    text = f"{entry['value']:.3f}"
    if entry.get("ci") is not None:
        low, high = entry["ci"]
        text += f" [{low:.3f}, {high:.3f}]"
    return text


def _ordered_metrics(metric_sets: Sequence[Mapping[str, Any]]) -> list[str]:
    names = {name for metrics in metric_sets for name in metrics}
    pass_names = sorted((n for n in names if n.startswith("pass@")), key=lambda n: int(n.removeprefix("pass@")))
    return pass_names + [n for n in sorted(names) if not n.startswith("pass@")]


def format_results_markdown(results: Mapping[str, Any]) -> str:
    """``results.md``: one row per benchmark plus macro/weighted averages, then per-difficulty tables."""
    benchmarks: Mapping[str, Any] = results["benchmarks"]
    aggregate = results.get("aggregate", {})
    names = _ordered_metrics([b["metrics"] for b in benchmarks.values()])
    sampling = results.get("sampling", {})
    confidence = results.get("confidence", 0.95)
    intervals = (
        f"[{confidence:.0%} bootstrap interval over problems, {results['bootstrap_samples']} resamples]"
        if results.get("bootstrap_samples") else "no intervals (bootstrap_samples = 0)"
    )
    lines = [
        f"# Evaluation of `{results.get('policy', '?')}`",
        "",
        f"n = {results.get('num_samples')} samples per problem, temperature {sampling.get('temperature')}, "
        f"top-p {sampling.get('top_p')}, at most {sampling.get('max_new_tokens')} new tokens. "
        f"Unbiased pass@k; {intervals}.",
        "",
        "| benchmark | problems | too long | " + " | ".join(names) + " |",
        "|---|---:|---:|" + "---|" * len(names),
    ]
    for name, entry in benchmarks.items():
        cells = " | ".join(_cell(entry["metrics"].get(metric)) for metric in names)
        lines.append(f"| {name} | {entry['num_problems']} | {entry['num_too_long']} | {cells} |")
    for kind in ("macro", "weighted"):
        if aggregate.get(kind):
            cells = " | ".join(_cell(aggregate[kind].get(metric)) for metric in names)
            lines.append(f"| **{kind}** | {aggregate['num_problems']} |  | {cells} |")
    for name, entry in benchmarks.items():
        buckets = entry.get("buckets")
        if not buckets:
            continue
        bucket_names = _ordered_metrics([g["metrics"] for g in buckets["groups"].values()])
        lines += [
            "",
            f"## {name} by {buckets['key']}",
            "",
            f"| {buckets['key']} | problems | " + " | ".join(bucket_names) + " |",
            "|---|---:|" + "---|" * len(bucket_names),
        ]
        for value, group in buckets["groups"].items():
            cells = " | ".join(_cell(group["metrics"].get(metric)) for metric in bucket_names)
            lines.append(f"| {value} | {group['num_problems']} | {cells} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- comparison


@dataclass(frozen=True, slots=True)
class ComparisonRow:
    """One metric of one benchmark (or ``"macro"``) in runs A and B; ``difference`` is B − A."""

    benchmark: str
    metric: str
    value_a: float
    value_b: float
    difference: float
    ci: tuple[float, float] | None
    paired: bool
    num_problems_a: int
    num_problems_b: int


def _problem_values(entry: Mapping[str, Any], ks: Sequence[int]) -> tuple[list[str], list[str], np.ndarray]:
    problems = entry["problems"]
    names, values = per_problem_metrics(problems["n"], problems["c"], ks)
    return list(problems["id"]), names, values


def compare(
    run_a: str | Path | Mapping[str, Any],
    run_b: str | Path | Mapping[str, Any],
    *,
    bootstrap_samples: int = 1000,
    seed: int = 0,
    confidence: float = 0.95,
) -> list[ComparisonRow]:
    """Per benchmark both runs evaluated, and per shared metric: A, B, B − A and its bootstrap interval.

    ``run_a``/``run_b``: a run directory, its ``results.json``, or the loaded dict. Metrics
    are recomputed from the per-problem counts, for every k both runs can estimate. A
    final ``"macro"`` group averages the per-benchmark differences (stratified
    bootstrap; paired where each benchmark is). See the module docstring for pairing.
    """
    results_a, results_b = load_results(run_a), load_results(run_b)
    ks = sorted(set(results_a.get("ks", [])) | set(results_b.get("ks", [])))
    shared_benchmarks = [name for name in results_a["benchmarks"] if name in results_b["benchmarks"]]
    rows: list[ComparisonRow] = []
    macro_parts: list[tuple[list[str], np.ndarray, np.ndarray | None, bool, int, int]] = []
    for benchmark in shared_benchmarks:
        entry_a, entry_b = results_a["benchmarks"][benchmark], results_b["benchmarks"][benchmark]
        if not entry_a["problems"]["id"] or not entry_b["problems"]["id"]:
            continue
        ids_a, names_a, values_a = _problem_values(entry_a, ks)
        ids_b, names_b, values_b = _problem_values(entry_b, ks)
        names = [name for name in names_a if name in names_b]
        values_a = values_a[:, [names_a.index(n) for n in names]]  # (Pa, M)
        values_b = values_b[:, [names_b.index(n) for n in names]]  # (Pb, M)
        paired = len(ids_a) == len(set(ids_a)) and set(ids_a) == set(ids_b)
        rng = np.random.default_rng(derive_seed(seed, benchmark))
        if paired:
            order = {problem_id: row for row, problem_id in enumerate(ids_b)}
            differences = values_b[[order[i] for i in ids_a]] - values_a  # (P, M)
            point = differences.mean(axis=0)
            boot = (
                bootstrap_means(differences, num_resamples=bootstrap_samples, rng=rng) if bootstrap_samples else None
            )
        else:
            point = values_b.mean(axis=0) - values_a.mean(axis=0)
            boot = (
                bootstrap_means(values_b, num_resamples=bootstrap_samples, rng=rng)
                - bootstrap_means(values_a, num_resamples=bootstrap_samples, rng=rng)
                if bootstrap_samples
                else None
            )
        interval = percentile_interval(boot, confidence) if boot is not None else None
        mean_a, mean_b = values_a.mean(axis=0), values_b.mean(axis=0)
        for m, metric in enumerate(names):
            rows.append(
                ComparisonRow(
                    benchmark=benchmark,
                    metric=metric,
                    value_a=float(mean_a[m]),
                    value_b=float(mean_b[m]),
                    difference=float(point[m]),
                    ci=None if interval is None else (float(interval[0, m]), float(interval[1, m])),
                    paired=paired,
                    num_problems_a=len(ids_a),
                    num_problems_b=len(ids_b),
                )
            )
        macro_parts.append((names, np.stack([mean_a, mean_b]), boot, paired, len(ids_a), len(ids_b)))
    if len(macro_parts) > 1:
        rows += _macro_rows(macro_parts, confidence=confidence)
    return rows


def _macro_rows(parts, *, confidence: float) -> list[ComparisonRow]:
    shared = [name for name in parts[0][0] if all(name in p[0] for p in parts)]
    means = np.stack([p[1][:, [p[0].index(n) for n in shared]] for p in parts]).mean(axis=0)  # (2, M)
    interval = None
    if all(p[2] is not None for p in parts):
        boot = np.stack([p[2][:, [p[0].index(n) for n in shared]] for p in parts]).mean(axis=0)  # (B, M)
        interval = percentile_interval(boot, confidence)
    return [
        ComparisonRow(
            benchmark="macro",
            metric=metric,
            value_a=float(means[0, m]),
            value_b=float(means[1, m]),
            difference=float(means[1, m] - means[0, m]),
            ci=None if interval is None else (float(interval[0, m]), float(interval[1, m])),
            paired=all(p[3] for p in parts),
            num_problems_a=sum(p[4] for p in parts),
            num_problems_b=sum(p[5] for p in parts),
        )
        for m, metric in enumerate(shared)
    ]


def format_comparison(
    rows: Sequence[ComparisonRow], *, label_a: str = "A", label_b: str = "B", confidence: float = 0.95
) -> str:
    """A Markdown table of ``compare`` rows."""
    lines = [
        f"| benchmark | metric | {label_a} | {label_b} | {label_b} − {label_a} | {confidence:.0%} CI "
        "| problems | pairing |",
        "|---|---|---:|---:|---:|---|---:|---|",
    ]
    for row in rows:
        interval = "—" if row.ci is None else f"[{row.ci[0]:+.3f}, {row.ci[1]:+.3f}]"
        problems = (
            str(row.num_problems_a) if row.num_problems_a == row.num_problems_b
            else f"{row.num_problems_a} / {row.num_problems_b}"
        )
        lines.append(
            f"| {row.benchmark} | {row.metric} | {row.value_a:.3f} | {row.value_b:.3f} | {row.difference:+.3f} | "
            f"{interval} | {problems} | {'paired' if row.paired else 'unpaired'} |"
        )
    return "\n".join(lines) + "\n"
