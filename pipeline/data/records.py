"""Typed records at the data boundary: ``Prompt``, ``BadRow``, ``LoadReport``, ``DataError``.

Every loader in ``pipeline.data`` returns ``(list[Prompt], LoadReport)``. A row that
cannot become a ``Prompt`` is a ``BadRow``: with ``on_bad_row="fail"`` it is raised as
a ``DataError`` naming file, line and reason; with ``on_bad_row="skip"`` it is counted
by reason in the ``LoadReport``. Nothing is dropped without being counted, so

    num_rows == num_kept + num_beyond_limit + num_duplicates + num_other_split + num_bad

holds for every report (``LoadReport.check_balanced``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

from pipeline.errors import UserError

OnBadRow = Literal["fail", "skip"]
ON_BAD_ROW_CHOICES: tuple[str, ...] = ("fail", "skip")

# Reasons a row is rejected. Text duplicates are not bad rows (they are counted in
# LoadReport.num_duplicates); an id shared by two different problems is.
INVALID_JSON = "invalid_json"  # undecodable UTF-8 or unparsable JSON
NOT_AN_OBJECT = "not_an_object"  # valid JSON, but not a {...} object
MISSING_FIELD = "missing_field"  # none of the mapped keys present, or the value is null
WRONG_TYPE = "wrong_type"  # problem/answer not a string; id not a string or int
INVALID_TEXT = "invalid_text"  # a lone UTF-16 surrogate (JSON "\ud800"): not encodable text
EMPTY_FIELD = "empty_field"  # problem/answer/id empty after stripping whitespace
TOO_LONG = "too_long"  # problem or answer longer than max_field_chars
UNPARSEABLE_ANSWER = "unparseable_answer"  # the dataset's answer parser found no answer
DUPLICATE_ID = "duplicate_id"  # id already used by an earlier kept row

BAD_ROW_REASONS: tuple[str, ...] = (
    INVALID_JSON,
    NOT_AN_OBJECT,
    MISSING_FIELD,
    WRONG_TYPE,
    INVALID_TEXT,
    EMPTY_FIELD,
    TOO_LONG,
    UNPARSEABLE_ANSWER,
    DUPLICATE_ID,
)

# Only this many BadRow examples are kept in a report; the counts are always complete.
MAX_BAD_ROW_EXAMPLES = 20


@dataclass(frozen=True, slots=True)
class Prompt:
    """One problem with its reference answer.

    ``id`` is unique within a load (benchmarks and synthetic sources prefix it with
    their name, so ids from different sources never collide). ``metadata`` holds
    per-source extras under common keys where they exist: ``level`` (int or None),
    ``subject`` (str), ``difficulty`` (int, synthetic sources), ``solution`` (a worked
    reference solution, str), ``split`` (str). Because ``metadata`` is a dict a
    ``Prompt`` is not hashable; key sets by ``id``.
    """

    id: str
    problem: str
    answer: str
    source: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class BadRow:
    """A row that could not become a ``Prompt``; ``line`` is 1-based (a Parquet row number for Parquet)."""

    path: str
    line: int
    reason: str
    field: str | None = None
    detail: str = ""
    unit: Literal["line", "row"] = "line"

    def __post_init__(self) -> None:
        assert self.reason in BAD_ROW_REASONS, self.reason

    def __str__(self) -> str:
        where = f"{self.path}, {self.unit} {self.line}"
        what = self.reason if self.field is None else f"{self.reason} (field {self.field!r})"
        return f"{where}: {what}" + (f": {self.detail}" if self.detail else "")


class DataError(UserError):
    """A data file or row is unusable; the message names the file, the line and the reason."""

    def __init__(self, message: str, *, bad_row: BadRow | None = None) -> None:
        super().__init__(message)
        self.bad_row = bad_row


@dataclass(slots=True)
class LoadReport:
    """What a load read, kept and rejected.

    ``num_rows`` counts rows read (blank JSONL lines are counted separately in
    ``num_blank_lines`` and are not rows); ``num_duplicates`` counts rows whose
    normalized problem text was already kept (``num_conflicting_duplicates`` of them
    carried a different answer than the kept row); ``num_other_split`` counts
    synthetic draws that hashed into another split; ``num_beyond_limit`` counts kept
    prompts cut by ``limit`` after a shuffle.
    """

    source: str
    num_rows: int = 0
    num_kept: int = 0
    num_duplicates: int = 0
    num_conflicting_duplicates: int = 0
    num_other_split: int = 0
    num_beyond_limit: int = 0
    num_blank_lines: int = 0
    bad_row_counts: Counter[str] = field(default_factory=Counter)
    bad_row_examples: list[BadRow] = field(default_factory=list)

    @property
    def num_bad(self) -> int:
        return sum(self.bad_row_counts.values())

    def add_bad_row(self, bad_row: BadRow) -> None:
        self.bad_row_counts[bad_row.reason] += 1
        if len(self.bad_row_examples) < MAX_BAD_ROW_EXAMPLES:
            self.bad_row_examples.append(bad_row)

    def check_balanced(self) -> None:
        accounted = (
            self.num_kept + self.num_beyond_limit + self.num_duplicates + self.num_other_split + self.num_bad
        )
        assert self.num_rows == accounted, f"{self.source}: read {self.num_rows} rows, accounted {accounted}"

    def as_dict(self) -> dict[str, Any]:
        """A JSON-serialisable summary (for logs and ``inspect_dataset``)."""
        return {
            "source": self.source,
            "num_rows": self.num_rows,
            "num_kept": self.num_kept,
            "num_duplicates": self.num_duplicates,
            "num_conflicting_duplicates": self.num_conflicting_duplicates,
            "num_other_split": self.num_other_split,
            "num_beyond_limit": self.num_beyond_limit,
            "num_blank_lines": self.num_blank_lines,
            "num_bad": self.num_bad,
            "bad_row_counts": dict(sorted(self.bad_row_counts.items())),
            "bad_row_examples": [str(bad_row) for bad_row in self.bad_row_examples],
        }
