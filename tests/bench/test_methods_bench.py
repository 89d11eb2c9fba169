"""The per-mechanism benchmarks (``tools.bench.methods``): their metrics by hand, the FLOPs estimate of a step
whose row has no count, the oracle and band pools, the argument checks, and a toy DEPO run that resumes.

Runtime: everything but the toy run well under a second; the toy run (the session's tiny bootstrap,
GRPO and DEPO with the offline estimator, 1 seed x 2 steps, then a resumed rerun) ~20 s on 2 cores.
"""

from __future__ import annotations

import json
import math
import types

import pytest

from tools.bench import methods

CURVE = [(0.0, 0.2), (10.0, 0.4), (20.0, 0.5)]


# --------------------------------------------------------------------------- metrics by hand


def test_area_is_the_trapezoid_over_the_budget():
    # (0.2 + 0.4)/2·10 + (0.4 + 0.5)/2·10 = 3 + 4.5 over 20 FLOPs.
    assert methods.area_under_curve(CURVE, 20.0) == pytest.approx(0.375)
    # Cut at 15: the score there is 0.45 (halfway from 0.4 to 0.5): (3 + (0.4 + 0.45)/2·5)/15.
    assert methods.area_under_curve(CURVE, 15.0) == pytest.approx((3 + 2.125) / 15)
    # A curve ending at 20 of a 30-FLOP budget keeps its last score to the budget: (3 + 4.5 + 0.5·10)/30.
    assert methods.area_under_curve(CURVE, 30.0) == pytest.approx(12.5 / 30)


def test_cut_at_budget_interpolates_and_marks_a_short_curve():
    assert methods.cut_at_budget(CURVE, 15.0) == ([(0.0, 0.2), (10.0, 0.4), (15.0, pytest.approx(0.45))], True)
    assert methods.cut_at_budget(CURVE, 20.0) == ([*CURVE], True)
    assert methods.cut_at_budget(CURVE, 25.0) == ([*CURVE, (25.0, 0.5)], False)
    with pytest.raises(ValueError, match="step-0 point"):
        methods.cut_at_budget(CURVE[1:], 20.0)
    with pytest.raises(ValueError, match="decrease"):
        methods.cut_at_budget([(0.0, 0.2), (10.0, 0.3), (5.0, 0.4)], 20.0)


def test_flops_to_reach_interpolates_between_evaluations():
    assert methods.flops_to_reach(CURVE, 0.45, 20.0) == pytest.approx(15.0)  # halfway from (10, 0.4) to (20, 0.5)
    assert methods.flops_to_reach(CURVE, 0.3, 20.0) == pytest.approx(5.0)
    assert methods.flops_to_reach(CURVE, 0.2, 20.0) == 0.0  # the base already reaches it
    assert methods.flops_to_reach(CURVE, 0.6, 20.0) is None  # never reached
    assert methods.flops_to_reach(CURVE, 0.48, 15.0) is None  # reached only after the budget (0.45 at 15)
    assert methods.flops_to_reach(CURVE, 0.5, 30.0) == pytest.approx(20.0)  # not moved by the flat extension


def test_half_gain_target_and_drop_from_peak():
    assert methods.half_gain_target(0.3, [0.4, 0.5]) == pytest.approx(0.375)  # 0.3 + (0.45 − 0.3)/2
    assert methods.drop_from_peak([(0.0, 0.3), (10.0, 0.5), (20.0, 0.4)], 20.0) == pytest.approx(0.1)
    assert methods.drop_from_peak(CURVE, 20.0) == 0.0


