"""Which prompts get rolled out, how many samples each, and in how many rounds.

Three registries, each entry chosen once by name from ``AlgorithmConfig``:

``PROMPT_FILTERS``  before rollout: ``none`` or ``depo`` (the DEPO estimator drops prompts
                    whose G rollouts would likely all get the same reward, up to a filter ratio).
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
  ``update(end)`` trains DEPO's estimator on the step's observations (and replays older ones);
* budget: ``__call__(indices) -> (budgets (P,), metrics)``; ``update(end)`` re-ranks (E3) after a pass;
* sampler: ``__call__(indices, budgets, generate=, draw=, seed=) -> Sampled``.

Their decisions are pure functions of the tensors they are given (the algorithm library does
the arithmetic) and whatever state they keep round-trips through ``state_dict``. The
per-prompt counts they read live in the run's ``PromptStatsStore``, so there is one source
of truth for "how often was this prompt solved". Every rank builds and calls them alike, except
that a method with a model of its own (DEPO's estimator) runs it on the rank that samples only and
broadcasts its decision to the others (``MethodSetting.is_sampling_rank``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeline.algorithms.depo import depo_drop_decision, observed_zero_variance, zero_variance_targets
from pipeline.algorithms.e3 import difficulty_ranks, e3_budget_bounds, e3_rollout_budgets
from pipeline.algorithms.reinforce_ada import ada_est_budgets, balanced_downsample, exit_condition
from pipeline.config import DEPO_ONLINE_LR, AlgorithmConfig
from pipeline.errors import CheckpointError
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
    """DEPO (§3, Figure 2): predict each candidate's P(all G rewards equal) from its text; drop the likely ones.

    The estimator is ``pipeline.estimator.online.OnlineEstimator``: warm-started from
    ``depo.estimator_dir`` when given, trained after every step on a replay buffer of every
    observed prompt (``depo.minibatches`` × ``depo.minibatch_size``), its zero-variance head
    Platt-calibrated on its own pre-rollout predictions. The drop rule is
    ``depo_drop_decision`` at the operating point (``depo.filter_ratio``, ``depo.threshold``).

    Warm-up (§3.2): for the first ``depo.warmup_steps`` nothing is dropped; the rule is still
    evaluated, and since every rolled-out candidate's outcome is then observed, its precision
    and recall are measured. After warm-up a dropped prompt is never rolled out, so a seeded
    ``depo.audit_fraction`` of the would-be-dropped candidates is rolled out anyway (counted as
    kept, not filtered); they keep ``depo/precision`` measured, and ``depo/recall`` is estimated
    from them and the kept prompts (see ``_drop_quality``). Audits cost rollouts: at the
    defaults (2B candidates, at most half of them would-drop, 5% of those audited) an audited
    prompt takes about one batch slot in twenty.

    Each step's decisions (candidates, Ẑ, p̂, would-drop, rolled) wait in ``pending`` until
    that step's ``update``: with one-step-off-policy batches the filter of step t+1 runs before
    the update of step t, and a checkpoint between them keeps both.

    Placement (``MethodSetting``): only the rank that samples (global rank 0) builds, runs and
    trains the estimator, on its device (``sampling_device``: its GPU under NCCL, the CPU under
    gloo); it broadcasts each step's ``SelectedPrompts``, the filter metrics and the candidates'
    p̂ (a few KiB) to the other ranks, which hold no estimator, checkpoint none and ignore rank
    0's state on load (the checkpoint holds rank 0's, which every rank reads). Cost at the staged
    H100 default (``recipes.campaigns.h100_staged_rl``: B = 128, 2B = 256 candidates scored and
    4 × 32 questions trained a step, MiniLM-L6 with 22.6 M parameters, fp32):

    * memory, on that one GPU: weights 86 MiB, gradients 86 MiB, AdamW state 172 MiB, plus one
      minibatch's activations while it trains: 473 MiB for 32 questions of 68 tokens, 3.0 GiB at
      MiniLM's 256-token limit (saved tensors measured with the CPU's eager attention, which keeps
      the T × T probabilities): 0.8 to 3.4 GiB beside rank 0's actor. Before, each of the 16 ranks
      of 2 × 8 H100 held the 344 MiB of state in host memory (5.5 GiB in all) and its activations.
    * time: 9.2e11 FLOPs a step at 68-token questions (3.5e12 at 256; ``estimator_flops``), on
      one H100 about 0.05 s (0.17 s) at 30% of its 67 TFLOPS fp32 peak, plus a few hundredths of
      a second of kernel launches and tokenization: a model, not measured on a GPU. Before, every
      rank spent 8.1 s (38 s) of one CPU thread a step on it, the tiny encoder 0.12 s, measured on
      a shared 2-core CPU by ``.venv/bin/python -m tests.estimator.step_timing --encoder minilm
      --question-tokens 64`` (it joins problems to at least 64 tokens: 68 on average;
      ``--question-tokens 256``; ``--encoder tiny``); the other ranks now wait for rank 0 at the
      broadcast instead.

    The estimator's dropout draws from a stream of its own (``pipeline.estimator.online``), so
    training it on rank 0 alone moves none of the actor's random generators.
    """

    # A step needs groups to compare: when the filter would leave fewer prompts, the least
    # likely zero-variance candidates are rolled out anyway (and counted as not filtered).
    MIN_PROMPTS = 2
    _PENDING_PREFIX = "pending."

    def __init__(self, cfg: AlgorithmConfig, setting: MethodSetting) -> None:
        depo = cfg.depo
        self.cfg = depo
        self.stats = setting.stats
        self.seed = setting.seed
        # The event predicted, labelled and dropped on: all of G samples equal, G the update group
        # or (zero_variance_samples) the pool a sampler such as Ada-Seq draws before giving up.
        self.group_size = depo.zero_variance_samples or setting.group_size
        self.broadcast = setting.broadcast_from_sampling_rank
        self.pending: dict[int, dict[str, torch.Tensor]] = {}
        # Only the rank that samples holds an estimator; the others receive its decisions.
        self.online = self._build_estimator(cfg, setting) if setting.is_sampling_rank else None

    def _build_estimator(self, cfg: AlgorithmConfig, setting: MethodSetting) -> Any:
        from pipeline.estimator import DifficultyEstimator, EstimatorTrainer
        from pipeline.estimator.online import OnlineEstimator

        depo = cfg.depo
        # Built on the CPU from a seeded CPU generator, then moved: the same weights on any device, and
        # building it does not shift the actor's random stream (only the CPU generator is forked and
        # seeded, so no GPU's generator is touched).
        with torch.random.fork_rng(devices=[]):
            torch.random.default_generator.manual_seed(setting.seed)
            if depo.estimator_dir is not None:
                model = DifficultyEstimator.load(depo.estimator_dir)
            elif depo.encoder == "minilm":
                model = DifficultyEstimator.from_pretrained_minilm(depo.cache_dir)
            else:
                model = DifficultyEstimator.tiny()
        model.to(setting.sampling_device)
        lr = depo.lr if depo.lr is not None else DEPO_ONLINE_LR[model.kind]
        trainer = EstimatorTrainer(model, group_size=self.group_size, lr=lr, w_distill=depo.w_distill,
                                   w_rank=depo.w_rank, margin=depo.margin, w_zero_variance=depo.w_zero_variance)
        return OnlineEstimator(trainer, setting.texts, replay_size=depo.replay_size, minibatches=depo.minibatches,
                               minibatch_size=depo.minibatch_size, calibration_window=depo.calibration_window,
                               seed=setting.seed)

    @property
    def trainer(self) -> Any:
        """The ``EstimatorTrainer`` (its model is what the step's FLOP count charges the estimator for); None on
        a rank that does not sample, so the estimator is charged once, by the rank that runs it."""
        return self.online.trainer if self.online is not None else None

    def num_candidates(self, batch_size: int) -> int:
        return math.ceil(batch_size * self.cfg.oversample)

    @property
    def needs_question_logprobs(self) -> bool:
        return self.cfg.w_distill > 0

    def __call__(self, candidates: torch.Tensor, *, batch_size: int, step: int) -> tuple[SelectedPrompts, Metrics]:
        """The step's decision, made on the rank that samples and broadcast to every rank.

        A collective: every rank calls the filter at the same point of the loop
        (``pipeline.rl.step.plan_step``). One pickled broadcast a step of the selection, the metrics
        and the candidates' p̂: about 6 KiB for 256 candidates, a millisecond or so at 7B on 8×H100.
        """
        decision = self._decide(candidates, batch_size=batch_size, step=step) if self.online is not None else None
        selected, metrics, pass_rate = self.broadcast(decision)
        # Every rank's statistics store records the predictions, so every rank holds the same store.
        unique, inverse = candidates.unique(return_inverse=True)
        self.stats.set_column("estimator_prediction", prompt_ids=unique,
                              values=torch.zeros(unique.numel(), dtype=torch.float64).scatter_(0, inverse, pass_rate))
        return selected, metrics

    def _decide(self, candidates: torch.Tensor, *, batch_size: int, step: int
                ) -> tuple[SelectedPrompts, Metrics, torch.Tensor]:
        """(selection, metrics, every candidate's predicted pass rate ``(C,)``) from the estimator."""
        prediction = self.online.predict(candidates)  # (C,) each
        would_drop, decision_metrics = depo_drop_decision(zero_variance_prob=prediction.zero_variance_prob,
                                                          filter_ratio=self.cfg.filter_ratio,
                                                          threshold=self.cfg.threshold)
        active = step >= self.cfg.warmup_steps
        audited = torch.zeros_like(would_drop)
        if active and self.cfg.audit_fraction > 0:
            # Even seeds audit, odd ones draw the estimator's replay minibatches (OnlineEstimator).
            generator = torch.Generator().manual_seed((self.seed * 1_000_003 + step) * 2)
            draws = torch.rand(candidates.numel(), generator=generator, dtype=torch.float64)  # (C,)
            audited = would_drop & (draws < self.cfg.audit_fraction)
        drop = would_drop & ~audited if active else torch.zeros_like(would_drop)
        minimum = min(self.MIN_PROMPTS, candidates.numel())
        shortfall = minimum - int((~drop).sum())
        if shortfall > 0:
            least_likely = torch.argsort(prediction.zero_variance_prob, stable=True)  # (C,) ascending
            drop[least_likely[drop[least_likely]][:shortfall]] = False
        kept = (~drop).nonzero().squeeze(1)[:batch_size]  # (P,)
        rolled = torch.zeros_like(drop)
        rolled[kept] = True
        self.pending[step] = {"candidates": candidates.clone(), "pass_rate": prediction.pass_rate,
                              "zero_variance_logit": prediction.zero_variance_logit, "would_drop": would_drop,
                              "rolled": rolled}
        num_candidates = max(candidates.numel(), 1)
        metrics = {
            "depo/filter_active": float(active),
            "depo/filter_ratio": float(drop.sum()) / num_candidates,
            "depo/would_drop_ratio": decision_metrics["depo/filter_ratio"],
            "depo/above_threshold_fraction": decision_metrics["depo/above_threshold_fraction"],
            "depo/zero_variance_prob_mean": decision_metrics["depo/zero_variance_prob_mean"],
            "depo/audited": float((audited & rolled).sum()),
        }
        selected = SelectedPrompts(candidates[kept], prediction.pass_rate[kept], candidates[drop])
        return selected, metrics, prediction.pass_rate

    def update(self, end: StepEnd) -> Metrics:
        """Train the estimator on the step's outcome (the rank that samples; nothing elsewhere)."""
        if self.online is None:
            return {}
        rollouts = end.pool
        record = self.pending.pop(end.step, None)
        for stale in [step for step in self.pending if step < end.step]:
            del self.pending[stale]
        num_samples = rollouts.num_samples_per_prompt()  # (P,)
        rolled = num_samples > 0
        if not bool(rolled.any()):
            return self._encoded_tokens()
        pass_rates = rollouts.num_correct_per_prompt().double() / num_samples.clamp(min=1)  # (P,)
        targets = zero_variance_targets(rewards=rollouts.rewards, group_ids=rollouts.group_ids,
                                        group_size=self.group_size, num_groups=rollouts.num_prompts)  # (P,)
        indices = rollouts.prompt_indices
        question_logprobs = (torch.full((rollouts.num_prompts,), math.nan, dtype=torch.float64)
                             if end.question_logprobs is None else end.question_logprobs.double())
        predicted_logits = torch.full((rollouts.num_prompts,), math.nan, dtype=torch.float64)  # (P,)
        if record is not None:
            logit_of = dict(zip(record["candidates"].tolist(), record["zero_variance_logit"].tolist()))
            predicted_logits = torch.tensor([logit_of.get(i, math.nan) for i in indices.tolist()], dtype=torch.float64)
        metrics = self.online.learn(step=end.step, prompt_indices=indices[rolled], pass_rates=pass_rates[rolled],
                                    zero_variance_targets=targets[rolled], question_logprobs=question_logprobs[rolled],
                                    predicted_zero_variance_logits=predicted_logits[rolled])
        zero_variance = observed_zero_variance(rewards=rollouts.rewards, group_ids=rollouts.group_ids,
                                               num_groups=rollouts.num_prompts)[rolled]
        metrics["depo/observed_zero_variance_fraction"] = float(zero_variance.double().mean())
        if record is not None:
            metrics.update(self._drop_quality(record, indices=indices[rolled], pass_rates=pass_rates[rolled],
                                              targets=targets[rolled]))
        return {**metrics, **self._encoded_tokens()}

    @staticmethod
    def _drop_quality(record: dict[str, torch.Tensor], *, indices: torch.Tensor, pass_rates: torch.Tensor,
                      targets: torch.Tensor) -> Metrics:
        """Precision and recall of the step's drop rule, from the candidates that were rolled out.

        The candidates fall in two classes, would-drop (D) and keep (K). Each class's
        zero-variance rate is the mean observed label of its rolled-out members: in warm-up
        the first B candidates in stream order, after it the audited part of D and the first
        kept part of K; both are unbiased samples of their class. Then precision = rate_D and
        recall = |D|·rate_D / (|D|·rate_D + |K|·rate_K), reported only where the classes they
        need have a rolled-out member (``depo/precision_support`` counts D's). Labels are
        ``zero_variance_targets`` (exactly the all-equal event for a group of G).
        """
        target_of: dict[int, float] = {}
        pass_rate_of: dict[int, float] = {}
        for index, target, pass_rate in zip(indices.tolist(), targets.tolist(), pass_rates.tolist()):
            pass_rate_of.setdefault(index, pass_rate)
            if not math.isnan(target):
                target_of.setdefault(index, target)
        candidates, rolled, would_drop = record["candidates"].tolist(), record["rolled"], record["would_drop"]
        labels = torch.tensor([target_of.get(index, math.nan) if was_rolled else math.nan
                               for index, was_rolled in zip(candidates, rolled.tolist())], dtype=torch.float64)
        known = ~torch.isnan(labels)  # (C,)
        metrics: Metrics = {"depo/precision_support": float((would_drop & known).sum())}
        rates: dict[bool, float | None] = {}
        for dropped in (True, False):
            members = (would_drop == dropped) & known
            rates[dropped] = float(labels[members].mean()) if bool(members.any()) else None
        num_drop = int(would_drop.sum())
        num_keep = would_drop.numel() - num_drop
        if rates[True] is not None:
            metrics["depo/precision"] = rates[True]
        if (num_drop == 0 or rates[True] is not None) and (num_keep == 0 or rates[False] is not None):
            true_positive = num_drop * (rates[True] or 0.0)
            false_negative = num_keep * (rates[False] or 0.0)
            if true_positive + false_negative > 0:
                metrics["depo/recall"] = true_positive / (true_positive + false_negative)
        scored = [(float(record["pass_rate"][k]), pass_rate_of[index]) for k, index in enumerate(candidates)
                  if bool(rolled[k]) and index in pass_rate_of]
        if scored:
            metrics["depo/prediction_mae"] = sum(abs(p - q) for p, q in scored) / len(scored)
        return metrics

    def _encoded_tokens(self) -> Metrics:
        """The tokens the estimator has read in this run, scoring and training (cumulative: the campaign ledger's)."""
        return {"depo/encoded_tokens": float(sum(self.trainer.model.num_encoded_tokens.values()))}

    def state_dict(self) -> dict[str, Any]:
        """The estimator's state and the pending decisions; empty on a rank that does not sample (the
        checkpoint holds global rank 0's, the rank that samples)."""
        if self.online is None:
            return {"tensors": {}, "json": {}}
        state = self.online.state_dict()
        tensors = dict(state["tensors"])
        for step, record in self.pending.items():
            tensors.update({f"{self._PENDING_PREFIX}{step}.{name}": tensor.clone() for name, tensor in record.items()})
        return {"tensors": tensors, "json": {**state["json"], "pending_steps": sorted(self.pending)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the sampling rank's state; every rank reads the checkpoint, and the others only check
        that it is one this version resumes (so every rank refuses an old one, none waits for the rest)."""
        meta = dict(state["json"])
        if "replay" not in meta:
            raise CheckpointError("the checkpoint's DEPO filter state predates its replay buffer and calibration; "
                                  "resume it with the winnow version that wrote it, or start a new run")
        if self.online is None:
            return
        steps = meta.pop("pending_steps")
        pending_tensors = {name: tensor for name, tensor in state["tensors"].items()
                           if name.startswith(self._PENDING_PREFIX)}
        self.pending = {}
        for step in steps:
            prefix = f"{self._PENDING_PREFIX}{step}."
            self.pending[int(step)] = {name.removeprefix(prefix): tensor.clone()
                                       for name, tensor in pending_tensors.items() if name.startswith(prefix)}
        self.online.load_state_dict({"tensors": {name: tensor for name, tensor in state["tensors"].items()
                                                 if not name.startswith(self._PENDING_PREFIX)}, "json": meta})


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
