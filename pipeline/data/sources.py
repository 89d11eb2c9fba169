"""One entry point for every prompt source: ``load_prompts(spec, ...)``.

A spec is a string (what configs and the CLI carry) or a ``SourceSpec`` (its parsed,
structured form; ``str(SourceSpec)`` gives back the canonical string):

=======================================  ===========================================================
spec string                              meaning
=======================================  ===========================================================
``math500``, ``gsm8k``, ``math``,        a named benchmark (``pipeline.data.benchmarks``); default
``minerva``                              split ``test``
``gsm8k?split=train``                    the same, another split
``arith?difficulty=2&size=1000``         a synthetic source (``pipeline.data.synthetic``): ``arith``
``rg:gcd?difficulty=3&size=500``         or ``rg:<generator>``; ``difficulty`` 1-5 (default 1),
``rg:gcd?difficulty=3&split=test``       ``size`` (default 1000), default split ``train``
``data/prompts.jsonl``,                  a file (``pipeline.data.loaders``), whole; files take no
``/abs/prompts.parquet``                 query parameters and have no splits
=======================================  ===========================================================

Resolution order: an existing file wins; then a name before ``?`` that is a benchmark
or synthetic source; then a ``.jsonl``/``.parquet``/``.pq`` path (which must exist).
Anything else is a ``ValueError`` naming the spec and listing the known names.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qsl, urlencode

from pipeline.data.benchmarks import BENCHMARKS, load_benchmark
from pipeline.data.loaders import (
    DEFAULT_MAX_FIELD_CHARS,
    JSONL_SUFFIXES,
    PARQUET_SUFFIXES,
    FieldMap,
    check_on_bad_row,
    load_file,
)
from pipeline.data.records import LoadReport, OnBadRow, Prompt
from pipeline.data.synthetic import SYNTHETIC_SOURCES, generate_synthetic

SourceKind = Literal["benchmark", "synthetic", "file"]
DEFAULT_SYNTHETIC_SIZE = 1000
DEFAULT_SYNTHETIC_DIFFICULTY = 1
DEFAULT_SPLITS: dict[str, str] = {"benchmark": "test", "synthetic": "train"}
_QUERY_KEYS: dict[str, tuple[str, ...]] = {
    "benchmark": ("split",),
    "synthetic": ("difficulty", "size", "split"),
    "file": (),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class SourceSpec:
    """A parsed spec. ``name`` is the benchmark/source name, or the path for a file."""

    kind: SourceKind
    name: str
    split: str | None = None
    difficulty: int | None = None
    size: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in _QUERY_KEYS:
            raise ValueError(f"SourceSpec.kind must be one of {list(_QUERY_KEYS)}, got {self.kind!r}")
        if self.kind != "synthetic" and (self.difficulty is not None or self.size is not None):
            raise ValueError(f"data source {self.name!r}: difficulty and size apply to synthetic sources only")
        if self.kind == "file" and self.split is not None:
            raise ValueError(f"data file {self.name!r} has no splits; split the file itself")

    def __str__(self) -> str:
        query = {
            key: value
            for key, value in (("difficulty", self.difficulty), ("size", self.size), ("split", self.split))
            if value is not None
        }
        return self.name + (f"?{urlencode(query)}" if query else "")


def known_source_names() -> list[str]:
    return sorted(BENCHMARKS) + sorted(SYNTHETIC_SOURCES)


def _unknown(spec: str, why: str) -> ValueError:
    return ValueError(
        f"unknown data source {spec!r}: {why}. Known benchmarks: {sorted(BENCHMARKS)}; "
        f"synthetic sources: {sorted(SYNTHETIC_SOURCES)} (e.g. 'rg:gcd?difficulty=3&size=500'); "
        f"or a path to an existing {JSONL_SUFFIXES + PARQUET_SUFFIXES} file"
    )


def _query_int(spec: str, key: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"data source {spec!r}: {key} must be an integer, got {text!r}") from None
    if value < 0 or (key == "difficulty" and value == 0):
        raise ValueError(f"data source {spec!r}: {key} must be positive, got {value}")
    return value


def parse_spec(spec: str) -> SourceSpec:
    """Parse a spec string (see the module docstring); raises ``ValueError`` naming the spec."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"a data source spec must be a non-empty string, got {spec!r}")
    if Path(spec).is_file():
        return SourceSpec(kind="file", name=spec)
    name, _, query = spec.partition("?")
    if name in BENCHMARKS:
        kind: SourceKind = "benchmark"
    elif name in SYNTHETIC_SOURCES:
        kind = "synthetic"
    elif Path(name).suffix.lower() in JSONL_SUFFIXES + PARQUET_SUFFIXES:
        if query:
            raise ValueError(f"data source {spec!r}: files take no query parameters")
        raise _unknown(spec, f"no such file {name!r}")
    else:
        raise _unknown(spec, "not a known name and not an existing file")
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=True) if query else []
    except ValueError:
        raise ValueError(f"data source {spec!r}: malformed query {query!r}; expected key=value&key=value") from None
    options: dict[str, Any] = {}
    for key, value in pairs:
        if key not in _QUERY_KEYS[kind]:
            raise ValueError(
                f"data source {spec!r}: unknown parameter {key!r}; {kind} sources take {list(_QUERY_KEYS[kind])}"
            )
        if key in options:
            raise ValueError(f"data source {spec!r}: parameter {key!r} given twice")
        options[key] = value if key == "split" else _query_int(spec, key, value)
    return SourceSpec(kind=kind, name=name, **options)