def test_bootstrap_interval_over_seeds():
    constant = methods.bootstrap_interval([0.1] * 6)
    assert constant == pytest.approx({"mean": 0.1, "low": 0.1, "high": 0.1, "n": 6})
    # Two seeds: resampled means are 0, 0.5 and 1 with probabilities 1/4, 1/2, 1/4, so the 95% interval is [0, 1].
    assert methods.bootstrap_interval([0.0, 1.0]) == pytest.approx({"mean": 0.5, "low": 0.0, "high": 1.0, "n": 2})
    consistent = methods.bootstrap_interval([0.10, 0.12, 0.09, 0.11, 0.10, 0.10])
    assert consistent["mean"] == pytest.approx(0.62 / 6) and 0.09 < consistent["low"] < consistent["mean"] < \
        consistent["high"] < 0.12
    assert consistent == methods.bootstrap_interval([0.10, 0.12, 0.09, 0.11, 0.10, 0.10])  # seeded
    assert methods.bootstrap_interval([0.3]) == {"mean": 0.3, "low": None, "high": None, "n": 1}
    assert methods.bootstrap_interval([])["n"] == 0


def test_paired_uses_seeds_both_arms_have():
    mine, theirs = {0: 0.5, 1: 0.6, 2: None, 3: 0.4}, {0: 0.4, 1: 0.4, 2: 0.3}
    result = methods.paired(mine, theirs)
    assert result["seeds"] == [0, 1] and result["mean"] == pytest.approx(0.15)
    ratio = methods.paired({0: 10.0, 1: 30.0}, {0: 20.0, 1: 0.0}, combine=methods.ratio)
    assert ratio["seeds"] == [0] and ratio["mean"] == pytest.approx(0.5)  # a baseline at 0 FLOPs has no ratio


def test_a_run_stops_at_the_budget_or_the_step_cap():
    assert methods.run_finished({"flops": 10.0, "step": 5}, budget=10.0, max_steps=100)
    assert methods.run_finished({"flops": 1.0, "step": 100}, budget=10.0, max_steps=100)
    assert not methods.run_finished({"flops": 9.9, "step": 99}, budget=10.0, max_steps=100)


# --------------------------------------------------------------------------- FLOPs from metrics rows


def _tiny_model(**changes):
    from pipeline.stats.flops import ForwardCost

    policy = ForwardCost(matmul_parameters=100, num_layers=1, attention_width=2)
    estimator = ForwardCost(matmul_parameters=50, num_layers=1, attention_width=2)
    fields = {"policy": policy, "prompt_tokens": 5.0, "estimator": estimator, "selects_samples": False,
              "question_forward": False, "reference_forward": False, **changes}
    return methods.StepFlopsModel(**fields)


ROW = {"ledger/groups": 2, "budget/samples_per_prompt_mean": 4.0, "ledger/tokens_generated": 24,
       "update/num_sequences": 6.0, "mismatch/mean_abs": 0.0, "depo/encoded_tokens": 10.0}


def test_a_step_without_a_count_is_estimated_from_its_row_by_hand():
    # 2 prompts of 5 tokens, 8 samples of 3 tokens (rows of 8); forward = 2·100·tokens + 4·1·2·pairs.
    flops = methods.estimate_step_flops(ROW, {}, _tiny_model())
    # Generation: 2 fed-back tokens at contexts 6 and 7: 2·100·2 + 8·13 = 504 a sample.
    assert flops["generation"] == pytest.approx(8 * 504)
    # Prefill: 5 tokens, 15 pairs: 1000 + 120 a prompt.
    assert flops["prefill"] == pytest.approx(2 * 1120)
    # Update: 6 kept rows of 8 tokens (36 pairs): forward 1600 + 288 = 1888, ×3; π_old's forward of the 6 once more.
    assert flops["update"] == pytest.approx(6 * 3 * 1888 + 6 * 1888)
    # Estimator: 10 tokens read, charged as training: 3 × 2·50 each.
    assert flops["estimator"] == pytest.approx(3000)
    # A sample selector computes π_old for all 8 pool samples; DEPO's distillation reads the prompts again;
    # the reference policy adds one more forward.
    more = methods.estimate_step_flops(ROW, {}, _tiny_model(selects_samples=True, question_forward=True,
                                                           reference_forward=True))
    assert more["prefill"] == pytest.approx(2 * 2 * 1120)
    assert more["update"] == pytest.approx(6 * 3 * 1888 + 2 * 8 * 1888)
    # The cumulative counters are differenced against the previous step's row.
    previous = {"ledger/groups": 2, "ledger/tokens_generated": 24, "depo/encoded_tokens": 10.0}
    later = methods.estimate_step_flops({**ROW, "ledger/groups": 4, "ledger/tokens_generated": 48,
                                         "depo/encoded_tokens": 20.0}, previous, _tiny_model())
    assert later == pytest.approx(flops)


