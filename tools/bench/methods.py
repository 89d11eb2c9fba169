"""Per-mechanism benchmarks: each paper's mechanism in the regime it needs, against GRPO at equal FLOPs.

    .venv/bin/python -m tools.bench.methods --scenario depo                  # 6 seeds, the scenario's budget
    .venv/bin/python -m tools.bench.methods --scenario depo --seeds 2 --flops-budget 2e12 --lr-check 1e-4
    nohup nice -n 10 .venv/bin/python -m tools.bench.methods --scenario e3 > e3.log 2>&1 &   # long: background

The sample-efficiency race (``tools.bench.race``) compares methods at a fixed number of steps on
one pool, where most methods spend the same rollouts by construction and a mechanism that needs
waste, large groups or many passes has nothing to act on. Here each paper gets a **scenario**: a
pool and settings in which its mechanism can act (each scenario function's docstring states the
regime the paper needs and why this pool gives it), its arms, and GRPO arms paired on seeds.

**Cost.** Every run is charged the model FLOPs its RL loop logs (``flops/cumulative/total`` of
``metrics.jsonl``: generation, prefill, update and the difficulty estimator, counted by
``pipeline.stats.flops``), and runs until the first evaluation point whose cumulative FLOPs reach
the scenario's budget (``--flops-budget``), or its step cap (``--max-steps``, the horizon of every
schedule that depends on the run length: D³S's N_s/K ramp, E3's annealing). A run that hits the
cap first is extended at its last score to the budget and marked short in the table. An arm's
one-off cost before RL (the DEPO offline estimator's curation and training) is reported beside the
area, not in it.

**Evaluation.** Every ``--eval-every`` steps the policy samples ``--eval-samples`` answers to each
held-out problem (the test split of the scenario's levels, ``--heldout-per-level`` each) at the RL
temperature with one sampling seed for every arm, seed and step: pass@1, pass@k for the scenario's
k, and pass@1 by category (difficulty level ``d3``; ``mul`` for problems with a product, ``addsub``
for the others).

**Metrics** (per arm, over seeds; paired = the same seed's run of the arm it is compared with):

* **area**: the area under held-out pass@1 against FLOPs on [0, budget] (trapezoid, the point at the
  budget interpolated between evaluations), divided by the budget: the mean pass@1 over the budget.
  Paired difference to each arm in ``compare_to``, with a 95% bootstrap interval over seeds
  (10,000 resamples of the seeds' differences, percentile interval).
* **FLOPs to half gain**: FLOPs to reach base + ½·(the target baseline's mean pass@1 at the budget −
  base), linearly interpolated between evaluations; seeds that never reach it are counted as not
  reached; the paired ratio over seeds where both arms reached it, with its bootstrap interval.
* each scenario's own judgement: E3 pass@16 at the budget and entropy kept (the last evaluation
  window's mean entropy over the first step's); CW-GRPO the drop from peak pass@1 to the budget;
  D³S pass@1 and update FLOPs at the last evaluation step both arms reached (equal steps).

``--lr-check LR`` also runs seed 0 of every arm at learning rate LR (the CPU rate was tuned for
GRPO alone); the table shows each arm's area and its difference to its comparison there.

**What this toy cannot test**: token-level selection on answers of ~18 tokens (D³S's top-K and
CW-GRPO's weights act on a handful of tokens a sample), an estimator's reading of long problem
statements (arithmetic difficulty is in the digits), or exploration the policy cannot do at all
(the base policy solves no difficulty-4 or -5 problem in 32 samples).

Resumable: ``<out>/<scenario>/results/<arm>/seed<k>.json`` is written when a run finishes and
reused; an unfinished run resumes from its checkpoint (saved at every evaluation point) with the
evaluations it had. Settings that change what a run measures are checked against the scenario
folder's ``settings.json``. Outputs: ``<out>/<scenario>.json`` and ``<out>/<scenario>.png``
(``tools.bench.report``) and a printed table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from tools.bench.chunks import reuse_or_run, train_in_chunks

BOOTSTRAP_RESAMPLES = 10_000
CONFIDENCE = 0.95
MEASURE_DIR = "measure"
ESTIMATOR_DIR = "estimator"
PoolKind = Literal["pool", "oracle", "band"]
Judgement = Literal["none", "e3", "cw_grpo", "d3s"]


# --------------------------------------------------------------------------- metrics


def cut_at_budget(points: Sequence[tuple[float, float]], budget: float) -> tuple[list[tuple[float, float]], bool]:
    """``(flops, score)`` points (ascending FLOPs, the first at 0) up to ``budget``, the last one at it.

    The score at the budget is interpolated linearly between the evaluations around it; a curve that
    ends before the budget is extended at its last score (the second value is then False: short).
    """
    if not points or points[0][0] != 0:
        raise ValueError("a curve starts with its step-0 point at 0 FLOPs")
    if budget <= 0:
        raise ValueError(f"budget must be positive, got {budget}")
    kept = [points[0]]
    for (f0, s0), (f1, s1) in zip(points, points[1:]):
        if f1 < f0:
            raise ValueError(f"FLOPs decrease along the curve ({f0} then {f1})")
        if f1 >= budget:
            score = s1 if f1 == f0 else s0 + (s1 - s0) * (budget - f0) / (f1 - f0)
            kept.append((budget, score))
            return kept, True
        kept.append((f1, s1))
    kept.append((budget, kept[-1][1]))
    return kept, False


def area_under_curve(points: Sequence[tuple[float, float]], budget: float) -> float:
    """The trapezoid area under ``points`` on [0, budget] (``cut_at_budget``) over ``budget``."""
    cut, _ = cut_at_budget(points, budget)
    return sum((f1 - f0) * (s0 + s1) / 2 for (f0, s0), (f1, s1) in zip(cut, cut[1:])) / budget


def flops_to_reach(points: Sequence[tuple[float, float]], target: float, budget: float) -> float | None:
    """The FLOPs at which the curve first reaches ``target`` within the budget, interpolated linearly
    between the two evaluations around the crossing; None: not reached."""
    cut, _ = cut_at_budget(points, budget)
    # A score equal to the target reaches it: the target is computed (base + ½ gain), so allow its rounding.
    target -= 1e-12
    if cut[0][1] >= target:
        return 0.0
    for (f0, s0), (f1, s1) in zip(cut, cut[1:]):
        if s1 >= target:
            return f0 + (f1 - f0) * max(target - s0, 0.0) / (s1 - s0)
    return None


def half_gain_target(base: float, baseline_at_budget: Sequence[float]) -> float:
    """base + ½·(the baseline's mean score at the budget − base)."""
    return base + 0.5 * (statistics.fmean(baseline_at_budget) - base)


def bootstrap_interval(values: Sequence[float], *, resamples: int = BOOTSTRAP_RESAMPLES, confidence: float = CONFIDENCE,
                       seed: int = 0) -> dict[str, Any]:
    """Mean of per-seed ``values`` and the percentile bootstrap interval of that mean over seeds.

    ``low``/``high`` are None with fewer than two values (no spread to resample).
    """
    import numpy as np

    if not values:
        return {"mean": None, "low": None, "high": None, "n": 0}
    array = np.asarray(values, dtype=np.float64)
    mean = float(array.mean())
    if array.size < 2:
        return {"mean": mean, "low": None, "high": None, "n": 1}
    rows = np.random.default_rng(seed).integers(0, array.size, size=(resamples, array.size))
    means = array[rows].mean(axis=1)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return {"mean": mean, "low": float(low), "high": float(high), "n": int(array.size)}


def difference(value: float, baseline: float) -> float:
    return value - baseline


def ratio(value: float, baseline: float) -> float | None:
    """value / baseline; None where the baseline is 0 (it reached the target before its first step)."""
    return value / baseline if baseline > 0 else None


def paired(values: Mapping[int, float | None], baseline: Mapping[int, float | None],
           combine: Callable[[float, float], float | None] = difference) -> dict[str, Any]:
    """``combine(value, baseline)`` per seed both have (and ``combine`` defines), with its bootstrap interval
    over those seeds."""
    combined = {s: combine(values[s], baseline[s]) for s in sorted(values)
                if values[s] is not None and baseline.get(s) is not None}
    seeds = [s for s, value in combined.items() if value is not None]
    return {**bootstrap_interval([combined[s] for s in seeds]), "seeds": seeds}


def drop_from_peak(points: Sequence[tuple[float, float]], budget: float) -> float:
    """The best score within the budget minus the score at the budget (0: never below its peak)."""
    cut, _ = cut_at_budget(points, budget)
    return max(score for _, score in cut) - cut[-1][1]


def run_finished(point: Mapping[str, Any], *, budget: float, max_steps: int) -> bool:
    """A run stops at the first evaluation point whose cumulative FLOPs reach the budget, or at the cap."""
    return point["flops"] >= budget or point["step"] >= max_steps


# --------------------------------------------------------------------------- scenarios


@dataclasses.dataclass(frozen=True, slots=True)
class Arm:
    name: str
    recipe: Callable[..., Any]  # recipes.cpu-style: (steps=, group_size=) -> RLConfig
    group_size: int
    train_on: PoolKind = "pool"  # the scenario's pool, its oracle-filtered part, or its pass-rate band
    offline_estimator: bool = False  # DEPO warm-started from the estimator trained on the measurement
    lr: float | None = None  # None: the recipe's
    compare_to: tuple[str, ...] = ()
    about: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    claim: str
    pool_levels: tuple[int, ...]  # arith difficulties of the training pool
    pool_per_level: int
    heldout_levels: tuple[int, ...]
    heldout_per_level: int
    arms: tuple[Arm, ...]
    target_baseline: str  # whose gain sets the half-gain target
    flops_budget: float
    max_steps: int
    eval_every: int
    eval_samples: int
    pass_ks: tuple[int, ...]
    measure_samples: int | None = None  # k of the base-policy measurement of every pool prompt (None: none)
    judgement: Judgement = "none"
    cannot_test: str = ""

    def arm(self, name: str) -> Arm:
        return next(arm for arm in self.arms if arm.name == name)


# One GRPO step of the demo policy at 16 prompts × G = 8 (~20-token answers) costs ≈ 3.0e10 FLOPs
# (measured on the DEPO pool: 3.2e9 generation, 2.6e10 update with π_old's forward, 3.8e8 prefill);
# budgets are set in multiples of it so that GRPO runs about the steps the docstrings name.
GRPO_G8_STEP_FLOPS = 3.0e10
CPU_STRESS_LR = 3e-4  # recipes.cpu: GRPO at 3e-4 fell from 0.286 to 0.090 held-out pass@1 in 150 steps


def _grpo(*, steps: int, group_size: int):
    from recipes.cpu import grpo_cpu

    return grpo_cpu(steps=steps, group_size=group_size)


def _recipe(name: str) -> Callable[..., Any]:
    def build(*, steps: int, group_size: int):
        from recipes.cpu import RECIPES

        return RECIPES[name](steps=steps, group_size=group_size)

    build.__name__ = name
    return build


def depo_scenario() -> Scenario:
    """DEPO ("Difficulty-Estimated Policy Optimization", §3 and §4.3): drop prompts whose G rollouts
    would all get the same reward, before rolling them out, at no loss of accuracy.

    Regime the paper needs: a stream with much waste that the question text reveals. Its §4.3
    filter ratio settles near 50%; DEPO's saving is over DAPO's dynamic sampling, which pays
    rollouts for the waste and tops the batch up. Pool: ``arith`` difficulty 3 (the base policy's
    level: measured pass rates from 0 to 1, a third of the prompts solved every time) plus
    difficulty 5 (three 3-digit numbers: never solved in 32 samples), 500 each, so over 60% of
    G = 8 groups are all-equal and half of them are readable from the digits alone.

    Arms (G = 8, the CPU learning rate): GRPO on the pool; **oracle**: GRPO on the pool without the
    prompts whose exact P(all G rewards equal) under the base policy (the share of G-subsets of
    their 32 measured samples that are all equal) exceeds today's drop threshold: the ceiling of
    any estimator at the base policy's pass rates, with no filter-ratio cap, no warm-up and no
    audits, free of charge; **offline**: DEPO warm-started from the estimator trained on that
    measurement (``winnow train-estimator``, the tiny encoder; its curation and training are the
    pre-RL FLOPs column); **default**: DEPO at today's defaults (a fresh online estimator);
    **DAPO** dynamic sampling. Budget: 100 GRPO steps.
    """
    compare = ("grpo", "dapo")
    return Scenario(
        name="depo", claim="≈ 2× less rollout cost than DAPO at equal accuracy (DEPO abstract, §4.3)",
        pool_levels=(3, 5), pool_per_level=500, heldout_levels=(3, 5), heldout_per_level=200,
        arms=(Arm("grpo", _grpo, 8, about="GRPO on the pool"),
              Arm("depo_oracle", _grpo, 8, train_on="oracle", compare_to=compare,
                  about="GRPO on the pool without the prompts the base policy's measured rates drop"),
              Arm("depo_offline", _recipe("depo_cpu"), 8, offline_estimator=True, compare_to=compare,
                  about="DEPO warm-started from the estimator trained on the measurement"),
              Arm("depo_default", _recipe("depo_cpu"), 8, compare_to=compare,
                  about="DEPO at today's defaults (fresh online estimator)"),
              Arm("dapo", _recipe("dapo_cpu"), 8, compare_to=("grpo",), about="DAPO dynamic sampling")),
        target_baseline="grpo", flops_budget=100 * GRPO_G8_STEP_FLOPS, max_steps=300, eval_every=20,
        eval_samples=8, pass_ks=(1, 8), measure_samples=32,
        cannot_test="an estimator reading long problem statements (arithmetic difficulty is in the digits)")


def d3s_scenario() -> Scenario:
    """D³S ("Learning More with Less: A Dynamic Dual-Level Down-Sampling Framework", §3 and Table 6):
    train on the highest-Var(A) subset of a large group and the top |A|·H tokens, reaching GRPO's
    accuracy per step at a fraction of the update compute.

    Regime the paper needs: groups large enough that a subset can carry their variance (the paper
    samples many rollouts per prompt and keeps N_s of them); at G = 8 there is little to select.
    Here G = 32 for both arms (16 prompts, 512 samples a step) on ``arith`` difficulty 3, N_s from
    8 to 32 and K from 5% to 20% of tokens over the step cap (Table 6's schedule scaled to G).
    Its claim is equal accuracy per step at lower update compute, so beside the area the judgement
    compares pass@1 and update FLOPs at the last evaluation step both arms reached.
    Budget: 60 GRPO steps at G = 32.
    """
    return Scenario(
        name="d3s", claim="GRPO's accuracy per step at a fraction of its update compute; ≈ 2× faster (D³S §4)",
        pool_levels=(3,), pool_per_level=2000, heldout_levels=(3,), heldout_per_level=300,
        arms=(Arm("grpo_g32", _grpo, 32, about="GRPO, G = 32"),
              Arm("d3s_g32", _recipe("d3s_cpu"), 32, compare_to=("grpo_g32",),
                  about="D³S across groups + top-K tokens, G = 32")),
        target_baseline="grpo_g32", flops_budget=60 * 4 * GRPO_G8_STEP_FLOPS, max_steps=120, eval_every=10,
        eval_samples=8, pass_ks=(1, 8), judgement="d3s",
        cannot_test="token-level selection on answers of ~18 tokens (top-K keeps 1–4 tokens a sample)")


def reinforce_ada_scenario() -> Scenario:
    """Reinforce-Ada ("Reinforce-Ada: An Adaptive Sampling Framework under Non-linear RL Objectives",
    §4.1 and Tables 2–3): sample each prompt in rounds until it has enough correct and incorrect
    answers, then update on n = 4 of them: GRPO-n16's accuracy at n = 4 update cost.

    Regime the paper needs: hard prompts where n = 4 often finds no success. The paper curates its
    pool to 0 < p ≤ 0.375 with 16 base-policy samples (§4.1); here the same band of ``arith``
    difficulty 3 (3,000 prompts measured k = 16; about one in five lands in it), Ada-Seq-BALANCE as
    the paper preset runs it (``recipes.papers.with_ada_seq``: rounds of 8 up to 32, exit at 2
    correct and 2 incorrect, the pool-normalised advantage), against GRPO at n = 4, 8 and 16.
    Budget: 100 GRPO-n8 steps.
    """
    ada = ("grpo_n4", "grpo_n8", "grpo_n16")
    return Scenario(
        name="reinforce_ada", claim="GRPO-n16's accuracy at n = 4 update cost (Reinforce-Ada Tables 2–3)",
        pool_levels=(3,), pool_per_level=3000, heldout_levels=(3,), heldout_per_level=300,
        arms=(Arm("grpo_n8", _grpo, 8, train_on="band", about="GRPO, n = 8, on the band"),
              Arm("grpo_n4", _grpo, 4, train_on="band", about="GRPO, n = 4"),
              Arm("grpo_n16", _grpo, 16, train_on="band", about="GRPO, n = 16"),
              Arm("ada_seq_balance", _recipe("ada_seq_balance_cpu"), 4, train_on="band", compare_to=ada,
                  about="Ada-Seq-BALANCE, n = 4 update, rounds of 8 up to 32")),
        target_baseline="grpo_n8", flops_budget=100 * GRPO_G8_STEP_FLOPS, max_steps=300, eval_every=20,
        eval_samples=8, pass_ks=(1, 8), measure_samples=16)


def e3_scenario() -> Scenario:
    """E3 ("Enhancing Efficiency and Exploration in Reinforcement Learning for LLMs", §4.1 Algorithm 1
    and §4.2 Eq. 4–5): move rollouts from easy to hard prompts by difficulty rank, bounds widening
    after each pass over the data, and hold entropy near its first batch's by temperature.

    Regime the paper needs: a pool with easy and hard prompts (ranks must differ) seen over several
    passes (the bounds widen per pass, [8, 8] → [4, 16] after four); its claims are pass@k and
    entropy, not pass@1. Pool: ``arith`` difficulty 2 (mostly solved) and 3 (pass rates 0–1),
    96 each: a pass every 12 steps, 12 passes in the 150-step budget. Held-out: difficulty 3 (the
    test split of difficulty 2 holds only ~14 distinct problems), 16 samples each for pass@16.
    Arms: GRPO, E3 (budgets + temperature), E3's temperature alone. Budget: 150 GRPO steps.
    """
    return Scenario(
        name="e3", claim="higher pass@k and entropy held near H_init (E3 Fig. 1, Tables 1–2)",
        pool_levels=(2, 3), pool_per_level=96, heldout_levels=(3,), heldout_per_level=300,
        arms=(Arm("grpo", _grpo, 8, about="GRPO"),
              Arm("e3", _recipe("e3_cpu"), 8, compare_to=("grpo",), about="E3 rank budgets + temperature"),
              Arm("e3_temperature", _recipe("e3_temperature_cpu"), 8, compare_to=("grpo",),
                  about="E3's temperature alone")),
        # The step cap is the annealing horizon (Eq. 5 from half of it): 200 anneals over the budget's last third.
        target_baseline="grpo", flops_budget=150 * GRPO_G8_STEP_FLOPS, max_steps=200, eval_every=25,
        eval_samples=16, pass_ks=(1, 8, 16), judgement="e3",
        cannot_test="exploration of problems the base policy never solves (difficulty 4–5: 0 of 32)")


def cw_grpo_scenario() -> Scenario:
    """CW-GRPO ("Taming Extreme Tokens: Covariance-Aware GRPO with Gaussian-Kernel Advantage
    Reweighting", §3): down-weight tokens whose probability–advantage covariance is extreme, which
    stabilises entropy and training.

    Regime the paper needs: updates large enough to destabilise GRPO; at the CPU learning rate
    GRPO does not collapse, so nothing needs taming. Here both arms also run at a stress rate
    (3e-4, ten times the CPU rate, where GRPO fell from 0.286 to 0.090 in 150 steps) on ``arith``
    difficulty 3, and the judgement is the drop from peak pass@1 to the budget.
    Budget: 120 GRPO steps.
    """
    return Scenario(
        name="cw_grpo", claim="stable entropy and training where GRPO destabilises (CW-GRPO §4)",
        pool_levels=(3,), pool_per_level=2000, heldout_levels=(3,), heldout_per_level=300,
        arms=(Arm("grpo", _grpo, 8, about="GRPO, CPU learning rate"),
              Arm("cw_grpo", _recipe("cw_grpo_cpu"), 8, compare_to=("grpo",), about="CW-GRPO, CPU learning rate"),
              Arm("grpo_stress", _grpo, 8, lr=CPU_STRESS_LR, about="GRPO at the stress learning rate"),
              Arm("cw_grpo_stress", _recipe("cw_grpo_cpu"), 8, lr=CPU_STRESS_LR, compare_to=("grpo_stress",),
                  about="CW-GRPO at the stress learning rate")),
        target_baseline="grpo", flops_budget=120 * GRPO_G8_STEP_FLOPS, max_steps=240, eval_every=20,
        eval_samples=8, pass_ks=(1, 8), judgement="cw_grpo",
        cannot_test="token weighting on answers of ~18 tokens")


SCENARIOS: dict[str, Callable[[], Scenario]] = {
    "depo": depo_scenario, "d3s": d3s_scenario, "reinforce_ada": reinforce_ada_scenario, "e3": e3_scenario,
    "cw_grpo": cw_grpo_scenario,
}


# --------------------------------------------------------------------------- settings


@dataclasses.dataclass(frozen=True, slots=True)
class Settings:
    """One invocation: a scenario with the command line's sizes applied."""

    scenario: Scenario
    out: Path
    seeds: tuple[int, ...]
    arms: tuple[str, ...]
    flops_budget: float
    max_steps: int
    eval_every: int
    eval_samples: int
    pool_per_level: int
    heldout_per_level: int
    measure_samples: int | None
    lr_check: float | None = None
    eval_seed: int = 1234
    overrides: tuple[str, ...] = ()
    progress: bool = False

    @property
    def folder(self) -> Path:
        return self.out / self.scenario.name

    def run_name(self, arm: str, lr: float | None) -> str:
        return arm if lr is None else f"{arm}@lr{lr:g}"

    def result_path(self, run: str, seed: int) -> Path:
        return self.folder / "results" / run / f"seed{seed}.json"

    def run_dir(self, run: str, seed: int) -> Path:
        return self.folder / "runs" / run / f"seed{seed}"

    def fingerprint(self) -> dict[str, Any]:
        """What a finished run's numbers depend on: reused results must share it."""
        return {"scenario": self.scenario.name, "flops_budget": self.flops_budget, "max_steps": self.max_steps,
                "eval_every": self.eval_every, "eval_samples": self.eval_samples,
                "pool_per_level": self.pool_per_level, "heldout_per_level": self.heldout_per_level,
                "measure_samples": self.measure_samples, "eval_seed": self.eval_seed,
                "overrides": list(self.overrides)}


def check_fingerprint(settings: Settings) -> None:
    """Refuse to mix runs of other settings into a scenario folder (written on first use)."""
    path = settings.folder / "settings.json"
    wanted = settings.fingerprint()
    if path.is_file():
        found = json.loads(path.read_text())
        if found != wanted:
            changed = sorted(key for key in wanted.keys() | found.keys() if found.get(key) != wanted.get(key))
            raise SystemExit(f"[methods] {settings.folder} holds runs with other settings ({', '.join(changed)}); "
                             "use another --out or the settings it was run with")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(wanted, indent=1))


