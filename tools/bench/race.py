"""Sample-efficiency race: every CPU recipe against GRPO from the same base policy, seeds and budget.

    .venv/bin/python -m tools.bench.race                          # every recipe + more SFT, 3 seeds, 100 steps
    .venv/bin/python -m tools.bench.race --methods grpo_cpu d3s_cpu more_sft --seeds 1 --steps 20

Methods are the names in ``recipes.cpu.RECIPES`` (read at run time, so new presets join
the race without a change here) plus ``more_sft``; ``grpo_cpu`` is the baseline and
always runs first. Every RL run starts from the cached bootstrap policy with its
recipe's config at the same budget (``--steps`` x prompts per step), seeded by the
race seed, and is scored on the held-out set every ``--eval-every`` steps and at the
end: sampled pass@1 and pass@8 (unbiased, ``pipeline.eval.passk``) over
``--eval-samples`` samples of each of ``--eval-prompts`` held-out problems, at the
RL sampling temperature, with one fixed sampling seed for every method and step so
that curves are paired. Costs at an evaluation point come from the run's
``metrics.jsonl``: rollout tokens (``ledger/tokens_generated``), tokens with gradient
(``ledger/tokens_with_gradient``) and wall time = the sum of the steps' ``time/*``
phases (setup, checkpoints and the race's own evaluations are excluded, for every
method alike).

``more_sft`` continues the bootstrap's supervised training (its data, batch size and
cross-entropy step, at the learning rate its schedule ended on) for the wall time GRPO
used with the same seed, evaluated at GRPO's evaluation times. It generates no
rollouts, so its rollout-token columns are empty; its "tokens with gradient" are the
supervised tokens.

Each evaluation point also records the policy's mean token entropy over the steps
since the previous point (the RL loop's logged ``entropy``, at the sampling
temperature); a method's "entropy end/start" is the last window's mean over its
first step's entropy (E3's H_init), the quantity E3's temperature scheduler claims
to keep near 1 (its Fig. 1; with annealing, near η = 0.9) where GRPO's falls.

For each method: steps, rollout tokens, tokens with gradient and wall time to first
reach the target held-out pass@1 (``--target``; default GRPO's final pass@1, averaged
over seeds), measured at the evaluation points (no interpolation), and the final
pass@1/pass@8 — each as the mean of per-seed ratios to ``grpo_cpu`` with their
min–max spread. A seed that never reaches the target has no ratio; the table shows
how many did.

Resumable: ``<out>/results/<method>/seed<k>.json`` is written when a (method, seed)
finishes and skipped when present; an unfinished RL run resumes from its last
checkpoint (saved at every evaluation point) with the evaluations it had
(``curve.jsonl`` next to it). Outputs: ``<out>/race.json``, ``<out>/race.png``
(pass@1 against rollout tokens and against wall time) and a printed table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tools.bench.chunks import reuse_or_run, train_in_chunks

BASELINE = "grpo_cpu"
MORE_SFT = "more_sft"
PASS_KS = (1, 8)
COST_KEYS = ("steps", "tokens_generated", "tokens_with_gradient", "wall_s")


@dataclasses.dataclass(frozen=True, slots=True)
class RaceSettings:
    out: Path
    steps: int = 100
    group_size: int | None = None  # None: each recipe's own G (grpo_n4_cpu is G = 4)
    eval_every: int = 25
    eval_set: str = "arith?difficulty=3&size=1000"
    eval_prompts: int = 500
    eval_samples: int = 8
    eval_seed: int = 1234
    overrides: tuple[str, ...] = ()  # dotted RLConfig overrides applied to every method
    progress: bool = False

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"--steps: need at least 1, got {self.steps}")
        if not 1 <= self.eval_every <= self.steps:
            raise ValueError(f"--eval-every: {self.eval_every} is outside [1, steps={self.steps}]")
        if self.eval_prompts < 1 or self.eval_samples < 1:
            raise ValueError("--eval-prompts and --eval-samples must be ≥ 1")

    @property
    def eval_steps(self) -> list[int]:
        return sorted({*range(self.eval_every, self.steps, self.eval_every), self.steps})

    def result_path(self, method: str, seed: int) -> Path:
        return self.out / "results" / method / f"seed{seed}.json"

    def run_dir(self, method: str, seed: int) -> Path:
        return self.out / "runs" / method / f"seed{seed}"


# --------------------------------------------------------------------------- evaluation


def heldout_scores(*, model, tokenizer, prompts, num_samples: int, max_new_tokens: int, temperature: float,
                   seed: int, pool, template: str) -> dict[str, float]:
    """Sampled pass@k (k in PASS_KS, k ≤ num_samples) of an HF causal LM on held-out prompts."""
    from pipeline.eval.runner import sample_and_grade, score
    from pipeline.rollout.local import LocalEngine
    from pipeline.rollout.types import SamplingParams

    engine = LocalEngine(model, eos_token_ids=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         show_progress=False)
    results = sample_and_grade(engine=engine, tokenizer=tokenizer, prompts=prompts, num_samples=num_samples,
                               pool=pool, template=template,
                               params=SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed))
    scores = score(results, [k for k in PASS_KS if k <= num_samples])
    return {key: value for key, value in scores.items() if key.startswith("pass@")}


def load_heldout(settings: RaceSettings) -> list:
    from pipeline.data import load_prompts

    prompts, _ = load_prompts(settings.eval_set, split="test", limit=settings.eval_prompts)
    if len(prompts) < settings.eval_prompts:
        raise ValueError(f"--eval-set {settings.eval_set}: its test split has {len(prompts)} problems, "
                         f"fewer than --eval-prompts={settings.eval_prompts}")
    return prompts


# --------------------------------------------------------------------------- runs


def method_config(method: str, seed: int, settings: RaceSettings, *, recipe: Callable[..., Any] | None = None):
    """The recipe's RLConfig for this race: its outputs under the run directory, the race's overrides on top.

    ``recipe``: a function like those of ``recipes.cpu.RECIPES`` (``steps``, ``group_size``) to use
    instead of the one named ``method`` (``tools.bench.default_race`` races its own combinations).
    """
    from pipeline import configlib
    from pipeline.config import RLConfig
    from recipes.cpu import RECIPES

    run_dir = settings.run_dir(method, seed)
    group = {} if settings.group_size is None else {"group_size": settings.group_size}
    base = (recipe or RECIPES[method])(steps=settings.steps, **group)
    return configlib.load(RLConfig, base=base, overrides=[
        f"seed={seed}", f"logging.output_dir={run_dir}", f"checkpoint.directory={run_dir}/checkpoints",
        # A checkpoint at every evaluation point is what a resumed race restarts from.
        f"checkpoint.every_steps={settings.eval_every}", "checkpoint.keep_last=1", "checkpoint.resume=auto",
        "logging.trackers=[]", f"logging.progress={str(settings.progress).lower()}",
        # run_rl's own start/end evaluation is superseded by the race's pass@k; one sample keeps it cheap.
        "eval_samples=1",
        *settings.overrides,
    ])


def _costs_at(metrics_rows: list[dict[str, Any]], step: int, *, since: int) -> dict[str, float]:
    """Cumulative costs after ``step`` RL steps, from run_rl's metrics rows (row 0 is the initial evaluation),
    and the policy's mean token entropy over the steps after ``since`` (the previous evaluation point)."""
    trained = [row for row in metrics_rows if 1 <= row["step"] <= step]
    assert [row["step"] for row in trained] == list(range(1, step + 1)), "metrics.jsonl misses steps"
    last = trained[-1] if trained else {}
    wall = sum(value for row in trained for key, value in row.items() if key.startswith("time/"))
    window = [row["entropy"] for row in trained[since:]]
    return {"steps": step, "tokens_generated": last.get("ledger/tokens_generated", 0),
            "tokens_with_gradient": last.get("ledger/tokens_with_gradient", 0), "wall_s": wall,
            "entropy": statistics.fmean(window) if window else None}