def test_cumulative_flops_prefers_the_loops_own_count():
    model = _tiny_model()
    logged = {"flops/cumulative/total": 7.0, "flops/counted_from_step": 1, "flops/cumulative/generation": 1.0,
              "flops/cumulative/prefill": 2.0, "flops/cumulative/update": 3.0, "flops/cumulative/estimator": 1.0}
    rows = {1: {**ROW}, 2: {**ROW, "ledger/groups": 4, "ledger/tokens_generated": 48, "depo/encoded_tokens": 20.0,
                            **logged}}
    assert methods.cumulative_flops(rows, 2, model) == {"flops": 7.0, "flops_source": "logged",
                                                        "flops_generation": 1.0, "flops_prefill": 2.0,
                                                        "flops_update": 3.0, "flops_estimator": 1.0}
    one_step = sum(methods.estimate_step_flops(ROW, {}, model).values())
    rows[2]["flops/counted_from_step"] = 2  # counted only after a resume: not the run's total
    estimated = methods.cumulative_flops(rows, 2, model)
    assert estimated["flops_source"] == "estimated" and estimated["flops"] == pytest.approx(2 * one_step)


# --------------------------------------------------------------------------- pools


def _prompt(pid):
    return types.SimpleNamespace(id=pid, problem="What is 1 + 1?", metadata={})


def test_oracle_keeps_prompts_unlikely_to_give_an_all_equal_group():
    prompts = [_prompt(p) for p in ("solved", "half", "never", "unmeasured", "rare")]
    counts = {"solved": (8, 8), "half": (8, 4), "never": (8, 0), "rare": (8, 1)}
    # G = 4 of 8 samples: all equal with probability (C(c,4) + C(8−c,4))/C(8,4): 1, 2/70, 1 and 35/70 = 0.5.
    kept = methods.oracle_kept(prompts, counts, group_size=4, threshold=0.5)
    assert [p.id for p in kept] == ["half", "rare"]
    assert [p.id for p in methods.oracle_kept(prompts, counts, group_size=4, threshold=0.4)] == ["half"]


def test_band_is_reinforce_adas_curation_rule():
    prompts = [_prompt(p) for p in ("zero", "low", "edge", "above")]
    counts = {"zero": (16, 0), "low": (16, 1), "edge": (16, 6), "above": (16, 7)}  # 6/16 = 0.375
    assert [p.id for p in methods.band_kept(prompts, counts)] == ["low", "edge"]


def test_held_out_categories_are_level_and_operator():
    prompt = types.SimpleNamespace(problem="What is 74 - 89 * 50?", metadata={"difficulty": 4})
    assert methods.category_names(prompt) == ["d4", "mul"]
    prompt = types.SimpleNamespace(problem="What is 20 + 11?", metadata={"difficulty": 3})
    assert methods.category_names(prompt) == ["d3", "addsub"]


# --------------------------------------------------------------------------- summary


