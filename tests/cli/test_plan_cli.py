"""`winnow plan` and the plan check of `winnow launch`."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.cli.plan import check_campaign_plan
from pipeline.errors import UserError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "model_configs"


def test_plan_prints_the_table_and_a_verdict(capsys):
    code = main(["plan", "--model", str(FIXTURES / "Qwen2.5-Math-7B.json"), "--preset", "d3s_qwen25_math_7b",
                 "--nodes", "2", "--rollout-nodes", "1", "--servers-per-node", "8"])
    out = capsys.readouterr().out
    assert code == 0
    for text in ("weights", "gradients", "optimizer", "log-prob head", "pipeline bubble", "SGLang", "context:",
                 "GPU-hours", "verdict: FITS", "layout: TP=4 PP=1 DP=4"):
        assert text in out


def test_plan_refuses_and_exits_1(capsys):
    code = main(["plan", "--model", str(FIXTURES / "Qwen2.5-Math-7B.json"), "--preset", "d3s_qwen25_math_7b",
                 "--nodes", "2", "parallel.tensor_parallel=1"])
    out = capsys.readouterr().out
    assert code == 1
    # With the distributed optimizer (on by default at DP > 1) TP=2 already fits.
    assert "verdict: DOES NOT FIT" in out and "smallest fitting layout: TP=2 PP=1 DP=8" in out


def test_launch_refuses_an_infeasible_campaign_unless_forced(tmp_path):
    from recipes.campaigns import h100_rl, qwen25_math_7b

    model_dir = tmp_path / "Qwen2.5-Math-7B"
    model_dir.mkdir()
    shutil.copy(FIXTURES / "Qwen2.5-Math-7B.json", model_dir / "config.json")
    too_big = h100_rl(model_dir=str(model_dir), tensor_parallel=1, max_new_tokens=3072)  # 7B at TP=1
    plan = qwen25_math_7b(output_dir=tmp_path / "run", model_dir=str(model_dir), rl=too_big)
    args = argparse.Namespace(gpu="h100", distributed_optimizer="off", recompute="none", prompt_tokens=1024,
                              mfu=0.35, rollout_mfu=0.1, response_fraction=1.0, force=False)
    printed: list[str] = []
    with pytest.raises(UserError, match="the plan refuses: rl-default"):
        check_campaign_plan(plan, args, out=printed.append)
    args.force = True
    check_campaign_plan(plan, args, out=printed.append)
    assert any("verdict: DOES NOT FIT" in text for text in printed)


def test_launch_skips_the_check_when_the_model_is_only_on_the_cluster(tmp_path):
    from recipes.campaigns import qwen25_math_7b

    plan = qwen25_math_7b(output_dir=tmp_path / "run", model_dir=str(tmp_path / "absent"))
    args = argparse.Namespace(gpu="h100", distributed_optimizer="off", recompute="none", prompt_tokens=1024,
                              mfu=0.35, rollout_mfu=0.1, response_fraction=1.0, force=False)
    printed: list[str] = []
    check_campaign_plan(plan, args, out=printed.append)
    assert printed and all("not checked" in text for text in printed)


def test_a_campaigns_overrides_reach_every_rl_stage():
    from pipeline.cli.plan import rl_jobs

    args = argparse.Namespace(recipe="cpu", preset=None, config=None, overrides=["steps=7"])
    jobs = rl_jobs(args)
    assert {name for name, _, _ in jobs} == {"rl-default", "rl-grpo", "rl-methods"}
    assert {cfg.steps for _, cfg, _ in jobs} == {7}
