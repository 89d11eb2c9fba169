"""The default race's cost math by hand (curation charged, best baseline as target), and the
bootstrap seed study's kernel switch and loss milestones. All well under a second."""

from __future__ import annotations

import json

import pytest

from tools.bench import bootstrap_seeds, default_race


def _run(points, *, curation_tokens=0, zero_share=0.5, bounds=()):
    curve = [{"step": step, "pass@1": pass1, "pass@8": pass1 + 0.2, "tokens_generated": tokens}
             for step, pass1, tokens in points]
    return {"curve": curve, "final": curve[-1], "curation_tokens": curation_tokens,
            "summary": {"zero_variance_share": zero_share, "prompts_filtered": 0, "e3_bounds": list(bounds)}}


RESULTS = {
    "grpo_raw": {0: _run([(0, 0.3, 0), (10, 0.40, 1000), (20, 0.44, 2000)]),
                 1: _run([(0, 0.3, 0), (10, 0.42, 1000), (20, 0.46, 2000)])},
    # Curation costs 5,000 tokens; its RL reaches the target sooner in rollout tokens, not in total.
    "grpo_curated": {0: _run([(0, 0.3, 0), (10, 0.50, 800), (20, 0.52, 1600)], curation_tokens=5000),
                     1: _run([(0, 0.3, 0), (10, 0.47, 800), (20, 0.50, 1600)], curation_tokens=5000)},
    "depo_e3_d3s_cw_raw": {0: _run([(0, 0.3, 0), (10, 0.45, 700), (20, 0.51, 1400)], zero_share=0.25,
                                   bounds=[(8, 8), (6, 10)]),
                           1: _run([(0, 0.3, 0), (10, 0.52, 700), (20, 0.53, 1400)], zero_share=0.75)},
}


def test_target_is_the_best_baseline_and_cost_includes_curation():
    summary = default_race.summarize(RESULTS)
    assert summary["best_baseline"] == "grpo_curated"
    assert summary["target_pass@1"] == pytest.approx(0.51)
    curated = summary["methods"]["grpo_curated"]
    # Seed 0 reaches 0.51 at step 20 (5,000 + 1,600); seed 1 never does (0.50).
    assert curated["tokens_to_target"]["per_seed"] == {0: 6600, 1: None} and curated["reached"] == 1
    candidate = summary["methods"]["depo_e3_d3s_cw_raw"]
    assert candidate["tokens_to_target"]["per_seed"] == {0: 1400, 1: 700}
    # Only seed 0 has a paired ratio (the baseline's seed 1 never reached the target).
    assert candidate["tokens_to_target"]["ratio"] == pytest.approx({"mean": 1400 / 6600, "min": 1400 / 6600,
                                                                   "max": 1400 / 6600, "n": 1})
    assert candidate["zero_variance_share"]["mean"] == pytest.approx(0.5)
    assert summary["methods"]["grpo_raw"]["reached"] == 0
    assert summary["methods"]["grpo_raw"]["total_tokens_end"]["mean"] == 2000
    table = default_race.format_table(summary)
    assert "| grpo_curated | 0.510 [0.500–0.520] | 1/2 | 6,600 | 1.00 | 5,000 |" in table
    assert "[8, 8] → [6, 10]" in table


def test_race_arguments():
    assert default_race.parse_args([]).methods == list(default_race.METHODS)
    assert default_race.parse_args(["--methods", "depo_d3s_cw_raw", "--seeds", "2"]).seeds == 2
    with pytest.raises(SystemExit):
        default_race.parse_args(["--methods", "ppo"])


def test_campaign_tokens_charge_the_online_estimator_and_the_curation(tmp_path):
    run = _run([(0, 0.3, 0), (10, 0.4, 1000), (20, 0.5, 2000)], curation_tokens=300)
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": step, "depo/encoded_tokens": encoded}) + "\n" for step, encoded in ((10, 70), (20, 150))))
    default_race.add_encoded_tokens(run, tmp_path, filters_with_depo=True)
    assert [point["tokens_encoded"] for point in run["curve"]] == [0, 70, 150]
    assert default_race.campaign_tokens(run["final"], run) == 2000 + 150 + 300
    plain = _run([(0, 0.3, 0), (10, 0.4, 1000)])
    default_race.add_encoded_tokens(plain, tmp_path / "absent", filters_with_depo=False)
    assert default_race.campaign_tokens(plain["final"], plain) == 1000
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 10, "depo/encoded_tokens": 70}) + "\n")
    with pytest.raises(SystemExit, match="no depo/encoded_tokens at step 20"):
        default_race.add_encoded_tokens(_run([(0, 0.3, 0), (20, 0.5, 2000)]), tmp_path, filters_with_depo=True)