# --------------------------------------------------------------------------- pools and measurement


def arm_config(settings: Settings, arm: Arm, seed: int, *, train_file: Path | None, estimator_dir: Path | None = None,
               lr: float | None = None):
    """The arm's RLConfig: its recipe at the step cap, outputs under the run folder, ``--set`` on top,
    then the scenario's pool (which wins over ``--set``'s data.train)."""
    from pipeline import configlib
    from pipeline.config import RLConfig

    run = settings.run_name(arm.name, lr)
    run_dir = settings.run_dir(run, seed)
    learning_rate = lr if lr is not None else arm.lr
    return configlib.load(RLConfig, base=arm.recipe(steps=settings.max_steps, group_size=arm.group_size), overrides=[
        f"seed={seed}", f"logging.output_dir={run_dir}", f"checkpoint.directory={run_dir}/checkpoints",
        # A checkpoint at every evaluation point is what a resumed run restarts from.
        f"checkpoint.every_steps={settings.eval_every}", "checkpoint.keep_last=1", "checkpoint.resume=auto",
        "logging.trackers=[]", f"logging.progress={str(settings.progress).lower()}",
        # run_rl's own start/end evaluation is superseded by the bench's; a small one keeps it cheap.
        "eval_samples=1", "eval_limit=32",
        *([f"optim.lr={learning_rate}"] if learning_rate is not None else []),
        *([f"algorithm.depo.estimator_dir={estimator_dir}"] if estimator_dir is not None else []),
        *settings.overrides,
        "logging.log_every=1",  # every step's FLOPs and entropy are read back
        *([f"data.train={json.dumps([str(train_file)])}"] if train_file is not None else []),
    ])


