"""`winnow plan` and the plan check of `winnow launch`."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest

from pipeline.cli import build_parser, main
from pipeline.cli.plan import check_campaign_plan
from pipeline.errors import EXIT_USER_ERROR, UserError

FIXTURES = Path(__file__).resolve().parents[2] / "pipeline" / "models" / "published" / "configs"


def test_plan_prints_the_table_and_a_verdict(capsys):
    code = main(["plan", "--model", str(FIXTURES / "Qwen2.5-Math-7B.json"), "--preset", "d3s_qwen25_math_7b",
                 "--nodes", "2", "--rollout-nodes", "1", "--servers-per-node", "8"])
    out = capsys.readouterr().out
    assert code == 0
    for text in ("weights", "gradients", "optimizer", "log-prob head", "pipeline bubble", "SGLang", "context:",
                 "GPU-hours", "verdict: FITS", "layout: TP=4 PP=1 DP=4"):
        assert text in out


def test_plan_prints_the_rollout_clients_requests_in_flight(capsys):
    args = ["plan", "--model", str(FIXTURES / "Qwen2.5-Math-7B.json"), "--preset", "d3s_qwen25_math_7b",
            "--nodes", "2", "--rollout-nodes", "2", "--servers-per-node", "8"]
    assert main(args) == 0
    assert ("requests in flight: 16 servers × 256 = 4,096 sequences (rollout.max_running_requests_per_server)"
            in capsys.readouterr().out.splitlines())
    assert main([*args, "rollout.max_running_requests_per_server=128", "rollout.max_in_flight_sequences=1000"]) == 0
    assert ("requests in flight: 1,000 sequences (rollout.max_in_flight_sequences; 16 servers × 128 = 2,048 derived)"
            in capsys.readouterr().out.splitlines())
    assert main(args[:-4]) == 0  # no rollout servers: the local engine, no such line
    assert "requests in flight" not in capsys.readouterr().out


def test_plan_refuses_and_exits_1(capsys):
    code = main(["plan", "--model", str(FIXTURES / "Qwen2.5-Math-7B.json"), "--preset", "d3s_qwen25_math_7b",
                 "--nodes", "2", "--rollout-nodes", "1", "parallel.tensor_parallel=1"])
    out = capsys.readouterr().out
    assert code == 1
    # With the distributed optimizer (on by default at DP > 1) TP=2 already fits.
    assert "verdict: DOES NOT FIT" in out and "smallest fitting layout: TP=2 PP=1 DP=8" in out
    # Without rollout nodes rank 0 also holds the fp32 generator (28.4 GiB at 7.6B): TP=4 is the smallest.
    code = main(["plan", "--model", str(FIXTURES / "Qwen2.5-Math-7B.json"), "--preset", "d3s_qwen25_math_7b",
                 "--nodes", "2", "parallel.tensor_parallel=1"])
    out = capsys.readouterr().out
    assert code == 1 and "generator (fp32)     28.37" in out and "smallest fitting layout: TP=4 PP=1 DP=4" in out


def _launch_args(**changes) -> argparse.Namespace:
    """What `winnow launch` passes the check: the planner's flags at their defaults."""
    values = dict(gpu="h100", distributed_optimizer=None, recompute=None, prompt_tokens=None, mfu=0.35,
                  rollout_mfu=0.1, response_fraction=1.0, force=False, skip_plan_check=False)
    return argparse.Namespace(**{**values, **changes})


def _model_folder(tmp_path: Path, model: str = "Qwen2.5-Math-7B") -> Path:
    folder = tmp_path / model
    folder.mkdir()
    shutil.copy(FIXTURES / f"{model}.json", folder / "config.json")
    return folder


def test_launch_refuses_an_infeasible_campaign_unless_forced(tmp_path):
    from recipes.campaigns import h100_rl, qwen25_math_7b

    model_dir = _model_folder(tmp_path)
    too_big = h100_rl(model_dir=str(model_dir), tensor_parallel=1, max_new_tokens=3072)  # 7B at TP=1
    plan = qwen25_math_7b(output_dir=tmp_path / "run", model_dir=str(model_dir), rl=too_big)
    args = _launch_args(distributed_optimizer="off", recompute="none")
    printed: list[str] = []
    with pytest.raises(UserError, match="the plan refuses: rl-default"):
        check_campaign_plan(plan, args, out=printed.append)
    args.force = True
    check_campaign_plan(plan, args, out=printed.append)
    assert any("verdict: DOES NOT FIT" in text for text in printed)


@pytest.mark.parametrize(("override", "option"), [
    ("curate.max_new_tokens=4096", "curate.max_new_tokens"),
    ("evaluate-grpo.eval.max_new_tokens=4096", "evaluate-grpo.eval.max_new_tokens"),
])
def test_launch_refuses_a_curate_or_evaluate_stage_whose_new_tokens_fill_the_context(tmp_path, override, option):
    # Qwen2.5-Math-7B has 4,096 positions: 4,096 new tokens leave none for a prompt, and
    # curation and evaluation would drop every prompt as too long.
    from recipes.campaigns import qwen25_math_7b

    plan = qwen25_math_7b(output_dir=tmp_path / "run", model_dir=str(_model_folder(tmp_path))).with_overrides(
        [override])
    printed: list[str] = []
    expected = (f"the plan refuses: {option}: 4096 new tokens + a ~1024-token prompt exceed Qwen2.5-Math-7B's "
                f"4096 positions ({option} ≤ 3072 fits)")
    with pytest.raises(UserError) as refusal:
        check_campaign_plan(plan, _launch_args(), out=printed.append)
    assert str(refusal.value).startswith(expected) and "--force" in str(refusal.value)
    assert any(text.startswith(f"plan: {option.split('.')[0]}: context: ") and "DOES NOT FIT" in text
               for text in printed)
    check_campaign_plan(plan, _launch_args(force=True), out=printed.append)