def base_scores(settings: RaceSettings, *, context, heldout, pool) -> dict[str, float]:
    """Held-out scores of the bootstrap policy (shared by every method and seed), cached in <out>."""
    from pipeline.eval.policy import load_policy
    from pipeline.stages.bootstrap import run_bootstrap

    path = settings.out / "base_scores.json"
    if path.is_file():
        return json.loads(path.read_text())
    cfg = method_config(BASELINE, 0, settings)
    policy = load_policy(run_bootstrap(cfg.bootstrap, context=context).directory, context=context)
    scores = heldout_scores(model=policy.hf_model, tokenizer=policy.tokenizer, prompts=heldout,
                            num_samples=settings.eval_samples, max_new_tokens=cfg.max_new_tokens,
                            temperature=cfg.temperature, seed=settings.eval_seed, pool=pool,
                            template=cfg.data.template)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(scores))
    return scores


def run_rl_method(method: str, seed: int, *, settings: RaceSettings, context, heldout, pool,
                  recipe: Callable[..., Any] | None = None) -> dict[str, Any]:
    """Train ``method`` (or ``recipe``, see ``method_config``) in chunks between evaluation points;
    resume from the newest checkpoint (``tools.bench.chunks``)."""
    from pipeline.metrics import read_metrics

    cfg = method_config(method, seed, settings, recipe=recipe)
    run_dir = settings.run_dir(method, seed)
    started = time.perf_counter()

    def first_point() -> dict[str, Any]:
        return {**base_scores(settings, context=context, heldout=heldout, pool=pool),
                "steps": 0, "tokens_generated": 0, "tokens_with_gradient": 0, "wall_s": 0.0, "entropy": None}

    def score(policy, step: int, previous: dict[str, Any]) -> dict[str, Any]:
        scores = heldout_scores(model=policy.hf_model, tokenizer=policy.tokenizer, prompts=heldout,
                                num_samples=settings.eval_samples, max_new_tokens=cfg.max_new_tokens,
                                temperature=cfg.temperature, seed=settings.eval_seed, pool=pool,
                                template=cfg.data.template)
        return {**scores, **_costs_at(read_metrics(run_dir / "metrics.jsonl"), step, since=previous["step"])}

    def next_step(done: int, last: dict[str, Any]) -> int | None:  # noqa: ARG001 - fixed evaluation steps
        return next((s for s in settings.eval_steps if s > done), None)

    curve = train_in_chunks(cfg, context=context, curve_path=run_dir / "curve.jsonl", first_point=first_point,
                            score=score, next_step=next_step, label=f"[race] {method} seed {seed}")
    # E3's H_init (Eq. 4): the entropy of the first batch, what its temperature scheduler holds the policy to.
    first_step = next(row for row in read_metrics(run_dir / "metrics.jsonl") if row["step"] == 1)
    return {"method": method, "seed": seed, "curve": curve, "final": curve[-1],
            "first_step_entropy": first_step["entropy"], "bench_seconds": time.perf_counter() - started}


