"""One-step-off-policy rollouts against the synchronous loop: wall time per step and held-out pass@1.

    .venv/bin/python -m tools.bench.staleness                      # 3 seeds x 3 variants, 20 steps each
    .venv/bin/python -m tools.bench.staleness --seeds 1 --steps 4  # a quick look

Every run is ``recipes.cpu.grpo_cpu`` (GRPO on the demo's bootstrap policy) with nothing changed
but ``rollout.max_staleness`` and the trainer's torch threads (and the ``--set`` dotted
overrides, the same for every run: a smaller bootstrap policy or batch). Three variants:

``sync``          ``max_staleness=0`` as a user runs it: engine in the trainer's process, torch's
                  default thread count (all cores), generating between updates.
``sync_1thread``  the same loop with the thread share the asynchronous trainer gets (half the
                  cores): separates what the overlap buys from what the thread count does.
``async``         ``max_staleness=1``: the engine in a process of its own generates step t+1
                  while step t updates, each process on half the cores.

Runs rotate the variants' order from seed to seed, so slow phases of a shared machine fall on
all of them. Wall time per step is the sum of the step's timed phases (``time/*`` of
``metrics.jsonl``, without ``time/generate_ahead``, which overlaps the previous step), averaged
over steps 2 to N−1: step 1 has nothing in flight (its batch is generated on the spot, on
policy) and step N launches nothing and scores the held-out set. The phase breakdown is
averaged the same way; ``generate_and_grade`` (synchronous) and ``generate_wait`` (asynchronous:
the part of the generation the update did not hide) are the phases to compare. Held-out pass@1
is the run's own evaluation at step N (``eval/pass@1``: ``--eval-limit`` problems of the
difficulty-3 test split, ``--eval-samples`` samples each, sampling seed = run seed).

Resumable: each finished run writes ``<out>/runs/<variant>-seed<k>.json`` and is skipped when
present (an interrupted run restarts from scratch). Output: ``<out>/staleness.json`` (settings,
machine, every run, the summary), ``<out>/staleness.png`` and a printed table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

VARIANTS = ("sync", "sync_1thread", "async")
BASELINE = "sync"


def run_one(variant: str, *, seed: int, steps: int, eval_limit: int, eval_samples: int, out: Path,
            context, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """One RL run; its per-step wall time and phases (steps 2..N-1) and its final held-out pass@1."""
    import torch

    from pipeline import configlib
    from pipeline.config import RLConfig
    from pipeline.metrics import read_metrics
    from pipeline.rollout.process_engine import split_threads
    from pipeline.stages.rl import run_rl
    from recipes.cpu import grpo_cpu

    run_dir = out / variant / f"seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = configlib.load(RLConfig, base=grpo_cpu(steps=steps), overrides=[
        *overrides,
        f"seed={seed}", f"rollout.max_staleness={int(variant == 'async')}", f"logging.output_dir={run_dir}",
        f"checkpoint.directory={run_dir}/checkpoints", f"checkpoint.every_steps={steps}", "checkpoint.resume=never",
        "logging.trackers=[]", "logging.progress=false", f"eval_limit={eval_limit}", f"eval_samples={eval_samples}",
    ])
    default_threads = torch.get_num_threads()
    threads = split_threads()[0] if variant == "sync_1thread" else default_threads
    torch.set_num_threads(threads)  # the async engine sets its own split while it runs
    started = time.perf_counter()
    try:
        run_rl(cfg, context=context)
    finally:
        torch.set_num_threads(default_threads)
    run_seconds = time.perf_counter() - started
    final = read_metrics(run_dir / "metrics.jsonl")[-1]
    if final["step"] != steps:  # run_rl honoured SIGTERM/SIGUSR1: a partial run measures nothing
        raise SystemExit(f"[staleness] {variant} seed {seed} stopped at step {final['step']}; "
                         "rerun the benchmark to redo it")
    rows = [row for row in read_metrics(run_dir / "metrics.jsonl") if 2 <= row["step"] <= steps - 1]
    phases = sorted({key for row in rows for key in row if key.startswith("time/") and key != "time/generate_ahead"})
    phase_means = {key.removeprefix("time/"): statistics.fmean(row.get(key, 0.0) for row in rows) for key in phases}
    # The async engine splits the cores itself: the trainer's threads + the engine process's.
    used = "+".join(map(str, split_threads())) if variant == "async" else str(threads)
    return {"variant": variant, "seed": seed, "threads": used, "step_seconds": sum(phase_means.values()),
            "phases": phase_means,
            "generate_ahead": statistics.fmean(row.get("time/generate_ahead", 0.0) for row in rows),
            "staleness_mean": statistics.fmean(row["rollout/staleness_mean"] for row in rows),
            "pass_at_1": final["eval/pass@1"], "run_seconds": run_seconds}


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per variant: mean and min–max of step time, pass@1 and phases; per-seed ratios to each sync variant."""
    summary: dict[str, Any] = {}
    for variant in VARIANTS:
        runs = [r for r in results if r["variant"] == variant]
        if not runs:
            continue
        phases = sorted({name for r in runs for name in r["phases"]})
        summary[variant] = {
            "step_seconds": _spread([r["step_seconds"] for r in runs]),
            "pass_at_1": _spread([r["pass_at_1"] for r in runs]),
            "phases": {name: statistics.fmean(r["phases"].get(name, 0.0) for r in runs) for name in phases},
            "generate_ahead": statistics.fmean(r["generate_ahead"] for r in runs),
            "staleness_mean": statistics.fmean(r["staleness_mean"] for r in runs),
        }
    by_seed = {(r["variant"], r["seed"]): r for r in results}
    for reference in ("sync", "sync_1thread"):
        seeds = sorted({seed for variant, seed in by_seed if (reference, seed) in by_seed and ("async", seed) in by_seed})
        if seeds:
            summary[f"step_time_ratio_async_to_{reference}"] = _spread(
                [by_seed["async", s]["step_seconds"] / by_seed[reference, s]["step_seconds"] for s in seeds])
            summary[f"pass_at_1_difference_async_minus_{reference}"] = _spread(
                [by_seed["async", s]["pass_at_1"] - by_seed[reference, s]["pass_at_1"] for s in seeds])
    return summary