def test_flops_beside_tokens_from_the_runs_own_count_plus_the_curation(tmp_path):
    run = _run([(0, 0.3, 0), (10, 0.4, 1000), (20, 0.5, 2000)], curation_tokens=300)
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": step, "flops/cumulative/total": flops}) + "\n" for step, flops in ((10, 4e12), (20, 9e12))))
    default_race.add_flops(run, tmp_path)
    assert [point["flops"] for point in run["curve"]] == [0.0, 4e12, 9e12]
    # The curation's generation at the demo policy's 843,776 matmul weights (2·N per generated token).
    assert default_race.curation_flops({"num_generated_tokens": 100}) == 100 * 2 * 843_776
    run["curation_flops"] = 5e11
    assert default_race.campaign_flops(run["final"], run) == 9.5e12
    old = _run([(0, 0.3, 0), (10, 0.4, 1000)])
    default_race.add_flops(old, tmp_path / "absent")  # a run from before the count: no FLOPs, no crash
    assert old["final"]["flops"] is None and default_race.campaign_flops(old["final"], old) is None

    results = {"grpo_raw": {0: _run([(0, 0.3, 0), (10, 0.40, 1000), (20, 0.50, 2000)])},
               "depo_d3s_cw_raw": {0: _run([(0, 0.3, 0), (10, 0.52, 900)])}}
    for point, flops in zip(results["grpo_raw"][0]["curve"], (0.0, 2e12, 4e12)):
        point["flops"] = flops
    for point, flops in zip(results["depo_d3s_cw_raw"][0]["curve"], (0.0, 2.2e12)):
        point["flops"] = flops
    summary = default_race.summarize(results)
    depo = summary["methods"]["depo_d3s_cw_raw"]
    # 900 tokens against 2,000 to the target, but 2.2e12 FLOPs against 4e12.
    assert depo["tokens_to_target"]["per_seed"] == {0: 900} and depo["flops_to_target"]["per_seed"] == {0: 2.2e12}
    assert depo["flops_to_target"]["ratio"]["mean"] == pytest.approx(0.55)
    table = default_race.format_table(summary)
    assert "| FLOPs to target | vs best baseline (FLOPs) | FLOPs at the end |" in table
    assert "| 2.20e12 | 0.55 | 2.20e12 |" in table


def test_candidates_skip_curation_and_filter_online():
    for name in ("depo_d3s_cw_raw", "depo_e3_d3s_cw_raw", "fast_depo_d3s_cw_raw", "fast_depo_ada_est_d3s_cw_raw"):
        method = default_race.METHODS[name]
        cfg = method.recipe(steps=10)
        assert not method.curated and cfg.algorithm.prompt_filter == "depo"
        assert cfg.algorithm.depo.estimator_dir is None  # trained online: there is no curation to train it on
        assert "cw_grpo" in cfg.algorithm.token_weights and cfg.algorithm.sample_selector == "d3s_cross"
    assert default_race.METHODS["depo_e3_d3s_cw_raw"].recipe(steps=10).algorithm.budget == "e3"
    assert default_race.METHODS["fast_depo_ada_est_d3s_cw_raw"].recipe(steps=10).algorithm.budget == "ada_est"


def test_adam_kernel_switch_sets_and_restores_the_param_group_flags():
    import torch

    from pipeline.trainer.actor import Actor

    original = Actor.__init__

    class _Wrapper:
        def __init__(self):
            self.optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])

    def fake_init(self, *args, **kwargs):
        self.optimizer = _Wrapper()

    Actor.__init__ = fake_init
    try:
        with bootstrap_seeds.adam_kernel("fused"):
            actor = Actor()
        group = actor.optimizer.optimizer.param_groups[0]
        assert (group["fused"], group["foreach"]) == (True, False)
        with bootstrap_seeds.adam_kernel("default"):
            group = Actor().optimizer.optimizer.param_groups[0]
        assert (group["fused"], group["foreach"]) == (None, None)  # torch picks: the per-parameter loop on CPU
        assert Actor.__init__ is fake_init
    finally:
        Actor.__init__ = original
    with pytest.raises(ValueError, match="unknown"):
        with bootstrap_seeds.adam_kernel("apex"):
            pass


def test_loss_milestones(tmp_path):
    path = tmp_path / "metrics.jsonl"
    losses = [0.3] * 5 + [0.14] * 5 + [0.1] * 5
    path.write_text("".join(json.dumps({"step": i, "loss": loss}) + "\n" for i, loss in enumerate(losses)))
    milestones = bootstrap_seeds.loss_milestones(path, window=2, levels=(0.15, 0.12, 0.05))
    assert milestones == {"step_loss<0.15": 6, "step_loss<0.12": 11, "step_loss<0.05": None,
                          "final_loss_mean": pytest.approx(0.1)}