def run_more_sft(seed: int, *, settings: RaceSettings, context, heldout, pool,
                 eval_wall_s: Sequence[float]) -> dict[str, Any]:
    """Continue the bootstrap's supervised training for GRPO's wall time, scored at GRPO's evaluation times."""
    import torch

    from pipeline.checkpoint.artifact import load_weights
    from pipeline.checkpoint.convert import copy_into_model
    from pipeline.checkpoint.manager import CheckpointManager
    from pipeline.data import render_prompt
    from pipeline.models.spec import ModelSpec
    from pipeline.models.tokenizer import load_tokenizer
    from pipeline.rollout.weight_sync import actor_hf_state, build_hf_model
    from pipeline.stages.bootstrap import TEMPLATE, encode_example, load_training_prompts, make_batch, run_bootstrap
    from pipeline.trainer.actor import Actor
    from pipeline.trainer.losses import CrossEntropyLoss

    assert eval_wall_s and all(b > a for a, b in zip(eval_wall_s, eval_wall_s[1:])), eval_wall_s
    cfg = method_config(BASELINE, seed, settings)
    bootstrap = cfg.bootstrap
    base = run_bootstrap(bootstrap, context=context)
    tokenizer = load_tokenizer(base.tokenizer_dir)
    spec = ModelSpec(**base.summary["model_spec"])
    # Pick up where the bootstrap schedule ended: its final learning rate, held constant.
    optim = dataclasses.replace(bootstrap.optim, lr=bootstrap.optim.lr * bootstrap.optim.min_lr_ratio,
                                warmup_steps=0, decay="constant")
    actor = Actor(spec=spec, context=context, trainer=bootstrap.trainer, optim=optim, seed=seed)
    load_weights(CheckpointManager(base.checkpoint_dir, keep_last=1).newest_valid(), actor.module)
    policy = build_hf_model(spec)
    examples = [encode_example(tokenizer, render_prompt(p, template=TEMPLATE), p.metadata["solution"])
                for p in load_training_prompts(bootstrap)]
    order_generator = torch.Generator().manual_seed(seed)
    order: list[int] = []
    loss = CrossEntropyLoss()
    curve = [{**base_scores(settings, context=context, heldout=heldout, pool=pool),
              "steps": 0, "tokens_generated": None, "tokens_with_gradient": 0, "wall_s": 0.0, "entropy": None,
              "step": 0}]
    wall, num_tokens, step = 0.0, 0, 0
    started = time.perf_counter()
    for checkpoint_wall in eval_wall_s:
        while wall < checkpoint_wall:
            if len(order) < bootstrap.batch_size:  # a new epoch, in a seeded order
                order += torch.randperm(len(examples), generator=order_generator).tolist()
            rows, order = order[: bootstrap.batch_size], order[bootstrap.batch_size:]
            batch = make_batch([examples[i] for i in rows], pad_id=tokenizer.pad_token_id)
            step_started = time.perf_counter()
            actor.train_step(batch, loss)
            wall += time.perf_counter() - step_started
            num_tokens += int(batch.response_mask.sum())
            step += 1
        copy_into_model(policy, actor_hf_state(actor))  # the same Megatron → HF map as RL's weight sync
        scores = heldout_scores(model=policy, tokenizer=tokenizer, prompts=heldout,
                                num_samples=settings.eval_samples, max_new_tokens=cfg.max_new_tokens,
                                temperature=cfg.temperature, seed=settings.eval_seed, pool=pool,
                                template=cfg.data.template)
        curve.append({**scores, "steps": step, "tokens_generated": None, "tokens_with_gradient": num_tokens,
                      "wall_s": wall, "entropy": None, "step": step})
    return {"method": MORE_SFT, "seed": seed, "curve": curve, "final": curve[-1],
            "bench_seconds": time.perf_counter() - started}


