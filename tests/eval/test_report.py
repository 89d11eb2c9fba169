"""Bootstrap intervals, results files, Markdown tables, plots and run comparison."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline.eval.report import (
    RESULTS_FORMAT,
    ResultsError,
    average_over_benchmarks,
    bootstrap_means,
    compare,
    format_comparison,
    format_results_markdown,
    load_results,
    per_problem_metrics,
    percentile_interval,
    summarize_metrics,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def make_results(problems: dict[str, tuple[list[str], list[int], list[int]]], *, ks=(1, 2, 4), bootstrap_samples=100) -> dict:
    """A results dict as ``winnow evaluate`` writes it, from per-benchmark (ids, n, c)."""
    benchmarks = {}
    parts = {}
    for name, (ids, n, c) in problems.items():
        names, values = per_problem_metrics(n, c, ks)
        metrics, boot = summarize_metrics(names, values, bootstrap_samples=bootstrap_samples, seed=0)
        parts[name] = (names, values, boot)
        benchmarks[name] = {
            "num_loaded": len(ids), "num_too_long": 0, "num_problems": len(ids), "metrics": metrics, "buckets": None,
            "problems": {"id": ids, "n": n, "c": c},
        }
    return {
        "format": RESULTS_FORMAT, "policy": "hf:/tiny", "num_samples": 4, "ks": list(ks), "confidence": 0.95,
        "bootstrap_samples": bootstrap_samples, "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8},
        "benchmarks": benchmarks, "aggregate": average_over_benchmarks(parts, confidence=0.95),
    }


def row(rows, benchmark, metric):
    (match,) = [r for r in rows if r.benchmark == benchmark and r.metric == metric]
    return match


# ----------------------------------------------------------------------------- bootstrap


def test_bootstrap_means_equal_a_loop_over_resampled_problems():
    values = np.random.default_rng(0).random((7, 3))
    fast = bootstrap_means(values, num_resamples=50, rng=np.random.default_rng(5))
    draws = np.random.default_rng(5).integers(0, 7, size=(50, 7))  # the same stream, one chunk
    for b in range(50):
        expected = [sum(values[i, m] for i in draws[b]) / 7 for m in range(3)]
        np.testing.assert_allclose(fast[b], expected, rtol=0, atol=1e-12)


def test_bootstrap_chunks_cover_every_resample(monkeypatch):
    import pipeline.eval.report as report

    monkeypatch.setattr(report, "_MAX_DRAWS_PER_CHUNK", 20)  # 4 problems: 5 resamples per chunk
    values = np.arange(4.0)[:, None]
    means = bootstrap_means(values, num_resamples=23, rng=np.random.default_rng(1))
    assert means.shape == (23, 1) and np.all((means >= 0) & (means <= 3))
    assert len(np.unique(means)) > 3  # every chunk drew fresh resamples


def test_percentile_interval_by_hand():
    samples = np.arange(101.0)[:, None]  # 0, 1, ..., 100
    np.testing.assert_allclose(percentile_interval(samples, 0.95)[:, 0], [2.5, 97.5])
    np.testing.assert_allclose(percentile_interval(samples, 0.5)[:, 0], [25.0, 75.0])
    with pytest.raises(ValueError, match="confidence"):
        percentile_interval(samples, 1.0)


def test_constant_values_have_a_zero_width_interval_and_no_bootstrap_gives_none():
    names, values = per_problem_metrics([4, 4, 4], [2, 2, 2], [1, 2])
    metrics, boot = summarize_metrics(names, values, bootstrap_samples=50, seed=3)
    assert metrics["pass@1"] == {"value": 0.5, "ci": [0.5, 0.5]}
    assert metrics["pass@2"]["value"] == pytest.approx(5 / 6)  # 1 − C(2,2)/C(4,2)
    metrics, boot = summarize_metrics(names, values, bootstrap_samples=0, seed=3)
    assert boot is None and metrics["avg@n"] == {"value": 0.5, "ci": None}


def test_per_problem_metrics_keeps_only_estimable_k():
    names, values = per_problem_metrics([2, 3], [1, 0], [1, 2, 4])
    assert names == ["pass@1", "pass@2", "avg@n"]
    np.testing.assert_allclose(values, [[0.5, 1.0, 0.5], [0.0, 0.0, 0.0]])


def test_macro_and_weighted_averages_by_hand():
    # a: avg@n per problem 1/4, 3/4 → 0.5 (2 problems); b: 1 (1 problem).
    results = make_results({"a": (["a1", "a2"], [4, 4], [1, 3]), "b": (["b1"], [4], [4])})
    aggregate = results["aggregate"]
    assert aggregate["macro"]["avg@n"]["value"] == pytest.approx((0.5 + 1.0) / 2)
    assert aggregate["weighted"]["avg@n"]["value"] == pytest.approx((2 * 0.5 + 1 * 1.0) / 3)
    for kind in ("macro", "weighted"):
        for entry in aggregate[kind].values():
            assert entry["ci"][0] <= entry["value"] <= entry["ci"][1]
    assert aggregate["num_problems"] == 3 and aggregate["benchmarks"] == ["a", "b"]


# ----------------------------------------------------------------------------- compare


def test_paired_comparison_by_hand():
    ids = ["p1", "p2", "p3"]
    run_a = make_results({"gsm8k": (ids, [4, 4, 4], [1, 2, 3])})
    # B solves one more sample of every problem, listed in another order (pairing is by id).
    run_b = make_results({"gsm8k": (["p3", "p1", "p2"], [4, 4, 4], [4, 2, 3])})
    rows = compare(run_a, run_b, bootstrap_samples=500)
    pass1 = row(rows, "gsm8k", "pass@1")
    # pass@1 = c/n: A = (1+2+3)/12 = 0.5, B = (2+3+4)/12 = 0.75; every problem gains exactly 0.25.
    assert (pass1.value_a, pass1.value_b, pass1.difference) == pytest.approx((0.5, 0.75, 0.25))
    assert pass1.paired and pass1.ci == pytest.approx((0.25, 0.25))
    # pass@2 = 1 − C(4−c,2)/6: A = (1/2 + 5/6 + 1)/3, B = (5/6 + 1 + 1)/3; per-problem gains 1/3, 1/6, 0.
    pass2 = row(rows, "gsm8k", "pass@2")
    assert pass2.difference == pytest.approx((1 / 3 + 1 / 6 + 0) / 3)
    assert 0.0 <= pass2.ci[0] <= pass2.difference <= pass2.ci[1] <= 1 / 3
    assert row(rows, "gsm8k", "pass@4").ci == pytest.approx((0.0, 0.0))  # every problem solved in both
    assert [r.metric for r in rows] == ["pass@1", "pass@2", "pass@4", "avg@n"]


def test_unpaired_comparison_when_the_problems_differ():
    run_a = make_results({"gsm8k": (["p1", "p2", "p3"], [4, 4, 4], [1, 2, 3])})
    run_b = make_results({"gsm8k": (["q1", "q2", "q3"], [4, 4, 4], [2, 3, 4])})
    pass1 = row(compare(run_a, run_b, bootstrap_samples=500), "gsm8k", "pass@1")
    assert not pass1.paired and pass1.difference == pytest.approx(0.25)
    # Resampling the runs independently leaves between-problem variance in the interval.
    assert pass1.ci[0] < 0.25 < pass1.ci[1]


def test_comparison_direction_shared_benchmarks_and_macro_row():
    run_a = make_results({"x": (["1", "2"], [4, 4], [0, 4]), "y": (["1"], [4], [2]), "only_a": (["1"], [4], [1])})
    run_b = make_results({"x": (["1", "2"], [4, 4], [4, 4]), "y": (["1"], [4], [1])})
    forward, backward = compare(run_a, run_b, seed=3), compare(run_b, run_a, seed=3)
    assert {r.benchmark for r in forward} == {"x", "y", "macro"}
    for f, b in zip(forward, backward):
        assert (f.benchmark, f.metric, f.difference) == (b.benchmark, b.metric, pytest.approx(-b.difference))
    # avg@n: x gains (1 − 0.5) = 0.5, y loses 0.25 → macro difference 0.125.
    macro = row(forward, "macro", "avg@n")
    assert macro.difference == pytest.approx((0.5 - 0.25) / 2) and macro.paired
    assert macro.value_a == pytest.approx((0.5 + 0.5) / 2) and macro.value_b == pytest.approx((1.0 + 0.25) / 2)


def test_comparison_keeps_only_k_both_runs_estimate():
    run_a = make_results({"x": (["1"], [4], [1])}, ks=(1, 2, 4))
    run_b = make_results({"x": (["1"], [2], [1])}, ks=(1, 2))
    assert [r.metric for r in compare(run_a, run_b)] == ["pass@1", "pass@2", "avg@n"]


def test_results_files_round_trip_and_bad_files_are_clear_errors(tmp_path):
    results = make_results({"x": (["1"], [4], [1])})
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "results.json").write_text(json.dumps(results))
    assert load_results(tmp_path / "run") == results
    assert load_results(tmp_path / "run" / "results.json") == results
    with pytest.raises(ResultsError, match="does not exist"):
        load_results(tmp_path / "nothing")
    (tmp_path / "other.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ResultsError, match="not a winnow evaluation result"):
        load_results(tmp_path / "other.json")
    broken = make_results({"x": (["1", "2"], [4, 4], [1, 2])})
    broken["benchmarks"]["x"]["problems"]["c"] = [1]
    with pytest.raises(ResultsError, match="differ in length"):
        load_results(broken)


# ----------------------------------------------------------------------------- tables, plots, CLI


def test_markdown_tables():
    results = make_results({"math": (["1", "2"], [4, 4], [1, 3]), "gsm8k": (["1"], [4], [4])}, bootstrap_samples=0)
    results["benchmarks"]["math"]["buckets"] = {
        "key": "level", "groups": {"3": {"num_problems": 2, "metrics": results["benchmarks"]["math"]["metrics"]}},
    }
    text = format_results_markdown(results)
    assert "| benchmark | problems | too long | pass@1 | pass@2 | pass@4 | avg@n |" in text
    # c = 1, 3 of n = 4: pass@2 = (1/2 + 1)/2 (1 − C(3,2)/C(4,2) = 1/2; c = 3 leaves one wrong sample).
    assert "| math | 2 | 0 | 0.500 | 0.750 | 1.000 | 0.500 |" in text
    assert "| **macro** | 3 |" in text and "## math by level" in text and "| 3 | 2 |" in text
    rows = compare(results, results, bootstrap_samples=0)
    table = format_comparison(rows, label_a="base", label_b="rl")
    assert "| benchmark | metric | base | rl | rl − base |" in table and "| math | pass@1 | 0.500 | 0.500 | +0.000 | — |" in table


def test_plots_are_png_files(tmp_path):
    from pipeline.eval.plots import plot_comparison, plot_pass_at_k

    run_a = make_results({"math": (["1", "2"], [4, 4], [1, 3]), "gsm8k": (["1"], [4], [0])})
    run_b = make_results({"math": (["1", "2"], [4, 4], [2, 3])})
    run_a["benchmarks"]["empty"] = {"num_problems": 0, "num_too_long": 5, "metrics": {}, "buckets": None,
                                    "problems": {"id": [], "n": [], "c": []}}
    for path in (plot_pass_at_k(run_a, tmp_path / "a.png"), plot_comparison({"A": run_a, "B": run_b}, tmp_path / "c.png")):
        assert path.read_bytes()[:8] == PNG_SIGNATURE and path.stat().st_size > 5000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.png", "c.png"]  # no temporary files left
