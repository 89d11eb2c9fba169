"""inspect_dataset / format_inspection: counts, fields, examples, bad rows, histograms."""

import json

from pipeline.data.inspect import format_inspection, inspect_dataset


def test_inspect_benchmark_levels_and_subjects():
    result = inspect_dataset("math500", num_examples=2)
    json.dumps(result)  # JSON-serialisable for `--json` output
    assert (result["kind"], result["split"], result["num_prompts"]) == ("benchmark", "test", 500)
    assert result["histograms"]["level"] == {"1": 43, "2": 90, "3": 105, "4": 128, "5": 134}
    assert result["histograms"]["subject"]["Algebra"] == 124
    assert result["metadata_fields"] == {"level": 500, "solution": 500, "split": 500, "subject": 500}
    assert [example["id"] for example in result["examples"]] == [
        "math500/test/test/precalculus/807.json",
        "math500/test/test/intermediate_algebra/1994.json",
    ]
    text = format_inspection(result)
    assert "data source: math500 (benchmark, split test)" in text
    assert "prompts: 500 kept of 500 rows read" in text
    assert "level:" in text and "134" in text


def test_inspect_file_with_bad_rows_truncates_examples(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [
        json.dumps({"problem": "x" * 500, "answer": "1", "difficulty": 2}),
        "{broken",
        json.dumps({"problem": "p", "answer": 3}),
        json.dumps({"problem": "X" * 500, "answer": "2", "difficulty": 2}),
        json.dumps({"problem": "q", "answer": "4", "difficulty": 5}),
    ]
    path.write_text("\n".join(rows) + "\n")
    result = inspect_dataset(str(path), num_examples=1, max_example_chars=50)
    assert (result["kind"], result["split"], result["num_prompts"]) == ("file", None, 2)
    assert result["report"]["bad_row_counts"] == {"invalid_json": 1, "wrong_type": 1}
    strict = inspect_dataset(str(path), max_field_chars=100)
    assert strict["report"]["bad_row_counts"] == {"invalid_json": 1, "too_long": 2, "wrong_type": 1}
    assert result["report"]["num_duplicates"] == 1  # case-folded duplicate
    assert result["report"]["num_conflicting_duplicates"] == 1
    assert result["histograms"] == {"difficulty": {"2": 1, "5": 1}}
    (example,) = result["examples"]
    assert len(example["problem"]) == 50 and example["problem"].endswith("…")
    assert result["problem_chars"] == {"min": 1, "mean": 250.5, "max": 500}
    text = format_inspection(result)
    assert "bad rows by reason: invalid_json 1, wrong_type 1" in text
    assert f"{path}, line 2: invalid_json" in text
    assert "duplicates 1 (1 with a different answer)" in text


def test_inspect_synthetic_source():
    result = inspect_dataset("rg:lcm?difficulty=4&size=20")
    assert result["spec"] == "rg:lcm?difficulty=4&size=20"
    assert (result["kind"], result["split"], result["num_prompts"]) == ("synthetic", "train", 20)
    assert result["histograms"]["difficulty"] == {"4": 20}
    report = result["report"]
    assert report["num_rows"] == 20 + report["num_other_split"] + report["num_duplicates"]
    assert report["num_other_split"] > 0  # ~10% of draws hash into validation/test
    assert f"synthetic draws in other splits: {report['num_other_split']}" in format_inspection(result)
