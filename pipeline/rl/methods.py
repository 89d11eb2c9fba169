"""The update-side methods of the loop: advantage, sample selection, token weighting, loss, temperature.

Five registries of ``Method`` factories (see ``pipeline/rl/registry.py`` for the shape);
``build_methods`` picks one entry per slot by the config's names. The call contract of
each slot:

``ADVANTAGES``       ``(rewards=, group_ids=, pool_rewards=, pool_group_ids=) -> (advantages, metrics)``,
                     all ``(S,)``; the ``pool_*`` tensors are every sample drawn for the trained
                     prompts (Reinforce-Ada's pool), which only a pool-level baseline reads.
``SAMPLE_SELECTORS`` ``(advantages=, rewards=, group_ids=, seed=) -> ((keep_mask, advantages), metrics)``;
                     ``keep_mask`` ``(S,)`` bool, the advantages the update uses (PODS
                     re-normalises inside the subset, D³S does not).
``TOKEN_WEIGHTS``    ``(advantages=, entropy=, logprobs=, response_mask=, group_ids=, sample_keep_mask=)
                     -> (weights, metrics)``; ``advantages`` ``(S,)``, the rest ``(S, T)``; ``weights``
                     non-negative ``(S, T)`` without gradient.
``ROLLOUT_CORRECTIONS`` ``(old_logprobs=, engine_logprobs=, response_mask=) -> ((weights, keep), metrics)``,
                     all ``(S, T)``: importance weights for the engine/trainer gap (TIS), or a keep
                     mask (MIS); applied before the token weightings.
``POLICY_LOSSES``    a ``pipeline.trainer.losses.PolicyLoss`` (``method.loss``) the actor minimises.
``TEMPERATURES``     ``method.value``: τ of the next rollout; ``update`` may change it (E3).

The D³S schedule (N_s samples and K% tokens per step) is one object shared by the D³S
selectors and the D³S top-K weighting, advanced once per step by its own ``update`` and
checkpointed once as ``d3s_schedule``. PODS keeps its own fixed N (``algorithm.pods``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from pipeline.algorithms.advantages import (
    dr_grpo_advantages,
    global_baseline_advantages,
    grpo_advantages,
    rloo_advantages,
)
from pipeline.algorithms.cw_grpo import cw_grpo_token_weights
from pipeline.algorithms.d3s import D3SSchedule, d3s_cross_select, d3s_intra_select, d3s_topk_token_weights
from pipeline.algorithms.e3 import TemperatureScheduler
from pipeline.algorithms.losses import grpo_loss, gspo_loss
from pipeline.algorithms.pods import pods_select
from pipeline.algorithms.reinforce_ada import balanced_downsample
from pipeline.algorithms.rollout_correction import rollout_correction
from pipeline.config import AlgorithmConfig
from pipeline.rl.registry import Method, MethodSetting, Metrics, Registry, StepEnd, float_metrics
from pipeline.trainer.losses import PolicyLoss

ADVANTAGES = Registry("advantage")
SAMPLE_SELECTORS = Registry("sample selector")
TOKEN_WEIGHTS = Registry("token weighting")
POLICY_LOSSES = Registry("policy loss")
TEMPERATURES = Registry("temperature")
ROLLOUT_CORRECTIONS = Registry("rollout correction")

D3S_SCHEDULE = "d3s_schedule"


# ---------------------------------------------------------------------------- the D³S schedule


class D3SScheduleMethod(Method):
    """D³S Eq. 9's linear N_s and K schedule over the run (held at the initial values unless ``d3s.dynamic``)."""

    def __init__(self, cfg: AlgorithmConfig, setting: MethodSetting) -> None:
        d3s = cfg.d3s
        self.schedule = D3SSchedule(
            total_steps=setting.total_steps,
            num_keep_init=min(d3s.num_keep_init, setting.group_size),
            num_keep_final=min(d3s.num_keep_final, setting.group_size),
            keep_ratio_init=d3s.keep_ratio_init, keep_ratio_final=d3s.keep_ratio_final, dynamic=d3s.dynamic)

    def current(self) -> tuple[int, float]:
        """``(N_s, K)`` for this step."""
        return self.schedule.current()

    def update(self, end: StepEnd) -> Metrics:  # noqa: ARG002 - one optimizer step passed
        self.schedule.update()
        return {}

    def state_dict(self) -> dict[str, Any]:
        return self.schedule.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.schedule.load_state_dict(state)


