"""load_prompts: spec parsing, dispatch to benchmarks / synthetic sources / files, errors."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.data.loaders import FieldMap
from pipeline.data.sources import SourceSpec, load_prompts, parse_spec


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("math500", SourceSpec(kind="benchmark", name="math500")),
        ("gsm8k?split=train", SourceSpec(kind="benchmark", name="gsm8k", split="train")),
        ("arith", SourceSpec(kind="synthetic", name="arith")),
        (
            "rg:basic_arithmetic?difficulty=3&size=1000",
            SourceSpec(kind="synthetic", name="rg:basic_arithmetic", difficulty=3, size=1000),
        ),
        ("rg:gcd?split=test&difficulty=2", SourceSpec(kind="synthetic", name="rg:gcd", difficulty=2, split="test")),
    ],
)
def test_parse_spec(spec, expected):
    assert parse_spec(spec) == expected
    assert parse_spec(str(expected)) == expected  # str() is the canonical, re-parsable form


def test_parse_spec_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("")
    assert parse_spec(str(path)) == SourceSpec(kind="file", name=str(path))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "aime24",
            r"unknown data source 'aime24': not a known name.*Known benchmarks: "
            r"\['gsm8k', 'math', 'math500', 'minerva'\]; synthetic sources: \['arith', 'rg:basic_arithmetic'",
        ),
        ("missing/file.jsonl", r"unknown data source 'missing/file.jsonl': no such file 'missing/file.jsonl'"),
        ("", r"non-empty string"),
        ("arith?level=2", r"unknown parameter 'level'; synthetic sources take \['difficulty', 'size', 'split'\]"),
        ("math500?difficulty=2", r"unknown parameter 'difficulty'; benchmark sources take \['split'\]"),
        ("arith?difficulty=two", r"difficulty must be an integer, got 'two'"),
        ("arith?difficulty=0", r"difficulty must be positive"),
        ("arith?size=-3", r"size must be positive"),
        ("arith?size=3&size=4", r"'size' given twice"),
        ("arith?size", r"malformed query"),
        ("data.parquet?split=test", r"files take no query parameters"),
    ],
)
def test_parse_spec_errors_name_the_spec(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_spec(spec)


def test_source_spec_validation():
    with pytest.raises(ValueError, match="synthetic sources only"):
        SourceSpec(kind="benchmark", name="math500", difficulty=2)
    with pytest.raises(ValueError, match="has no splits"):
        SourceSpec(kind="file", name="a.jsonl", split="train")
    with pytest.raises(ValueError, match="kind must be one of"):
        SourceSpec(kind="web", name="x")


def test_load_benchmark_spec_with_split_and_limit():
    prompts, report = load_prompts("gsm8k", split="train", limit=5)
    assert [p.id for p in prompts] == [f"gsm8k/train/{i}" for i in range(5)]
    assert report.num_rows == 5  # stopped reading early
    same, _ = load_prompts("gsm8k?split=train", limit=5)
    assert same == prompts
    default, _ = load_prompts("gsm8k", limit=1)
    assert default[0].id == "gsm8k/test/0"


def test_conflicting_split_is_an_error():
    with pytest.raises(ValueError, match="asks for split 'train' but split='test' was passed"):
        load_prompts("gsm8k?split=train", split="test")


def test_load_synthetic_spec():
    prompts, report = load_prompts("rg:gcd?difficulty=2&size=30", seed=4)
    assert len(prompts) == 30 and report.num_kept == 30
    assert all(p.metadata["difficulty"] == 2 and p.metadata["split"] == "train" for p in prompts)
    limited, _ = load_prompts("rg:gcd?difficulty=2&size=30", seed=4, limit=10)
    assert limited == prompts[:10]
    default, _ = load_prompts("arith", limit=3)
    assert [p.metadata["difficulty"] for p in default] == [1, 1, 1]
    structured, _ = load_prompts(SourceSpec(kind="synthetic", name="rg:gcd", difficulty=2, size=30), seed=4)
    assert structured == prompts


def test_load_file_spec_with_fields(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"q": "1+1", "a": "2"}) + "\n")
    prompts, _ = load_prompts(str(path), fields=FieldMap(problem=("q",), answer=("a",)))
    assert (prompts[0].problem, prompts[0].answer) == ("1+1", "2")
    with pytest.raises(ValueError, match="has no splits"):
        load_prompts(str(path), split="train")
    with pytest.raises(ValueError, match="fields= applies to files only"):
        load_prompts("math500", fields=FieldMap())


def test_load_parquet_file_spec(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"problem": ["a", "b"], "answer": ["1", "2"]}), path)
    prompts, _ = load_prompts(str(path))
    assert [p.problem for p in prompts] == ["a", "b"]


def test_file_bad_rows_fail_by_default_and_skip_on_request(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"problem": "a", "answer": "1"}\n{oops\n')
    with pytest.raises(ValueError, match=rf"{path}, line 2: invalid_json"):
        load_prompts(str(path))
    prompts, report = load_prompts(str(path), on_bad_row="skip")
    assert len(prompts) == 1 and dict(report.bad_row_counts) == {"invalid_json": 1}
    with pytest.raises(ValueError, match="on_bad_row must be one of"):
        load_prompts("arith", on_bad_row="warn")


def test_shuffle_is_seeded_and_counts_what_limit_cuts():
    ordered, _ = load_prompts("minerva")
    shuffled, report = load_prompts("minerva", shuffle=True, seed=1, limit=10)
    again, _ = load_prompts("minerva", shuffle=True, seed=1, limit=10)
    other, _ = load_prompts("minerva", shuffle=True, seed=2, limit=10)
    assert shuffled == again and shuffled != other
    assert [p.id for p in shuffled] != [p.id for p in ordered[:10]]
    assert {p.id for p in shuffled} <= {p.id for p in ordered}
    assert (report.num_rows, report.num_kept, report.num_beyond_limit) == (272, 10, 262)
    report.check_balanced()


@pytest.mark.parametrize("limit", [-1, 1.5, True])
def test_bad_limit(limit):
    with pytest.raises(ValueError, match="limit must be a non-negative integer"):
        load_prompts("math500", limit=limit)