def write_prompts(path: Path, prompts: Sequence[Any]) -> Path:
    from pipeline.io import atomic_write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "".join(json.dumps({"id": p.id, "problem": p.problem, "answer": p.answer, **p.metadata})
                                    + "\n" for p in prompts))
    return path


def scenario_pool(settings: Settings) -> list:
    """The training pool: seed 0's train split of each level, ``pool_per_level`` each."""
    from pipeline.data import load_prompts

    prompts = []
    for level in settings.scenario.pool_levels:
        loaded, _ = load_prompts(f"arith?difficulty={level}&size={settings.pool_per_level}", split="train", seed=0)
        prompts.extend(loaded)
    return prompts


def load_heldout(settings: Settings) -> list:
    from pipeline.data import load_prompts

    prompts = []
    for level in settings.scenario.heldout_levels:
        loaded, _ = load_prompts(f"arith?difficulty={level}&size={settings.heldout_per_level}", split="test")
        prompts.extend(loaded)
    return prompts


def measure_pool(settings: Settings, pool_file: Path, *, policy_dir: Path, cfg, context) -> dict[str, tuple[int, int]]:
    """Every pool prompt's (samples, correct) under the base policy: ``measure_samples`` answers each at the RL
    temperature and length, by ``winnow curate`` with no rule dropping by pass rate (resumable by shard)."""
    from pipeline.config import CurateRulesConfig
    from pipeline.stages.curate import run_curate
    from pipeline.stats.curation import MANIFEST_FILE, load_curation
    from recipes.stages import curate_cpu

    folder = settings.folder / MEASURE_DIR
    if not (folder / MANIFEST_FILE).is_file():
        curate = dataclasses.replace(
            curate_cpu(), sources=[str(pool_file)], policy=str(policy_dir), output_dir=str(folder),
            num_samples=settings.measure_samples, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
            template=cfg.data.template, rules=CurateRulesConfig(trivial_threshold=None, drop_impossible=False))
        run_curate(curate, context=context, out=lambda line: print(f"[measure] {line}", flush=True))
    curation = load_curation(folder)
    return {pid: (int(n), int(c)) for pid, n, c in zip(curation.prompt_ids, curation.num_samples.tolist(),
                                                         curation.num_correct.tolist())}


