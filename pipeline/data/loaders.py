"""JSONL and Parquet prompt loaders with field mapping, validation and deduplication.

Each row is mapped to a ``Prompt`` through a ``FieldMap``: the first key present (and
not null) among ``FieldMap.problem`` gives the problem, among ``FieldMap.answer`` the
answer, among ``FieldMap.id`` the id; without an id the row gets a stable hash of
``source + "\\n" + problem``. Fields not used for problem/answer/id become metadata
(or ``FieldMap.metadata`` builds it).

A row is bad (reasons in ``pipeline.data.records``) when it is not valid UTF-8 JSON,
not an object, has no problem/answer, a non-string problem/answer, an empty one, one
holding a lone surrogate, a problem or raw answer longer than ``max_field_chars``, an answer
the dataset's parser cannot read, or an id already used by a kept row. ``on_bad_row="fail"`` raises ``DataError``
with path, line and reason at the first bad row; ``"skip"`` counts it and goes on.

Deduplication (on by default) keeps the first row of each *normalized* problem text:
Unicode NFKC, then ``str.casefold``, then every whitespace run collapsed to one space
and the ends stripped (``normalize_text``). Duplicates are counted in the report, and
so are those whose answer disagrees with the kept row's. Text dedup runs before the id
check, so an exact duplicate line is a duplicate, not a duplicate id.

Rows stream through generators (JSONL line by line, Parquet one row group at a time),
so ``limit`` stops reading early; the public functions return a list and the report.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.data.records import (
    DUPLICATE_ID,
    EMPTY_FIELD,
    INVALID_JSON,
    INVALID_TEXT,
    MISSING_FIELD,
    NOT_AN_OBJECT,
    ON_BAD_ROW_CHOICES,
    TOO_LONG,
    UNPARSEABLE_ANSWER,
    WRONG_TYPE,
    BadRow,
    DataError,
    LoadReport,
    OnBadRow,
    Prompt,
)

DEFAULT_MAX_FIELD_CHARS = 20_000  # longest MATH train problem is 4,309 chars, longest solution 6,767
JSONL_SUFFIXES = (".jsonl",)
PARQUET_SUFFIXES = (".parquet", ".pq")


@dataclass(frozen=True, kw_only=True, slots=True)
class FieldMap:
    """Which raw fields hold problem, answer and id, and how to read them.

    ``parse_answer`` turns the raw answer string into the reference answer (``None``
    means the row is bad: ``unparseable_answer``); without it the stripped string is
    the answer. ``metadata`` builds the metadata dict from the raw row; without it the
    fields not used for problem/answer/id are kept as they are. ``id_prefix`` is put in
    front of every id (benchmarks use ``"<name>/<split>/"``).
    """

    problem: tuple[str, ...] = ("problem", "question", "prompt")
    answer: tuple[str, ...] = ("answer", "solution", "final_answer")
    id: tuple[str, ...] = ("id", "unique_id", "idx")
    parse_answer: Callable[[str], str | None] | None = None
    metadata: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
    id_prefix: str = ""

    def __post_init__(self) -> None:
        if not self.problem or not self.answer:
            raise ValueError("FieldMap needs at least one problem key and one answer key")


def normalize_text(text: str) -> str:
    """The dedup key: NFKC, case-folded, whitespace runs collapsed to one space, ends stripped."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def stable_id(source: str, problem: str) -> str:
    """A 16-hex-digit id that depends only on ``source`` and the problem text."""
    return hashlib.sha256(f"{source}\n{problem}".encode()).hexdigest()[:16]


def check_on_bad_row(on_bad_row: str) -> None:
    if on_bad_row not in ON_BAD_ROW_CHOICES:
        raise ValueError(f"on_bad_row must be one of {ON_BAD_ROW_CHOICES}, got {on_bad_row!r}")


# A raw row is a (line, mapping) pair, or a BadRow when it could not even be decoded.
RawRow = tuple[int, Mapping[str, Any]] | BadRow


def iter_jsonl_rows(path: Path, *, report: LoadReport) -> Iterator[RawRow]:
    """Decode ``path`` line by line; blank lines are counted in the report and skipped.

    The file is read as bytes so one bad byte sequence spoils one line, not the file.
    """
    with path.open("rb") as handle:
        for line_number, raw_line in enumerate(handle, start=1):
            if not raw_line.strip():
                report.num_blank_lines += 1
                continue
            try:
                # Editors on Windows start files with a byte-order mark; JSON forbids it.
                value = json.loads(raw_line.decode("utf-8-sig" if line_number == 1 else "utf-8"))
            except UnicodeDecodeError as error:
                yield BadRow(str(path), line_number, INVALID_JSON, detail=f"not UTF-8: {error.reason}")
                continue
            # Beyond JSONDecodeError, json.loads raises a plain ValueError for integers of
            # over 4,300 digits (CPython's int-conversion limit) and RecursionError for
            # deep nesting; both are broken lines, not crashes.
            except (ValueError, RecursionError) as error:
                yield BadRow(str(path), line_number, INVALID_JSON, detail=_short(str(error)))
                continue
            if not isinstance(value, dict):
                yield BadRow(str(path), line_number, NOT_AN_OBJECT, detail=f"got a JSON {type(value).__name__}")
                continue
            yield line_number, value


