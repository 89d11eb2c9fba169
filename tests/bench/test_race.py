"""The sample-efficiency race: its ratio math by hand, and a tiny end-to-end race that resumes.

Runtime: the summary/argument tests take well under a second; the tiny race (tiny bootstrap,
2 RL methods + more SFT x 1 seed x 2 steps, then a resumed rerun) ~40-60 s on 2 cores (slow).
"""

from __future__ import annotations

import json

import pytest

from tests.distributed_utils import run_distributed
from tests.stages.test_bootstrap import OVERRIDES as BOOTSTRAP_OVERRIDES
from tools.bench import race, trl_compare


def _point(step, pass1, tokens, gradient_tokens, wall, pass8=None):
    point = {"step": step, "steps": step, "pass@1": pass1, "tokens_generated": tokens,
             "tokens_with_gradient": gradient_tokens, "wall_s": wall}
    if pass8 is not None:
        point["pass@8"] = pass8
    return point


def _run(curve, *, first_step_entropy=None, final_entropy=None):
    if final_entropy is not None:
        curve[-1]["entropy"] = final_entropy
    return {"curve": curve, "final": curve[-1], "first_step_entropy": first_step_entropy}


RESULTS = {
    "grpo_cpu": {
        0: _run([_point(0, 0.30, 0, 0, 0.0), _point(10, 0.40, 1000, 500, 10.0),
                 _point(20, 0.50, 2000, 1000, 20.0, pass8=0.80)], first_step_entropy=0.50, final_entropy=0.25),
        1: _run([_point(0, 0.30, 0, 0, 0.0), _point(10, 0.45, 1100, 550, 12.0),
                 _point(20, 0.60, 2200, 1100, 24.0, pass8=0.90)], first_step_entropy=0.40, final_entropy=0.30),
    },
    "d3s_cpu": {
        0: _run([_point(0, 0.30, 0, 0, 0.0), _point(10, 0.56, 800, 200, 9.0),
                 _point(20, 0.58, 1600, 400, 18.0, pass8=0.88)]),
        1: _run([_point(0, 0.30, 0, 0, 0.0), _point(10, 0.50, 900, 300, 10.0),
                 _point(20, 0.52, 1800, 600, 20.0, pass8=0.72)]),
    },
    "more_sft": {
        0: _run([_point(0, 0.30, None, 0, 0.0), _point(50, 0.47, None, 5000, 20.0, pass8=0.70)]),
    },
}


def test_summary_ratios_match_hand_computed_values():
    summary = race.summarize(RESULTS, target=0.45)
    d3s = summary["methods"]["d3s_cpu"]
    # GRPO reaches 0.45 at step 20 (seed 0) and step 10 (seed 1); D³S at step 10 on both seeds.
    assert d3s["reached"] == 2
    assert d3s["to_target"]["steps"]["ratio"] == pytest.approx({"mean": 0.75, "min": 0.5, "max": 1.0, "n": 2})
    tokens = d3s["to_target"]["tokens_generated"]["ratio"]
    assert tokens["mean"] == pytest.approx((800 / 2000 + 900 / 1100) / 2)
    assert (tokens["min"], tokens["max"]) == pytest.approx((0.4, 900 / 1100))
    assert d3s["to_target"]["tokens_with_gradient"]["ratio"]["mean"] == pytest.approx((200 / 1000 + 300 / 550) / 2)
    assert d3s["to_target"]["wall_s"]["ratio"]["mean"] == pytest.approx((9 / 20 + 10 / 12) / 2)
    assert d3s["to_target"]["wall_s"]["value"] == pytest.approx({"mean": 9.5, "min": 9.0, "max": 10.0, "n": 2})
    assert d3s["final"]["pass@1"]["ratio"]["mean"] == pytest.approx((0.58 / 0.50 + 0.52 / 0.60) / 2)
    assert d3s["final"]["pass@8"]["ratio"] == pytest.approx({"mean": 0.95, "min": 0.8, "max": 1.1, "n": 2})
    grpo = summary["methods"]["grpo_cpu"]
    assert all(grpo["to_target"][key]["ratio"]["mean"] == pytest.approx(1.0) for key in race.COST_KEYS)
    # Entropy kept: the last window's mean over the first step's, per seed (0.25/0.50 and 0.30/0.40).
    assert grpo["entropy_retained"] == pytest.approx({"mean": 0.625, "min": 0.5, "max": 0.75, "n": 2})
    assert d3s["entropy_retained"]["n"] == 0  # no entropy recorded: no ratio, not a zero
    sft = summary["methods"]["more_sft"]
    assert sft["to_target"]["tokens_generated"]["ratio"]["n"] == 0  # SFT generates no rollouts
    assert sft["to_target"]["wall_s"]["ratio"] == pytest.approx({"mean": 1.0, "min": 1.0, "max": 1.0, "n": 1})
    assert sft["to_target"]["tokens_with_gradient"]["per_seed"] == {0: 5000}
    table = race.format_table(summary)
    assert "0.75× [0.50–1.00]" in table and "1/1" in table
    assert table.splitlines()[2].endswith("0.62× [0.50–0.75]")  # GRPO's row ends with its entropy kept