# --------------------------------------------------------------------------- summary


def first_reaching(curve: Sequence[dict[str, Any]], target: float) -> dict[str, Any] | None:
    """The first evaluation point whose pass@1 is at least ``target`` (None: never reached)."""
    return next((point for point in curve if point["pass@1"] >= target), None)


def spread(values: Sequence[float | None]) -> dict[str, Any]:
    """Mean, min and max over the values that exist, and how many exist."""
    present = [v for v in values if v is not None]
    if not present:
        return {"mean": None, "min": None, "max": None, "n": 0}
    return {"mean": statistics.fmean(present), "min": min(present), "max": max(present), "n": len(present)}


def _ratio(value: float | None, baseline: float | None) -> float | None:
    if value is None or baseline is None or baseline == 0:
        return None
    return value / baseline


def summarize(results: dict[str, dict[int, dict[str, Any]]], *, target: float | None = None) -> dict[str, Any]:
    """Per-method costs to reach ``target`` and final scores, as per-seed ratios to GRPO of the same seed."""
    if BASELINE not in results or not results[BASELINE]:
        raise ValueError(f"the race needs {BASELINE} results: it is the baseline of every ratio")
    if target is None:
        target = statistics.fmean(run["final"]["pass@1"] for run in results[BASELINE].values())
    baseline_reach = {seed: first_reaching(run["curve"], target) for seed, run in results[BASELINE].items()}
    methods: dict[str, Any] = {}
    for method, runs in results.items():
        row: dict[str, Any] = {"seeds": sorted(runs), "reached": 0, "to_target": {}, "final": {}}
        reach = {seed: first_reaching(run["curve"], target) for seed, run in runs.items()}
        row["reached"] = sum(point is not None for point in reach.values())
        for key in COST_KEYS:
            values = {seed: (point[key] if point is not None else None) for seed, point in reach.items()}
            ratios = [_ratio(values[seed], (baseline_reach.get(seed) or {}).get(key)) for seed in runs]
            row["to_target"][key] = {"per_seed": values, "value": spread(list(values.values())),
                                     "ratio": spread(ratios)}
        for k in PASS_KS:
            key = f"pass@{k}"
            values = {seed: run["final"].get(key) for seed, run in runs.items()}
            ratios = [_ratio(values[seed], results[BASELINE].get(seed, {}).get("final", {}).get(key)) for seed in runs]
            row["final"][key] = {"per_seed": values, "value": spread(list(values.values())), "ratio": spread(ratios)}
        # E3's claim (Fig. 1): GRPO's entropy falls, the temperature scheduler keeps it near H_init.
        retained = [_ratio(run["final"].get("entropy"), run.get("first_step_entropy")) for run in runs.values()]
        row["entropy_retained"] = spread(retained)
        methods[method] = row
    return {"target_pass@1": target, "baseline": BASELINE, "methods": methods}