def oracle_kept(prompts: Sequence[Any], counts: Mapping[str, tuple[int, int]], *, group_size: int,
                threshold: float) -> list:
    """The prompts DEPO's drop rule keeps when it knows each one's P(all G rewards equal) under the base
    policy: the share of G-subsets of its measured samples that are all equal (exact for those samples)."""
    import torch

    from pipeline.algorithms.depo import zero_variance_targets_from_counts

    measured = [p for p in prompts if p.id in counts]
    probabilities = zero_variance_targets_from_counts(
        num_samples=torch.tensor([counts[p.id][0] for p in measured]),
        num_correct=torch.tensor([counts[p.id][1] for p in measured]), group_size=group_size)
    return [p for p, probability in zip(measured, probabilities.tolist()) if probability <= threshold]


def band_kept(prompts: Sequence[Any], counts: Mapping[str, tuple[int, int]]) -> list:
    """Reinforce-Ada's curated band (§4.1): at least one correct sample, pass rate ≤ the trivial threshold
    (the curation rules' defaults: 0.375)."""
    from pipeline.config import CurateRulesConfig

    rules = CurateRulesConfig()
    return [p for p in prompts if p.id in counts and counts[p.id][1] > 0
            and counts[p.id][1] / counts[p.id][0] <= rules.trivial_threshold]


def offline_estimator(settings: Settings, *, group_size: int) -> tuple[Path, float]:
    """Train (once) DEPO's estimator on the measurement, as ``winnow train-estimator`` with the CPU preset
    and the arm's G; returns its folder and its training FLOPs."""
    from pipeline.stages.train_estimator import CALIBRATION_FILE, run_train_estimator
    from pipeline.stages.train_estimator import ESTIMATOR_DIR as MODEL_DIR
    from pipeline.stats.flops import ForwardCost, estimator_flops
    from recipes.stages import estimator_cpu

    folder = settings.folder / ESTIMATOR_DIR
    cfg = dataclasses.replace(estimator_cpu(), curation_dir=str(settings.folder / MEASURE_DIR), group_size=group_size,
                              output_dir=str(folder))
    report = run_train_estimator(cfg, out=lambda line: print(f"[estimator] {line}", flush=True))
    described = json.loads((folder / MODEL_DIR / "estimator.json").read_text())
    assert (folder / CALIBRATION_FILE).is_file()
    return folder / MODEL_DIR, estimator_flops(ForwardCost.from_bert_config(described["bert_config"]),
                                               report["num_encoded_tokens"])


def measurement_flops(settings: Settings, policy_spec) -> float:
    """The measurement's generation at the policy's size, from its generated tokens (2·N each)."""
    from pipeline.stats.curation import MANIFEST_FILE
    from pipeline.stats.flops import ForwardCost, forward_flops

    manifest = json.loads((settings.folder / MEASURE_DIR / MANIFEST_FILE).read_text())
    return forward_flops(ForwardCost.from_spec(policy_spec), tokens=int(manifest["num_generated_tokens"]), attended=0)


# --------------------------------------------------------------------------- evaluation and runs


def category_names(prompt) -> list[str]:
    """A held-out problem's categories: its difficulty level, and whether it holds a product."""
    return [f"d{prompt.metadata['difficulty']}", "mul" if "*" in prompt.problem else "addsub"]