def test_default_target_is_grpo_final_mean_and_unreached_seeds_have_no_ratio():
    summary = race.summarize(RESULTS)
    assert summary["target_pass@1"] == pytest.approx(0.55)
    d3s, grpo = summary["methods"]["d3s_cpu"], summary["methods"]["grpo_cpu"]
    assert (grpo["reached"], d3s["reached"]) == (1, 1)  # GRPO seed 1 (0.60), D³S seed 0 (0.56)
    # Seed 0: GRPO never reaches 0.55; seed 1: D³S never does — no seed has both.
    assert d3s["to_target"]["steps"]["per_seed"] == {0: 10, 1: None}
    assert d3s["to_target"]["steps"]["ratio"]["n"] == 0
    assert "—" in race.format_table(summary)


def test_summary_requires_the_baseline():
    with pytest.raises(ValueError, match="grpo_cpu"):
        race.summarize({"d3s_cpu": RESULTS["d3s_cpu"]})


def test_method_names_come_from_the_recipe_registry():
    from recipes.cpu import RECIPES

    names = race.method_names(None)
    assert names[0] == race.BASELINE and names[-1] == race.MORE_SFT
    assert set(names) == {*RECIPES, race.MORE_SFT}
    assert race.method_names(["more_sft", "d3s_cpu", "grpo_cpu"]) == ["grpo_cpu", "d3s_cpu", "more_sft"]
    with pytest.raises(ValueError, match="must include grpo_cpu"):
        race.method_names(["d3s_cpu"])
    with pytest.raises(ValueError, match="unknown"):
        race.method_names(["grpo_cpu", "no_such_recipe"])


def test_each_recipe_keeps_its_own_group_size_unless_the_race_sets_one(tmp_path):
    own = race.RaceSettings(out=tmp_path)
    assert [race.method_config(m, 0, own).group_size for m in ("grpo_n4_cpu", "grpo_cpu", "grpo_n16_cpu")] == [4, 8, 16]
    forced = race.RaceSettings(out=tmp_path, group_size=8)
    assert race.method_config("grpo_n4_cpu", 0, forced).group_size == 8


def test_command_lines_parse():
    args = race.parse_args(["--methods", "grpo_cpu", "d3s_cpu", "--seeds", "2", "--steps", "20",
                            "--eval-prompts", "600", "--eval-samples", "16", "--out", "x", "--set", "optim.lr=1e-3"])
    assert (args.methods, args.seeds, args.steps, args.eval_prompts, args.eval_samples, args.out, args.overrides) == (
        ["grpo_cpu", "d3s_cpu"], 2, 20, 600, 16, "x", ["optim.lr=1e-3"])
    args = trl_compare.parse_args(["--rounds", "2", "--steps-per-round", "3", "--eval-prompts", "0"])
    assert (args.rounds, args.steps_per_round, args.prompts, args.group_size, args.new_tokens) == (2, 3, 16, 8, 48)
    with pytest.raises(SystemExit):
        trl_compare.parse_args(["--steps-per-round", "1"])  # its only step would be dropped


def test_trl_round_comparison_drops_each_rounds_first_step():
    winnow = [[{"total": 9.0, "update": 9.0}, {"total": 1.0, "update": 0.6}, {"total": 3.0, "update": 2.0}]]
    trl = [[{"total": 9.0, "generate": 1.0, "reward": 0.5}, {"total": 4.0, "generate": 2.0, "reward": 1.0},
            {"total": 4.0, "generate": 2.0, "reward": 1.0}]]
    result = trl_compare.compare_rounds(winnow, trl)
    assert (result["winnow_step_s"], result["trl_step_s"], result["ratio"]) == (2.0, 4.0, 0.5)
    assert result["per_round_ratio"] == [0.5] and result["num_steps_each"] == 2
    assert (result["winnow_best_step_s"], result["trl_best_step_s"], result["best_ratio"]) == (1.0, 4.0, 0.25)
    assert result["trl_phases_s"] == {"generate": 2.0, "reward": 1.0, "loss+backward+optimizer": 1.0}
    assert result["winnow_phases_s"] == {"update": 1.3}


