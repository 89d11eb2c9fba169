"""The H100 campaign recipes mean what they say: budgets that fit the model, a matched baseline, no unread stage."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pipeline import configlib
from pipeline.config import METHOD_FIELDS, AlgorithmConfig, RLConfig, plain_grpo
from recipes.campaigns import CAMPAIGNS, h100_rl, qwen25_math_7b
from recipes.cpu import methods_cpu

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


@pytest.mark.parametrize("recipe", sorted(H100_MODELS))
def test_h100_campaigns_without_depo_train_no_estimator(recipe, tmp_path):
    plan = CAMPAIGNS[recipe](output_dir=tmp_path)
    assert "train-estimator" not in [stage.name for stage in plan.stages]
    assert all("train-estimator" not in stage.depends_on for stage in plan.stages)


def _methods_rl() -> RLConfig:
    """The H100 base config with the combined methods stack, and shared settings off their defaults."""
    base = h100_rl(model_dir="/models/Qwen2.5-Math-7B", tensor_parallel=4, max_new_tokens=3072,
                   micro_batch_tokens=8192)
    algorithm = dataclasses.replace(methods_cpu().algorithm, rollout_correction="tis", eps_high=0.2, kl_coef=1e-3)
    return dataclasses.replace(base, algorithm=algorithm)


def test_a_methods_campaign_trains_the_estimator_for_its_depo_variant(tmp_path):
    plan = qwen25_math_7b(output_dir=tmp_path, rl=_methods_rl())
    estimator = plan.stage("train-estimator")
    assert estimator.depends_on == ("curate",) and estimator.resources.gpus_per_node == 1
    assert "train-estimator" in plan.stage("rl-default").depends_on
    assert "train-estimator" not in plan.stage("rl-grpo").depends_on  # the baseline filters nothing


def test_the_baseline_differs_from_the_method_exactly_in_the_method_fields(tmp_path):
    rl = _methods_rl()
    plan = qwen25_math_7b(output_dir=tmp_path, rl=rl)
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
    assert baseline["algorithm.rollout_correction"] == "tis" and baseline["algorithm.kl_coef"] == 1e-3
    assert plan.stage("rl-grpo").config.algorithm == plain_grpo(rl.algorithm)


def test_method_and_shared_fields_split_the_algorithm_config():
    names = {field.name for field in dataclasses.fields(AlgorithmConfig)}
    # A new field must be classed: a method resets in the matched baseline, or a shared setting it keeps.
    assert set(METHOD_FIELDS) | SHARED_ALGORITHM_FIELDS == names
    assert not set(METHOD_FIELDS) & SHARED_ALGORITHM_FIELDS
    grpo = plain_grpo(_methods_rl().algorithm)
    assert all(getattr(grpo, name) == getattr(AlgorithmConfig(), name) for name in METHOD_FIELDS)