def _run(points, *, entropy_first=1.0, entropy_last=0.5, update=None, reached_budget=True):
    curve = []
    for index, (step, flops, pass1) in enumerate(points):
        point = {"step": step, "flops": flops, "pass@1": pass1, "pass@1[d3]": pass1, "pass@16": pass1 + 0.2,
                 "entropy": entropy_last if index == len(points) - 1 else None, "zero_variance_share": 0.5,
                 "prompts_filtered": 0, "flops_estimator": 0.0,
                 "flops_update": (update or {}).get(step, flops / 2)}
        curve.append(point)
    return {"curve": curve, "first_step_entropy": entropy_first, "reached_budget": reached_budget}


BASE = {"pass@1": 0.2, "pass@1[d3]": 0.2}
RESULTS = {
    "grpo": {0: _run([(0, 0.0, 0.2), (10, 10.0, 0.4), (20, 20.0, 0.5)]),
             1: _run([(0, 0.0, 0.2), (10, 10.0, 0.3), (20, 20.0, 0.3)])},
    "depo_oracle": {0: _run([(0, 0.0, 0.2), (10, 10.0, 0.5), (20, 20.0, 0.6)]),
                    1: _run([(0, 0.0, 0.2), (10, 10.0, 0.3), (20, 20.0, 0.5)])},
}


def test_summary_pairs_areas_and_flops_to_the_half_gain_target():
    scenario = methods.depo_scenario()
    summary = methods.summarize(scenario, RESULTS, base=BASE, budget=20.0)
    # GRPO at the budget: 0.5 and 0.3, mean 0.4; target 0.2 + (0.4 − 0.2)/2 = 0.3.
    assert summary["target_pass@1"] == pytest.approx(0.3)
    grpo, oracle = summary["arms"]["grpo"], summary["arms"]["depo_oracle"]
    assert grpo["area_per_seed"] == pytest.approx({0: 0.375, 1: 0.275})  # (3 + 4.5)/20 and (2.5 + 3)/20
    assert oracle["area_per_seed"] == pytest.approx({0: 0.45, 1: 0.325})  # (3.5 + 5.5)/20 and (2.5 + 4)/20
    versus = oracle["versus"]["grpo"]
    assert versus["area_difference"]["mean"] == pytest.approx((0.075 + 0.05) / 2)
    assert versus["area_difference"]["seeds"] == [0, 1]
    # To 0.3: GRPO at 5 (seed 0) and 10 (seed 1); the oracle at 10/3 and 10: ratios 2/3 and 1.
    assert grpo["flops_to_target"] == pytest.approx({0: 5.0, 1: 10.0})
    assert oracle["flops_to_target"] == pytest.approx({0: 10 / 3, 1: 10.0})
    assert versus["flops_to_target_ratio"]["mean"] == pytest.approx((2 / 3 + 1) / 2)
    assert versus["categories_difference"]["pass@1[d3]"]["mean"] == pytest.approx(0.15)
    assert "dapo" not in oracle["versus"]  # compared only with arms that ran
    table = methods.format_table(summary)
    assert "| depo_oracle | 2 | 0.3875 [" in table and "| grpo | +0.0625 [" in table
    assert "half-gain target 0.3000 (grpo)" in table


def test_without_a_gain_there_is_no_half_gain_target():
    flat = {"grpo": {0: _run([(0, 0.0, 0.2), (10, 10.0, 0.2)])},
            "depo_oracle": {0: _run([(0, 0.0, 0.2), (10, 10.0, 0.3)])}}
    summary = methods.summarize(methods.depo_scenario(), flat, base=BASE, budget=10.0)
    assert summary["target_pass@1"] is None
    assert summary["arms"]["depo_oracle"]["flops_to_target"] == {0: None}
    assert "half-gain target none (grpo did not gain" in methods.format_table(summary)