def _format_ratio(entry: dict[str, Any]) -> str:
    ratio = entry["ratio"]
    if ratio["n"] == 0:
        return "—"
    if ratio["n"] == 1 or math.isclose(ratio["min"], ratio["max"]):
        return f"{ratio['mean']:.2f}×"
    return f"{ratio['mean']:.2f}× [{ratio['min']:.2f}–{ratio['max']:.2f}]"


def format_table(summary: dict[str, Any]) -> str:
    header = ["method", "reached", "steps→target", "rollout tok→target", "grad tok→target", "wall→target",
              "final pass@1", "final pass@8", "entropy end/start"]
    lines = [f"target held-out pass@1: {summary['target_pass@1']:.4f} (ratios: per-seed vs {BASELINE}, "
             "mean [min–max])", " | ".join(header)]
    for method, row in summary["methods"].items():
        finals = []
        for k in PASS_KS:
            entry = row["final"][f"pass@{k}"]
            finals.append("—" if entry["value"]["n"] == 0 else f"{entry['value']['mean']:.3f} ({_format_ratio(entry)})")
        lines.append(" | ".join([method, f"{row['reached']}/{len(row['seeds'])}",
                                 *(_format_ratio(row["to_target"][key]) for key in COST_KEYS), *finals,
                                 _format_ratio({"ratio": row["entropy_retained"]})]))
    return "\n".join(lines)


