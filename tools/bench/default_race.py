"""Default race: which combination should the CPU campaign run, on total campaign tokens?

    .venv/bin/python -m tools.bench.default_race                         # every method, 3 seeds, 100 steps
    .venv/bin/python -m tools.bench.default_race --methods grpo_raw grpo_curated --seeds 1 --steps 20

Every method trains the demo's bootstrap policy on one **mixed-difficulty pool**: ``arith``
difficulties 2-5, ``--pool-per-level`` train problems each, written once to
``<out>/pool.jsonl`` so that every method and seed draws from the same prompts. Difficulty 2
is nearly solved by the base policy and 5 nearly never: much of the pool gives groups whose
rewards are all equal, the waste the methods claim to remove. Methods:

- ``grpo_raw``: plain GRPO on the pool as it is (baseline a);
- ``grpo_curated``: the campaign as it runs today: curate the pool first (k = 8 samples per
  prompt, ``recipes.stages.curate_cpu``'s rules) and run GRPO on the kept prompts, its
  statistics seeded by the curation (baseline b). The curation is run once and its tokens are
  charged to every seed;
- ``depo_d3s_cw_raw``: no offline curation; DEPO's online estimator (fresh, trained during the
  run) drops prompts before rollout, D³S selects samples and tokens, CW-GRPO weights them;
- ``depo_e3_d3s_cw_raw``: the same with E3's rank budgets (B·G rollouts per step, conserved,
  moved from easy to hard prompts; bounds widen each pass over the pool);
- ``fast_depo_d3s_cw_raw``: ``depo_d3s_cw_raw`` with an estimator that learns ten times faster
  and filters at P(all G rewards equal) > 0.5 instead of 0.9 (the recorded race; both are today's
  defaults for the tiny encoder);
- ``fast_depo_ada_est_d3s_cw_raw``: the same with Reinforce-Ada-Est budgets (B·G a step,
  conserved, in [2, 2G]).

The CPU campaign's default (``recipes.cpu.default_cpu``) is the method this race measured best.

Cost = **total campaign tokens**, as the campaign ledger counts them (``pipeline.launch.ledger``):
rollout tokens of the RL run up to an evaluation point, plus the tokens DEPO's online estimator
read up to that point (``depo/encoded_tokens``), plus the curation's generated tokens for
curated methods. A DEPO run whose metrics predate that count stops the race with a message to
rerun it. The target is the
best baseline's final held-out pass@1 (mean over seeds); each method's cost to target is read
at the first evaluation point reaching it (no interpolation), per seed, and compared with
the best baseline's cost of the same seed. Held-out set: ``--heldout-per-level`` test problems
of each difficulty 3-5 (difficulty 2's test split holds only ~14 distinct problems), sampled
as in ``tools.bench.race`` (same sampling seed everywhere, so curves are paired).

Beside tokens, the same costs in **FLOPs** (``pipeline.stats.flops``), where an estimator token costs
what the estimator costs (2.9% of a policy token's matmuls for the tiny encoder), not a policy
token: the RL run's own count up to the point (``flops/cumulative/total``: generation, prefill,
update, estimator), plus for curated methods the curation's generation estimated from its tokens
(``2·N`` each; its prompts and attention are not recorded, so a curated method's FLOPs are
somewhat low, marked ``~``). A run from before the count has no FLOPs (``n/a``).

A pass over the pool is ``4 · pool_per_level`` prompts; at 16 prompts a step, the default 100
prompts per level give a pass every 25 steps, so E3's budget widening (after each pass,
``algorithm.e3_budget.widen_step``) happens three times within the 100 steps. The zero-variance
share is the RL run's ``ledger/zero_variance_groups`` over ``ledger/groups``.

The race's evaluation points are checkpoint-and-resume boundaries of the RL run. E3's budget
does not survive a resume after a completed pass (the size of its last ranking is not in its
state dict), so ``depo_e3_d3s_cw_raw`` runs in one piece and is scored at its end only: its cost
to target is its total at the end when it reaches the target there.

Resumable like ``tools.bench.race`` (it reuses its runner). Outputs: ``<out>/default_race.json``
and a printed table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

LEVELS = (2, 3, 4, 5)
HELDOUT_LEVELS = (3, 4, 5)  # difficulty 2's test split holds only ~14 distinct problems
BASELINES = ("grpo_raw", "grpo_curated")


def _grpo(*, steps: int, group_size: int = 8):
    from recipes.cpu import grpo_cpu

    return grpo_cpu(steps=steps, group_size=group_size)


def _depo_d3s_cw(*, steps: int, group_size: int = 8):
    from recipes.cpu import d3s_cw_cpu

    cfg = d3s_cw_cpu(steps=steps, group_size=group_size)
    cfg.algorithm.prompt_filter = "depo"  # a fresh estimator, warmed up online (no curation to train it on)
    return cfg


def _depo_e3_d3s_cw(*, steps: int, group_size: int = 8):
    cfg = _depo_d3s_cw(steps=steps, group_size=group_size)
    cfg.algorithm.budget = "e3"
    cfg.algorithm.e3_budget = dataclasses.replace(cfg.algorithm.e3_budget, min_limit=group_size // 2,
                                                  max_limit=2 * group_size)
    return cfg


# Recorded with the filter before its calibrated head: at the then-defaults (lr 1e-4, drop when
# p̂^8 + (1 − p̂)^8 > 0.9) the online estimator filtered nothing in 60 steps, its predicted pass rates
# within ±0.02 of the batch mean; at ten times the learning rate it separated the pool's levels only
# after ~45 steps (docs/benchmarks.md, "The default race"). The filter now drops on a calibrated
# P(all G equal) and these two values are the tiny encoder's defaults, so the candidate repeats
# ``depo_d3s_cw_raw`` at today's settings; it stays so that the recorded race reruns by name.
FAST_DEPO_LR = 1e-3
FAST_DEPO_THRESHOLD = 0.5


def _fast_depo_d3s_cw(*, steps: int, group_size: int = 8):
    cfg = _depo_d3s_cw(steps=steps, group_size=group_size)
    cfg.algorithm.depo = dataclasses.replace(cfg.algorithm.depo, lr=FAST_DEPO_LR, threshold=FAST_DEPO_THRESHOLD)
    return cfg


def _fast_depo_ada_est_d3s_cw(*, steps: int, group_size: int = 8):
    """Reinforce-Ada-Est budgets (B·G a step, conserved) in [2, 2G]: fewer samples on prompts the
    run has seen solved, more on the hard ones, where 8 samples rarely find a success."""
    cfg = _fast_depo_d3s_cw(steps=steps, group_size=group_size)
    cfg.algorithm.budget = "ada_est"
    cfg.algorithm.ada_est = dataclasses.replace(cfg.algorithm.ada_est, min_budget=2, max_budget=2 * group_size)
    return cfg


@dataclasses.dataclass(frozen=True, slots=True)
class Method:
    recipe: Callable[..., Any]
    curated: bool
    # E3's budget keeps the size of its last ranking outside its state dict, so an RL run resumed
    # after a completed pass splits budgets with the wrong rank denominator and stops with an error.
    # The race's evaluation points are resumes; such a method is evaluated at its end only.
    evaluate_at_end_only: bool = False


METHODS = {
    "grpo_raw": Method(recipe=_grpo, curated=False),
    "grpo_curated": Method(recipe=_grpo, curated=True),
    "depo_d3s_cw_raw": Method(recipe=_depo_d3s_cw, curated=False),
    "depo_e3_d3s_cw_raw": Method(recipe=_depo_e3_d3s_cw, curated=False, evaluate_at_end_only=True),
    "fast_depo_d3s_cw_raw": Method(recipe=_fast_depo_d3s_cw, curated=False),
    "fast_depo_ada_est_d3s_cw_raw": Method(recipe=_fast_depo_ada_est_d3s_cw, curated=False),
}


def write_pool(path: Path, *, per_level: int) -> list:
    """The training pool, seed 0's train split of each level, as a prompts file ``load_prompts`` reads."""
    from pipeline.data import load_prompts

    prompts = []
    for level in LEVELS:
        loaded, _ = load_prompts(f"arith?difficulty={level}&size={per_level}", split="train", seed=0)
        prompts.extend(loaded)
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps({"id": p.id, "problem": p.problem, "answer": p.answer, **p.metadata}) + "\n"
                                for p in prompts))
    return prompts