def test_scenario_judgements():
    e3 = {"grpo": {0: _run([(0, 0.0, 0.2), (10, 10.0, 0.4)], entropy_last=0.5)},
          "e3": {0: _run([(0, 0.0, 0.2), (10, 10.0, 0.4)], entropy_last=0.9)}}
    judged = methods.summarize(methods.e3_scenario(), e3, base=BASE, budget=10.0)["arms"]["e3"]["versus"]["grpo"]
    assert judged["judgement"]["entropy_kept_difference"]["mean"] == pytest.approx(0.4)
    assert judged["judgement"]["pass@16_difference"]["mean"] == pytest.approx(0.0)

    cw = {"grpo": {0: _run([(0, 0.0, 0.2), (10, 10.0, 0.5), (20, 20.0, 0.3)])},
          "cw_grpo": {0: _run([(0, 0.0, 0.2), (10, 10.0, 0.45), (20, 20.0, 0.4)])}}
    judged = methods.summarize(methods.cw_grpo_scenario(), cw, base=BASE, budget=20.0)
    drops = judged["arms"]["cw_grpo"]["versus"]["grpo"]["judgement"]
    assert drops["drop_from_peak"] == pytest.approx({0: 0.05}) and drops["drop_difference"]["mean"] == \
        pytest.approx(-0.15)

    # D³S runs more steps on the budget; equal steps compares step 20, GRPO's last.
    d3s = {"grpo_g32": {0: _run([(0, 0.0, 0.2), (10, 10.0, 0.4), (20, 20.0, 0.5)], update={10: 8.0, 20: 16.0})},
           "d3s_g32": {0: _run([(0, 0.0, 0.2), (10, 6.0, 0.35), (20, 12.0, 0.45), (30, 18.0, 0.5)],
                               update={10: 4.0, 20: 8.0, 30: 12.0}, reached_budget=False)}}
    summary = methods.summarize(methods.d3s_scenario(), d3s, base=BASE, budget=20.0)
    judged = summary["arms"]["d3s_g32"]["versus"]["grpo_g32"]["judgement"]
    assert judged["equal_step"] == {0: 20}
    assert judged["pass@1_difference_at_equal_step"]["mean"] == pytest.approx(-0.05)
    assert judged["update_flops_ratio_at_equal_step"]["mean"] == pytest.approx(0.5)
    assert summary["arms"]["d3s_g32"]["short_of_budget"] == [0]
    assert "| d3s_g32 | 1 (1 short) |" in methods.format_table(summary)


def test_the_summary_needs_the_target_baseline():
    with pytest.raises(ValueError, match="grpo"):
        methods.summarize(methods.depo_scenario(), {"depo_oracle": RESULTS["depo_oracle"]}, base=BASE, budget=20.0)


# --------------------------------------------------------------------------- command line