def plot(results: dict[str, dict[int, dict[str, Any]]], summary: dict[str, Any], path: Path) -> Path:
    """pass@1 against rollout tokens (RL methods) and against wall time (all), mean over seeds."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 4))
    FigureCanvasAgg(figure)
    by_tokens, by_wall = figure.subplots(1, 2)
    for method, runs in results.items():
        curves = [run["curve"] for run in runs.values()]
        length = min(len(curve) for curve in curves)  # seeds evaluate at the same points; guard a short one
        pass1 = [statistics.fmean(curve[i]["pass@1"] for curve in curves) for i in range(length)]
        wall = [statistics.fmean(curve[i]["wall_s"] for curve in curves) for i in range(length)]
        by_wall.plot(wall, pass1, marker="o", markersize=3, label=method)
        if curves[0][-1]["tokens_generated"] is not None:
            tokens = [statistics.fmean(curve[i]["tokens_generated"] for curve in curves) for i in range(length)]
            by_tokens.plot(tokens, pass1, marker="o", markersize=3, label=method)
    for axes, label in ((by_tokens, "rollout tokens"), (by_wall, "wall time of the steps (s)")):
        axes.axhline(summary["target_pass@1"], color="gray", linestyle="--", linewidth=1, label="target")
        axes.set_xlabel(label)
        axes.set_ylabel("held-out pass@1")
        axes.grid(alpha=0.3)
    by_wall.legend(fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return path


# --------------------------------------------------------------------------- driver


def method_names(requested: Sequence[str] | None) -> list[str]:
    """Requested (or all) method names, validated, with the baseline first and more SFT last."""
    from recipes.cpu import RECIPES

    known = [*RECIPES, MORE_SFT]
    names = list(dict.fromkeys(requested)) if requested else known
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"--methods: unknown {unknown}; known: {known}")
    if BASELINE not in names:
        raise ValueError(f"--methods must include {BASELINE}: every ratio is taken against it")
    return sorted(names, key=lambda name: (name != BASELINE, name == MORE_SFT))


def run_race(settings: RaceSettings, *, methods: Sequence[str], seeds: Sequence[int], context,
             target: float | None = None, log=print) -> dict[str, Any]:
    """Run (or reuse) every (method, seed), then write race.json and race.png; returns the summary."""
    from pipeline.rewards import GradingPool

    methods = method_names(methods)
    heldout = load_heldout(settings)
    results: dict[str, dict[int, dict[str, Any]]] = {}
    with GradingPool(**method_config(BASELINE, 0, settings).reward.pool_kwargs()) as pool:
        for method in methods:
            for seed in seeds:

                def train(method=method, seed=seed) -> dict[str, Any]:
                    if method == MORE_SFT:
                        grpo_curve = results[BASELINE][seed]["curve"]
                        return run_more_sft(seed, settings=settings, context=context, heldout=heldout, pool=pool,
                                            eval_wall_s=[point["wall_s"] for point in grpo_curve[1:]])
                    return run_rl_method(method, seed, settings=settings, context=context, heldout=heldout, pool=pool)

                result = reuse_or_run(settings.result_path(method, seed), train, label=f"[race] {method} seed {seed}",
                                      log=log)
                results.setdefault(method, {})[seed] = result
    summary = summarize(results, target=target)
    report = {"settings": {**dataclasses.asdict(settings), "out": str(settings.out), "methods": methods,
                           "seeds": list(seeds)},
              "summary": summary, "runs": {m: {str(s): r for s, r in runs.items()} for m, runs in results.items()}}
    (settings.out / "race.json").write_text(json.dumps(report, indent=1))
    plot(results, summary, settings.out / "race.png")
    return summary


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=None,
                        help=f"recipe names from recipes.cpu.RECIPES and/or {MORE_SFT} (default: all)")
    parser.add_argument("--seeds", type=int, default=3, help="number of seeds (0..N-1)")
    parser.add_argument("--steps", type=int, default=100, help="RL steps per run (the shared budget)")
    parser.add_argument("--group-size", type=int, default=None,
                        help="G passed to every recipe (default: each recipe's own, e.g. 4 for grpo_n4_cpu)")
    parser.add_argument("--eval-every", type=int, default=None, help="steps between held-out evaluations "
                        "(default: steps/4)")
    parser.add_argument("--eval-set", default="arith?difficulty=3&size=1000", help="held-out source (test split)")
    parser.add_argument("--eval-prompts", type=int, default=500, help="held-out problems")
    parser.add_argument("--eval-samples", type=int, default=8, help="samples per held-out problem")
    parser.add_argument("--eval-seed", type=int, default=1234, help="sampling seed of every held-out evaluation")
    parser.add_argument("--target", type=float, default=None, help="target pass@1 (default: GRPO's final)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="dotted RLConfig override applied to every method (repeatable)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--progress", action="store_true", help="show run_rl's progress bars")
    parser.add_argument("--out", default="runs/bench/race", help="output directory")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error("--seeds: need at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    import torch

    from pipeline.parallel.rendezvous import initialize_process_context

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    settings = RaceSettings(out=Path(args.out), steps=args.steps, group_size=args.group_size,
                            eval_every=args.eval_every or max(1, args.steps // 4), eval_set=args.eval_set,
                            eval_prompts=args.eval_prompts, eval_samples=args.eval_samples,
                            eval_seed=args.eval_seed, overrides=tuple(args.overrides), progress=args.progress)
    context = initialize_process_context(seed=0)
    summary = run_race(settings, methods=args.methods, seeds=range(args.seeds), context=context, target=args.target)
    print(format_table(summary))
    print(f"wrote {settings.out / 'race.json'} and {settings.out / 'race.png'}")


if __name__ == "__main__":
    main()