def heldout_scores(*, model, tokenizer, prompts, num_samples: int, ks: Sequence[int], max_new_tokens: int,
                   temperature: float, seed: int, pool, template: str) -> dict[str, float]:
    """Sampled pass@k (unbiased, ``pipeline.eval.passk``) over the held-out set, and pass@1 per category."""
    import numpy as np

    from pipeline.eval.passk import pass_at_k
    from pipeline.eval.runner import sample_and_grade
    from pipeline.rollout.local import LocalEngine
    from pipeline.rollout.types import SamplingParams

    engine = LocalEngine(model, eos_token_ids=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         show_progress=False)
    results = sample_and_grade(engine=engine, tokenizer=tokenizer, prompts=prompts, num_samples=num_samples,
                               pool=pool, template=template,
                               params=SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed))
    n = np.array([r.num_samples for r in results])
    c = np.array([r.num_correct for r in results])
    scores = {f"pass@{k}": float(pass_at_k(n, c, k).mean()) for k in ks if k <= num_samples}
    per_prompt = c / n
    groups: dict[str, list[float]] = {}
    for result, value in zip(results, per_prompt.tolist()):
        for name in category_names(result.prompt):
            groups.setdefault(name, []).append(value)
    scores.update({f"pass@1[{name}]": statistics.fmean(values) for name, values in sorted(groups.items())})
    return scores


def step_rows(metrics_path: Path) -> dict[int, dict[str, Any]]:
    """The RL run's metrics rows by step (a step logged twice, before and after a resume: the last row)."""
    from pipeline.metrics import read_metrics

    return {int(row["step"]): row for row in read_metrics(metrics_path)}


@dataclasses.dataclass(frozen=True, slots=True)
class StepFlopsModel:
    """What a step's FLOPs estimate needs beyond its metrics row, for rows without the RL loop's own count.

    The row gives the step's pool (prompts, samples, generated tokens), the rows the update trained on,
    whether π_old was recomputed (its engine/trainer mismatch is logged only then) and the estimator's
    cumulative reading; prompt lengths are not in it, so every prompt counts the mean length of the arm's
    training pool.
    """

    policy: Any  # pipeline.stats.flops.ForwardCost of the policy
    prompt_tokens: float  # mean prompt tokens of the arm's training pool, template applied
    estimator: Any | None  # ForwardCost of DEPO's estimator; None without one
    selects_samples: bool  # a sample selector: π_old is computed for every pool sample, the update for the kept
    question_forward: bool  # DEPO's distillation target: the actor reads every pool prompt once more
    reference_forward: bool  # kl_coef > 0: a frozen reference forward of every trained row
    recompute: str = "none"


def estimate_step_flops(row: Mapping[str, Any], previous: Mapping[str, Any], model: StepFlopsModel) -> dict[str, float]:
    """One step's FLOPs per category (``pipeline.stats.flops``'s formulas, as ``pipeline.rl.step.policy_step_flops``
    applies them) from its metrics row and the previous step's (``{}`` before step 1): generation and prefill of
    the step's pool at its mean response length, forward + backward of the kept rows, the extra log-prob forwards,
    and the estimator's reading charged as training (3 forwards a token: the row does not split scoring from
    training; at the tiny encoder's 2.9% of a policy token it is a few per mille of a step)."""
    from pipeline.stats.flops import forward_flops, generation_flops, prefill_flops, sequence_forward_flops, \
        update_flops

    prompts = row["ledger/groups"] - previous.get("ledger/groups", 0)
    samples = prompts * row["budget/samples_per_prompt_mean"]
    generated = row["ledger/tokens_generated"] - previous.get("ledger/tokens_generated", 0)
    response = generated / samples if samples else 0.0
    length = model.prompt_tokens + response
    kept = row["update/num_sequences"]
    log_prob_rows = samples if model.selects_samples else kept
    forwards = int("mismatch/mean_abs" in row) + int(model.reference_forward)
    encoded = row.get("depo/encoded_tokens", 0.0) - previous.get("depo/encoded_tokens", 0.0)
    return {
        "generation": samples * generation_flops(model.policy, prompt_tokens=model.prompt_tokens,
                                                 generated_tokens=response),
        "prefill": prompts * prefill_flops(model.policy, model.prompt_tokens) * (1 + int(model.question_forward)),
        "update": kept * update_flops(model.policy, length, recompute=model.recompute)
        + forwards * log_prob_rows * sequence_forward_flops(model.policy, length),
        "estimator": 3 * encoded * forward_flops(model.estimator, tokens=1, attended=0) if model.estimator else 0.0,
    }


def cumulative_flops(rows: Mapping[int, Mapping[str, Any]], step: int, model: StepFlopsModel) -> dict[str, Any]:
    """The run's FLOPs after ``step`` steps, total and per category: the RL loop's own count
    (``flops/cumulative/*``) where its row has one counted from step 1, else ``estimate_step_flops`` summed."""
    from pipeline.stats.flops import CATEGORIES

    row = rows[step]
    if "flops/cumulative/total" in row and row.get("flops/counted_from_step") == 1:
        return {"flops": float(row["flops/cumulative/total"]), "flops_source": "logged",
                **{f"flops_{category}": float(row[f"flops/cumulative/{category}"]) for category in CATEGORIES}}
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for s in range(1, step + 1):
        for category, value in estimate_step_flops(rows[s], rows.get(s - 1, {}) if s > 1 else {}, model).items():
            totals[category] += value
    return {"flops": sum(totals.values()), "flops_source": "estimated",
            **{f"flops_{category}": value for category, value in totals.items()}}


def cumulative_costs(rows: Mapping[int, Mapping[str, Any]], step: int, *, since: int,
                     model: StepFlopsModel) -> dict[str, Any]:
    """The run's cumulative FLOPs and ledger after ``step`` steps, and its mean token entropy over the steps
    after ``since``."""
    missing = [s for s in range(1, step + 1) if s not in rows]
    if missing:
        raise SystemExit(f"[methods] metrics.jsonl misses steps {missing[:5]}: the run folder is damaged; "
                         "move it aside")
    row = rows[step]
    window = [rows[s]["entropy"] for s in range(since + 1, step + 1)]
    return {**cumulative_flops(rows, step, model),
            "tokens_generated": int(row.get("ledger/tokens_generated", 0)),
            "zero_variance_share": row["ledger/zero_variance_groups"] / max(1, row["ledger/groups"]),
            "prompts_filtered": int(row.get("ledger/prompts_filtered", 0)),
            "entropy": statistics.fmean(window) if window else None}


def step_flops_model(cfg, *, train_file: Path, estimator_dir: Path | None, context) -> StepFlopsModel:
    """The arm's ``StepFlopsModel``: its policy's size, its pool's mean prompt length, its estimator's size."""
    from pipeline.data import load_prompts
    from pipeline.data.templates import prompt_token_ids
    from pipeline.models.spec import ModelSpec
    from pipeline.models.tokenizer import load_tokenizer
    from pipeline.stages.bootstrap import run_bootstrap
    from pipeline.stats.flops import ForwardCost

    base = run_bootstrap(cfg.bootstrap, context=context)
    tokenizer = load_tokenizer(base.tokenizer_dir)
    prompts, _ = load_prompts(str(train_file))
    lengths = [len(prompt_token_ids(tokenizer, p, template=cfg.data.template)) for p in prompts]
    algorithm = cfg.algorithm
    estimator = None
    if algorithm.prompt_filter == "depo":
        if estimator_dir is not None:
            described = json.loads((Path(estimator_dir) / "estimator.json").read_text())
        elif algorithm.depo.encoder == "tiny":
            from pipeline.estimator import DifficultyEstimator

            described = DifficultyEstimator.tiny().describe()
        else:
            raise SystemExit("[methods] a fresh MiniLM estimator's FLOPs need the RL loop's own count "
                             "(flops/cumulative/*), which this run's rows do not carry")
        estimator = ForwardCost.from_bert_config(described["bert_config"])
    return StepFlopsModel(policy=ForwardCost.from_spec(ModelSpec(**base.summary["model_spec"])),
                          prompt_tokens=statistics.fmean(lengths), estimator=estimator,
                          selects_samples=algorithm.sample_selector != "none",
                          question_forward=algorithm.prompt_filter == "depo" and algorithm.depo.w_distill > 0,
                          reference_forward=algorithm.kl_coef > 0, recompute=cfg.trainer.recompute)


