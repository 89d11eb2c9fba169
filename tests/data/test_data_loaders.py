"""JSONL/Parquet loaders: field mapping, every bad-row reason in both modes, dedup, ids, fuzz."""

import json
import re
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.data.loaders import FieldMap, load_file, load_jsonl, load_parquet, normalize_text, stable_id
from pipeline.data.records import BAD_ROW_REASONS, DataError, Prompt


def write_jsonl(path: Path, lines: list) -> Path:
    """Each entry: a dict (dumped as JSON), a str (written verbatim) or bytes (written raw)."""
    with path.open("wb") as handle:
        for line in lines:
            if isinstance(line, dict):
                line = json.dumps(line)
            handle.write(line if isinstance(line, bytes) else line.encode())
            handle.write(b"\n")
    return path


def test_jsonl_default_field_mapping(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"problem": "1+1?", "answer": " 2 ", "id": "a", "level": 3},
            {"question": "2+2?", "solution": "4", "unique_id": "b"},
            {"prompt": "3+3?", "final_answer": "6", "idx": 7},
            {"problem": "4+4?", "answer": "8"},
        ],
    )
    prompts, report = load_jsonl(path)
    assert [p.problem for p in prompts] == ["1+1?", "2+2?", "3+3?", "4+4?"]
    assert [p.answer for p in prompts] == ["2", "4", "6", "8"]  # answers stripped
    assert [p.id for p in prompts[:3]] == ["a", "b", "7"]
    assert prompts[3].id == stable_id(str(path), "4+4?")
    assert prompts[0].metadata == {"level": 3}  # used fields are not repeated in metadata
    assert all(p.source == str(path) for p in prompts)
    assert (report.num_rows, report.num_kept, report.num_bad, report.num_duplicates) == (4, 4, 0, 0)


def test_answer_key_priority_keeps_solution_as_metadata(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"problem": "p", "answer": "5", "solution": "2+3=5"}])
    (prompt,), _ = load_jsonl(path)
    assert prompt.answer == "5"
    assert prompt.metadata == {"solution": "2+3=5"}


def test_field_map_override_and_answer_parser(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": "Q1", "a": "work #### 1,234", "key": "k1"}])
    fields = FieldMap(problem=("q",), answer=("a",), id=("key",), parse_answer=lambda s: s.split("####")[1].strip())
    (prompt,), _ = load_jsonl(path, fields=fields, source="mine")
    assert (prompt.id, prompt.problem, prompt.answer, prompt.source) == ("k1", "Q1", "1,234", "mine")


def test_stable_id_is_deterministic_and_source_dependent():
    assert stable_id("s", "p") == stable_id("s", "p")
    assert stable_id("s", "p") != stable_id("t", "p")
    assert stable_id("s", "p") != stable_id("s", "q")
    assert re.fullmatch(r"[0-9a-f]{16}", stable_id("s", "p"))


# One file per bad-row reason; the bad row is always on line 3 (after a good row and a blank line).
BAD_ROW_CASES = {
    "invalid_json": ('{"problem": "x", "answer": ', None),
    "not_an_object": ("[1, 2, 3]", None),
    "missing_field": ({"problem": "x"}, "answer"),
    "wrong_type": ({"problem": "x", "answer": 5}, "answer"),
    "invalid_text": ('{"problem": "\\ud800 lone surrogate", "answer": "1"}', "problem"),
    "empty_field": ({"problem": "   ", "answer": "1"}, "problem"),
    "too_long": ({"problem": "x" * 101, "answer": "1"}, "problem"),
    "unparseable_answer": ({"problem": "x", "answer": "no marker"}, "answer"),
    "duplicate_id": ({"problem": "another problem", "answer": "1", "id": "first"}, None),
}


def test_bad_row_cases_cover_every_reason():
    assert set(BAD_ROW_CASES) == set(BAD_ROW_REASONS)


def _bad_row_file(tmp_path: Path, reason: str) -> Path:
    bad_line, _ = BAD_ROW_CASES[reason]
    good_first = {"problem": "first problem", "answer": "#### 1", "id": "first"}
    good_last = {"problem": "last problem", "answer": "#### 2", "id": "last"}
    return write_jsonl(tmp_path / f"{reason}.jsonl", [good_first, "", bad_line, good_last])


def _fields_for(reason: str) -> FieldMap:
    # Only the unparseable case uses a parser, so the others' answers are taken verbatim.
    if reason == "unparseable_answer":
        return FieldMap(parse_answer=lambda s: s.split("####")[1].strip() if "####" in s else None)
    return FieldMap()


@pytest.mark.parametrize("reason", sorted(BAD_ROW_CASES))
def test_bad_row_fails_naming_file_line_and_reason(tmp_path, reason):
    path = _bad_row_file(tmp_path, reason)
    with pytest.raises(DataError) as info:
        load_jsonl(path, fields=_fields_for(reason), max_field_chars=100)
    message = str(info.value)
    assert str(path) in message and "line 3" in message and reason in message
    expected_field = BAD_ROW_CASES[reason][1]
    if expected_field is not None:
        assert repr(expected_field) in message
    assert info.value.bad_row.line == 3 and info.value.bad_row.reason == reason
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("reason", sorted(BAD_ROW_CASES))
def test_bad_row_skip_counts_by_reason(tmp_path, reason):
    path = _bad_row_file(tmp_path, reason)
    prompts, report = load_jsonl(path, fields=_fields_for(reason), max_field_chars=100, on_bad_row="skip")
    assert [p.id for p in prompts] == ["first", "last"]
    assert dict(report.bad_row_counts) == {reason: 1}
    assert (report.num_rows, report.num_kept, report.num_blank_lines) == (3, 2, 1)
    (example,) = report.bad_row_examples
    assert (example.path, example.line, example.reason) == (str(path), 3, reason)
    assert report.as_dict()["bad_row_counts"] == {reason: 1}


def test_invalid_utf8_is_an_invalid_json_row(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"problem": "a", "answer": "1"}, b'{"problem": "\xff\xfe"}'])
    with pytest.raises(DataError, match=r"line 2: invalid_json: not UTF-8"):
        load_jsonl(path)