def _spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "n": len(values)}


def format_table(summary: dict[str, Any]) -> str:
    lines = ["variant | s/step (mean, min-max) | held-out pass@1 (mean, min-max) | phases (s/step)"]
    for variant in VARIANTS:
        if variant not in summary:
            continue
        row = summary[variant]
        step, score = row["step_seconds"], row["pass_at_1"]
        phases = ", ".join(f"{name} {seconds:.3f}" for name, seconds in row["phases"].items())
        lines.append(f"{variant} | {step['mean']:.3f} ({step['min']:.3f}-{step['max']:.3f}) | "
                     f"{score['mean']:.3f} ({score['min']:.3f}-{score['max']:.3f}) | {phases}")
    for reference in ("sync", "sync_1thread"):
        ratio = summary.get(f"step_time_ratio_async_to_{reference}")
        if ratio is not None:
            difference = summary[f"pass_at_1_difference_async_minus_{reference}"]
            lines.append(f"async : {reference} s/step per seed {ratio['mean']:.3f} ({ratio['min']:.3f}-"
                         f"{ratio['max']:.3f}); pass@1 async - {reference} {difference['mean']:+.3f} "
                         f"({difference['min']:+.3f} to {difference['max']:+.3f})")
    if "async" in summary:
        lines.append(f"generation overlapped with the update at async: {summary['async']['generate_ahead']:.3f} s/step")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="number of seeds (0..N-1)")
    parser.add_argument("--steps", type=int, default=20, help="RL steps per run (N)")
    parser.add_argument("--eval-limit", type=int, default=200, help="held-out problems scored at step N")
    parser.add_argument("--eval-samples", type=int, default=4, help="samples per held-out problem")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), help="variants to run")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="dotted RLConfig override applied to every run (repeatable), e.g. a smaller "
                             "bootstrap.model; the variant's own settings win")
    parser.add_argument("--out", default="runs/bench/staleness", help="output directory")
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error("--steps must be at least 3 (steps 2..N-1 are timed)")
    from pipeline import configlib
    from pipeline.config import RLConfig
    from recipes.cpu import grpo_cpu

    try:  # a bad --set fails here, before any run
        configlib.load(RLConfig, base=grpo_cpu(steps=args.steps), overrides=args.overrides)
    except configlib.ConfigError as error:
        parser.error(f"--set: {error}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    import torch

    from pipeline.io import atomic_write_json
    from pipeline.parallel.rendezvous import initialize_process_context
    from tools.bench.report import Panel, save

    args = parse_args(argv)
    out = Path(args.out)
    context = initialize_process_context(seed=0)
    results = []
    for seed in range(args.seeds):
        order = args.variants[seed % len(args.variants):] + args.variants[: seed % len(args.variants)]
        for variant in order:
            done = out / "runs" / f"{variant}-seed{seed}.json"
            if done.is_file():
                result = json.loads(done.read_text())
            else:
                result = run_one(variant, seed=seed, steps=args.steps, eval_limit=args.eval_limit,
                                 eval_samples=args.eval_samples, out=out, context=context, overrides=args.overrides)
                done.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_json(done, result)
            print(json.dumps(result), flush=True)
            results.append(result)
    summary = summarize(results)
    print(format_table(summary))
    variants = [v for v in VARIANTS if v in summary]
    save(out, "staleness", settings=vars(args), results={"runs": results, "summary": summary},
         threads=torch.get_num_threads(), title=f"One-step-off-policy rollouts: grpo_cpu, {args.steps} steps, "
         f"{args.seeds} seeds", panels=[
             Panel(title="wall time per RL step (steps 2..N-1, mean over seeds)", xlabel="seconds",
                   bars={v: summary[v]["step_seconds"]["mean"] for v in variants},
                   markers={v: summary[v]["step_seconds"]["min"] for v in variants}, marker_label="fastest seed"),
             Panel(title=f"held-out pass@1 after {args.steps} steps (mean over seeds)", xlabel="pass@1",
                   bars={v: summary[v]["pass_at_1"]["mean"] for v in variants},
                   markers={v: summary[v]["pass_at_1"]["min"] for v in variants}, marker_label="lowest seed"),
         ])


if __name__ == "__main__":
    main()
