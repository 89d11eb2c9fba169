"""Which prompts get rolled out, how many samples each, and in how many rounds.

Three registries, each entry chosen once by name from ``AlgorithmConfig``:

``PROMPT_FILTERS``  before rollout: ``none`` or ``depo`` (the DEPO estimator drops prompts
                    whose G rollouts would likely all get the same reward).
``BUDGETS``         samples per prompt: ``uniform`` (G each), ``e3`` (E3 Algorithm 1 from
                    difficulty ranks, G_min/G_max widening per pass) or ``ada_est``
                    (Reinforce-Ada-Est, N ∝ 1/√p̂ from the EMA/Beta pass rates).
``SAMPLERS``        how the budgets are spent: ``single`` (one round), ``ada_seq``
                    (Reinforce-Ada-Seq rounds until each prompt's exit rule or cap, then
                    balanced down-sampling to G) or ``dynamic`` (DAPO: draw more prompts
                    until enough groups have reward variance).

Every entry is a ``Method`` (``pipeline/rl/registry.py``): built from its config section and
the run's ``MethodSetting``, with these calls —

* filter: ``num_candidates(B)``; ``__call__(candidates, batch_size=, step=) -> (SelectedPrompts, metrics)``;
  ``update(end)`` trains DEPO's estimator on the step's observed pass rates;
* budget: ``__call__(indices) -> (budgets (P,), metrics)``; ``update(end)`` re-ranks (E3) after a pass;
* sampler: ``__call__(indices, budgets, generate=, draw=, seed=) -> Sampled``.

Their decisions are pure functions of the tensors they are given (the algorithm library does
the arithmetic) and whatever state they keep round-trips through ``state_dict``. The
per-prompt counts they read live in the run's ``PromptStatsStore``, so there is one source
of truth for "how often was this prompt solved".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeline.algorithms.depo import depo_filter, observed_zero_variance, zero_variance_log_prob
from pipeline.algorithms.e3 import difficulty_ranks, e3_budget_bounds, e3_rollout_budgets
from pipeline.algorithms.reinforce_ada import ada_est_budgets, balanced_downsample, exit_condition
from pipeline.config import AlgorithmConfig
from pipeline.rl.registry import Method, MethodSetting, Metrics, Registry, StepEnd, float_metrics
from pipeline.rl.rollouts import RolloutBatch
from pipeline.stats.store import PromptStatsStore

# generate(prompt indices (P,), budgets (P,), round) -> graded rollouts of those prompts
Generate = Callable[[torch.Tensor, torch.Tensor, int], RolloutBatch]
# draw(count) -> the next ``count`` prompt indices of the stream
Draw = Callable[[int], torch.Tensor]

PROMPT_FILTERS: Registry = Registry("prompt filter")
BUDGETS: Registry = Registry("rollout budget")
SAMPLERS: Registry = Registry("sampler")


def curation_prior(stats: PromptStatsStore, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(samples, successes) ``(P,)`` float64 from the curation stage, for prompts RL has not sampled yet.

    The curation measured each kept prompt k times under the base policy; until RL has its
    own counts those are the best evidence of difficulty, so E3 ranks and Ada-Est's p̂
    start from them instead of from a flat prior.
    """
    rows = stats.rows(indices)
    measured = (rows["num_samples"] == 0) & (rows["curation_num_samples"] > 0)  # (P,)
    samples = torch.where(measured, rows["curation_num_samples"].double(), torch.zeros_like(rows["reward_sum"]))
    rates = torch.nan_to_num(rows["curation_pass_rate"], nan=0.0)
    return samples, samples * rates


# ---------------------------------------------------------------------------- filters


@dataclass
class SelectedPrompts:
    """The prompts a step rolls out, after filtering, and what the filter predicted for them."""

    indices: torch.Tensor  # (P,) dataset indices
    predicted_pass_rate: torch.Tensor | None  # (P,) or None without an estimator
    dropped: torch.Tensor  # (F,) dataset indices the filter dropped before rollout


