"""Prompt filters, budgets and samplers of ``pipeline/rl/sampling.py`` against a fake engine."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.config import AlgorithmConfig, RLConfig
from pipeline.configlib import ConfigError
from pipeline.rl.registry import MethodSetting, StepEnd
from pipeline.rl.rollouts import RolloutBatch
from pipeline.rl.sampling import (
    BUDGETS,
    PROMPT_FILTERS,
    SAMPLERS,
    AdaEstBudget,
    AdaSeq,
    DepoFilter,
    DynamicSampling,
    E3Budget,
    NoFilter,
    SingleRound,
    UniformBudget,
    build_sampling,
)
from pipeline.rollout.types import Completion
from pipeline.stats.store import PromptStatsStore


class FakeEngine:
    """Prompt i answers correctly on sample s iff ``outcomes[i][s % len]`` is 1; records every call."""

    def __init__(self, outcomes: dict[int, list[int]]) -> None:
        self.outcomes = outcomes
        self.calls: list[tuple[list[int], list[int], int]] = []
        self.drawn = {i: 0 for i in outcomes}

    def generate(self, indices: torch.Tensor, budgets: torch.Tensor, round_index: int) -> RolloutBatch:
        self.calls.append((indices.tolist(), budgets.tolist(), round_index))
        group_ids, completions, rewards = [], [], []
        for g, (i, n) in enumerate(zip(indices.tolist(), budgets.tolist())):
            for _ in range(n):
                pattern = self.outcomes[i]
                rewards.append(float(pattern[self.drawn[i] % len(pattern)]))
                self.drawn[i] += 1
                group_ids.append(g)
                completions.append(Completion(prompt_id=str(i), sample_index=len(completions),
                                              token_ids=torch.tensor([1, 2, 3]), logprobs=torch.zeros(3),
                                              finish_reason="stop", weight_version=0))
        return RolloutBatch(indices.clone(), [[7, i] for i in indices.tolist()], torch.tensor(group_ids, dtype=torch.long),
                            completions, ["x"] * len(completions), torch.tensor(rewards))


def _setting(*, group_size: int = 4, texts=(), stats=None, seed: int = 0) -> MethodSetting:
    return MethodSetting(total_steps=10, group_size=group_size, temperature=1.0, texts=list(texts), stats=stats,
                         seed=seed)


def _end(pool: RolloutBatch, *, selected=None, question_logprobs=None, epoch_ended: bool = False) -> StepEnd:
    return StepEnd(step=0, mean_entropy=1.0, epoch_ended=epoch_ended, pool=pool, selected=selected,
                   question_logprobs=question_logprobs)


def _no_draw(count: int) -> torch.Tensor:
    raise AssertionError("this sampler must not draw more prompts")


def test_registries_name_every_config_choice():
    assert set(PROMPT_FILTERS.names()) == {"none", "depo"}
    assert set(BUDGETS.names()) == {"uniform", "e3", "ada_est"}
    assert set(SAMPLERS.names()) == {"single", "ada_seq", "dynamic"}


def test_rollout_batch_selection_and_merging_keep_prompt_major_order():
    engine = FakeEngine({5: [1, 0], 6: [0], 7: [1]})
    first = engine.generate(torch.tensor([5, 6, 7]), torch.tensor([2, 1, 2]), 0)
    second = engine.generate(torch.tensor([5, 7]), torch.tensor([1, 1]), 1)
    merged = RolloutBatch.merge_rounds(first, [first, second], [torch.arange(3), torch.tensor([0, 2])])
    assert merged.group_ids.tolist() == [0, 0, 0, 1, 2, 2, 2]
    assert merged.rewards.tolist() == [1, 0, 1, 0, 1, 1, 1]
    assert merged.num_samples_per_prompt().tolist() == [3, 1, 3]
    picked = merged.select_prompts(torch.tensor([2, 0]))
    assert picked.prompt_indices.tolist() == [7, 5]
    assert picked.group_ids.tolist() == [0, 0, 0, 1, 1, 1]
    assert picked.rewards.tolist() == [1, 1, 1, 1, 0, 1]
    kept = merged.select_samples(torch.tensor([True, False, False, True, False, True, False]))
    assert kept.group_ids.tolist() == [0, 1, 2] and kept.num_prompts == 3
    both = RolloutBatch.concat([first, second])
    assert both.prompt_indices.tolist() == [5, 6, 7, 5, 7]
    assert both.group_ids.tolist() == [0, 0, 1, 2, 2, 3, 4]


def test_single_round_spends_the_budgets_once():
    engine = FakeEngine({0: [1], 1: [0]})
    sampled = SingleRound(AlgorithmConfig(), _setting(group_size=4))(
        torch.tensor([0, 1]), torch.tensor([4, 4]), generate=engine.generate, draw=_no_draw, seed=0)
    assert engine.calls == [([0, 1], [4, 4], 0)]
    assert sampled.pool is sampled.train is sampled.baseline


def test_ada_seq_balance_samples_until_both_outcomes_then_keeps_a_balanced_group():
    cfg = AlgorithmConfig(sampling="ada_seq")
    cfg.ada_seq.exit_rule, cfg.ada_seq.k_pos, cfg.ada_seq.k_neg = "balance", 2, 2
    cfg.ada_seq.round_size, cfg.ada_seq.max_samples = 4, 12
    # Prompt 0: 1 of 4 correct → needs rounds until 2 correct (8 samples: 2 correct, 6 wrong).
    # Prompt 1: alternating → exits after round 1. Prompt 2: never correct → capped at 12.
    engine = FakeEngine({0: [1, 0, 0, 0], 1: [1, 0], 2: [0]})
    sampled = AdaSeq(cfg, _setting(group_size=4))(torch.tensor([0, 1, 2]), torch.tensor([4, 4, 4]),
                                               generate=engine.generate, draw=_no_draw, seed=3)
    assert [call[0] for call in engine.calls] == [[0, 1, 2], [0, 2], [2]]
    assert [call[2] for call in engine.calls] == [0, 1, 2]
    assert sampled.pool.num_samples_per_prompt().tolist() == [8, 4, 12]
    assert sampled.baseline is sampled.pool
    train = sampled.train
    assert train.num_samples_per_prompt().tolist() == [4, 4, 4]
    # Balanced down-sampling keeps 2 correct + 2 wrong where the pool has them.
    assert train.num_correct_per_prompt().tolist() == [2, 2, 0]
    assert sampled.metrics["ada/rounds"] == 3.0
    assert sampled.metrics["ada/unresolved_fraction"] == pytest.approx(1 / 3)


def test_ada_seq_pos_exits_on_correct_answers_only():
    cfg = AlgorithmConfig(sampling="ada_seq")
    cfg.ada_seq.exit_rule, cfg.ada_seq.k_pos, cfg.ada_seq.round_size, cfg.ada_seq.max_samples = "pos", 1, 2, 6
    engine = FakeEngine({0: [1], 1: [0, 0, 0, 1]})
    sampled = AdaSeq(cfg, _setting(group_size=2))(torch.tensor([0, 1]), torch.tensor([2, 2]),
                                               generate=engine.generate, draw=_no_draw, seed=0)
    assert sampled.pool.num_samples_per_prompt().tolist() == [2, 4]


def test_dynamic_sampling_draws_more_prompts_until_enough_groups_vary():
    cfg = AlgorithmConfig(sampling="dynamic")
    cfg.dynamic.max_rounds = 5
    engine = FakeEngine({0: [1], 1: [1, 0], 2: [0], 3: [0, 1], 4: [1, 0], 5: [0]})
    stream = iter([torch.tensor([2]), torch.tensor([3, 4])])
    sampled = DynamicSampling(cfg, _setting(group_size=2))(torch.tensor([0, 1, 5]), torch.tensor([2, 2, 2]),
                                                        generate=engine.generate, draw=lambda n: next(stream), seed=0)
    # Round 1: only prompt 1 varies → 2 more drawn; round 2: prompt 2 constant → 2 more; then 3 useful.
    assert [call[0] for call in engine.calls] == [[0, 1, 5], [2], [3, 4]]
    assert sampled.train.prompt_indices.tolist() == [1, 3, 4]
    assert sampled.baseline is sampled.train
    assert sampled.pool.num_prompts == 6
    assert sampled.metrics["dapo/useful_groups"] == 3.0


def test_dynamic_sampling_with_nothing_useful_trains_on_the_first_round():
    cfg = AlgorithmConfig(sampling="dynamic")
    cfg.dynamic.max_rounds = 1
    engine = FakeEngine({0: [1], 1: [0]})
    sampled = DynamicSampling(cfg, _setting(group_size=2))(torch.tensor([0, 1]), torch.tensor([2, 2]),
                                                        generate=engine.generate, draw=_no_draw, seed=0)
    assert sampled.train.prompt_indices.tolist() == [0, 1]
    assert sampled.metrics["dapo/useful_groups"] == 0.0


def _store(num_prompts: int, *, decay: float = 0.9) -> PromptStatsStore:
    return PromptStatsStore([f"p{i}" for i in range(num_prompts)], ema_decay=decay)


def test_uniform_budget_gives_every_prompt_g():
    budgets, _ = UniformBudget(AlgorithmConfig(), _setting(group_size=6, stats=_store(3)))(torch.tensor([2, 0]))
    assert budgets.tolist() == [6, 6]


def test_e3_budget_is_uniform_in_the_first_pass_then_favours_hard_prompts():
    cfg = AlgorithmConfig(budget="e3")
    cfg.e3_budget.min_limit, cfg.e3_budget.max_limit, cfg.e3_budget.widen_step = 2, 8, 2
    stats = _store(4)
    # p0 always solved, p3 never: ranks by average reward.
    stats.record_rollouts(prompt_ids=torch.arange(4), num_samples=torch.full((4,), 4),
                          num_correct=torch.tensor([4, 3, 1, 0]), reward_sum=torch.tensor([4.0, 3.0, 1.0, 0.0]), step=0)
    budget = E3Budget(cfg, _setting(group_size=4, stats=stats))
    first, metrics = budget(torch.arange(4))
    assert first.tolist() == [4, 4, 4, 4] and metrics["e3/g_max"] == 4.0
    budget.update(_end(None, epoch_ended=True))  # only the pass counter is read
    assert budget.state_dict() == {"num_completed_passes": 1, "num_ranked": 4}
    second, metrics = budget(torch.arange(4))
    assert (metrics["e3/g_min"], metrics["e3/g_max"]) == (2.0, 6.0)
    assert int(second.sum()) == 16
    assert second.tolist() == sorted(second.tolist())  # harder prompt, larger budget
    assert stats.column("e3_rank").tolist() == [0.25, 0.5, 0.75, 1.0]
    restored = E3Budget(cfg, _setting(group_size=4, stats=stats))
    restored.load_state_dict(budget.state_dict())
    assert torch.equal(restored(torch.arange(4))[0], second)
    # A resumed run builds its methods on an empty store and loads the store's state afterwards:
    # the ranking's size must come from the checkpoint, not from the empty store.
    resumed_stats = _store(4)
    resumed = E3Budget(cfg, _setting(group_size=4, stats=resumed_stats))
    resumed_stats.load_state_dict(stats.state_dict())
    resumed.load_state_dict(budget.state_dict())
    assert torch.equal(resumed(torch.arange(4))[0], second)


def test_ada_est_budget_follows_the_ema_pass_rate_and_uses_curation_as_a_prior():
    cfg = AlgorithmConfig(budget="ada_est")
    cfg.ada_est.min_budget, cfg.ada_est.max_budget = 1, 16
    stats = _store(3, decay=cfg.ada_est.ema_decay)
    stats.seed_from_curation(prompt_ids=["p0", "p1"], pass_rates=torch.tensor([0.9, 0.1], dtype=torch.float64),
                             num_samples=torch.tensor([10, 10]))
    budget = AdaEstBudget(cfg, _setting(group_size=4, stats=stats))
    # Hand-computed: p̂ = (c + α)/(n + α + β) with α = β = 1: (9+1)/12, (1+1)/12, (0+1)/2.
    assert budget.pass_rates(torch.arange(3)).tolist() == pytest.approx([10 / 12, 2 / 12, 0.5])
    budgets, _ = budget(torch.arange(3))
    # N ∝ 1/√p̂ = (1.095, 2.449, 1.414) scaled to 12: (2.65, 5.93, 3.42); largest remainders round
    # prompts 1 and 0 up: (3, 6, 3).
    assert budgets.tolist() == [3, 6, 3]
    # Once RL has sampled a prompt, its own EMA counts replace the curation prior.
    stats.record_rollouts(prompt_ids=torch.tensor([1]), num_samples=torch.tensor([4]), num_correct=torch.tensor([4]),
                          reward_sum=torch.tensor([4.0], dtype=torch.float64), step=0)
    assert float(budget.pass_rates(torch.tensor([1]))) == pytest.approx((4 + 1) / (4 + 2))


def test_depo_filter_keeps_everything_in_warmup_then_drops_confident_zero_variance_prompts():
    cfg = AlgorithmConfig(prompt_filter="depo")
    cfg.depo.warmup_steps, cfg.depo.audit_fraction = 1, 0.0
    texts = [f"What is {i} + {i}?" for i in range(6)]
    stats = _store(6)
    depo = DepoFilter(cfg, _setting(group_size=4, texts=texts, stats=stats))
    selected, metrics = depo(torch.arange(6), batch_size=6, step=0)
    assert selected.indices.tolist() == list(range(6)) and selected.dropped.numel() == 0
    assert metrics["depo/filter_active"] == 0.0 and metrics["depo/filter_ratio"] == 0.0
    assert not torch.isnan(stats.column("estimator_prediction")).any()
    # Force confident predictions: p̂ ≈ 1 for even prompts (P(4 equal) = 0.996), 0.5 for odd ones (2/16);
    # the zero-variance residual is 0, so P is the point estimate.
    depo.trainer.model.predict_heads = lambda batch: (torch.logit(torch.tensor(
        [0.999 if int(t.split()[2]) % 2 == 0 else 0.5 for t in batch])), torch.zeros(len(batch)))
    selected, metrics = depo(torch.arange(6), batch_size=6, step=0)  # still warm-up: the rule runs, drops nothing
    assert selected.dropped.numel() == 0 and metrics["depo/would_drop_ratio"] == 0.5
    selected, metrics = depo(torch.arange(6), batch_size=6, step=1)
    assert selected.indices.tolist() == [1, 3, 5]
    assert selected.dropped.tolist() == [0, 2, 4]
    assert metrics["depo/filter_ratio"] == 0.5 and metrics["depo/filter_active"] == 1.0


def test_depo_filter_never_leaves_fewer_than_two_prompts():
    cfg = AlgorithmConfig(prompt_filter="depo")
    cfg.depo.warmup_steps, cfg.depo.threshold, cfg.depo.filter_ratio, cfg.depo.audit_fraction = 0, 0.01, 1.0, 0.0
    depo = DepoFilter(cfg, _setting(group_size=8, texts=["a", "bb", "ccc"], stats=_store(3)))
    depo.trainer.model.predict_heads = lambda batch: (torch.logit(torch.tensor([0.99, 0.9, 0.999])), torch.zeros(3))
    selected, _ = depo(torch.arange(3), batch_size=3, step=5)
    assert sorted(selected.indices.tolist()) == [0, 1]  # the two least likely to be all-equal


def test_depo_filter_learns_online_and_round_trips_its_state():
    cfg = AlgorithmConfig(prompt_filter="depo")
    texts = ["easy one", "hard one", "medium one"]
    first = build_sampling(cfg, _setting(group_size=2, texts=texts, stats=_store(3), seed=4))
    second = build_sampling(cfg, _setting(group_size=2, texts=texts, stats=_store(3), seed=4))
    engine = FakeEngine({0: [1], 1: [0], 2: [1, 0]})
    rollouts = engine.generate(torch.arange(3), torch.tensor([2, 2, 2]), 0)
    selected, _ = first.prompt_filter(torch.arange(3), batch_size=3, step=0)
    metrics = first.prompt_filter.update(_end(rollouts, selected=selected,
                                              question_logprobs=torch.tensor([-1.0, -2.0, -1.5])))
    # One AdamW step per replay minibatch; the step's three observations are in the buffer.
    assert metrics["estimator/num_updates"] == float(cfg.depo.minibatches) and "depo/loss_distill" in metrics
    assert metrics["depo/replay_entries"] == 3.0
    # The estimator counts what it read (3 prompts scored, 3 trained on), and a resumed run keeps counting.
    encoded = first.prompt_filter.trainer.model.num_encoded_tokens
    assert encoded["inference"] > 0 and encoded["train"] > 0
    assert metrics["depo/encoded_tokens"] == float(encoded["inference"] + encoded["train"])
    state, tensors = first.state()
    assert tensors and all(name.startswith("filter.") for name in tensors)
    second.load_state(state, tensors)
    assert second.prompt_filter.trainer.model.num_encoded_tokens == encoded
    probe = ["easy one", "something else"]
    assert torch.equal(first.prompt_filter.trainer.model.predict_pass_rate(probe),
                       second.prompt_filter.trainer.model.predict_pass_rate(probe))


def test_no_filter_is_the_identity():
    selected, metrics = NoFilter(AlgorithmConfig(), _setting(stats=_store(1)))(
        torch.tensor([3, 1, 2]), batch_size=2, step=0)
    assert selected.indices.tolist() == [3, 1] and metrics == {}


@pytest.mark.parametrize(("overrides", "field"), [
    ({"sampling": "ada_seq", "budget": "e3"}, "budget"),
    ({"ada_seq": {"round_size": 8, "max_samples": 4}}, "ada_seq.round_size"),
])
def test_incompatible_sampling_options_fail_naming_the_field(overrides, field):
    from pipeline import configlib

    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        configlib.from_dict(AlgorithmConfig, overrides)


def test_budget_bounds_must_contain_the_group_size():
    from pipeline import configlib

    with pytest.raises(ConfigError, match="algorithm.e3_budget"):
        configlib.from_dict(RLConfig, {"group_size": 8, "algorithm": {"budget": "e3",
                                                                      "e3_budget": {"min_limit": 2, "max_limit": 6}}})
    assert math.isfinite(configlib.from_dict(RLConfig, {"group_size": 4, "algorithm": {"budget": "e3"}}).group_size)
