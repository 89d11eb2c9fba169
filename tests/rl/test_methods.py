"""The update-side methods of ``pipeline/rl/methods.py``: one shape, the right function behind each name."""

from __future__ import annotations

import pytest
import torch

from pipeline.algorithms import advantages as adv
from pipeline.algorithms import cw_grpo, d3s, losses, pods, reinforce_ada
from pipeline.config import AlgorithmConfig, D3SConfig
from pipeline.rl.methods import (
    ADVANTAGES,
    D3S_SCHEDULE,
    POLICY_LOSSES,
    SAMPLE_SELECTORS,
    TEMPERATURES,
    TOKEN_WEIGHTS,
    build_methods,
)
from pipeline.rl.registry import Method, MethodSetting, Registry, StepEnd


def _setting(**overrides) -> MethodSetting:
    return MethodSetting(**{"total_steps": 4, "group_size": 4, "temperature": 0.8, "vocab_size": 64,
                            "max_new_tokens": 16, **overrides})


def _end(step: int, entropy: float = 1.0) -> StepEnd:
    return StepEnd(step=step, mean_entropy=entropy, epoch_ended=False, pool=None, selected=None, question_logprobs=None)


@pytest.mark.parametrize(("name", "function"), [
    ("grpo", adv.grpo_advantages), ("dr_grpo", adv.dr_grpo_advantages), ("rloo", adv.rloo_advantages)])
def test_group_advantages_call_their_function(name, function):
    method = ADVANTAGES.build(name, AlgorithmConfig(), _setting())
    rewards, group_ids = torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1])
    got, _ = method(rewards=rewards, group_ids=group_ids, pool_rewards=rewards, pool_group_ids=group_ids)
    assert torch.equal(got, function(rewards=rewards, group_ids=group_ids)[0])


def test_the_pool_baseline_reads_the_pool():
    cfg = AlgorithmConfig(advantage="global_baseline", baseline_weight="inv_mean")
    method = ADVANTAGES.build("global_baseline", cfg, _setting())
    rewards, group_ids = torch.tensor([1.0, 0.0]), torch.tensor([0, 0])
    pool_rewards, pool_ids = torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([0, 0, 0, 0])
    got, _ = method(rewards=rewards, group_ids=group_ids, pool_rewards=pool_rewards, pool_group_ids=pool_ids)
    expected, _ = adv.global_baseline_advantages(rewards=rewards, group_ids=group_ids, pool_rewards=pool_rewards,
                                                 pool_group_ids=pool_ids, weight="inv_mean")
    assert torch.equal(got, expected)


@pytest.mark.parametrize(("name", "function"), [
    ("d3s_intra", d3s.d3s_intra_select), ("d3s_cross", d3s.d3s_cross_select), ("pods", pods.pods_select),
    ("balanced", reinforce_ada.balanced_downsample)])
def test_selectors_wrap_their_function(name, function):
    assert SAMPLE_SELECTORS.build(name, AlgorithmConfig(), _setting()).function is function


def test_token_weights_and_losses_wrap_their_function(monkeypatch):
    calls = []
    monkeypatch.setattr("pipeline.rl.methods.cw_grpo_token_weights",
                        lambda **kwargs: calls.append(kwargs) or (torch.ones(1, 2), {}))
    TOKEN_WEIGHTS.build("cw_grpo", AlgorithmConfig(cw_grpo_scope="batch"), _setting())(
        advantages=torch.ones(1), entropy=None, logprobs=torch.zeros(1, 2), response_mask=torch.ones(1, 2, dtype=bool),
        group_ids=torch.zeros(1, dtype=torch.long), sample_keep_mask=torch.ones(1, dtype=bool))
    assert calls[0]["scope"] == "batch" and cw_grpo.cw_grpo_token_weights is not None
    assert POLICY_LOSSES.build("gspo", AlgorithmConfig(), _setting()).loss.fn is losses.gspo_loss
    assert POLICY_LOSSES.build("grpo", AlgorithmConfig(), _setting()).loss.options["max_response_length"] == 16


def test_one_d3s_schedule_drives_samples_and_tokens_and_advances_once_per_step():
    cfg = AlgorithmConfig(sample_selector="d3s_cross", token_weights=["d3s_topk"],
                          d3s=D3SConfig(num_keep_init=2, num_keep_final=4, keep_ratio_init=0.1, keep_ratio_final=0.5))
    methods = build_methods(cfg, _setting())
    schedule = methods.shared[D3S_SCHEDULE]
    assert methods.sample_selector.schedule is schedule and methods.token_weightings[0].schedule is schedule
    assert schedule.current() == (2, 0.1)
    methods.end_step(_end(0))
    methods.end_step(_end(1))
    assert schedule.schedule.step == 2 and schedule.current() == (3, 0.3)
    assert methods.needs_token_stats


def test_state_round_trips_and_names_each_component_once():
    cfg = AlgorithmConfig(sample_selector="d3s_intra", temperature="e3")
    first, second = build_methods(cfg, _setting()), build_methods(cfg, _setting())
    for step in range(3):
        first.end_step(_end(step, entropy=2.0 + step))
    assert set(first.state_dict()) == {D3S_SCHEDULE, "temperature"}
    second.load_state_dict(first.state_dict())
    assert second.state_dict() == first.state_dict()
    assert second.temperature.value == first.temperature.value != 0.8


def test_fixed_temperature_is_the_runs():
    methods = build_methods(AlgorithmConfig(), _setting(temperature=0.7))
    methods.end_step(_end(0, entropy=5.0))
    assert methods.temperature.value == 0.7 and not methods.needs_token_stats
    assert TEMPERATURES.names() == ["e3", "fixed"]


def test_registry_names_unknown_entries_and_refuses_duplicates():
    registry = Registry("widget")
    registry.add("a", lambda cfg, setting: Method())
    with pytest.raises(ValueError, match="registered twice"):
        registry.add("a", lambda cfg, setting: Method())
    with pytest.raises(ValueError, match=r"unknown widget 'b'; choose one of \['a'\]"):
        registry.build("b", AlgorithmConfig(), _setting())


def test_rollout_corrections_weight_or_mask_before_the_token_weightings():
    response = torch.ones(2, 2, dtype=torch.bool)
    old = torch.log(torch.tensor([[3.0, 1.0], [1.0, 1.0]]))  # (S, T): token ratios π_old/π_rollout = (3, 1), (1, 1)
    engine = torch.zeros(2, 2)
    common = dict(advantages=torch.ones(2), entropy=None, logprobs=old, engine_logprobs=engine,
                  response_mask=response, group_ids=torch.tensor([0, 0]), keep_mask=torch.ones(2, dtype=torch.bool))
    tis = build_methods(AlgorithmConfig(rollout_correction="tis"), _setting())
    weights, token_mask, metrics = tis.token_weights(**common)
    assert weights.tolist() == [[2.0, 1.0], [1.0, 1.0]] and bool(token_mask.all())
    assert metrics["correction/corrected_fraction"] == 0.25 and tis.needs_token_stats
    mis = build_methods(AlgorithmConfig(rollout_correction="mis"), _setting())
    weights, token_mask, _ = mis.token_weights(**common)
    assert token_mask.tolist() == [[False, True], [True, True]] and weights.tolist() == [[0.0, 1.0], [1.0, 1.0]]
    none = build_methods(AlgorithmConfig(), _setting())
    weights, token_mask, metrics = none.token_weights(**common)
    assert bool(weights.eq(1).all()) and bool(token_mask.all()) and metrics == {}
