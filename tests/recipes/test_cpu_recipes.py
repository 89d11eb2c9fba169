"""Recipes produce valid configs and differ from their parent only where they say they do."""

import pytest

from pipeline import configlib
from recipes.cpu import RECIPES, d3s_cpu, d3s_cw_cpu, grpo_cpu


def _flat(cfg) -> dict[str, object]:
    return configlib.to_flat_dict(cfg)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_validates(name):
    configlib.validate(RECIPES[name]())


def test_d3s_differs_from_grpo_only_in_the_algorithm():
    base, d3s = _flat(grpo_cpu()), _flat(d3s_cpu())
    changed = {key for key in base if base[key] != d3s[key]}
    assert changed == {"algorithm.sample_selector", "algorithm.token_weights", "algorithm.aggregation",
                       "algorithm.d3s.num_keep_init", "algorithm.d3s.num_keep_final"}


def test_cw_builds_on_d3s():
    assert d3s_cw_cpu().algorithm.token_weights == ["d3s_topk", "cw_grpo"]
    assert grpo_cpu(steps=7).optim.total_steps == 7


@pytest.mark.parametrize(("name", "parent", "changed"), [
    ("d3s_i_cpu", "d3s_cpu", {"algorithm.sample_selector"}),
    ("cw_grpo_cpu", "grpo_cpu", {"algorithm.token_weights"}),
    ("pods_cpu", "grpo_cpu", {"algorithm.sample_selector", "algorithm.pods.num_keep"}),
    ("dapo_cpu", "grpo_cpu", {"algorithm.sampling"}),
    ("ada_seq_pos_cpu", "ada_seq_balance_cpu", {"algorithm.ada_seq.exit_rule"}),
    ("ada_est_cpu", "grpo_cpu", {"algorithm.budget", "algorithm.ada_est.max_budget",  # min_budget 2 is the default
                                 "algorithm.advantage", "algorithm.baseline_weight"}),
    ("depo_cpu", "grpo_cpu", {"algorithm.prompt_filter"}),
    ("e3_cpu", "e3_temperature_cpu", {"algorithm.budget"}),
    ("grpo_async_cpu", "grpo_cpu", {"rollout.max_staleness", "algorithm.rollout_correction"}),  # [G/2, 2G] = [4, 16] are the defaults at G = 8
])
def test_method_recipes_differ_from_their_parent_only_in_their_method(name, parent, changed):
    child_values, parent_values = _flat(RECIPES[name]()), _flat(RECIPES[parent]())
    assert {key for key in child_values if child_values[key] != parent_values[key]} == changed


def test_ada_seq_balance_trains_on_n4_with_a_larger_pool():
    cfg = RECIPES["ada_seq_balance_cpu"]()
    assert cfg.group_size == 4 and cfg.algorithm.ada_seq.max_samples == 16
    assert cfg.algorithm.advantage == "global_baseline" and cfg.algorithm.sampling == "ada_seq"


def test_default_is_plain_grpo_and_methods_is_the_combined_stack():
    from recipes.cpu import default_cpu, methods_cpu

    # The default race found nothing cheaper than GRPO at GRPO's accuracy: the default is GRPO, config for config.
    assert _flat(default_cpu(steps=7)) == _flat(grpo_cpu(steps=7))
    methods = _flat(methods_cpu())
    assert (methods["algorithm.prompt_filter"], methods["algorithm.sampling"], methods["algorithm.temperature"],
            methods["algorithm.sample_selector"], methods["algorithm.token_weights"]) == (
        "depo", "ada_seq", "e3", "d3s_cross", ["d3s_topk", "cw_grpo"])
    assert methods["algorithm.ada_seq.max_samples"] == 4 * 8


def test_only_a_variant_without_depo_can_skip_the_curation(tmp_path):
    from pipeline.configlib import ConfigError
    from recipes.campaigns import _train_uncurated, cpu_campaign

    plan = cpu_campaign(output_dir=tmp_path, tiny=True)
    sources = plan.stage("curate").config.sources
    assert plan.stage("rl-default").config.data.train == sources
    with pytest.raises(ConfigError, match="rl-methods: the DEPO filter needs the estimator"):
        _train_uncurated(plan, variant="methods", sources=sources, split=None)
    rewired = _train_uncurated(plan, variant="grpo", sources=sources, split="train")
    grpo = rewired.stage("rl-grpo")
    assert grpo.depends_on == ("bootstrap",) and grpo.config.curation_dir is None
    assert (grpo.config.data.train, grpo.config.data.split) == (sources, "train")
    assert rewired.stage("rl-methods") == plan.stage("rl-methods")  # the other stages are untouched
