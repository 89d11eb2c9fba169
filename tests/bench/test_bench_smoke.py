"""Every tools/bench module runs in the suite: its command line parses, bad arguments stop it before any
work, and at toy size one round runs and writes its output.

``SMOKES`` names, for every module of ``tools/bench``, the test that runs it at toy size; a new module
without one fails ``test_every_bench_module_has_a_smoke_run``. The modules with no toy run elsewhere
run here as ``python -m tools.bench.<name>`` (a fresh process: each starts its own process group and
megatron state), on the session's tiny bootstrap policy (``tests/stages/test_bootstrap.py``, trained
once per session, ~10 s) through their ``--set`` overrides. TRL is not in ``.venv``:
``trl_compare`` is smoked up to its TRL subprocess (``test_trl_compare.py``: the exported tokenizer
and the prompt rows; here: the refusal without the TRL environment).

Runtime on the shared 2-core build machine at load ~10: argument checks ~2 s; staleness (with the
session's bootstrap), default_race and bootstrap_seeds 17-23 s each, about half that when idle;
plan_memory's tiny case (slow: a spawned rank) ~20 s.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.stages.test_bootstrap import OVERRIDES as BOOTSTRAP_OVERRIDES

REPO = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# Module → the test that runs it at toy size (file in tests/bench :: test function).
SMOKES = {
    "actor": "test_bench_reports.py::test_actor_as_a_module",
    "algorithms": "test_bench_reports.py::test_algorithms",
    "bootstrap_seeds": "test_bench_smoke.py::test_bootstrap_seeds_trains_and_scores_one_cell",
    "chunks": "test_race.py::test_tiny_race_writes_results_and_resumes",  # trains, resumes and scores in chunks
    "default_race": "test_bench_smoke.py::test_default_race_runs_one_baseline",
    "gpu_step": "test_gpu_step.py::test_gpu_step_measures_every_component_against_the_plan",
    "grading": "test_bench_reports.py::test_grading",
    "logprobs_memory": "test_bench_reports.py::test_logprobs_memory",
    "methods": "test_methods_bench.py::test_depo_scenario_runs_two_arms_at_toy_size_and_resumes",
    "parallel": "test_bench_parallel.py::test_four_layouts_time_the_same_model",
    "plan_memory": "test_bench_smoke.py::test_plan_memory_writes_its_table",
    "race": "test_race.py::test_tiny_race_writes_results_and_resumes",
    "report": "test_bench_report_helper.py::test_save_round_trips_the_json_and_writes_a_real_png",
    "rollout": "test_bench_reports.py::test_rollout",
    "staleness": "test_bench_smoke.py::test_staleness_times_one_synchronous_run",
    "sync": "test_bench_sync.py::test_streamed_and_gather_sync_the_same_weights",
    "trl_compare": ("test_trl_compare.py::"
                    "test_every_prompt_row_encodes_to_winnows_prompt_ids_through_the_exported_tokenizer"),
}
# Modules with a command line (``report`` and ``chunks`` are helpers the others write and train with).
COMMANDS = sorted(set(SMOKES) - {"report", "chunks"})

# RL runs at toy size: a few short prompts, small groups, a 2-problem evaluation.
RL_OVERRIDES = ['data.train=["arith?difficulty=3&size=200"]', "prompts_per_step=4", "group_size=4",
                "max_new_tokens=24", "reward.num_workers=1", "eval_set=arith?difficulty=3&size=16", "eval_limit=2"]
# A bootstrap policy of its own for bootstrap_seeds (it trains into its --out): 3 steps of a 2-layer model.
TINY_BOOTSTRAP = ['sources=["arith?difficulty=1&size=60"]', "vocab_size=64", "model.hidden_size=32",
                  "model.ffn_hidden_size=64", "model.num_layers=2", "model.num_attention_heads=2",
                  "model.num_query_groups=2", "optim.total_steps=3", "optim.warmup_steps=1", "batch_size=8"]


def _bench_modules() -> set[str]:
    return {path.stem for path in (REPO / "tools" / "bench").glob("*.py") if path.stem != "__init__"}


def _sets(overrides) -> list[str]:
    return [word for override in overrides for word in ("--set", override)]


def _rl_sets(cache: Path) -> list[str]:
    return _sets([*(f"bootstrap.{o}" for o in BOOTSTRAP_OVERRIDES), f"bootstrap.cache_dir={cache}", *RL_OVERRIDES])


def _run_module(name: str, *args: str, timeout_s: float = 240.0) -> subprocess.CompletedProcess:
    completed = subprocess.run([sys.executable, "-m", f"tools.bench.{name}", *args], cwd=REPO, capture_output=True,
                               text=True, timeout=timeout_s)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed


def test_every_bench_module_has_a_smoke_run():
    assert set(SMOKES) == _bench_modules(), "add the new module's toy run to SMOKES"
    for module, test in SMOKES.items():
        file, function = test.split("::")
        assert f"def {function}(" in (REPO / "tests" / "bench" / file).read_text(), (module, test)


@pytest.mark.parametrize("name", COMMANDS)
def test_the_command_line_parses(name, capsys):
    module = importlib.import_module(f"tools.bench.{name}")
    with pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code == 0
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize(("name", "argv", "message"), [
    ("staleness", ["--steps", "2"], "--steps must be at least 3"),
    ("staleness", ["--set", "bootstrap.model.hidden_sise=32"], "unknown option bootstrap.model.hidden_sise"),
    ("default_race", ["--methods", "ppo"], "invalid choice"),
    ("default_race", ["--set", "prompts_per_step=0"], "prompts_per_step"),
    ("bootstrap_seeds", ["--eval-samples", "4"], "--eval-samples ≥ 8"),
    ("bootstrap_seeds", ["--set", "model.num_layer=2"], "unknown option model.num_layer"),
    ("race", ["--seeds", "0"], "--seeds: need at least 1"),
    ("trl_compare", ["--steps-per-round", "1"], "--steps-per-round ≥ 2"),
])
def test_bad_arguments_stop_before_any_work(name, argv, message, capsys):
    module = importlib.import_module(f"tools.bench.{name}")
    with pytest.raises(SystemExit) as exit_:
        module.parse_args(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_trl_compare_refuses_to_start_without_the_trl_environment(tmp_path):
    from tools.bench import trl_compare

    with pytest.raises(SystemExit, match="create the TRL venv"):
        trl_compare.main(["--trl-python", str(tmp_path / "no-venv" / "python"), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()  # refused before the bootstrap and the export


def test_staleness_times_one_synchronous_run(tmp_path, bootstrap_cache_dir):
    out = tmp_path / "staleness"
    _run_module("staleness", "--seeds", "1", "--steps", "3", "--variants", "sync", "--eval-limit", "2",
                "--eval-samples", "1", "--out", str(out), *_rl_sets(bootstrap_cache_dir))
    assert (out / "staleness.png").read_bytes()[:8] == PNG_SIGNATURE
    report = json.loads((out / "staleness.json").read_text())
    (run,) = report["results"]["runs"]
    assert (run["variant"], run["seed"]) == ("sync", 0)
    assert run["step_seconds"] > 0 and 0.0 <= run["pass_at_1"] <= 1.0
    assert report["results"]["summary"]["sync"]["step_seconds"]["n"] == 1
    assert (out / "runs" / "sync-seed0.json").is_file()  # what a rerun reuses


def test_default_race_runs_one_baseline(tmp_path, bootstrap_cache_dir):
    out = tmp_path / "default_race"
    # The race trains on its own pool: its data.train comes after --set's and wins.
    _run_module("default_race", "--methods", "grpo_raw", "--seeds", "1", "--steps", "1", "--eval-every", "1",
                "--pool-per-level", "2", "--heldout-per-level", "2", "--eval-samples", "1", "--out", str(out),
                *_rl_sets(bootstrap_cache_dir))
    assert len((out / "pool.jsonl").read_text().splitlines()) == 2 * 4  # 2 problems of each difficulty 2-5
    report = json.loads((out / "default_race.json").read_text())
    assert report["summary"]["best_baseline"] == "grpo_raw"
    curve = report["runs"]["grpo_raw"]["0"]["curve"]
    assert [point["step"] for point in curve] == [0, 1] and curve[1]["tokens_generated"] > 0
    assert report["runs"]["grpo_raw"]["0"]["curation_tokens"] == 0


def test_bootstrap_seeds_trains_and_scores_one_cell(tmp_path):
    out = tmp_path / "bootstrap_seeds"
    _run_module("bootstrap_seeds", "--seeds", "0", "--kernels", "default", "--eval-set", "arith?difficulty=3&size=16",
                "--eval-prompts", "2", "--eval-samples", "8", "--threads", "1", "--out", str(out),
                *_sets(TINY_BOOTSTRAP))
    report = json.loads((out / "bootstrap_seeds.json").read_text())
    (cell,) = report["cells"]
    assert (cell["seed"], cell["kernel"]) == (0, "default")
    assert 0.0 <= cell["pass@1"] <= cell["pass@8"] <= 1.0 and cell["final_loss_mean"] > 0
    assert json.loads((out / "cells" / "seed0_default.json").read_text()) == cell


@pytest.mark.slow  # a spawned rank importing megatron, ~10 s idle and over 20 s at load ~10
def test_plan_memory_writes_its_table(tmp_path):
    out = tmp_path / "plan_memory"
    completed = _run_module("plan_memory", "--cases", "tiny", "--out", str(out))
    report = json.loads((out / "plan_memory.json").read_text())
    (result,) = report["results"]
    assert result["case"]["name"] == "tiny" and [row["rank"] for row in result["ranks"]] == [0]  # TP = PP = 1
    assert report["within_tolerance"] is True
    assert "every measured component within" in completed.stdout