@pytest.mark.parametrize(("argv", "message"), [
    (["--scenario", "ppo"], "invalid choice"),
    (["--scenario", "depo", "--arms", "grpo", "depo_magic"], "are not arms of depo"),
    (["--scenario", "depo", "--max-steps", "50", "--eval-every", "15"], "must be a multiple of --eval-every"),
    (["--scenario", "e3", "--eval-samples", "8"], "scores pass@16, so it needs at least 16"),
    (["--scenario", "depo", "--measure-samples", "4"], "--measure-samples: depo_oracle needs P(all G = 8"),
    (["--scenario", "depo", "--flops-budget", "0"], "--flops-budget: need a positive"),
    (["--scenario", "depo", "--seeds", "0"], "--seeds: need at least 1"),
    (["--scenario", "cw_grpo", "--set", "optim.lrr=1e-3"], "--set (grpo)"),
])
def test_bad_arguments_stop_before_any_work(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        methods.parse_args(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_defaults_come_from_the_scenario(tmp_path):
    settings = methods.settings_from_args(methods.parse_args(["--scenario", "d3s", "--out", str(tmp_path)]))
    scenario = methods.d3s_scenario()
    assert settings.seeds == tuple(range(6)) and settings.arms == ("grpo_g32", "d3s_g32")
    assert (settings.flops_budget, settings.max_steps, settings.eval_every) == (
        scenario.flops_budget, scenario.max_steps, scenario.eval_every)
    assert settings.measure_samples is None  # no arm of D³S needs the measurement
    config = methods.arm_config(settings, scenario.arm("d3s_g32"), 3, train_file=tmp_path / "pool.jsonl", lr=1e-4)
    assert (config.group_size, config.seed, config.optim.lr, config.steps) == (32, 3, 1e-4, scenario.max_steps)
    assert config.data.train == [str(tmp_path / "pool.jsonl")]
    assert config.checkpoint.every_steps == scenario.eval_every and config.logging.log_every == 1
    stress = methods.cw_grpo_scenario().arm("cw_grpo_stress")
    assert methods.arm_config(settings, stress, 0, train_file=None).optim.lr == methods.CPU_STRESS_LR


def test_a_folder_refuses_runs_of_other_settings(tmp_path):
    args = ["--scenario", "depo", "--out", str(tmp_path)]
    methods.check_fingerprint(methods.settings_from_args(methods.parse_args(args)))
    methods.check_fingerprint(methods.settings_from_args(methods.parse_args([*args, "--seeds", "2"])))  # seeds add
    with pytest.raises(SystemExit, match="other settings \\(flops_budget\\)"):
        methods.check_fingerprint(methods.settings_from_args(methods.parse_args([*args, "--flops-budget", "1e12"])))


# --------------------------------------------------------------------------- toy run


def test_depo_scenario_runs_two_arms_at_toy_size_and_resumes(tmp_path, bootstrap_cache_dir):
    from tests.bench.test_bench_smoke import PNG_SIGNATURE, _rl_sets, _run_module

    out = tmp_path / "methods"
    argv = ["--scenario", "depo", "--arms", "grpo", "depo_offline", "--seeds", "1", "--max-steps", "2",
            "--eval-every", "1", "--flops-budget", "1e15", "--pool-per-level", "16", "--heldout-per-level", "3",
            "--measure-samples", "4", "--threads", "1", "--out", str(out), *_rl_sets(bootstrap_cache_dir)]
    first = _run_module("methods", *argv)
    assert "| depo_offline | 1 (1 short) |" in first.stdout
    assert (out / "depo.png").read_bytes()[:8] == PNG_SIGNATURE
    report = json.loads((out / "depo.json").read_text())
    grpo = report["results"]["runs"]["grpo"]["0"]
    assert [point["step"] for point in grpo["curve"]] == [0, 1, 2]
    assert 0 < grpo["curve"][1]["flops"] < grpo["curve"][2]["flops"] and not grpo["reached_budget"]
    assert {"pass@1", "pass@8", "pass@1[d3]", "pass@1[d5]"} <= set(grpo["curve"][2])
    offline = report["results"]["runs"]["depo_offline"]["0"]
    assert offline["pre_rl_flops"] > 0 and offline["curve"][2]["flops_estimator"] > 0
    assert report["results"]["summary"]["arms"]["depo_offline"]["versus"]["grpo"]["area_difference"]["n"] == 1

    # Stopped after training step 2, before scoring it: the rerun scores the checkpoint, trains nothing more.
    (out / "depo" / "results" / "grpo" / "seed0.json").unlink()
    curve_path = out / "depo" / "runs" / "grpo" / "seed0" / "curve.jsonl"
    curve_path.write_text("".join(curve_path.read_text().splitlines(keepends=True)[:2]))
    second = _run_module("methods", *argv)
    assert "depo_offline seed 0: reusing" in second.stdout and "grpo seed 0 step 2: pass@1" in second.stdout
    rerun = json.loads((out / "depo" / "results" / "grpo" / "seed0.json").read_text())
    assert [point["step"] for point in rerun["curve"]] == [0, 1, 2]
    assert math.isclose(rerun["curve"][2]["flops"], grpo["curve"][2]["flops"])
    assert rerun["curve"][2]["pass@1"] == grpo["curve"][2]["pass@1"]  # the same weights, the same sampling seed