def base_scores(settings: Settings, *, evaluate: Callable[[Any, Any], dict[str, float]], policy) -> dict[str, float]:
    """Held-out scores of the base policy (every arm's step 0), cached in the scenario folder."""
    path = settings.folder / "base_scores.json"
    if path.is_file():
        return json.loads(path.read_text())
    scores = evaluate(policy.hf_model, policy.tokenizer)
    path.write_text(json.dumps(scores))
    return scores


def run_arm(settings: Settings, cfg, *, run: str, seed: int, context, evaluate, base: dict[str, float],
            flops_model: StepFlopsModel) -> dict[str, Any]:
    """Train in chunks of ``eval_every`` steps, scoring each checkpoint, until the budget or the step cap;
    resumes from the newest checkpoint with the evaluations it had (``tools.bench.chunks``)."""

    run_dir = settings.run_dir(run, seed)
    started = time.perf_counter()

    def score(policy, step: int, previous: dict[str, Any]) -> dict[str, Any]:
        costs = cumulative_costs(step_rows(run_dir / "metrics.jsonl"), step, since=previous["step"],
                                 model=flops_model)
        point = {**evaluate(policy.hf_model, policy.tokenizer), **costs}
        print(f"[methods] {run} seed {seed} step {step}: pass@1 {point['pass@1']:.3f} at "
              f"{point['flops']:.3g} FLOPs", flush=True)
        return point

    def next_step(done: int, last: dict[str, Any]) -> int | None:
        finished = run_finished(last, budget=settings.flops_budget, max_steps=settings.max_steps)
        return None if finished else done + settings.eval_every

    curve = train_in_chunks(cfg, context=context, curve_path=run_dir / "curve.jsonl",
                            first_point=lambda: {**base, "flops": 0.0, "entropy": None}, score=score,
                            next_step=next_step, label=f"[methods] {run} seed {seed}")
    rows = step_rows(run_dir / "metrics.jsonl")
    return {"run": run, "seed": seed, "curve": curve, "first_step_entropy": rows[1]["entropy"],
            "reached_budget": curve[-1]["flops"] >= settings.flops_budget,
            "bench_seconds": time.perf_counter() - started}


# --------------------------------------------------------------------------- summary


def _points(run: Mapping[str, Any], key: str) -> list[tuple[float, float]]:
    return [(point["flops"], point[key]) for point in run["curve"] if key in point]


def _score_at_budget(run: Mapping[str, Any], key: str, budget: float) -> float | None:
    points = _points(run, key)
    return cut_at_budget(points, budget)[0][-1][1] if points else None


def _judgement(kind: Judgement, runs: Mapping[int, Mapping[str, Any]], baseline: Mapping[int, Mapping[str, Any]],
               budget: float) -> dict[str, Any]:
    """The scenario's own comparison of one arm with its baseline, per seed and paired."""
    if kind == "e3":
        def kept(run):
            last = run["curve"][-1].get("entropy")
            return None if last is None or not run.get("first_step_entropy") else last / run["first_step_entropy"]

        def pass16(group):
            return {s: _score_at_budget(r, "pass@16", budget) for s, r in group.items()}

        return {"pass@16_at_budget": {s: v for s, v in pass16(runs).items()},
                "pass@16_difference": paired(pass16(runs), pass16(baseline)),
                "entropy_kept": {s: kept(r) for s, r in runs.items()},
                "entropy_kept_difference": paired({s: kept(r) for s, r in runs.items()},
                                                  {s: kept(r) for s, r in baseline.items()})}
    if kind == "cw_grpo":
        drops = {s: drop_from_peak(_points(r, "pass@1"), budget) for s, r in runs.items()}
        return {"drop_from_peak": drops,
                "drop_difference": paired(drops, {s: drop_from_peak(_points(r, "pass@1"), budget)
                                                  for s, r in baseline.items()})}
    if kind == "d3s":
        at_step, update_ratio, score_diff = {}, {}, {}
        for seed, run in runs.items():
            if seed not in baseline:
                continue
            theirs = {point["step"]: point for point in baseline[seed]["curve"]}
            common = [point for point in run["curve"] if point["step"] in theirs and point["step"] > 0]
            if not common:
                continue
            mine = common[-1]
            at_step[seed] = mine["step"]
            score_diff[seed] = mine["pass@1"] - theirs[mine["step"]]["pass@1"]
            update_ratio[seed] = mine["flops_update"] / theirs[mine["step"]]["flops_update"]
        return {"equal_step": at_step, "pass@1_difference_at_equal_step": bootstrap_interval(list(score_diff.values())),
                "update_flops_ratio_at_equal_step": bootstrap_interval(list(update_ratio.values()))}
    return {}