def test_utf8_bom_on_the_first_line_is_accepted(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"problem": "a", "answer": "1"}\r\n{"problem": "b", "answer": "2"}\r\n')
    prompts, _ = load_jsonl(path)
    assert [p.problem for p in prompts] == ["a", "b"]


@pytest.mark.parametrize(
    "line",
    [
        "[" * 100_000,  # RecursionError inside json
        '{"problem": "p", "answer": "1", "n": ' + "9" * 5000 + "}",  # int beyond CPython's digit limit
    ],
)
def test_pathological_json_is_a_data_error(tmp_path, line):
    path = write_jsonl(tmp_path / "d.jsonl", [line])
    with pytest.raises(DataError, match="line 1: invalid_json"):
        load_jsonl(path)


def test_id_types(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"problem": "a", "answer": "1", "id": True},
            {"problem": "b", "answer": "1", "id": 1.5},
            {"problem": "c", "answer": "1", "id": ""},
            {"problem": "d", "answer": "1", "id": 0},
        ],
    )
    prompts, report = load_jsonl(path, on_bad_row="skip")
    assert [p.id for p in prompts] == ["0"]
    assert dict(report.bad_row_counts) == {"wrong_type": 2, "empty_field": 1}


def test_null_value_counts_as_missing_and_falls_through_to_next_key(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [{"problem": None, "question": "q", "answer": "1"}, {"problem": None, "answer": "1"}],
    )
    prompts, report = load_jsonl(path, on_bad_row="skip")
    assert [p.problem for p in prompts] == ["q"]
    assert dict(report.bad_row_counts) == {"missing_field": 1}


def test_dedup_by_normalized_text_counts_duplicates_and_conflicts(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"problem": "What is  1+1?", "answer": "2"},
            {"problem": "what is 1+1?\n", "answer": "2"},  # case and whitespace differ: duplicate
            {"problem": "WHAT IS 1+1?", "answer": "3"},  # duplicate with a conflicting answer
            {"problem": "What is 1+2?", "answer": "3"},
        ],
    )
    prompts, report = load_jsonl(path)
    assert [p.problem for p in prompts] == ["What is  1+1?", "What is 1+2?"]
    assert (report.num_duplicates, report.num_conflicting_duplicates, report.num_bad) == (2, 1, 0)
    report.check_balanced()

    prompts, report = load_jsonl(path, dedup=False)
    assert len(prompts) == 4 and report.num_duplicates == 0


def test_exact_duplicate_line_with_id_is_a_duplicate_not_a_bad_id(tmp_path):
    row = {"problem": "p", "answer": "1", "id": "x"}
    prompts, report = load_jsonl(write_jsonl(tmp_path / "d.jsonl", [row, row]))
    assert len(prompts) == 1 and report.num_duplicates == 1 and report.num_bad == 0


def test_without_dedup_a_repeated_problem_gets_a_duplicate_hash_id(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"problem": "p", "answer": "1"}, {"problem": "p", "answer": "1"}])
    with pytest.raises(DataError, match="line 2: duplicate_id"):
        load_jsonl(path, dedup=False)


def test_normalize_text():
    assert normalize_text("  Hello\tWORLD \n x ") == "hello world x"
    assert normalize_text("ﬁ Ａ") == normalize_text("fi a")  # NFKC: ligature and full-width letters


def test_limit_stops_reading_early(tmp_path):
    rows = [{"problem": f"p{i}", "answer": "1"} for i in range(10)] + ["not json"]
    prompts, report = load_jsonl(write_jsonl(tmp_path / "d.jsonl", rows), limit=3)
    assert [p.problem for p in prompts] == ["p0", "p1", "p2"]
    assert report.num_rows == 3  # the bad last line is never read