# ----------------------------------------------------------------------------- tiny end-to-end race

RL_OVERRIDES = [
    'data.train=["arith?difficulty=3&size=200"]', "prompts_per_step=4", "max_new_tokens=24", "optim.lr=1e-3",
    "reward.num_workers=1", "eval_set=arith?difficulty=3&size=16",
]


def _race_worker(rank, world_size, tmp):
    from pathlib import Path

    from pipeline.parallel.context import ParallelContext

    settings = race.RaceSettings(
        out=Path(tmp) / "race", steps=2, group_size=4, eval_every=1, eval_set="arith?difficulty=3&size=100",
        eval_prompts=12, eval_samples=2,
        overrides=(*[f"bootstrap.{o}" for o in BOOTSTRAP_OVERRIDES], f"bootstrap.cache_dir={tmp}/cache",
                   *RL_OVERRIDES),
    )
    context = ParallelContext.initialize(tensor_parallel=1, pipeline_parallel=1, seed=0)
    logs: list[str] = []
    methods = ["d3s_cpu", "grpo_cpu", "more_sft"]
    first = race.run_race(settings, methods=methods, seeds=[0], context=context, log=logs.append)
    report = json.loads((settings.out / "race.json").read_text())
    second = race.run_race(settings, methods=methods, seeds=[0], context=context, log=logs.append)
    return first, second, report, logs


@pytest.mark.slow
def test_tiny_race_writes_results_and_resumes(tmp_path):
    first, second, report, logs = run_distributed(_race_worker, world_size=1, args=(str(tmp_path),),
                                                  timeout_s=300)[0]
    assert report["settings"]["methods"] == ["grpo_cpu", "d3s_cpu", "more_sft"]
    for method in ("grpo_cpu", "d3s_cpu"):
        curve = report["runs"][method]["0"]["curve"]
        assert [point["step"] for point in curve] == [0, 1, 2]
        assert curve[0]["tokens_generated"] == 0 and curve[0]["wall_s"] == 0.0
        assert 0 < curve[1]["tokens_generated"] < curve[2]["tokens_generated"]
        assert 0 < curve[1]["wall_s"] < curve[2]["wall_s"]
        assert all(0.0 <= point["pass@1"] <= 1.0 and "pass@8" not in point for point in curve)  # 2 samples
        assert curve[0]["entropy"] is None and all(point["entropy"] > 0 for point in curve[1:])
        assert report["runs"][method]["0"]["first_step_entropy"] == pytest.approx(curve[1]["entropy"])  # 1-step window
        assert (tmp_path / "race" / "results" / method / "seed0.json").is_file()
    # D³S keeps 2 of 4 samples at the start: fewer tokens carry gradient than GRPO's at equal rollouts.
    d3s_final, grpo_final = report["runs"]["d3s_cpu"]["0"]["final"], report["runs"]["grpo_cpu"]["0"]["final"]
    assert d3s_final["tokens_with_gradient"] < d3s_final["tokens_generated"]
    # Every method starts from the same base policy, scored once.
    assert len({report["runs"][m]["0"]["curve"][0]["pass@1"] for m in report["runs"]}) == 1
    sft = report["runs"]["more_sft"]["0"]["curve"]
    assert [point["tokens_generated"] for point in sft] == [None, None, None]
    grpo_walls = [point["wall_s"] for point in report["runs"]["grpo_cpu"]["0"]["curve"]]
    assert all(sft_point["wall_s"] >= wall for sft_point, wall in zip(sft[1:], grpo_walls[1:]))
    assert sft[-1]["tokens_with_gradient"] > 0
    summary = report["summary"]
    assert summary["target_pass@1"] == pytest.approx(grpo_final["pass@1"])
    assert summary["methods"]["grpo_cpu"]["final"]["pass@1"]["ratio"]["mean"] in (None, pytest.approx(1.0))
    assert (tmp_path / "race" / "race.png").stat().st_size > 0
    assert second == first  # the rerun reused every result file
    assert sum("reusing" in line for line in logs) == 3