def summarize(scenario: Scenario, results: Mapping[str, Mapping[int, Mapping[str, Any]]], *, base: Mapping[str, float],
              budget: float, lr_check: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """Every arm's area, FLOPs to half gain and judgement, paired against the arms it is compared with."""
    if scenario.target_baseline not in results:
        raise ValueError(f"the summary needs {scenario.target_baseline}'s runs: its gain sets the target")
    target = half_gain_target(base["pass@1"], [_score_at_budget(run, "pass@1", budget)
                                               for run in results[scenario.target_baseline].values()])
    areas = {arm: {seed: area_under_curve(_points(run, "pass@1"), budget) for seed, run in runs.items()}
             for arm, runs in results.items()}
    # Without a gain over the base policy there is no half-gain target: every run would "reach" it at 0 FLOPs.
    gained = target > base["pass@1"]
    reach = {arm: {seed: flops_to_reach(_points(run, "pass@1"), target, budget) if gained else None
                   for seed, run in runs.items()} for arm, runs in results.items()}
    arms: dict[str, Any] = {}
    for arm, runs in results.items():
        categories = sorted(key for key in base if key.startswith("pass@1["))
        row: dict[str, Any] = {
            "seeds": sorted(runs), "area": bootstrap_interval(list(areas[arm].values())), "area_per_seed": areas[arm],
            "pass@1_at_budget": bootstrap_interval([_score_at_budget(r, "pass@1", budget) for r in runs.values()]),
            "categories_at_budget": {key: bootstrap_interval([_score_at_budget(r, key, budget) for r in runs.values()])
                                     for key in categories},
            "flops_to_target": reach[arm], "reached": sum(v is not None for v in reach[arm].values()),
            "short_of_budget": sorted(seed for seed, run in runs.items() if not run["reached_budget"]),
            "steps_at_end": bootstrap_interval([run["curve"][-1]["step"] for run in runs.values()]),
            "zero_variance_share": bootstrap_interval([run["curve"][-1]["zero_variance_share"]
                                                       for run in runs.values()]),
            "prompts_filtered": bootstrap_interval([run["curve"][-1]["prompts_filtered"] for run in runs.values()]),
            "estimator_flops_share": bootstrap_interval([run["curve"][-1]["flops_estimator"] / run["curve"][-1]["flops"]
                                                         for run in runs.values()]),
            "pre_rl_flops": next(iter(runs.values())).get("pre_rl_flops", 0.0),
            "versus": {},
        }
        for other in scenario.arm(arm).compare_to:
            if other not in results:
                continue
            row["versus"][other] = {
                "area_difference": paired(areas[arm], areas[other]),
                "flops_to_target_ratio": paired(reach[arm], reach[other], combine=ratio),
                "categories_difference": {
                    key: paired({s: _score_at_budget(r, key, budget) for s, r in runs.items()},
                                {s: _score_at_budget(r, key, budget) for s, r in results[other].items()})
                    for key in categories},
                "judgement": _judgement(scenario.judgement, runs, results[other], budget),
            }
        arms[arm] = row
    checks = {}
    for run, seeds in (lr_check or {}).items():
        arm_name = run.split("@", 1)[0]
        area = {seed: area_under_curve(_points(r, "pass@1"), budget) for seed, r in seeds.items()}
        versus = {}
        for other in scenario.arm(arm_name).compare_to:
            twin = f"{other}@{run.split('@', 1)[1]}"
            if twin in lr_check:
                versus[other] = paired(area, {s: area_under_curve(_points(r, "pass@1"), budget)
                                              for s, r in lr_check[twin].items()})
        checks[run] = {"area": bootstrap_interval(list(area.values())), "versus": versus}
    return {"scenario": scenario.name, "claim": scenario.claim, "budget": budget, "base": dict(base),
            "target_pass@1": target if gained else None, "target_baseline": scenario.target_baseline,
            "arms": arms, "lr_check": checks,
            "cannot_test": scenario.cannot_test}


def _interval(entry: Mapping[str, Any], fmt: str = "+.4f") -> str:
    if not entry or entry.get("n", 0) == 0 or entry.get("mean") is None:
        return "—"
    text = format(entry["mean"], fmt)
    if entry.get("low") is None:
        return f"{text} (n = 1)"
    return f"{text} [{format(entry['low'], fmt)}, {format(entry['high'], fmt)}]"


def format_table(summary: Mapping[str, Any]) -> str:
    from pipeline.stats.flops import format_flops

    target = summary["target_pass@1"]
    lines = [f"{summary['scenario']}: budget {format_flops(summary['budget'])} FLOPs; base pass@1 "
             f"{summary['base']['pass@1']:.4f}; half-gain target "
             + (f"{target:.4f} ({summary['target_baseline']})" if target is not None
                else f"none ({summary['target_baseline']} did not gain over the base policy)")
             + "; means over seeds with 95% bootstrap intervals",
             "| arm | seeds | area (mean pass@1 over the budget) | pass@1 at budget | vs | area difference | "
             "FLOPs to target: reached, ratio | steps at budget | zero-variance groups | pre-RL FLOPs |",
             "|---|---:|---|---|---|---|---|---:|---:|---:|"]
    for arm, row in summary["arms"].items():
        versus = row["versus"] or {"—": None}
        for index, (other, entry) in enumerate(versus.items()):
            head = [arm, f"{len(row['seeds'])}" + (f" ({len(row['short_of_budget'])} short)" if row["short_of_budget"]
                                                   else ""),
                    _interval(row["area"], ".4f"), _interval(row["pass@1_at_budget"], ".4f")] if index == 0 \
                else ["", "", "", ""]
            difference = "—" if entry is None else _interval(entry["area_difference"])
            ratio = "—" if entry is None else _interval(entry["flops_to_target_ratio"], ".2f")
            tail = [f"{row['reached']}/{len(row['seeds'])}" + ("" if entry is None else f", {ratio}"),
                    _interval(row["steps_at_end"], ".0f"), _interval(row["zero_variance_share"], ".0%"),
                    format_flops(row["pre_rl_flops"]) if row["pre_rl_flops"] else "0"] if index == 0 \
                else [ratio, "", "", ""]
            lines.append("| " + " | ".join([*head, other, difference, *tail]) + " |")
    for arm, row in summary["arms"].items():
        for other, entry in row["versus"].items():
            judgement = entry["judgement"]
            if judgement:
                parts = [f"{key} {_interval(value)}" for key, value in judgement.items()
                         if isinstance(value, Mapping) and "mean" in value]
                lines.append(f"{arm} vs {other}: " + "; ".join(parts))
            categories = "; ".join(f"{key.removeprefix('pass@1')} {_interval(value)}"
                                   for key, value in entry["categories_difference"].items())
            lines.append(f"{arm} vs {other}, pass@1 at budget by category: {categories}")
    for run, check in summary["lr_check"].items():
        versus = "; ".join(f"vs {other} {_interval(entry)}" for other, entry in check["versus"].items())
        lines.append(f"lr check {run}: area {_interval(check['area'], '.4f')}" + (f"; {versus}" if versus else ""))
    if summary["cannot_test"]:
        lines.append(f"cannot test here: {summary['cannot_test']}")
    return "\n".join(lines)


def panels(summary: Mapping[str, Any]) -> list:
    from tools.bench.report import Panel

    arms = summary["arms"]
    area = {arm: row["area"]["mean"] for arm, row in arms.items()}
    reach = {arm: statistics.fmean(v for v in row["flops_to_target"].values() if v is not None)
             for arm, row in arms.items() if row["reached"]}
    result = [Panel(title="area under held-out pass@1 against FLOPs, over the budget (mean over seeds)",
                    xlabel="mean held-out pass@1 over the FLOPs budget", bars=area,
                    lines={"base policy": summary["base"]["pass@1"]})]
    if reach and summary["target_pass@1"] is not None:
        result.append(Panel(title=f"FLOPs to reach pass@1 {summary['target_pass@1']:.3f} (seeds that reached it)",
                            xlabel="FLOPs", bars=reach, lines={"budget": summary["budget"]}))
    return result


# --------------------------------------------------------------------------- driver


def prepare_pools(settings: Settings, *, context, probe_cfg) -> dict[str, Any]:
    """The scenario's pool file, and where its arms need them, the measurement, the oracle and band pools and
    the offline estimator (each made once and reused)."""
    from pipeline.config import DepoConfig
    from pipeline.stages.bootstrap import run_bootstrap

    scenario = settings.scenario
    pool = scenario_pool(settings)
    prepared: dict[str, Any] = {"pool": write_prompts(settings.folder / "pool.jsonl", pool)}
    arms = [scenario.arm(name) for name in settings.arms]
    if settings.measure_samples is None or all(arm.train_on == "pool" and not arm.offline_estimator for arm in arms):
        return prepared
    base = run_bootstrap(probe_cfg.bootstrap, context=context)
    counts = measure_pool(settings, prepared["pool"], policy_dir=base.directory, cfg=probe_cfg, context=context)
    for arm in arms:
        group_size = arm_config(settings, arm, 0, train_file=None).group_size  # the recipe's G, or --set's
        for kind, kept in (("oracle", lambda: oracle_kept(pool, counts, group_size=group_size,
                                                          threshold=DepoConfig().threshold)),
                           ("band", lambda: band_kept(pool, counts))):
            if arm.train_on == kind and kind not in prepared:
                prompts = kept()
                if not prompts:
                    raise SystemExit(f"[methods] the {kind} pool keeps none of the {len(pool)} pool prompts; "
                                     "a larger --pool-per-level or --measure-samples may keep some")
                prepared[kind] = write_prompts(settings.folder / f"{kind}_pool.jsonl", prompts)
                print(f"[methods] {kind} pool: {len(prompts)} of {len(pool)} prompts", flush=True)
        if arm.offline_estimator and "estimator" not in prepared:
            from pipeline.models.spec import ModelSpec

            prepared["estimator"], training = offline_estimator(settings, group_size=group_size)
            prepared["pre_rl_flops"] = training + measurement_flops(settings, ModelSpec(**base.summary["model_spec"]))
    return prepared


def run_scenario(settings: Settings, *, context, log=print) -> dict[str, Any]:
    """Run (or reuse) every (arm, seed) and the learning-rate check; write ``<scenario>.json`` and ``.png``."""
    from pipeline.eval.policy import load_policy
    from pipeline.rewards import GradingPool
    from pipeline.stages.bootstrap import run_bootstrap
    from tools.bench import report

    scenario = settings.scenario
    check_fingerprint(settings)
    probe = arm_config(settings, scenario.arm(settings.arms[0]), 0, train_file=None)
    prepared = prepare_pools(settings, context=context, probe_cfg=probe)
    heldout = load_heldout(settings)
    plan = [(name, seed, None) for name in settings.arms for seed in settings.seeds]
    if settings.lr_check is not None:
        plan += [(name, settings.seeds[0], settings.lr_check) for name in settings.arms]
    results: dict[str, dict[int, dict[str, Any]]] = {}
    checks: dict[str, dict[int, dict[str, Any]]] = {}
    with GradingPool(**probe.reward.pool_kwargs()) as grading:
        def evaluate(model, tokenizer) -> dict[str, float]:
            return heldout_scores(model=model, tokenizer=tokenizer, prompts=heldout, num_samples=settings.eval_samples,
                                  ks=scenario.pass_ks, max_new_tokens=probe.max_new_tokens,
                                  temperature=probe.temperature, seed=settings.eval_seed, pool=grading,
                                  template=probe.data.template)

        base_policy = load_policy(run_bootstrap(probe.bootstrap, context=context).directory, context=context)
        base = base_scores(settings, evaluate=evaluate, policy=base_policy)
        for name, seed, lr in plan:
            arm = scenario.arm(name)
            run = settings.run_name(name, lr)

            def train(arm=arm, run=run, seed=seed, lr=lr) -> dict[str, Any]:
                estimator_dir = prepared.get("estimator") if arm.offline_estimator else None
                cfg = arm_config(settings, arm, seed, train_file=prepared[arm.train_on], estimator_dir=estimator_dir,
                                 lr=lr)
                flops_model = step_flops_model(cfg, train_file=prepared[arm.train_on], estimator_dir=estimator_dir,
                                               context=context)
                result = run_arm(settings, cfg, run=run, seed=seed, context=context, evaluate=evaluate, base=base,
                                 flops_model=flops_model)
                result["pre_rl_flops"] = prepared.get("pre_rl_flops", 0.0) if arm.offline_estimator else 0.0
                return result

            result = reuse_or_run(settings.result_path(run, seed), train, label=f"[methods] {run} seed {seed}", log=log)
            (results if lr is None else checks).setdefault(run, {})[seed] = result
    if scenario.target_baseline not in results:
        log(f"no {scenario.target_baseline} runs among --arms: rerun with it for the summary "
            "(finished runs are reused)")
        return {}
    summary = summarize(scenario, results, base=base, budget=settings.flops_budget, lr_check=checks)
    report.save(settings.out, scenario.name, settings={**settings.fingerprint(), "seeds": list(settings.seeds),
                                                       "arms": list(settings.arms), "lr_check": settings.lr_check},
                results={"summary": summary, "runs": {run: {str(s): r for s, r in seeds.items()}
                                                      for run, seeds in {**results, **checks}.items()}},
                title=f"tools.bench.methods --scenario {scenario.name}", panels=panels(summary))
    return summary


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", required=True, choices=list(SCENARIOS), help="which paper's mechanism")
    parser.add_argument("--arms", nargs="+", default=None, help="a subset of the scenario's arms (default: all)")
    parser.add_argument("--seeds", type=int, default=6, help="paired seeds 0..N-1")
    parser.add_argument("--flops-budget", type=float, default=None, help="FLOPs per run (default: the scenario's)")
    parser.add_argument("--max-steps", type=int, default=None,
                        help="step cap and schedule horizon of every run (default: the scenario's)")
    parser.add_argument("--eval-every", type=int, default=None, help="steps between held-out evaluations")
    parser.add_argument("--eval-samples", type=int, default=None, help="samples per held-out problem")
    parser.add_argument("--pool-per-level", type=int, default=None, help="train prompts per difficulty level")
    parser.add_argument("--heldout-per-level", type=int, default=None, help="held-out problems per difficulty level")
    parser.add_argument("--measure-samples", type=int, default=None,
                        help="base-policy samples per pool prompt for the oracle, band and offline estimator")
    parser.add_argument("--lr-check", type=float, default=None, metavar="LR",
                        help="also run seed 0 of every arm at this learning rate")
    parser.add_argument("--eval-seed", type=int, default=1234, help="sampling seed of every held-out evaluation")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="dotted RLConfig override applied to every arm (repeatable); the pool is the scenario's")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--progress", action="store_true", help="show run_rl's progress bars")
    parser.add_argument("--out", default="runs/bench/methods", help="output directory")
    args = parser.parse_args(argv)
    scenario = SCENARIOS[args.scenario]()
    names = [arm.name for arm in scenario.arms]
    if args.arms is not None:
        unknown = [name for name in args.arms if name not in names]
        if unknown:
            parser.error(f"--arms: {unknown} are not arms of {args.scenario}; its arms: {names}")
    for name, value, minimum in (("--seeds", args.seeds, 1), ("--max-steps", args.max_steps, 1),
                                 ("--eval-every", args.eval_every, 1), ("--eval-samples", args.eval_samples, 1),
                                 ("--pool-per-level", args.pool_per_level, 1),
                                 ("--heldout-per-level", args.heldout_per_level, 1),
                                 ("--measure-samples", args.measure_samples, 2)):
        if value is not None and value < minimum:
            parser.error(f"{name}: need at least {minimum}, got {value}")
    if args.flops_budget is not None and not (args.flops_budget > 0 and math.isfinite(args.flops_budget)):
        parser.error(f"--flops-budget: need a positive number of FLOPs, got {args.flops_budget}")
    if args.lr_check is not None and not args.lr_check > 0:
        parser.error(f"--lr-check: need a positive learning rate, got {args.lr_check}")
    max_steps = args.max_steps or scenario.max_steps
    eval_every = args.eval_every or min(scenario.eval_every, max_steps)
    if max_steps % eval_every:
        parser.error(f"--max-steps {max_steps} must be a multiple of --eval-every {eval_every} (evaluation points "
                     "are the resume points)")
    eval_samples = args.eval_samples or scenario.eval_samples
    if eval_samples < max(scenario.pass_ks):
        parser.error(f"--eval-samples: {args.scenario} scores pass@{max(scenario.pass_ks)}, so it needs at least "
                     f"{max(scenario.pass_ks)} samples, got {eval_samples}")
    from pipeline import configlib
    from pipeline.config import RLConfig

    measure_samples = (args.measure_samples or scenario.measure_samples) if scenario.measure_samples else None
    for arm in scenario.arms:  # a bad --set fails here, before any run
        if args.arms is None or arm.name in args.arms:
            try:
                cfg = configlib.load(RLConfig, base=arm.recipe(steps=max_steps, group_size=arm.group_size),
                                     overrides=args.overrides)
            except configlib.ConfigError as error:
                parser.error(f"--set ({arm.name}): {error}")
            if (arm.train_on == "oracle" or arm.offline_estimator) and measure_samples < cfg.group_size:
                parser.error(f"--measure-samples: {arm.name} needs P(all G = {cfg.group_size} rewards equal), which "
                             f"{measure_samples} samples per prompt cannot measure")
    return args