def test_launch_refuses_a_plan_it_cannot_check_unless_told_to_skip(tmp_path):
    from recipes.campaigns import qwen25_math_7b

    absent = tmp_path / "absent"  # a folder only the cluster sees
    plan = qwen25_math_7b(output_dir=tmp_path / "run", model_dir=str(absent))
    printed: list[str] = []
    with pytest.raises(UserError) as refusal:
        check_campaign_plan(plan, _launch_args(force=True), out=printed.append)  # --force is for refusals
    message = str(refusal.value)
    for text in ("rl-default", "curate", "evaluate-grpo", f"{absent} does not exist", "--skip-plan-check",
                 "--model-dir"):
        assert text in message, message
    printed.clear()
    check_campaign_plan(plan, _launch_args(skip_plan_check=True), out=printed.append)
    assert sum("not checked" in text for text in printed) == 5  # curate, 2 × (rl, evaluate)
    assert "unchecked (--skip-plan-check)" in printed[-1]


def test_the_launch_command_has_the_skip_flag_and_exits_2_naming_it(tmp_path, capsys):
    args = ["launch", "campaign", "--recipe", "qwen25-math-7b", "--output-dir", str(tmp_path / "run"),
            "--model-dir", str(tmp_path / "absent"), "--dryrun"]
    assert build_parser().parse_args([*args, "--skip-plan-check"]).skip_plan_check is True
    assert main(args) == EXIT_USER_ERROR
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--skip-plan-check" in errors[0], errors
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_a_cpu_campaign_is_checked_on_its_bootstrap_policy_before_it_exists(tmp_path):
    from recipes.campaigns import cpu_tiny_campaign

    plan = cpu_tiny_campaign(output_dir=tmp_path)
    printed: list[str] = []
    check_campaign_plan(plan, _launch_args(), out=printed.append)
    checked = [text for text in printed if "context:" in text]
    generating = [stage.name for stage in plan.stages if stage.kind in ("rl", "curate", "evaluate")]
    assert len(checked) == len(generating) == 7 and all(text.endswith(": fits") for text in checked), printed
    assert all("of 128 positions (the bootstrap policy" in text for text in checked)
    # A CPU stage is refused like a GPU one: 128 new tokens fill the bootstrap policy's 128 positions.
    with pytest.raises(UserError, match=r"curate\.max_new_tokens: 128 new tokens \+ a ~32-token prompt exceed the "
                                        r"bootstrap policy's 128 positions \(curate\.max_new_tokens ≤ 96 fits\)"):
        check_campaign_plan(plan.with_overrides(["curate.max_new_tokens=128"]), _launch_args(), out=printed.append)


def test_plan_checks_a_recipes_curate_and_evaluate_context_too(capsys, monkeypatch):
    from recipes import campaigns

    model = str(FIXTURES / "Qwen2.5-Math-7B.json")
    assert main(["plan", "--model", model, "--recipe", "qwen25-math-7b"]) == 0
    out = capsys.readouterr().out
    assert "context: curate.max_new_tokens: ~1024 prompt + 3072 new = 4096 of 4096 positions" in out
    assert "context: evaluate-default.eval.max_new_tokens: " in out
    recipe = campaigns.CAMPAIGNS["qwen25-math-7b"]
    monkeypatch.setitem(campaigns.CAMPAIGNS, "qwen25-math-7b",
                        lambda **kwargs: recipe(**kwargs).with_overrides(["curate.max_new_tokens=4096"]))
    assert main(["plan", "--model", model, "--recipe", "qwen25-math-7b"]) == 1
    assert "refused: curate.max_new_tokens: 4096 new tokens" in capsys.readouterr().out


def test_a_stage_refuses_new_tokens_that_fill_its_policys_context_itself(tmp_path):
    """The stage's own pre-flight (run in the job, also after --skip-plan-check): max_new_tokens must leave
    a position for the prompt."""
    from pipeline.config import CurateConfig, EvalConfig, EvaluateConfig
    from pipeline.stages.preflight import PreflightError, preflight

    folder = _model_folder(tmp_path)
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(PreflightError) as refusal:
        preflight(CurateConfig(sources=["arith?difficulty=1&size=8"], policy=str(folder), max_new_tokens=4096,
                               output_dir=str(tmp_path / "c")))
    assert any(problem.startswith("max_new_tokens: 4096 new tokens leave no room for a prompt in the 4096 positions")
               for problem in refusal.value.problems), refusal.value.problems
    with pytest.raises(PreflightError) as refusal:
        preflight(EvaluateConfig(policy=str(folder), eval=EvalConfig(benchmarks=["arith?difficulty=1&size=8"],
                                                                     max_new_tokens=5000),
                                 output_dir=str(tmp_path / "e")))
    assert any(problem.startswith("eval.max_new_tokens: 5000 new tokens") for problem in refusal.value.problems)
    with pytest.raises(PreflightError) as refusal:  # the tokenizer is missing, the length is fine
        preflight(CurateConfig(sources=["arith?difficulty=1&size=8"], policy=str(folder), max_new_tokens=4095,
                               output_dir=str(tmp_path / "c")))
    assert not any(problem.startswith("max_new_tokens") for problem in refusal.value.problems)


def test_a_campaigns_overrides_reach_every_rl_stage():
    from pipeline.cli.plan import rl_jobs

    args = argparse.Namespace(recipe="cpu", preset=None, config=None, overrides=["steps=7"])
    jobs = rl_jobs(args)
    assert {name for name, _, _ in jobs} == {"rl-default", "rl-grpo", "rl-methods"}
    assert {cfg.steps for _, cfg, _ in jobs} == {7}
