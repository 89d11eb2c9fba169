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
    ("ada_seq_pos_cpu", "ada_seq_balance_cpu", {"algorithm.ada_seq.exit_rule", "algorithm.ada_seq.k_pos",
                                                "algorithm.ada_seq.k_neg"}),
    ("ada_est_cpu", "grpo_cpu", {"algorithm.budget", "algorithm.ada_est.max_budget",  # min_budget 2 is the default
                                 "algorithm.advantage", "algorithm.baseline_weight"}),
    ("depo_cpu", "grpo_cpu", {"algorithm.prompt_filter"}),
    ("e3_cpu", "e3_temperature_cpu", {"algorithm.budget"}),
    ("grpo_async_cpu", "grpo_cpu", {"rollout.max_staleness", "algorithm.rollout_correction"}),  # [G/2, 2G] = [4, 16] are the defaults at G = 8
])
def test_method_recipes_differ_from_their_parent_only_in_their_method(name, parent, changed):
    child_values, parent_values = _flat(RECIPES[name]()), _flat(RECIPES[parent]())
    assert {key for key in child_values if child_values[key] != parent_values[key]} == changed


# What makes a Reinforce-Ada-Seq run the paper's: the sampler, its advantage and its exit and round settings.
ADA_SEQ_FIELDS = ("group_size", "algorithm.sampling", "algorithm.advantage", "algorithm.baseline_weight",
                  "algorithm.ada_seq.exit_rule", "algorithm.ada_seq.k_pos", "algorithm.ada_seq.k_neg",
                  "algorithm.ada_seq.round_size", "algorithm.ada_seq.max_samples")


@pytest.mark.parametrize(("name", "exit_rule"), [("ada_seq_balance_cpu", "balance"), ("ada_seq_pos_cpu", "pos")])
def test_ada_seq_cpu_presets_run_reinforce_ada_seq_as_the_paper_preset_does(name, exit_rule):
    """The per-prompt normalised advantage of the authors' code (not A = r − p̂), their rounds and exits."""
    from recipes.papers import ada_seq

    cpu, paper = _flat(RECIPES[name]()), _flat(ada_seq(backbone="qwen25_math_1p5b", exit_rule=exit_rule))
    assert {key: cpu[key] for key in ADA_SEQ_FIELDS} == {key: paper[key] for key in ADA_SEQ_FIELDS}
    assert cpu["algorithm.baseline_weight"] == "bernoulli_std" and cpu["algorithm.ada_seq.round_size"] == 8


def test_methods_is_the_staged_pipeline_and_its_ada_seq_the_paper_preset():
    from recipes.cpu import default_cpu, methods_cpu

    # The default race found nothing cheaper than GRPO at GRPO's accuracy: the default is GRPO, config for config.
    assert _flat(default_cpu(steps=7)) == _flat(grpo_cpu(steps=7))
    methods = _flat(methods_cpu())
    assert (methods["algorithm.prompt_filter"], methods["algorithm.sampling"], methods["algorithm.temperature"],
            methods["algorithm.sample_selector"], methods["algorithm.token_weights"]) == (
        "depo", "ada_seq", "fixed", "d3s_cross", ["d3s_topk", "cw_grpo"])
    balance = _flat(RECIPES["ada_seq_balance_cpu"]())
    assert {key: methods[key] for key in ADA_SEQ_FIELDS} == {key: balance[key] for key in ADA_SEQ_FIELDS}
    # Everything else is the CPU GRPO's: lr, steps, prompts per step, budgets of tokens.
    grpo = _flat(grpo_cpu(steps=9))
    assert {key for key in grpo if grpo[key] != _flat(methods_cpu(steps=9))[key]} <= {
        "group_size", *(key for key in grpo if key.startswith("algorithm."))}


def test_a_depo_variant_skips_curation_as_a_filter_but_waits_for_its_estimator(tmp_path):
    from recipes.campaigns import _train_uncurated, cpu_campaign

    plan = cpu_campaign(output_dir=tmp_path, tiny=True)
    sources = plan.stage("curate").config.sources
    assert plan.stage("rl-default").config.data.train == sources
    assert plan.stage("rl-default").depends_on == ("bootstrap",)
    rewired = _train_uncurated(plan, variant="grpo", sources=sources, split="train")
    grpo = rewired.stage("rl-grpo")
    assert grpo.depends_on == ("bootstrap",) and grpo.config.curation_dir is None
    assert (grpo.config.data.train, grpo.config.data.split) == (sources, "train")
    assert rewired.stage("rl-methods") == plan.stage("rl-methods")  # the other stages are untouched
    # The DEPO variant trains on the raw stream too, and still needs the estimator trained on the curation.
    methods = plan.stage("rl-methods")
    assert methods.config.data.train == sources and methods.depends_on == ("bootstrap", "train-estimator")
