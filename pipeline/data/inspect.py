"""``winnow data inspect``: what a data source holds, before anything trains on it.

``inspect_dataset(spec)`` loads the source (bad rows skipped and counted by default)
and returns a JSON-serialisable dict; ``format_inspection(result)`` renders it as text.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable
from typing import Any

from pipeline.data.loaders import DEFAULT_MAX_FIELD_CHARS
from pipeline.data.records import OnBadRow, Prompt
from pipeline.data.sources import SourceSpec, load_prompts, parse_spec, resolve_split

# Metadata keys whose values are shown as histograms.
HISTOGRAM_KEYS = ("level", "difficulty", "subject")
MAX_HISTOGRAM_BINS = 20
_BAR_WIDTH = 30


def _truncate(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else text[: max_chars - 1] + "…"


def _length_stats(lengths: list[int]) -> dict[str, float]:
    if not lengths:
        return {"min": 0, "mean": 0.0, "max": 0}
    return {"min": min(lengths), "mean": round(statistics.fmean(lengths), 1), "max": max(lengths)}


def _histogram(values: Iterable[Any]) -> dict[str, int]:
    """Counts keyed by ``str(value)``: numbers in numeric order, then the rest by frequency.

    At most ``MAX_HISTOGRAM_BINS`` bins; the remainder is summed under ``"(other)"``.
    """
    counts = Counter(values)

    def is_number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    numeric = sorted(value for value in counts if is_number(value))
    rest = sorted((value for value in counts if not is_number(value)), key=lambda value: (-counts[value], str(value)))
    ordered = [*numeric, *rest]
    histogram = {str(value): counts[value] for value in ordered[:MAX_HISTOGRAM_BINS]}
    num_other = sum(counts[value] for value in ordered[MAX_HISTOGRAM_BINS:])
    if num_other:
        histogram["(other)"] = num_other
    return histogram


def _example(prompt: Prompt, max_chars: int) -> dict[str, Any]:
    metadata = {
        key: _truncate(value, max_chars) if isinstance(value, str) else value
        for key, value in prompt.metadata.items()
        if isinstance(value, (str, int, float, bool)) or value is None
    }
    return {
        "id": prompt.id,
        "problem": _truncate(prompt.problem, max_chars),
        "answer": _truncate(prompt.answer, max_chars),
        "metadata": metadata,
    }


def inspect_dataset(
    spec: str | SourceSpec,
    *,
    num_examples: int = 3,
    on_bad_row: OnBadRow = "skip",
    split: str | None = None,
    limit: int | None = None,
    max_field_chars: int = DEFAULT_MAX_FIELD_CHARS,
    max_example_chars: int = 300,
) -> dict[str, Any]:
    """Load ``spec`` (as ``load_prompts`` does, with its ``split``/``limit``/``on_bad_row``/
    ``max_field_chars``) and summarise it.

    Returns a JSON-serialisable dict: ``spec``, ``kind``, ``split``, ``num_prompts``,
    ``report`` (``LoadReport.as_dict()``: rows, kept, duplicates, bad-row counts by
    reason and examples), ``metadata_fields`` (key → number of prompts with a non-null
    value), ``problem_chars``/``answer_chars`` (min/mean/max), ``histograms`` (for
    ``level``/``difficulty``/``subject`` where present) and ``examples`` (the first
    ``num_examples`` prompts, strings cut at ``max_example_chars``).
    """
    if num_examples < 0:
        raise ValueError(f"num_examples must be >= 0, got {num_examples}")
    parsed = parse_spec(spec) if isinstance(spec, str) else spec
    prompts, report = load_prompts(
        parsed, split=split, limit=limit, on_bad_row=on_bad_row, max_field_chars=max_field_chars
    )
    metadata_fields = Counter(
        key for prompt in prompts for key, value in prompt.metadata.items() if value is not None
    )
    histograms = {
        key: _histogram(prompt.metadata.get(key) for prompt in prompts)
        for key in HISTOGRAM_KEYS
        if metadata_fields[key]
    }
    return {
        "spec": str(parsed),
        "kind": parsed.kind,
        "split": resolve_split(parsed, split),
        "num_prompts": len(prompts),
        "report": report.as_dict(),
        "metadata_fields": dict(sorted(metadata_fields.items())),
        "problem_chars": _length_stats([len(prompt.problem) for prompt in prompts]),
        "answer_chars": _length_stats([len(prompt.answer) for prompt in prompts]),
        "histograms": histograms,
        "examples": [_example(prompt, max_example_chars) for prompt in prompts[:num_examples]],
    }


def _bar(count: int, largest: int) -> str:
    return "#" * max(1, round(_BAR_WIDTH * count / largest)) if count else ""


def format_inspection(result: dict[str, Any]) -> str:
    """Render an ``inspect_dataset`` result as plain text for a terminal."""
    report = result["report"]
    split = f", split {result['split']}" if result["split"] else ""
    lines = [
        f"data source: {result['spec']} ({result['kind']}{split})",
        f"prompts: {result['num_prompts']} kept of {report['num_rows']} rows read; "
        f"duplicates {report['num_duplicates']} ({report['num_conflicting_duplicates']} with a different answer); "
        f"bad rows {report['num_bad']}",
    ]
    if report["num_other_split"]:
        lines.append(f"synthetic draws in other splits: {report['num_other_split']}")
    if report["num_blank_lines"]:
        lines.append(f"blank lines: {report['num_blank_lines']}")
    if report["bad_row_counts"]:
        counts = ", ".join(f"{reason} {count}" for reason, count in report["bad_row_counts"].items())
        lines.append(f"bad rows by reason: {counts}")
        lines.extend(f"  e.g. {example}" for example in report["bad_row_examples"][:5])
    for name in ("problem_chars", "answer_chars"):
        stats = result[name]
        lines.append(f"{name.replace('_', ' ')}: min {stats['min']}, mean {stats['mean']}, max {stats['max']}")
    if result["metadata_fields"]:
        fields = ", ".join(f"{key} ({count})" for key, count in result["metadata_fields"].items())
        lines.append(f"metadata fields: {fields}")
    for key, histogram in result["histograms"].items():
        lines.append(f"{key}:")
        largest = max(histogram.values())
        width = max(len(bin_name) for bin_name in histogram)
        lines.extend(
            f"  {bin_name:>{width}} {count:>6} {_bar(count, largest)}" for bin_name, count in histogram.items()
        )
    if result["examples"]:
        lines.append("examples:")
    for number, example in enumerate(result["examples"], start=1):
        lines.append(f"  [{number}] id={example['id']}")
        lines.append("      problem: " + example["problem"].replace("\n", "\n               "))
        lines.append(f"      answer: {example['answer']}")
    return "\n".join(lines)