def settings_from_args(args: argparse.Namespace) -> Settings:
    scenario = SCENARIOS[args.scenario]()
    names = [arm.name for arm in scenario.arms]
    chosen = [name for name in names if args.arms is None or name in args.arms]
    max_steps = args.max_steps or scenario.max_steps
    return Settings(
        scenario=scenario, out=Path(args.out).absolute(), seeds=tuple(range(args.seeds)), arms=tuple(chosen),
        flops_budget=args.flops_budget or scenario.flops_budget, max_steps=max_steps,
        eval_every=args.eval_every or min(scenario.eval_every, max_steps),
        eval_samples=args.eval_samples or scenario.eval_samples,
        pool_per_level=args.pool_per_level or scenario.pool_per_level,
        heldout_per_level=args.heldout_per_level or scenario.heldout_per_level,
        measure_samples=(args.measure_samples or scenario.measure_samples) if scenario.measure_samples else None,
        lr_check=args.lr_check, eval_seed=args.eval_seed, overrides=tuple(args.overrides), progress=args.progress)


def main(argv: Sequence[str] | None = None) -> None:
    import torch

    from pipeline.parallel.rendezvous import initialize_process_context

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    settings = settings_from_args(args)
    context = initialize_process_context(seed=0)
    summary = run_scenario(settings, context=context)
    if summary:
        print(format_table(summary))


if __name__ == "__main__":
    main()
