"""The staged pipeline's composition: DEPO drops only what Ada-Seq's pool cannot rescue, one sampler, one entropy policy."""

from __future__ import annotations

import torch

from pipeline.algorithms.reinforce_ada import pool_zero_variance_probability
from pipeline.config import AdaSeqConfig
from pipeline.rl.methods import D3S_SCHEDULE, build_methods
from pipeline.rl.registry import MethodSetting
from recipes.cpu import grpo_cpu
from recipes.staged import POOL_ZERO_VARIANCE_THRESHOLD, staged_pipeline
from tests.recipes.test_cpu_recipes import _flat

AUTHORS_BALANCE = AdaSeqConfig(exit_rule="balance", k_pos=2, k_neg=2, round_size=8, max_samples=32)


def test_a_calibrated_drop_on_the_pool_event_spares_the_hard_prompts_ada_seq_rescues():
    """With P(all 32 pool samples equal) predicted exactly, the 0.9 threshold drops only p < 0.0033 or
    p > 0.9967; the same 0.9 on the update group's event (all 4 equal) would drop p = 0.02, whose pool
    of 32 has both outcomes with probability 1 − 0.98^32 = 0.48."""
    rates = torch.linspace(0.0, 1.0, 20_001, dtype=torch.float64)
    pool = pool_zero_variance_probability(rates, rule="balance", k_pos=2, k_neg=2, batch_size=8, max_samples=32)
    dropped = rates[pool > POOL_ZERO_VARIANCE_THRESHOLD]
    assert 0 < dropped.numel() < rates.numel()
    assert bool(((dropped < 0.0033) | (dropped > 0.9967)).all())
    hard = torch.tensor([0.02], dtype=torch.float64)
    update_group_event = hard**4 + (1 - hard) ** 4
    assert float(update_group_event) > POOL_ZERO_VARIANCE_THRESHOLD
    assert float(pool_zero_variance_probability(hard, rule="balance", k_pos=2, k_neg=2, batch_size=8,
                                                max_samples=32)) < POOL_ZERO_VARIANCE_THRESHOLD


def test_the_staged_pipeline_sets_only_method_fields_and_the_update_group():
    base = grpo_cpu(steps=12, group_size=8)
    staged = staged_pipeline(base, sample_selector="d3s_intra", estimator_encoder="tiny")
    before, after = _flat(base), _flat(staged)
    changed = {key for key in before if before[key] != after[key]}
    assert "group_size" in changed and all(key == "group_size" or key.startswith("algorithm.") for key in changed)
    algorithm = staged.algorithm
    assert staged.group_size == 4 and algorithm.ada_seq == AUTHORS_BALANCE
    assert (algorithm.depo.threshold, algorithm.depo.zero_variance_samples) == (POOL_ZERO_VARIANCE_THRESHOLD, 32)
    assert (algorithm.temperature, algorithm.budget, algorithm.sample_selector) == ("fixed", "uniform", "d3s_intra")
    assert (algorithm.d3s.num_keep_init, algorithm.d3s.num_keep_final) == (2, 4)  # Table 6's N 8 → 32 at G = 32


def test_the_loop_builds_the_staged_pipeline_with_one_shared_d3s_schedule():
    cfg = staged_pipeline(grpo_cpu(steps=10), sample_selector="d3s_cross", estimator_encoder="tiny")
    methods = build_methods(cfg.algorithm, MethodSetting(total_steps=cfg.steps, group_size=cfg.group_size,
                                                         temperature=cfg.temperature, vocab_size=64))
    assert methods.shared[D3S_SCHEDULE].current() == (2, 0.05)
    assert [type(weighting).__name__ for weighting in methods.token_weightings] == ["D3STopK", "CovarianceWeights"]
    assert type(methods.temperature).__name__ == "FixedTemperature"