def d3s_schedule(cfg: AlgorithmConfig, setting: MethodSetting) -> D3SScheduleMethod:
    return setting.shared(D3S_SCHEDULE, lambda: D3SScheduleMethod(cfg, setting))


# ---------------------------------------------------------------------------- advantages


class GroupAdvantage(Method):
    """An advantage computed from the trained samples of each prompt's group alone."""

    def __init__(self, cfg: AlgorithmConfig, setting: MethodSetting, *, function: Callable) -> None:  # noqa: ARG002
        self.function = function

    def __call__(self, *, rewards: torch.Tensor, group_ids: torch.Tensor, pool_rewards: torch.Tensor,  # noqa: ARG002
                 pool_group_ids: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        return self.function(rewards=rewards, group_ids=group_ids)


ADVANTAGES.add("grpo", partial(GroupAdvantage, function=grpo_advantages))
ADVANTAGES.add("dr_grpo", partial(GroupAdvantage, function=dr_grpo_advantages))
ADVANTAGES.add("rloo", partial(GroupAdvantage, function=rloo_advantages))


@ADVANTAGES.register("global_baseline")
class PoolBaselineAdvantage(Method):
    """Reinforce-Ada's A = w(r̄)·(r − r̄), with r̄ over every sample drawn for the prompt (the pool)."""

    def __init__(self, cfg: AlgorithmConfig, setting: MethodSetting) -> None:  # noqa: ARG002
        self.weight = cfg.baseline_weight

    def __call__(self, *, rewards: torch.Tensor, group_ids: torch.Tensor, pool_rewards: torch.Tensor,
                 pool_group_ids: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        return global_baseline_advantages(rewards=rewards, group_ids=group_ids, pool_rewards=pool_rewards,
                                          pool_group_ids=pool_group_ids, weight=self.weight)


# ---------------------------------------------------------------------------- sample selection


@SAMPLE_SELECTORS.register("none")
class KeepAll(Method):
    def __init__(self, cfg: AlgorithmConfig, setting: MethodSetting) -> None:
        pass

    def __call__(self, *, advantages: torch.Tensor, rewards: torch.Tensor, group_ids: torch.Tensor,  # noqa: ARG002
                 seed: int) -> tuple[tuple[torch.Tensor, torch.Tensor], Metrics]:
        return (torch.ones(advantages.numel(), dtype=torch.bool), advantages), {}


class SubsetSelector(Method):
    """Keep ``num_keep`` samples per group: N_s from the D³S schedule, else a fixed N (``fixed_keep`` of the
    config, capped at the group size), else the group size."""

    def __init__(self, cfg: AlgorithmConfig, setting: MethodSetting, *, function: Callable,
                 scheduled: bool, fixed_keep: Callable[[AlgorithmConfig], int] | None = None) -> None:
        self.function = function
        self.schedule = d3s_schedule(cfg, setting) if scheduled else None
        self.num_keep = setting.group_size if fixed_keep is None else min(fixed_keep(cfg), setting.group_size)

    def __call__(self, *, advantages: torch.Tensor, rewards: torch.Tensor, group_ids: torch.Tensor,
                 seed: int) -> tuple[tuple[torch.Tensor, torch.Tensor], Metrics]:
        num_keep = self.schedule.current()[0] if self.schedule is not None else self.num_keep
        return self.function(advantages=advantages, rewards=rewards, group_ids=group_ids, num_keep=num_keep,
                             generator=torch.Generator().manual_seed(seed))


SAMPLE_SELECTORS.add("d3s_intra", partial(SubsetSelector, function=d3s_intra_select, scheduled=True))
SAMPLE_SELECTORS.add("d3s_cross", partial(SubsetSelector, function=d3s_cross_select, scheduled=True))
# PODS keeps a fixed N of the G samples for the whole run (``algorithm.pods.num_keep``).
SAMPLE_SELECTORS.add("pods", partial(SubsetSelector, function=pods_select, scheduled=False,
                                     fixed_keep=lambda cfg: cfg.pods.num_keep))
SAMPLE_SELECTORS.add("balanced", partial(SubsetSelector, function=balanced_downsample, scheduled=False))


# ---------------------------------------------------------------------------- token weighting


@TOKEN_WEIGHTS.register("d3s_topk")
class D3STopK(Method):
    """D³S §3.2: 0/1 weights keeping the top K% tokens by |A|·H (K from the shared schedule)."""

    needs_token_stats = True

    def __init__(self, cfg: AlgorithmConfig, setting: MethodSetting) -> None:
        self.schedule = d3s_schedule(cfg, setting)
        self.scope = cfg.d3s.token_scope

    def __call__(self, *, advantages, entropy, logprobs, response_mask, group_ids,
                 sample_keep_mask) -> tuple[torch.Tensor, Metrics]:
        return d3s_topk_token_weights(advantages=advantages, entropy=entropy, logprobs=logprobs,
                                      response_mask=response_mask, group_ids=group_ids,
                                      keep_ratio=self.schedule.current()[1], scope=self.scope,
                                      sample_keep_mask=sample_keep_mask)


@TOKEN_WEIGHTS.register("cw_grpo")
class CovarianceWeights(Method):
    """CW-GRPO: Gaussian re-weighting of tokens by their advantage–log-prob covariance."""

    needs_token_stats = True

    def __init__(self, cfg: AlgorithmConfig, setting: MethodSetting) -> None:  # noqa: ARG002
        self.scope = cfg.cw_grpo_scope

    def __call__(self, *, advantages, entropy, logprobs, response_mask, group_ids,
                 sample_keep_mask) -> tuple[torch.Tensor, Metrics]:  # noqa: ARG002
        return cw_grpo_token_weights(advantages=advantages, entropy=entropy, logprobs=logprobs,
                                     response_mask=response_mask, group_ids=group_ids, scope=self.scope)


# ---------------------------------------------------------------------------- rollout correction


@ROLLOUT_CORRECTIONS.register("none")
class NoCorrection(Method):
    def __init__(self, cfg: AlgorithmConfig, setting: MethodSetting) -> None:
        pass

    def __call__(self, *, old_logprobs, engine_logprobs, response_mask) -> tuple[tuple[None, None], Metrics]:  # noqa: ARG002
        return (None, None), {}


class ImportanceCorrection(Method):
    """Truncated (TIS) or masked (MIS) importance ratios π_old/π_rollout, per token or per sample."""

    needs_token_stats = True  # π_old: the trainer's log-probs of the rollout's tokens

    def __init__(self, cfg: AlgorithmConfig, setting: MethodSetting, *, mode: str) -> None:  # noqa: ARG002
        self.mode, self.cfg = mode, cfg.correction

    def __call__(self, *, old_logprobs, engine_logprobs, response_mask):
        (weights, keep), metrics = rollout_correction(
            old_logprobs=old_logprobs, engine_logprobs=engine_logprobs, response_mask=response_mask, mode=self.mode,
            level=self.cfg.level, upper=self.cfg.upper, lower=self.cfg.lower)
        return (weights, keep), {f"correction/{name}": value for name, value in metrics.items()}


ROLLOUT_CORRECTIONS.add("tis", partial(ImportanceCorrection, mode="truncate"))
ROLLOUT_CORRECTIONS.add("mis", partial(ImportanceCorrection, mode="mask"))


# ---------------------------------------------------------------------------- policy losses


class ClippedPolicyLoss(Method):
    """A clipped policy-gradient loss with the config's clip range, aggregation, KL and entropy terms."""

    def __init__(self, cfg: AlgorithmConfig, setting: MethodSetting, *, function: Callable) -> None:
        # L_max of Dr. GRPO's constant normaliser is the generation budget (read by that aggregation only).
        self.loss = PolicyLoss(function, aggregation=cfg.aggregation, eps_low=cfg.eps_low, eps_high=cfg.eps_high,
                               kl_coef=cfg.kl_coef, entropy_coef=cfg.entropy_coef,
                               max_response_length=setting.max_new_tokens or None)


POLICY_LOSSES.add("grpo", partial(ClippedPolicyLoss, function=grpo_loss))
POLICY_LOSSES.add("gspo", partial(ClippedPolicyLoss, function=gspo_loss))


# ---------------------------------------------------------------------------- temperature


@TEMPERATURES.register("fixed")
class FixedTemperature(Method):
    def __init__(self, cfg: AlgorithmConfig, setting: MethodSetting) -> None:  # noqa: ARG002
        self.value = setting.temperature

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


@TEMPERATURES.register("e3")
class E3Temperature(Method):
    """E3 Eq. 4–5: τ follows the policy's entropy towards a (cosine-annealed) target, from τ₀ = ``temperature``."""

    needs_token_stats = True

    def __init__(self, cfg: AlgorithmConfig, setting: MethodSetting) -> None:
        e3, steps = cfg.e3, setting.total_steps
        anneal = e3.anneal_start_fraction
        self.scheduler = TemperatureScheduler(
            vocab_size=setting.vocab_size, initial_temperature=setting.temperature,
            min_temperature=e3.min_temperature, max_temperature=e3.max_temperature,
            anneal_start=None if anneal is None else int(anneal * steps),
            max_steps=None if anneal is None else steps, eta=e3.eta)
        self.value = setting.temperature

    def update(self, end: StepEnd) -> Metrics:
        self.value, metrics = self.scheduler.update(entropy=end.mean_entropy, step=end.step)
        return float_metrics(metrics)

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])
        self.scheduler.load_state_dict(state["scheduler"])