def resolve_split(parsed: SourceSpec, split: str | None) -> str | None:
    """The split a load reads: ``split``, else the spec's, else the kind's default (``None`` for files)."""
    if split is not None and parsed.split is not None and split != parsed.split:
        raise ValueError(f"data source {str(parsed)!r} asks for split {parsed.split!r} but split={split!r} was passed")
    if split is None:
        split = parsed.split
    if split is None and parsed.kind != "file":
        split = DEFAULT_SPLITS[parsed.kind]
    if split is not None and parsed.kind == "file":
        raise ValueError(f"data file {parsed.name!r} has no splits; split the file itself")
    return split


def load_prompts(
    spec: str | SourceSpec,
    *,
    split: str | None = None,
    limit: int | None = None,
    seed: int = 0,
    shuffle: bool = False,
    on_bad_row: OnBadRow = "fail",
    dedup: bool = True,
    max_field_chars: int = DEFAULT_MAX_FIELD_CHARS,
    fields: FieldMap | None = None,
) -> tuple[list[Prompt], LoadReport]:
    """Load prompts from a benchmark, a synthetic source or a file.

    ``split``: overrides the spec's ``split`` (a conflicting pair is an error); defaults
    to ``test`` for benchmarks and ``train`` for synthetic sources; files have none.
    ``limit``: at most this many prompts (for synthetic sources, ``min(size, limit)``
    are generated). ``seed``: the generation seed of synthetic sources, and the shuffle
    seed. ``shuffle``: shuffle with ``random.Random(seed)`` before ``limit`` is applied
    (otherwise ``limit`` keeps the first prompts in source order and stops reading
    early; after a shuffle the prompts cut are counted in ``report.num_beyond_limit``).
    ``on_bad_row``, ``dedup``, ``max_field_chars``: see ``pipeline.data.loaders`` (synthetic
    sources always deduplicate and produce no bad rows). ``fields``: the field mapping
    for files (benchmarks have their own).
    """
    parsed = parse_spec(spec) if isinstance(spec, str) else spec
    split = resolve_split(parsed, split)
    check_on_bad_row(on_bad_row)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be a non-negative integer or None, got {limit!r}")
    if fields is not None and parsed.kind != "file":
        raise ValueError(f"data source {str(parsed)!r}: fields= applies to files only")
    read_limit = None if shuffle else limit

    if parsed.kind == "benchmark":
        assert split is not None
        prompts, report = load_benchmark(
            parsed.name,
            split=split,
            on_bad_row=on_bad_row,
            limit=read_limit,
            dedup=dedup,
            max_field_chars=max_field_chars,
        )
    elif parsed.kind == "synthetic":
        assert split is not None
        size = parsed.size if parsed.size is not None else DEFAULT_SYNTHETIC_SIZE
        prompts, report = generate_synthetic(
            parsed.name,
            difficulty=parsed.difficulty if parsed.difficulty is not None else DEFAULT_SYNTHETIC_DIFFICULTY,
            size=size if read_limit is None else min(size, read_limit),
            seed=seed,
            split=split,
        )
    else:
        prompts, report = load_file(
            parsed.name,
            fields=fields,
            on_bad_row=on_bad_row,
            max_field_chars=max_field_chars,
            dedup=dedup,
            limit=read_limit,
        )
    if shuffle:
        random.Random(seed).shuffle(prompts)
        if limit is not None and len(prompts) > limit:
            report.num_beyond_limit = len(prompts) - limit
            report.num_kept = limit
            prompts = prompts[:limit]
        report.check_balanced()
    return prompts, report