def iter_parquet_rows(path: Path) -> Iterator[RawRow]:
    """Rows of a Parquet file, one row group in memory at a time; rows are numbered from 1."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet_file = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as error:
        raise DataError(f"{path}: not a readable Parquet file: {error}") from error
    row_number = 0
    for group_index in range(parquet_file.num_row_groups):
        try:
            rows = parquet_file.read_row_group(group_index).to_pylist()
        except (pa.ArrowException, OSError) as error:
            raise DataError(f"{path}: cannot read Parquet row group {group_index}: {error}") from error
        for row in rows:
            row_number += 1
            yield row_number, row


def _short(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_encodable(text: str) -> bool:
    # JSON allows "\ud800"; Python decodes it to a lone surrogate that no tokenizer,
    # hash or UTF-8 writer accepts.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _first_present(row: Mapping[str, Any], keys: tuple[str, ...]) -> tuple[str | None, Any]:
    for key in keys:
        if key in row and row[key] is not None:
            return key, row[key]
    return None, None


class _RowConverter:
    """Turns raw rows into Prompts, tracking seen texts and ids across one load."""

    def __init__(self, *, path: str, unit: str, source: str, fields: FieldMap, max_field_chars: int, dedup: bool):
        if max_field_chars <= 0:
            raise ValueError(f"max_field_chars must be positive, got {max_field_chars}")
        self.path = path
        self.unit = unit
        self.source = source
        self.fields = fields
        self.max_field_chars = max_field_chars
        self.dedup = dedup
        self.answer_by_text: dict[str, str] = {}
        self.seen_ids: set[str] = set()

    def bad(self, line: int, reason: str, field: str | None, detail: str) -> BadRow:
        return BadRow(self.path, line, reason, field=field, detail=detail, unit=self.unit)

    def _text_field(
        self, line: int, row: Mapping[str, Any], role: str, keys: tuple[str, ...]
    ) -> tuple[str, str] | BadRow:
        """``(key, value)`` of the first present key, or why the field is unusable."""
        key, value = _first_present(row, keys)
        if key is None:
            return self.bad(line, MISSING_FIELD, role, f"none of {list(keys)} present")
        if not isinstance(value, str):
            return self.bad(line, WRONG_TYPE, key, f"{role} must be a string, got {type(value).__name__}")
        if not value.strip():
            return self.bad(line, EMPTY_FIELD, key, f"{role} is empty")
        if len(value) > self.max_field_chars:
            return self.bad(line, TOO_LONG, key, f"{len(value)} chars > max_field_chars={self.max_field_chars}")
        if not _is_encodable(value):
            return self.bad(line, INVALID_TEXT, key, f"{role} holds a lone surrogate, not valid Unicode text")
        return key, value

    def _row_id(self, line: int, row: Mapping[str, Any], problem: str) -> str | BadRow:
        key, value = _first_present(row, self.fields.id)
        if key is None:
            return self.fields.id_prefix + stable_id(self.source, problem)
        # bool is an int subclass, but True is no id.
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            return self.bad(line, WRONG_TYPE, key, f"id must be a string or int, got {type(value).__name__}")
        row_id = str(value).strip()
        if not row_id:
            return self.bad(line, EMPTY_FIELD, key, "id is empty")
        if len(row_id) > self.max_field_chars:
            return self.bad(line, TOO_LONG, key, f"{len(row_id)} chars > max_field_chars={self.max_field_chars}")
        if not _is_encodable(row_id):
            return self.bad(line, INVALID_TEXT, key, "id holds a lone surrogate, not valid Unicode text")
        return self.fields.id_prefix + row_id

    def convert(self, line: int, row: Mapping[str, Any], report: LoadReport) -> Prompt | BadRow | None:
        """A Prompt, a BadRow, or None for a text duplicate (already counted in ``report``)."""
        problem_field = self._text_field(line, row, "problem", self.fields.problem)
        if isinstance(problem_field, BadRow):
            return problem_field
        answer_field = self._text_field(line, row, "answer", self.fields.answer)
        if isinstance(answer_field, BadRow):
            return answer_field
        (problem_key, problem), (answer_key, raw_answer) = problem_field, answer_field
        if self.fields.parse_answer is None:
            answer = raw_answer.strip()
        else:
            answer = self.fields.parse_answer(raw_answer)
            if answer is None or not answer.strip():
                return self.bad(line, UNPARSEABLE_ANSWER, answer_key, f"no answer in {_short(raw_answer, 60)!r}")
        row_id = self._row_id(line, row, problem)
        if isinstance(row_id, BadRow):
            return row_id

        if self.dedup:
            text_key = normalize_text(problem)
            kept_answer = self.answer_by_text.get(text_key)
            if kept_answer is not None:
                report.num_duplicates += 1
                report.num_conflicting_duplicates += kept_answer != answer
                return None
        if row_id in self.seen_ids:
            return self.bad(line, DUPLICATE_ID, None, f"id {row_id!r} already used by an earlier row")
        self.seen_ids.add(row_id)
        if self.dedup:
            self.answer_by_text[text_key] = answer

        if self.fields.metadata is not None:
            metadata = self.fields.metadata(row)
        else:
            used = {problem_key, answer_key, _first_present(row, self.fields.id)[0]}
            metadata = {key: value for key, value in row.items() if key not in used}
        return Prompt(id=row_id, problem=problem, answer=answer, source=self.source, metadata=metadata)


def iter_prompts(
    rows: Iterator[RawRow],
    *,
    path: str,
    unit: str,
    source: str,
    report: LoadReport,
    fields: FieldMap,
    on_bad_row: OnBadRow,
    max_field_chars: int,
    dedup: bool,
    tolerated_lines: frozenset[int] = frozenset(),
) -> Iterator[Prompt]:
    """Convert raw rows lazily, updating ``report``; bad rows raise or are counted.

    ``tolerated_lines`` are known-bad lines of a shipped dataset (see
    ``pipeline.data.benchmarks``): they are counted and skipped even when failing.
    """
    check_on_bad_row(on_bad_row)
    converter = _RowConverter(path=path, unit=unit, source=source, fields=fields, max_field_chars=max_field_chars, dedup=dedup)
    for raw in rows:
        if isinstance(raw, BadRow):
            result: Prompt | BadRow | None = raw
        else:
            line, row = raw
            result = converter.convert(line, row, report)
        report.num_rows += 1
        if result is None:
            continue
        if isinstance(result, BadRow):
            if on_bad_row == "fail" and result.line not in tolerated_lines:
                raise DataError(str(result), bad_row=result)
            report.add_bad_row(result)
            continue
        report.num_kept += 1
        yield result


def load_file(
    path: str | Path,
    *,
    fields: FieldMap | None = None,
    source: str | None = None,
    on_bad_row: OnBadRow = "fail",
    max_field_chars: int = DEFAULT_MAX_FIELD_CHARS,
    dedup: bool = True,
    limit: int | None = None,
    tolerated_lines: frozenset[int] = frozenset(),
) -> tuple[list[Prompt], LoadReport]:
    """Load a ``.jsonl`` or ``.parquet``/``.pq`` file into Prompts.

    ``source`` (default: the path as given) is stored on every Prompt and hashed into
    generated ids. ``limit`` stops after that many kept prompts (the report then covers
    only the rows read).
    """
    path = Path(path)
    check_on_bad_row(on_bad_row)
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if not path.is_file():
        raise FileNotFoundError(f"data file {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    source = str(path) if source is None else source
    report = LoadReport(source=source)
    if suffix in JSONL_SUFFIXES:
        rows: Iterator[RawRow] = iter_jsonl_rows(path, report=report)
        unit = "line"
    elif suffix in PARQUET_SUFFIXES:
        rows = iter_parquet_rows(path)
        unit = "row"
    else:
        raise ValueError(
            f"cannot load {str(path)!r}: unknown file type {suffix!r}; "
            f"expected one of {JSONL_SUFFIXES + PARQUET_SUFFIXES}"
        )
    prompts: list[Prompt] = []
    if limit == 0:
        return prompts, report
    for prompt in iter_prompts(
        rows,
        path=str(path),
        unit=unit,
        source=source,
        report=report,
        fields=fields or FieldMap(),
        on_bad_row=on_bad_row,
        max_field_chars=max_field_chars,
        dedup=dedup,
        tolerated_lines=tolerated_lines,
    ):
        prompts.append(prompt)
        if limit is not None and len(prompts) >= limit:
            break
    report.check_balanced()
    return prompts, report


def load_jsonl(path: str | Path, **options: Any) -> tuple[list[Prompt], LoadReport]:
    """``load_file`` for a JSONL file; raises ``ValueError`` for any other suffix."""
    if Path(path).suffix.lower() not in JSONL_SUFFIXES:
        raise ValueError(f"load_jsonl expects a {JSONL_SUFFIXES} file, got {str(path)!r}")
    return load_file(path, **options)


def load_parquet(path: str | Path, **options: Any) -> tuple[list[Prompt], LoadReport]:
    """``load_file`` for a Parquet file; raises ``ValueError`` for any other suffix."""
    if Path(path).suffix.lower() not in PARQUET_SUFFIXES:
        raise ValueError(f"load_parquet expects a {PARQUET_SUFFIXES} file, got {str(path)!r}")
    return load_file(path, **options)