def load_mixed_heldout(*, per_level: int) -> list:
    from pipeline.data import load_prompts

    prompts = []
    for level in HELDOUT_LEVELS:
        loaded, _ = load_prompts(f"arith?difficulty={level}&size={per_level}", split="test")
        prompts.extend(loaded)
    return prompts


def run_curation(pool_path: Path, out: Path, *, context, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Curate the pool with the demo's curation settings and the policy the RL runs start from
    (``overrides``: the race's ``--set``); returns its manifest."""
    from pipeline import configlib
    from pipeline.config import RLConfig
    from pipeline.stages.bootstrap import run_bootstrap
    from pipeline.stages.curate import run_curate
    from pipeline.stats.curation import MANIFEST_FILE
    from recipes.stages import curate_cpu

    manifest = out / MANIFEST_FILE
    if not manifest.is_file():
        bootstrap = configlib.load(RLConfig, base=_grpo(steps=1), overrides=list(overrides)).bootstrap
        policy = run_bootstrap(bootstrap, context=context).directory
        cfg = dataclasses.replace(curate_cpu(), sources=[str(pool_path)], policy=str(policy), output_dir=str(out))
        run_curate(cfg, context=context, out=lambda line: print(f"[curate] {line}", flush=True))
    return json.loads(manifest.read_text())


def run_summary(run_dir: Path) -> dict[str, Any]:
    """The RL run's zero-variance share and E3 bounds at its end, from its metrics."""
    from pipeline.metrics import read_metrics

    rows = [row for row in read_metrics(run_dir / "metrics.jsonl") if "ledger/groups" in row]
    last = max(rows, key=lambda row: row["step"])
    bounds = list(dict.fromkeys((row["e3/g_min"], row["e3/g_max"]) for row in rows if "e3/g_min" in row))
    return {"zero_variance_share": last["ledger/zero_variance_groups"] / max(1, last["ledger/groups"]),
            "prompts_filtered": last["ledger/prompts_filtered"], "e3_bounds": bounds}


def add_encoded_tokens(result: dict[str, Any], run_dir: Path, *, filters_with_depo: bool) -> None:
    """Put the estimator's cumulative encoded tokens (0 without DEPO) on every point of the run's curve."""
    from pipeline.metrics import read_metrics

    encoded = {0: 0}
    if filters_with_depo:
        rows = read_metrics(run_dir / "metrics.jsonl")
        encoded.update({row["step"]: int(row["depo/encoded_tokens"]) for row in rows if "depo/encoded_tokens" in row})
    for point in result["curve"]:
        if point["step"] not in encoded and filters_with_depo:
            raise SystemExit(f"[default_race] {run_dir}: metrics.jsonl has no depo/encoded_tokens at step "
                             f"{point['step']} (the run predates the count); move the run and its result aside "
                             "and rerun the race")
        point["tokens_encoded"] = encoded.get(point["step"], 0)
    result["final"] = result["curve"][-1]


def add_flops(result: dict[str, Any], run_dir: Path) -> None:
    """Put the run's cumulative FLOPs (``flops/cumulative/total``; None where the run predates the count)
    on every point of its curve (0 at step 0)."""
    from pipeline.metrics import read_metrics

    path = run_dir / "metrics.jsonl"
    rows = read_metrics(path) if path.is_file() else []
    counted = {row["step"]: float(row["flops/cumulative/total"]) for row in rows if "flops/cumulative/total" in row}
    for point in result["curve"]:
        point["flops"] = 0.0 if point["step"] == 0 else counted.get(point["step"])
    result["final"] = result["curve"][-1]


def curation_flops(manifest: dict[str, Any], overrides: Sequence[str] = ()) -> float:
    """The curation's generation, estimated from its generated tokens at the bootstrap policy's size."""
    from pipeline import configlib
    from pipeline.config import RLConfig
    from pipeline.launch.ledger import generated_tokens_flops
    from pipeline.launch.plan import bootstrap_model_dims

    bootstrap = configlib.load(RLConfig, base=_grpo(steps=1), overrides=list(overrides)).bootstrap
    policy = bootstrap_model_dims(bootstrap).forward_cost()
    flops, _ = generated_tokens_flops(int(manifest["num_generated_tokens"]), policy)
    return float(flops.total or 0.0)


def campaign_tokens(point: dict[str, Any], run: dict[str, Any]) -> int:
    """Rollout + estimator-encoded tokens up to ``point``, plus the curation the method paid before RL."""
    return point["tokens_generated"] + point.get("tokens_encoded", 0) + run["curation_tokens"]


def campaign_flops(point: dict[str, Any], run: dict[str, Any]) -> float | None:
    """The RL run's FLOPs up to ``point`` plus the curation's (``add_flops``); None without the run's count."""
    flops = point.get("flops")
    return None if flops is None else flops + run.get("curation_flops", 0.0)


def summarize(results: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    """Target = the best baseline's mean final pass@1; each method's total tokens to reach it, per seed."""
    from tools.bench.race import first_reaching, spread

    finals = {m: statistics.fmean(r["final"]["pass@1"] for r in runs.values()) for m, runs in results.items()}
    best = max((m for m in BASELINES if m in results), key=lambda m: finals[m])
    target = finals[best]

    def cost_to_target(run: dict[str, Any], cost: Callable[[dict[str, Any], dict[str, Any]], Any]) -> Any:
        point = first_reaching(run["curve"], target)
        return None if point is None else cost(point, run)

    def to_target(runs: dict[int, dict[str, Any]], cost: Callable[[dict[str, Any], dict[str, Any]], Any],
                  best_cost: dict[int, Any]) -> dict[str, Any]:
        costs = {seed: cost_to_target(run, cost) for seed, run in runs.items()}
        ratios = [None if costs[s] is None or not best_cost.get(s) else costs[s] / best_cost[s] for s in runs]
        return {"per_seed": costs, "value": spread(list(costs.values())), "ratio": spread(ratios)}

    best_tokens = {seed: cost_to_target(run, campaign_tokens) for seed, run in results[best].items()}
    best_flops = {seed: cost_to_target(run, campaign_flops) for seed, run in results[best].items()}
    methods = {}
    for method, runs in results.items():
        tokens = to_target(runs, campaign_tokens, best_tokens)
        methods[method] = {
            "final_pass@1": spread([run["final"]["pass@1"] for run in runs.values()]),
            "final_pass@8": spread([run["final"].get("pass@8") for run in runs.values()]),
            "reached": sum(c is not None for c in tokens["per_seed"].values()), "seeds": sorted(runs),
            "tokens_to_target": tokens,
            "flops_to_target": to_target(runs, campaign_flops, best_flops),
            "total_flops_end": spread([campaign_flops(run["final"], run) for run in runs.values()]),
            "flops_estimated": any(run.get("curation_flops") for run in runs.values()),
            "total_tokens_end": spread([campaign_tokens(run["final"], run) for run in runs.values()]),
            "rollout_tokens_end": spread([run["final"]["tokens_generated"] for run in runs.values()]),
            "encoded_tokens_end": spread([run["final"].get("tokens_encoded", 0) for run in runs.values()]),
            "curation_tokens": runs[min(runs)]["curation_tokens"],
            "zero_variance_share": spread([run["summary"]["zero_variance_share"] for run in runs.values()]),
            "prompts_filtered": spread([run["summary"]["prompts_filtered"] for run in runs.values()]),
            "e3_bounds": runs[min(runs)]["summary"]["e3_bounds"],
        }
    return {"target_pass@1": target, "best_baseline": best, "methods": methods}


def _range(entry: dict[str, Any], fmt: str) -> str:
    if entry["n"] == 0:
        return "—"
    text = format(entry["mean"], fmt)
    return text if entry["n"] == 1 else f"{text} [{format(entry['min'], fmt)}–{format(entry['max'], fmt)}]"


def _flops_range(entry: dict[str, Any], *, estimated: bool) -> str:
    """A spread of FLOPs as ``1.23e15 [1.10e15–1.31e15]``, ``~`` first when estimated, ``n/a`` without any."""
    from pipeline.stats.flops import format_flops

    if entry["n"] == 0:
        return "n/a"
    text = ("~" if estimated else "") + format_flops(entry["mean"])
    return text if entry["n"] == 1 else f"{text} [{format_flops(entry['min'])}–{format_flops(entry['max'])}]"


def format_table(summary: dict[str, Any]) -> str:
    lines = [f"target: {summary['best_baseline']}'s final held-out pass@1, {summary['target_pass@1']:.4f} "
             "(mean over seeds; [min–max] over seeds)",
             "| method | final pass@1 | reached | total tokens to target | vs best baseline | curation tokens | "
             "estimator tokens | total tokens at the end | FLOPs to target | vs best baseline (FLOPs) | "
             "FLOPs at the end | zero-variance groups | prompts filtered | E3 bounds |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for method, row in summary["methods"].items():
        bounds = " → ".join(f"[{int(lo)}, {int(hi)}]" for lo, hi in row["e3_bounds"]) or "—"
        estimated = row.get("flops_estimated", False)
        lines.append(f"| {method} | {_range(row['final_pass@1'], '.3f')} | {row['reached']}/{len(row['seeds'])} | "
                     f"{_range(row['tokens_to_target']['value'], ',.0f')} | "
                     f"{_range(row['tokens_to_target']['ratio'], '.2f')} | {row['curation_tokens']:,} | "
                     f"{_range(row['encoded_tokens_end'], ',.0f')} | {_range(row['total_tokens_end'], ',.0f')} | "
                     f"{_flops_range(row['flops_to_target']['value'], estimated=estimated)} | "
                     f"{_range(row['flops_to_target']['ratio'], '.2f')} | "
                     f"{_flops_range(row['total_flops_end'], estimated=estimated)} | "
                     f"{_range(row['zero_variance_share'], '.0%')} | {_range(row['prompts_filtered'], ',.0f')} | "
                     f"{bounds} |")
    lines.append("FLOPs: the RL run's own count, plus for curated methods (~) the curation's generation estimated "
                 "from its tokens, prompts and attention not recorded; n/a: runs from before the count.")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--seeds", type=int, default=3, help="number of seeds (0..N-1)")
    parser.add_argument("--steps", type=int, default=100, help="RL steps per run")
    parser.add_argument("--eval-every", type=int, default=25, help="steps between held-out evaluations")
    parser.add_argument("--pool-per-level", type=int, default=100, help="train problems per difficulty 2-5")
    parser.add_argument("--heldout-per-level", type=int, default=100, help="held-out problems per difficulty 3-5")
    parser.add_argument("--eval-samples", type=int, default=8, help="samples per held-out problem")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="dotted RLConfig override applied to every method and to the curation's policy "
                             "(repeatable), e.g. a smaller bootstrap.model")
    parser.add_argument("--out", default="runs/bench/default_race", help="output directory")
    args = parser.parse_args(argv)
    from pipeline import configlib
    from pipeline.config import RLConfig

    for name in args.methods:  # a bad --set fails here, before any run
        try:
            configlib.load(RLConfig, base=METHODS[name].recipe(steps=args.steps), overrides=args.overrides)
        except configlib.ConfigError as error:
            parser.error(f"--set ({name}): {error}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    import torch

    from pipeline.parallel.rendezvous import initialize_process_context
    from pipeline.rewards import GradingPool
    from tools.bench.race import RaceSettings, run_rl_method

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out).absolute()
    pool_path = out / "pool.jsonl"
    write_pool(pool_path, per_level=args.pool_per_level)
    heldout = load_mixed_heldout(per_level=args.heldout_per_level)
    context = initialize_process_context(seed=0)
    curation: dict[str, Any] | None = None
    results: dict[str, dict[int, dict[str, Any]]] = {}
    with GradingPool(**_grpo(steps=1).reward.pool_kwargs()) as pool:
        for name in args.methods:
            method = METHODS[name]
            overrides = [*args.overrides, f"data.train={json.dumps([str(pool_path)])}"]
            curation_tokens, curation_cost = 0, 0.0
            if method.curated:
                curation = curation or run_curation(pool_path, out / "curate", context=context,
                                                    overrides=args.overrides)
                curation_tokens = int(curation["num_generated_tokens"])
                curation_cost = curation_flops(curation, args.overrides)
                overrides = [*args.overrides, f"data.train={json.dumps([str(out / 'curate' / 'kept.jsonl')])}",
                             f"curation_dir={out / 'curate'}"]
            settings = RaceSettings(out=out, steps=args.steps,
                                    eval_every=args.steps if method.evaluate_at_end_only else args.eval_every,
                                    eval_set=f"arith {HELDOUT_LEVELS}, {args.heldout_per_level} each (test)",
                                    eval_prompts=len(heldout), eval_samples=args.eval_samples,
                                    overrides=tuple(overrides))
            for seed in range(args.seeds):
                path = settings.result_path(name, seed)
                if path.is_file():
                    result = json.loads(path.read_text())
                else:
                    print(f"[default_race] {name} seed {seed}: running", flush=True)
                    result = run_rl_method(name, seed, settings=settings, context=context, heldout=heldout, pool=pool,
                                           recipe=method.recipe)
                    result["curation_tokens"] = curation_tokens
                    result["summary"] = run_summary(settings.run_dir(name, seed))
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(json.dumps(result, indent=1))
                add_encoded_tokens(result, settings.run_dir(name, seed),
                                   filters_with_depo=method.recipe(steps=1).algorithm.prompt_filter == "depo")
                add_flops(result, settings.run_dir(name, seed))
                result["curation_flops"] = curation_cost
                print(f"[default_race] {name} seed {seed}: final pass@1 {result['final']['pass@1']:.3f}, "
                      f"rollout tokens {result['final']['tokens_generated']:,}, "
                      f"estimator tokens {result['final']['tokens_encoded']:,}, "
                      f"zero-variance {result['summary']['zero_variance_share']:.0%}", flush=True)
                results.setdefault(name, {})[seed] = result
    if not any(name in BASELINES for name in results):
        print(f"no baseline ({', '.join(BASELINES)}) among --methods: rerun with one for the table "
              "(finished runs are reused)")
        return
    summary = summarize(results)
    (out / "default_race.json").write_text(json.dumps(
        {"settings": vars(args), "summary": summary,
         "runs": {m: {str(s): r for s, r in runs.items()} for m, runs in results.items()}}, indent=1))
    print(format_table(summary))


if __name__ == "__main__":
    main()
