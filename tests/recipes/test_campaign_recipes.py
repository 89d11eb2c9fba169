"""The campaign recipes mean what they say: budgets that fit the model, the staged pipeline against a
matched baseline, a DEPO variant on the raw stream that pays for its estimator's curation, no unread stage."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pipeline import configlib
from pipeline.config import METHOD_FIELDS, AlgorithmConfig, RLConfig, plain_grpo
from recipes.campaigns import CAMPAIGNS, cpu_campaign, h100_rl, qwen25_math_7b
from recipes.staged import staged_pipeline

FIXTURES = Path(__file__).resolve().parents[2] / "pipeline" / "models" / "published" / "configs"
# Each H100 campaign's model (pipeline/models/published/README.md) and the new tokens it generates.
H100_MODELS = {"qwen25-math-7b": ("Qwen2.5-Math-7B", 3072), "qwen25-math-1.5b": ("Qwen2.5-Math-1.5B", 3072),
               "llama31-8b": ("Llama-3.1-8B", 4096)}
PROMPT_POSITIONS = 1024  # what a MATH prompt in the chat template needs, with room to spare
# Set by wire_campaign per variant: where each run writes.
PER_VARIANT_PATHS = {"checkpoint.directory", "logging.output_dir"}
# Every AlgorithmConfig field that is not a method: what a matched baseline shares with the method.
SHARED_ALGORITHM_FIELDS = {"eps_low", "eps_high", "kl_coef", "entropy_coef", "rollout_correction", "correction"}


def _flat(cfg) -> dict[str, object]:
    return configlib.to_flat_dict(cfg)


def _generated_tokens(stage) -> int | None:
    if stage.kind in ("curate", "rl"):
        return stage.config.max_new_tokens
    if stage.kind == "evaluate":
        return stage.config.eval.max_new_tokens
    return None


def test_every_campaign_but_the_cpu_ones_names_its_model():
    assert set(CAMPAIGNS) - {"cpu", "cpu-tiny"} == set(H100_MODELS)


@pytest.mark.parametrize("recipe", sorted(H100_MODELS))
def test_every_generating_stage_leaves_room_for_the_prompt(recipe, tmp_path):
    model, budget = H100_MODELS[recipe]
    positions = json.loads((FIXTURES / f"{model}.json").read_text())["max_position_embeddings"]
    plan = CAMPAIGNS[recipe](output_dir=tmp_path)
    budgets = {stage.name: _generated_tokens(stage) for stage in plan.stages if _generated_tokens(stage) is not None}
    assert {"curate", "rl-default", "rl-grpo", "evaluate-default", "evaluate-grpo"} <= set(budgets)
    # One budget, the model's: curation measures difficulty, and evaluation scores, at the length RL samples.
    assert set(budgets.values()) == {budget}
    assert budget + PROMPT_POSITIONS <= positions


def test_a_campaign_without_depo_trains_no_estimator_and_both_variants_on_the_curated_prompts(tmp_path):
    rl = h100_rl(model_dir="/models/Qwen2.5-Math-7B", tensor_parallel=4, max_new_tokens=3072)
    rl = dataclasses.replace(rl, algorithm=dataclasses.replace(rl.algorithm, token_weights=["cw_grpo"]))
    plan = qwen25_math_7b(output_dir=tmp_path, rl=rl)
    assert "train-estimator" not in [stage.name for stage in plan.stages]
    assert all("train-estimator" not in stage.depends_on for stage in plan.stages)
    for name in ("rl-default", "rl-grpo"):
        stage = plan.stage(name)
        assert stage.config.data.train == [str(tmp_path / "curate" / "kept.jsonl")]
        assert stage.depends_on == ("convert", "curate")


@pytest.mark.parametrize("recipe", sorted(H100_MODELS))
def test_the_shipped_default_is_the_staged_pipeline(recipe, tmp_path):
    """Curation → estimator → DEPO on the raw stream → Ada-Seq-BALANCE → D³S + CW-GRPO, n = 4."""
    plan = CAMPAIGNS[recipe](output_dir=tmp_path)
    default = plan.stage("rl-default").config
    algorithm = default.algorithm
    assert (algorithm.prompt_filter, algorithm.sampling, algorithm.ada_seq.exit_rule) == ("depo", "ada_seq", "balance")
    assert (algorithm.advantage, algorithm.baseline_weight) == ("global_baseline", "bernoulli_std")
    assert algorithm.token_weights == ["d3s_topk", "cw_grpo"] and algorithm.aggregation == "d3s"
    assert algorithm.temperature == "fixed" and algorithm.budget == "uniform" and default.group_size == 4
    # D³S Table 7: within-group selection for the unaligned Llama, across groups for the math models.
    assert algorithm.sample_selector == ("d3s_intra" if recipe == "llama31-8b" else "d3s_cross")
    assert algorithm.depo.estimator_dir == str(tmp_path / "estimator" / "estimator")
    assert algorithm.depo.encoder == "minilm" and algorithm.depo.warmup_steps == 0
    # Every stage the pipeline names runs: curation, the estimator on it, RL, pass@32 evaluation.
    estimator = plan.stage("train-estimator")
    assert estimator.depends_on == ("curate",) and estimator.resources.gpus_per_node == 1
    assert plan.stage("evaluate-default").config.eval.num_samples == 32


@pytest.mark.parametrize("recipe", sorted(H100_MODELS))
def test_the_depo_default_and_its_baseline_train_on_the_raw_stream(recipe, tmp_path):
    """DEPO replaces curation as a filter: both variants read the curation's sources as they are; only
    the default waits for (and is charged) the estimator and the curation it is trained on."""
    plan = CAMPAIGNS[recipe](output_dir=tmp_path)
    curate = plan.stage("curate").config
    for name in ("rl-default", "rl-grpo"):
        config = plan.stage(name).config
        assert (config.data.train, config.data.split, config.curation_dir) == (curate.sources, curate.split, None)
    assert plan.stage("rl-default").depends_on == ("convert", "train-estimator")
    assert plan.stage("rl-grpo").depends_on == ("convert",)


def _methods_rl() -> RLConfig:
    """The staged pipeline on the H100 base config, with shared settings off their defaults."""
    base = h100_rl(model_dir="/models/Qwen2.5-Math-7B", tensor_parallel=4, max_new_tokens=3072,
                   micro_batch_tokens=8192)
    base = dataclasses.replace(base, algorithm=dataclasses.replace(base.algorithm, eps_high=0.2, kl_coef=1e-3))
    return staged_pipeline(base, sample_selector="d3s_cross", estimator_encoder="minilm")


def _assert_differs_exactly_in_the_method_fields(plan, rl: RLConfig) -> None:
    method, baseline = _flat(plan.stage("rl-default").config), _flat(plan.stage("rl-grpo").config)
    differing = {key for key in method if method[key] != baseline[key]} - PER_VARIANT_PATHS
    assert differing and all(key.split(".")[0] == "algorithm" and key.split(".")[1] in METHOD_FIELDS
                             for key in differing), differing
    # Every method field the stack set (and the estimator wire_campaign gave its DEPO filter) is reset;
    # the shared ones (TIS among them) are the method's.
    wired = plan.stage("rl-default").config.algorithm
    changed = {name for name in METHOD_FIELDS if getattr(wired, name) != getattr(AlgorithmConfig(), name)}
    assert {key.split(".")[1] for key in differing} == changed
    for name in SHARED_ALGORITHM_FIELDS:
        assert {key: value for key, value in baseline.items() if key.startswith(f"algorithm.{name}")} == {
            key: value for key, value in method.items() if key.startswith(f"algorithm.{name}")}
    assert baseline["algorithm.rollout_correction"] == "tis"
    assert plan.stage("rl-grpo").config.algorithm == plain_grpo(rl.algorithm)


def test_the_baseline_differs_from_the_method_exactly_in_the_method_fields(tmp_path):
    rl = _methods_rl()
    plan = qwen25_math_7b(output_dir=tmp_path, rl=rl)
    _assert_differs_exactly_in_the_method_fields(plan, rl)
    assert _flat(plan.stage("rl-grpo").config)["algorithm.kl_coef"] == 1e-3


@pytest.mark.parametrize("recipe", sorted(H100_MODELS))
def test_the_shipped_campaigns_compare_the_staged_pipeline_with_a_matched_grpo(recipe, tmp_path):
    plan = CAMPAIGNS[recipe](output_dir=tmp_path)
    _assert_differs_exactly_in_the_method_fields(plan, plan.stage("rl-default").config)
    grpo = plan.stage("rl-grpo").config
    assert grpo.group_size == 4 and grpo.algorithm.prompt_filter == "none"  # GRPO-n4, Reinforce-Ada's Table 2 row


# ------------------------------------------------------------------ the CPU campaign's pairing


def test_the_cpu_methods_variant_filters_the_raw_stream_and_pays_for_its_estimator(tmp_path):
    """The methods stack trains on the uncurated prompts, where DEPO has something to drop; the ledger
    charges it the curation its estimator was trained on, and the estimator."""
    import json

    from pipeline.launch.ledger import read_ledger

    plan = cpu_campaign(output_dir=tmp_path, tiny=True)
    sources = plan.stage("curate").config.sources
    methods = plan.stage("rl-methods")
    assert (methods.config.data.train, methods.config.curation_dir) == (sources, None)
    assert methods.config.algorithm.prompt_filter == "depo"
    assert methods.config.algorithm.depo.estimator_dir == str(tmp_path / "estimator" / "estimator")
    assert methods.depends_on == ("bootstrap", "train-estimator")
    (tmp_path / "curate").mkdir()
    (tmp_path / "curate" / "manifest.json").write_text(json.dumps({"num_generated_tokens": 5_000}))
    (tmp_path / "estimator").mkdir()
    (tmp_path / "estimator" / "calibration.json").write_text(
        json.dumps({"num_encoded_tokens": {"train": 300, "inference": 20}}))
    ledger = read_ledger(plan)
    assert ledger.variant_cost("methods").before_rl == 5_320
    assert (ledger.variant_cost("grpo").before_rl, ledger.variant_cost("default").before_rl) == (5_000, 0)


def test_method_and_shared_fields_split_the_algorithm_config():
    names = {field.name for field in dataclasses.fields(AlgorithmConfig)}
    # A new field must be classed: a method resets in the matched baseline, or a shared setting it keeps.
    assert set(METHOD_FIELDS) | SHARED_ALGORITHM_FIELDS == names
    assert not set(METHOD_FIELDS) & SHARED_ALGORITHM_FIELDS
    grpo = plain_grpo(_methods_rl().algorithm)
    assert all(getattr(grpo, name) == getattr(AlgorithmConfig(), name) for name in METHOD_FIELDS)