@PROMPT_FILTERS.register("none")
class NoFilter(Method):
    def __init__(self, cfg: AlgorithmConfig, setting: MethodSetting) -> None:
        pass

    def num_candidates(self, batch_size: int) -> int:
        return batch_size

    def __call__(self, candidates: torch.Tensor, *, batch_size: int, step: int) -> tuple[SelectedPrompts, Metrics]:
        return SelectedPrompts(candidates[:batch_size], None, torch.zeros(0, dtype=torch.int64)), {}

    def state_dict(self) -> dict[str, Any]:
        return {"tensors": {}, "json": {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


@PROMPT_FILTERS.register("depo")
class DepoFilter(Method):
    """DEPO (§3): predict each candidate's pass rate from its text, drop likely zero-variance prompts.

    After ``warmup_steps`` a candidate is dropped when p̂^G + (1 − p̂)^G > threshold
    (``depo_filter``). Every step the estimator is trained on the prompts that were rolled
    out — observed avg@k, the actor's question perplexity (L_distill) and the ranking loss —
    "updated online with the actor" (§3.2). Prompts it drops are never rolled out, so it
    learns only from prompts it let through (plus everything during warm-up); we record
    its precision on the warm-up steps, where the truth is observed for every candidate.
    """

    def __init__(self, cfg: AlgorithmConfig, setting: MethodSetting) -> None:
        from pipeline.estimator import DifficultyEstimator, EstimatorTrainer

        depo = cfg.depo
        # Seeded apart from the global RNG: every rank builds the same estimator, and
        # building it does not shift the actor's random stream.
        with torch.random.fork_rng():
            torch.manual_seed(setting.seed)
            if depo.estimator_dir is not None:
                model = DifficultyEstimator.load(depo.estimator_dir)
            elif depo.encoder == "minilm":
                model = DifficultyEstimator.from_pretrained_minilm(depo.cache_dir)
            else:
                model = DifficultyEstimator.tiny()
        self.trainer = EstimatorTrainer(model, lr=depo.lr, w_distill=depo.w_distill, w_rank=depo.w_rank,
                                        margin=depo.margin)
        self.cfg = depo
        self.texts = setting.texts
        self.stats = setting.stats
        self.group_size = setting.group_size

    def num_candidates(self, batch_size: int) -> int:
        return math.ceil(batch_size * self.cfg.oversample)

    @property
    def needs_question_logprobs(self) -> bool:
        return self.cfg.w_distill > 0

    # A step needs groups to compare: when the filter would leave fewer prompts, the least
    # likely zero-variance candidates are rolled out anyway (and counted as not filtered).
    MIN_PROMPTS = 2

    def __call__(self, candidates: torch.Tensor, *, batch_size: int, step: int) -> tuple[SelectedPrompts, Metrics]:
        group_size = self.group_size
        self.trainer.model.eval()
        with torch.no_grad():
            predicted = self.trainer.model.predict_pass_rate([self.texts[i] for i in candidates.tolist()])  # (C,)
        predicted = predicted.double().clamp(0.0, 1.0)
        keep_mask, metrics = depo_filter(pass_rate=predicted, group_size=group_size, threshold=self.cfg.threshold,
                                         step=step, warmup_steps=self.cfg.warmup_steps)
        minimum = min(self.MIN_PROMPTS, candidates.numel())
        if int(keep_mask.sum()) < minimum:
            zero_variance = zero_variance_log_prob(group_size=group_size, pass_rate=predicted)  # (C,)
            keep_mask[torch.argsort(zero_variance, stable=True)[:minimum]] = True
        unique, inverse = candidates.unique(return_inverse=True)
        self.stats.set_column("estimator_prediction", prompt_ids=unique,
                              values=torch.zeros(unique.numel(), dtype=torch.float64).scatter_(0, inverse, predicted))
        kept = keep_mask.nonzero().squeeze(1)[:batch_size]  # (P,)
        metrics = {**float_metrics(metrics), "depo/filter_ratio": float((~keep_mask).double().mean())}
        return SelectedPrompts(candidates[kept], predicted[kept], candidates[~keep_mask]), metrics

    def update(self, end: StepEnd) -> Metrics:
        rollouts, question_logprobs, selected = end.pool, end.question_logprobs, end.selected
        num_samples = rollouts.num_samples_per_prompt()  # (P,)
        rolled = num_samples > 0
        if int(rolled.sum()) < 2:  # the ranking loss needs pairs; one prompt teaches too little
            return self._encoded_tokens()
        pass_rates = (rollouts.num_correct_per_prompt().double() / num_samples.clamp(min=1))[rolled]  # (P',)
        texts = [self.texts[i] for i in rollouts.prompt_indices[rolled].tolist()]
        logprobs = None if question_logprobs is None else question_logprobs[rolled]
        metrics = self.trainer.update(texts, pass_rates.float(), logprobs)
        if selected.predicted_pass_rate is not None:
            zero_variance = observed_zero_variance(rewards=rollouts.rewards, group_ids=rollouts.group_ids,
                                                   num_groups=rollouts.num_prompts)[rolled]
            predicted = selected.predicted_pass_rate[rolled].double()
            metrics["depo/observed_zero_variance_fraction"] = float(zero_variance.double().mean())
            metrics["depo/prediction_mae"] = float((predicted - pass_rates).abs().mean())
        return {**metrics, **self._encoded_tokens()}

    def _encoded_tokens(self) -> Metrics:
        """The tokens the estimator has read in this run, scoring and training (cumulative: the campaign ledger's)."""
        return {"depo/encoded_tokens": float(sum(self.trainer.model.num_encoded_tokens.values()))}

    def state_dict(self) -> dict[str, Any]:
        state = self.trainer.state_dict()  # {"json": ..., "tensors": ...}
        return {**state, "json": {**state["json"], "num_encoded_tokens": dict(self.trainer.model.num_encoded_tokens)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        trainer_json = dict(state["json"])
        counts = trainer_json.pop("num_encoded_tokens")
        self.trainer.load_state_dict({**state, "json": trainer_json})
        self.trainer.model.num_encoded_tokens = {kind: int(n) for kind, n in counts.items()}


# ---------------------------------------------------------------------------- budgets


@BUDGETS.register("uniform")
class UniformBudget(Method):
    def __init__(self, cfg: AlgorithmConfig, setting: MethodSetting) -> None:
        self.group_size = setting.group_size

    def __call__(self, indices: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        return torch.full((indices.numel(),), self.group_size, dtype=torch.int64), {}


@BUDGETS.register("e3")
class E3Budget(Method):
    """E3 §4.1: budgets from difficulty ranks, conserved at B·G, bounds widening each pass.

    The ranks k_i come from the store's cumulative reward and rollout counts (curation
    counts stand in for prompts RL has not sampled) and are recomputed at the end of each
    pass over the data, as in the paper; they are kept in the store's ``e3_rank`` column.
    Prompts never ranked get the neutral k = 1/2.
    """

    def __init__(self, cfg: AlgorithmConfig, setting: MethodSetting) -> None:
        self.cfg = cfg.e3_budget
        self.group_size = setting.group_size
        self.stats = setting.stats
        self.num_completed_passes = 0
        self._rank_all()

    def _rank_all(self) -> Metrics:
        everything = torch.arange(self.stats.num_prompts)
        prior_samples, prior_successes = curation_prior(self.stats, everything)
        rows = self.stats.rows(everything)
        ranks, metrics = difficulty_ranks(reward_sum=rows["reward_sum"] + prior_successes,
                                          num_rollouts=rows["num_samples"].double() + prior_samples)
        # Every stored rank is a multiple of 1/(2|D|) of this ranking (the unranked 1/2 too), so the
        # budget split can run in exact integers (E3 Algorithm 1 step 4).
        self.num_ranked = int(metrics["e3/num_ranked"])
        seen = (rows["num_samples"] + prior_samples) > 0
        if bool(seen.any()):
            self.stats.set_column("e3_rank", prompt_ids=everything[seen], values=ranks[seen])
        return float_metrics(metrics)

    def bounds(self) -> tuple[int, int]:
        return e3_budget_bounds(num_completed_passes=self.num_completed_passes, group_size=self.group_size,
                                min_limit=self.cfg.min_limit, max_limit=self.cfg.max_limit, step=self.cfg.widen_step)

    def __call__(self, indices: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        difficulty = torch.nan_to_num(self.stats.rows(indices)["e3_rank"], nan=0.5)  # (P,)
        low, high = self.bounds()
        budgets, metrics = e3_rollout_budgets(difficulty=difficulty, group_size=self.group_size, min_budget=low,
                                              max_budget=high, rank_denominator=2 * max(self.num_ranked, 1))
        return budgets, {**float_metrics(metrics), "e3/g_min": float(low), "e3/g_max": float(high)}

    def update(self, end: StepEnd) -> Metrics:
        """A completed pass over the data widens the bounds and re-ranks every prompt (E3 §4.1)."""
        if not end.epoch_ended:
            return {}
        self.num_completed_passes += 1
        return self._rank_all()

    def state_dict(self) -> dict[str, Any]:
        # num_ranked fixes the denominator of the stored ranks; a resumed run builds this method
        # before its statistics are loaded, so it cannot recount it from the store.
        return {"num_completed_passes": self.num_completed_passes, "num_ranked": self.num_ranked}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.num_completed_passes = int(state["num_completed_passes"])
        self.num_ranked = int(state["num_ranked"])


@BUDGETS.register("ada_est")
class AdaEstBudget(Method):
    """Reinforce-Ada-Est (Algorithm 1 line 5): N_x ∝ 1/√(p̂_x + ε) within [N_min, N_max], Σ = B·G.

    p̂ is the store's Ada-EMA/Beta estimate (λ = ``ada_est.ema_decay`` is the store's
    decay); a prompt RL has not sampled yet counts its curation samples as evidence.
    """

    def __init__(self, cfg: AlgorithmConfig, setting: MethodSetting) -> None:
        self.cfg = cfg.ada_est
        self.group_size = setting.group_size
        self.stats = setting.stats

    def pass_rates(self, indices: torch.Tensor) -> torch.Tensor:
        rows = self.stats.rows(indices)
        prior_samples, prior_successes = curation_prior(self.stats, indices)
        alpha, beta = self.cfg.prior_alpha, self.cfg.prior_beta
        return (rows["ema_correct"] + prior_successes + alpha) / (rows["ema_total"] + prior_samples + alpha + beta)

    def __call__(self, indices: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        estimate = self.pass_rates(indices)  # (P,)
        budgets, metrics = ada_est_budgets(pass_rate=estimate, total=indices.numel() * self.group_size,
                                           min_budget=self.cfg.min_budget, max_budget=self.cfg.max_budget,
                                           rule=self.cfg.rule)
        return budgets, {**float_metrics(metrics), "ada_est/pass_rate_mean": float(estimate.mean())}


# ---------------------------------------------------------------------------- samplers


@dataclass
class Sampled:
    """A step's samples: the whole graded pool, the subset the update trains on, and the
    samples that form each trained prompt's baseline (``train``'s prompt numbering)."""

    pool: RolloutBatch
    train: RolloutBatch
    baseline: RolloutBatch
    metrics: Metrics = field(default_factory=dict)


@SAMPLERS.register("single")
class SingleRound(Method):
    def __init__(self, cfg: AlgorithmConfig, setting: MethodSetting) -> None:
        pass

    def __call__(self, indices: torch.Tensor, budgets: torch.Tensor, *, generate: Generate, draw: Draw,
               seed: int) -> Sampled:
        rollouts = generate(indices, budgets, 0)
        return Sampled(pool=rollouts, train=rollouts, baseline=rollouts)


@SAMPLERS.register("ada_seq")
class AdaSeq(Method):
    """Reinforce-Ada-Seq (Algorithm 2): rounds of ``round_size`` per active prompt until its exit rule
    (POS: ≥ k_pos correct; BALANCE: also ≥ k_neg incorrect) or the cap N_max, then balanced
    down-sampling (line 18) to G per prompt. The advantage's baseline sees the whole pool
    (``Sampled.pool``), the update only the down-sampled G.
    """

    def __init__(self, cfg: AlgorithmConfig, setting: MethodSetting) -> None:
        self.cfg = cfg.ada_seq
        self.group_size = setting.group_size

    def __call__(self, indices: torch.Tensor, budgets: torch.Tensor, *, generate: Generate, draw: Draw,
               seed: int) -> Sampled:
        cfg = self.cfg
        parts: list[RolloutBatch] = []
        part_positions: list[torch.Tensor] = []
        num_drawn = torch.zeros(indices.numel(), dtype=torch.int64)  # (P,)
        num_correct = torch.zeros_like(num_drawn)
        active = torch.ones(indices.numel(), dtype=torch.bool)
        while bool(active.any()):
            positions = active.nonzero().squeeze(1)
            round_budgets = torch.clamp(cfg.max_samples - num_drawn[positions], max=cfg.round_size)
            part = generate(indices[positions], round_budgets, len(parts))
            parts.append(part)
            part_positions.append(positions)
            num_drawn[positions] += part.num_samples_per_prompt()
            num_correct[positions] += part.num_correct_per_prompt()
            exited, _ = exit_condition(num_correct=num_correct, num_incorrect=num_drawn - num_correct,
                                       rule=cfg.exit_rule, k_pos=cfg.k_pos, k_neg=cfg.k_neg)
            active = ~exited & (num_drawn < cfg.max_samples)
        num_rounds = len(parts)
        pool = RolloutBatch.merge_rounds(parts[0], parts, part_positions)
        (keep_mask, _), metrics = balanced_downsample(
            advantages=torch.zeros_like(pool.rewards), rewards=pool.rewards, group_ids=pool.group_ids,
            num_keep=self.group_size, generator=torch.Generator().manual_seed(seed), num_groups=pool.num_prompts)
        unresolved = ~exit_condition(num_correct=num_correct, num_incorrect=num_drawn - num_correct,
                                     rule=cfg.exit_rule, k_pos=cfg.k_pos, k_neg=cfg.k_neg)[0]
        metrics = {**float_metrics(metrics), "ada/rounds": float(num_rounds), "ada/pool_size_mean": float(num_drawn.double().mean()),
                   "ada/unresolved_fraction": float(unresolved.double().mean())}
        return Sampled(pool=pool, train=pool.select_samples(keep_mask), baseline=pool, metrics=metrics)


@SAMPLERS.register("dynamic")
class DynamicSampling(Method):
    """DAPO dynamic sampling: keep only groups with reward variance, drawing more prompts from the
    stream until ``min_useful_fraction`` of the batch is filled or ``max_rounds`` is reached.
    The batch trains on at most B useful groups; zero-variance groups are discarded.
    """

    def __init__(self, cfg: AlgorithmConfig, setting: MethodSetting) -> None:
        self.cfg = cfg.dynamic

    def __call__(self, indices: torch.Tensor, budgets: torch.Tensor, *, generate: Generate, draw: Draw,
               seed: int) -> Sampled:
        batch_size = indices.numel()
        target = math.ceil(self.cfg.min_useful_fraction * batch_size)
        budget = int(budgets[0]) if budgets.numel() else 0
        parts = [generate(indices, budgets, 0)]
        useful = [~observed_zero_variance(rewards=parts[0].rewards, group_ids=parts[0].group_ids,
                                          num_groups=parts[0].num_prompts)]
        num_rounds = 1
        num_useful = int(useful[0].sum())
        while num_useful < target and num_rounds < self.cfg.max_rounds:
            more = draw(target - num_useful)
            part = generate(more, torch.full((more.numel(),), budget, dtype=torch.int64), num_rounds)
            parts.append(part)
            useful.append(~observed_zero_variance(rewards=part.rewards, group_ids=part.group_ids,
                                                  num_groups=part.num_prompts))
            num_useful += int(useful[-1].sum())
            num_rounds += 1
        pool = RolloutBatch.concat(parts)
        useful_mask = torch.cat(useful)  # (P_total,)
        chosen = useful_mask.nonzero().squeeze(1)[:batch_size]
        metrics = {"dapo/rounds": float(num_rounds), "dapo/useful_groups": float(chosen.numel()),
                   "dapo/prompts_drawn": float(pool.num_prompts)}
        if chosen.numel() == 0:
            # Nothing useful within the cap: the first round trains (every advantage is 0, so
            # the step moves nothing but keeps the schedules and the data position in step).
            chosen = torch.arange(batch_size)
        train = pool.select_prompts(chosen)
        return Sampled(pool=pool, train=train, baseline=train, metrics=metrics)


@dataclass
class Sampling:
    """The filter, budget and sampler a run uses, built once from the config."""

    prompt_filter: Method
    budget: Method
    sampler: Method

    TENSOR_PREFIX = "filter."

    @property
    def needs_question_logprobs(self) -> bool:
        return any(method.needs_question_logprobs for method in (self.prompt_filter, self.budget, self.sampler))

    def end_step(self, end: StepEnd) -> Metrics:
        """The end-of-step hook: filter, budget and sampler each see the step's outcome."""
        metrics: Metrics = {}
        for method in (self.prompt_filter, self.budget, self.sampler):
            metrics.update(method.update(end))
        return metrics

    def state(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """(JSON state, tensors) for the checkpoint: the filter's ``{"json", "tensors"}`` (tensors prefixed
        ``filter.``), the budget's and the sampler's ``state_dict`` (JSON)."""
        filter_state = self.prompt_filter.state_dict() or {"tensors": {}, "json": {}}
        tensors = {self.TENSOR_PREFIX + name: tensor for name, tensor in filter_state["tensors"].items()}
        return {"filter": filter_state["json"], "budget": self.budget.state_dict(),
                "sampler": self.sampler.state_dict()}, tensors

    def load_state(self, state: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        filter_tensors = {name.removeprefix(self.TENSOR_PREFIX): tensor for name, tensor in tensors.items()
                          if name.startswith(self.TENSOR_PREFIX)}
        self.prompt_filter.load_state_dict({"tensors": filter_tensors, "json": state["filter"]})
        self.budget.load_state_dict(state["budget"])
        # A checkpoint without "sampler" predates saving it, when every sampler was stateless ({}).
        self.sampler.load_state_dict(state.get("sampler", {}))


def build_sampling(cfg: AlgorithmConfig, setting: MethodSetting) -> Sampling:
    return Sampling(
        prompt_filter=PROMPT_FILTERS.build(cfg.prompt_filter, cfg, setting),
        budget=BUDGETS.build(cfg.budget, cfg, setting),
        sampler=SAMPLERS.build(cfg.sampling, cfg, setting),
    )