def test_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_file(tmp_path / "missing.jsonl")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unknown file type '.csv'"):
        load_file(tmp_path / "d.csv")
    with pytest.raises(ValueError, match="on_bad_row"):
        load_file(write_jsonl(tmp_path / "d.jsonl", []), on_bad_row="ignore")
    with pytest.raises(ValueError, match="load_parquet expects"):
        load_parquet(tmp_path / "d.jsonl")


def test_empty_file(tmp_path):
    prompts, report = load_jsonl(write_jsonl(tmp_path / "d.jsonl", ["", "   "]))
    assert prompts == [] and report.num_rows == 0 and report.num_blank_lines == 2


# --------------------------------------------------------------------------- Parquet


def test_parquet_reads_every_row_group(tmp_path):
    table = pa.table(
        {
            "question": [f"problem {i}" for i in range(10)],
            "answer": [str(i) for i in range(10)],
            "idx": list(range(10)),
            "level": [i % 5 + 1 for i in range(10)],
        }
    )
    path = tmp_path / "d.parquet"
    pq.write_table(table, path, row_group_size=3)
    assert pq.ParquetFile(path).num_row_groups == 4
    prompts, report = load_parquet(path)
    assert [p.id for p in prompts] == [str(i) for i in range(10)]
    assert [p.metadata["level"] for p in prompts] == [1, 2, 3, 4, 5, 1, 2, 3, 4, 5]
    assert report.num_kept == 10


def test_parquet_bad_rows_name_the_row(tmp_path):
    table = pa.table({"problem": ["a", None, "c", "d"], "answer": ["1", "2", "3", None]})
    path = tmp_path / "d.parquet"
    pq.write_table(table, path, row_group_size=2)
    with pytest.raises(DataError, match=re.escape(f"{path}, row 2: missing_field (field 'problem')")):
        load_parquet(path)
    prompts, report = load_parquet(path, on_bad_row="skip")
    assert [p.problem for p in prompts] == ["a", "c"]
    assert dict(report.bad_row_counts) == {"missing_field": 2}
    assert [b.line for b in report.bad_row_examples] == [2, 4]


def test_parquet_non_string_answer_column_is_wrong_type(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"problem": ["a"], "answer": [3]}), path)
    with pytest.raises(DataError, match="row 1: wrong_type"):
        load_parquet(path)


def test_corrupt_parquet_is_a_data_error(tmp_path):
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        load_parquet(path)


# ------------------------------------------------------------------------------ fuzz

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8,
)
_field_values = st.one_of(
    st.text(max_size=30), st.integers(), st.none(), st.booleans(), st.lists(st.integers(), max_size=2)
)
_rowlike = st.fixed_dictionaries(
    {},
    optional={"problem": _field_values, "question": _field_values, "answer": _field_values, "id": _field_values},
).map(json.dumps)
_valid_row = st.fixed_dictionaries(
    {"problem": st.text(min_size=1, max_size=30), "answer": st.text(min_size=1, max_size=5)},
    optional={"id": st.integers(0, 5) | st.sampled_from(["a", "b"])},
).map(json.dumps)
_pathological = st.sampled_from(
    [b"[" * 5000, b"9" * 5000, b'{"problem": "\\ud800", "answer": "1"}', b"\xef\xbb\xbf{}", b"NaN", b'"\x00"']
)
_line = st.one_of(
    _valid_row,
    _pathological,
    st.binary(max_size=40),
    _json_values.map(json.dumps),
    _rowlike,
    _rowlike.map(lambda text: text[: len(text) // 2]),  # truncated JSON
).map(lambda line: line if isinstance(line, bytes) else line.encode())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=st.lists(_line, max_size=12), on_bad_row=st.sampled_from(["fail", "skip"]))
def test_fuzz_jsonl_loads_or_raises_data_error_naming_a_line(lines, on_bad_row):
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "fuzz.jsonl"
        path.write_bytes(b"\n".join(lines))
        content = path.read_bytes()
        num_physical_lines = content.count(b"\n") + (bool(content) and not content.endswith(b"\n"))
        try:
            prompts, report = load_jsonl(path, on_bad_row=on_bad_row, max_field_chars=25)
        except DataError as error:
            assert on_bad_row == "fail"
            match = re.search(rf"{re.escape(str(path))}, line (\d+): (\w+)", str(error))
            assert match is not None, str(error)
            assert 1 <= int(match.group(1)) <= num_physical_lines
            assert match.group(2) in BAD_ROW_REASONS
            return
    report.check_balanced()
    assert report.num_kept == len(prompts)
    assert report.num_rows + report.num_blank_lines == num_physical_lines
    for prompt in prompts:
        assert isinstance(prompt, Prompt)
        assert isinstance(prompt.problem, str) and prompt.problem.strip() and len(prompt.problem) <= 25
        assert isinstance(prompt.answer, str) and prompt.answer
    assert len({p.id for p in prompts}) == len(prompts)
    assert len({normalize_text(p.problem) for p in prompts}) == len(prompts)