# ---------------------------------------------------------------------------- the set a run uses


@dataclass(slots=True)
class Methods:
    """One method per slot, built once from the config, plus the components they share."""

    advantage: Method
    sample_selector: Method
    rollout_correction: Method
    token_weightings: list[Method]
    policy_loss: Method
    temperature: Method
    shared: dict[str, Method] = field(default_factory=dict)

    @property
    def loss(self) -> PolicyLoss:
        return self.policy_loss.loss

    def components(self) -> dict[str, Method]:
        """Every method by its checkpoint name (shared components once)."""
        return {"advantage": self.advantage, "sample_selector": self.sample_selector,
                "rollout_correction": self.rollout_correction,
                **{f"token_weights.{i}": method for i, method in enumerate(self.token_weightings)},
                "policy_loss": self.policy_loss, "temperature": self.temperature, **self.shared}

    @property
    def needs_token_stats(self) -> bool:
        """Whether log-probs and entropies are needed before the update (token weights, E3's τ)."""
        return any(method.needs_token_stats for method in self.components().values())

    def token_weights(self, *, advantages: torch.Tensor, entropy: torch.Tensor | None,
                      logprobs: torch.Tensor | None, engine_logprobs: torch.Tensor | None,
                      response_mask: torch.Tensor, group_ids: torch.Tensor,
                      keep_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Metrics]:
        """The rollout correction, then the configured token weightings, multiplied; (weights, token_mask, metrics).

        MIS and D³S top-K yield 0/1 weights that define the token mask; later weightings
        (CW-GRPO) see only the kept tokens, so CW's mean weight is 1 over the tokens in the loss.
        """
        weights = keep_mask[:, None].to(torch.float32) * response_mask  # (S, T)
        token_mask = response_mask & keep_mask[:, None]  # (S, T)
        (correction, kept), metrics = self.rollout_correction(
            old_logprobs=logprobs, engine_logprobs=engine_logprobs, response_mask=token_mask)
        if correction is not None:
            weights = weights * correction.to(weights.dtype)
            token_mask = token_mask & kept
        for weighting in self.token_weightings:
            w, m = weighting(advantages=advantages, entropy=entropy, logprobs=logprobs, response_mask=token_mask,
                             group_ids=group_ids, sample_keep_mask=keep_mask)
            weights = weights * w
            token_mask = token_mask & w.bool()  # weights are non-negative: non-zero means kept
            metrics.update(m)
        return weights, token_mask, metrics

    def end_step(self, end: StepEnd) -> Metrics:
        """The end-of-step hook: every method's ``update``, in slot order."""
        metrics: Metrics = {}
        for method in self.components().values():
            metrics.update(method.update(end))
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {name: state for name, method in self.components().items() if (state := method.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, method in self.components().items():
            if name in state:
                method.load_state_dict(state[name])


def build_methods(cfg: AlgorithmConfig, setting: MethodSetting) -> Methods:
    return Methods(
        advantage=ADVANTAGES.build(cfg.advantage, cfg, setting),
        sample_selector=SAMPLE_SELECTORS.build(cfg.sample_selector, cfg, setting),
        rollout_correction=ROLLOUT_CORRECTIONS.build(cfg.rollout_correction, cfg, setting),
        token_weightings=[TOKEN_WEIGHTS.build(name, cfg, setting) for name in cfg.token_weights],
        policy_loss=POLICY_LOSSES.build(cfg.loss, cfg, setting),
        temperature=TEMPERATURES.build(cfg.temperature, cfg, setting),
        shared=dict(setting.shared_components),
    )
