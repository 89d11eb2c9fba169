"""`winnow evaluate` and `winnow evaluate-compare`: arguments reach the config, one way to name a policy, printing."""

from __future__ import annotations

import argparse
import json

import pytest

from pipeline import cli
from pipeline.cli.evaluate import (
    add_compare_arguments,
    add_evaluate_arguments,
    policy_and_overrides,
    run_compare_command,
    run_evaluate_command,
)
from pipeline.errors import UserError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def seen_config(monkeypatch):
    """Replaces the stage, and its input checks (the policy folders here are empty): records the
    config `winnow evaluate` would run."""
    import pipeline.stages.evaluate as evaluate
    from pipeline.config import EvaluateConfig
    from pipeline.stages.preflight import PREFLIGHTS

    seen = {}
    monkeypatch.setattr(evaluate, "run_evaluate", lambda cfg: seen.setdefault("cfg", cfg))
    monkeypatch.setitem(PREFLIGHTS, EvaluateConfig, lambda cfg, found: None)
    return seen


def test_cli_arguments_reach_the_config(seen_config, tmp_path):
    parser = argparse.ArgumentParser()
    add_evaluate_arguments(parser)
    yaml_file = tmp_path / "eval.yaml"
    yaml_file.write_text("eval:\n  num_samples: 8\n  ks: [1, 8]\n")
    policy = tmp_path / "odd: [name]"  # not valid as a YAML value: must not go through overrides
    # argparse takes the overrides with the first positional: they follow POLICY directly.
    args = parser.parse_args([str(policy), "shard_size=16", "--tokenizer", "tok", "--config", str(yaml_file)])
    assert run_evaluate_command(args) == 0
    cfg = seen_config["cfg"]
    assert (cfg.policy, cfg.tokenizer, cfg.shard_size, cfg.eval.num_samples, cfg.eval.ks) == (
        str(policy), "tok", 16, 8, [1, 8]
    )


@pytest.mark.parametrize("argv", [
    ["{policy}", "eval.temperature=0.5"],
    ["policy={policy}", "eval.temperature=0.5"],
    ["eval.temperature=0.5", "policy={policy}"],
])
def test_policy_is_named_as_a_positional_or_as_policy_equals(seen_config, tmp_path, argv):
    policy = tmp_path / "odd: [name]"
    policy.mkdir()
    assert cli.main(["evaluate", *(arg.format(policy=policy) for arg in argv), f"output_dir={tmp_path / 'out'}"]) == 0
    cfg = seen_config["cfg"]
    assert (cfg.policy, cfg.eval.temperature, cfg.output_dir) == (str(policy), 0.5, str(tmp_path / "out"))


def test_policy_equals_a_missing_folder_names_the_folder(tmp_path, capsys):
    # Before `policy=DIR` was understood, the whole "policy=..." text was taken for a path.
    missing = tmp_path / "missing"
    assert cli.main(["evaluate", f"policy={missing}", f"output_dir={tmp_path / 'out'}"]) == cli.EXIT_USER_ERROR
    error = capsys.readouterr().err
    assert f"policy {missing} does not exist" in error and "policy=" not in error


def test_policy_given_in_the_yaml_file(seen_config, tmp_path):
    yaml_file = tmp_path / "eval.yaml"
    yaml_file.write_text(f"policy: {tmp_path / 'p'}\n")
    assert cli.main(["evaluate", "--config", str(yaml_file)]) == 0
    assert seen_config["cfg"].policy == str(tmp_path / "p")


def test_a_folder_whose_name_looks_like_an_override_is_still_a_policy(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "lr=0.1").mkdir()
    assert policy_and_overrides("lr=0.1", ["seed=1"]) == ("lr=0.1", ["seed=1"])
    assert policy_and_overrides("runs/lr=0.1", []) == ("runs/lr=0.1", [])  # a slash: a path, not a key
    assert policy_and_overrides(None, ["policy=a=b"]) == ("a=b", [])


def test_a_policy_named_twice_is_an_error():
    with pytest.raises(UserError, match="named 2 times"):
        policy_and_overrides("runs/a", ["policy=runs/b"])


def test_missing_policy_is_a_config_error(tmp_path, capsys):
    assert cli.main(["evaluate", f"output_dir={tmp_path}"]) == cli.EXIT_USER_ERROR
    assert "policy: required" in capsys.readouterr().err


def test_compare_command(tmp_path, capsys):
    from pipeline.eval.report import RESULTS_FORMAT, average_over_benchmarks, per_problem_metrics, summarize_metrics

    for name, counts in (("a", [1, 2, 3]), ("b", [2, 3, 4])):
        ids, n = ["p1", "p2", "p3"], [4, 4, 4]
        names, values = per_problem_metrics(n, counts, (1, 2, 4))
        metrics, boot = summarize_metrics(names, values, bootstrap_samples=100, seed=0)
        results = {
            "format": RESULTS_FORMAT, "policy": "hf:/tiny", "num_samples": 4, "ks": [1, 2, 4], "confidence": 0.95,
            "bootstrap_samples": 100, "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8},
            "benchmarks": {"gsm8k": {"num_loaded": 3, "num_too_long": 0, "num_problems": 3, "metrics": metrics,
                                     "buckets": None, "problems": {"id": ids, "n": n, "c": counts}}},
            "aggregate": average_over_benchmarks({"gsm8k": (names, values, boot)}, confidence=0.95),
        }
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(results))
    parser = argparse.ArgumentParser()
    add_compare_arguments(parser)
    args = parser.parse_args([str(tmp_path / "a"), str(tmp_path / "b"), "--plot", str(tmp_path / "cmp.png")])
    assert run_compare_command(args) == 0
    printed = capsys.readouterr().out
    assert "| gsm8k | pass@1 | 0.500 | 0.750 | +0.250 | [+0.250, +0.250] | 3 | paired |" in printed
    assert (tmp_path / "cmp.png").read_bytes()[:8] == PNG_SIGNATURE


def test_compare_refuses_a_negative_bootstrap_count(tmp_path):
    parser = argparse.ArgumentParser()
    add_compare_arguments(parser)
    with pytest.raises(UserError, match="--bootstrap-samples"):
        run_compare_command(parser.parse_args([str(tmp_path), str(tmp_path), "--bootstrap-samples", "-1"]))
