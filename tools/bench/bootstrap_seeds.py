"""Bootstrap seed study: the demo's base policy over bootstrap seeds and torch Adam kernels.

    .venv/bin/python -m tools.bench.bootstrap_seeds                       # seeds 0-4 x default, fused
    .venv/bin/python -m tools.bench.bootstrap_seeds --seeds 2 --kernels fused --set optim.total_steps=2000

Each cell trains ``winnow bootstrap`` (``BootstrapConfig`` defaults, the ``--set`` dotted
overrides on top, ``seed`` = the cell's seed) with megatron's torch Adam running one of
torch's CPU kernels, then scores the policy on the held-out set the race uses: sampled
pass@1 and pass@8 (unbiased) over ``--eval-samples`` samples of ``--eval-prompts``
problems at the RL presets' temperature and length, one sampling seed for every cell.

Kernels (torch 2.13 on CPU): ``default`` is what the actor runs (megatron leaves
``foreach``/``fused`` unset; on CPU torch then takes its per-parameter loop), ``foreach``
the multi-tensor path, ``fused`` the one-pass kernel. They give the same update up to float
rounding, so differences between a seed's cells are rounding alone. The bootstrap cache key
does not include the kernel, so each kernel trains into its own cache folder under ``--out``.

Resumable: ``<out>/cells/seed<k>_<kernel>.json`` is written when a cell finishes and
reused when present. Outputs: ``<out>/bootstrap_seeds.json`` and a printed table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

KERNELS = ("default", "foreach", "fused")


@contextlib.contextmanager
def adam_kernel(kernel: str) -> Iterator[None]:
    """Every Actor built inside the block runs its torch Adam with ``kernel`` (the flags live in the param groups)."""
    if kernel not in KERNELS:
        raise ValueError(f"--kernels: unknown {kernel!r}; known: {list(KERNELS)}")
    from pipeline.trainer.actor import Actor

    original = Actor.__init__

    def init(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        if kernel == "default":
            return
        for wrapper in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            for group in wrapper.optimizer.param_groups:
                group["foreach"], group["fused"] = kernel == "foreach", kernel == "fused"

    Actor.__init__ = init
    try:
        yield
    finally:
        Actor.__init__ = original


def loss_milestones(metrics_path: Path, *, window: int = 20, levels: Sequence[float] = (0.15, 0.12)) -> dict:
    """First step whose trailing ``window``-step mean loss is below each level (None: never), and the last mean."""
    from pipeline.metrics import read_metrics

    losses = [row["loss"] for row in read_metrics(metrics_path)]
    means = [statistics.fmean(losses[max(0, i - window + 1): i + 1]) for i in range(len(losses))]
    first = {f"step_loss<{level}": next((i for i, m in enumerate(means) if m < level), None) for level in levels}
    return {**first, "final_loss_mean": means[-1]}


def run_cell(*, seed: int, kernel: str, overrides: Sequence[str], out: Path, heldout, pool, context,
             eval_samples: int, eval_seed: int) -> dict[str, Any]:
    from pipeline import configlib
    from pipeline.config import BootstrapConfig
    from pipeline.eval.policy import load_policy
    from pipeline.stages.bootstrap import run_bootstrap
    from recipes.cpu import grpo_cpu
    from tools.bench.race import heldout_scores

    cfg = configlib.load(BootstrapConfig, overrides=[
        f"seed={seed}", f"cache_dir={(out / 'cache' / kernel).absolute()}", "progress=false", *overrides])
    with adam_kernel(kernel):
        result = run_bootstrap(cfg, context=context)
    rl = grpo_cpu()
    policy = load_policy(result.directory, context=context)
    scores = heldout_scores(model=policy.hf_model, tokenizer=policy.tokenizer, prompts=heldout,
                            num_samples=eval_samples, max_new_tokens=rl.max_new_tokens, temperature=rl.temperature,
                            seed=eval_seed, pool=pool, template=rl.data.template)
    return {"seed": seed, "kernel": kernel, "overrides": list(overrides), "directory": str(result.directory),
            "final_loss": result.summary["final_loss"], "seconds": result.summary["seconds"],
            **loss_milestones(result.directory / "metrics.jsonl"), **scores}


def format_table(cells: Sequence[dict[str, Any]], kernels: Sequence[str]) -> str:
    seeds = sorted({cell["seed"] for cell in cells})
    by_key = {(cell["seed"], cell["kernel"]): cell for cell in cells}
    lines = ["| seed | " + " | ".join(f"{k}: pass@1 (pass@8, loss)" for k in kernels) + " |",
             "|---|" + "---:|" * len(kernels)]
    for seed in seeds:
        row = []
        for kernel in kernels:
            cell = by_key.get((seed, kernel))
            row.append("—" if cell is None else
                       f"{cell['pass@1']:.3f} ({cell['pass@8']:.3f}, {cell['final_loss_mean']:.3f})")
        lines.append(f"| {seed} | " + " | ".join(row) + " |")
    values = [cell["pass@1"] for cell in cells]
    lines.append(f"min pass@1 {min(values):.3f}, mean {statistics.fmean(values):.3f}, max {max(values):.3f} "
                 f"over {len(values)} cells")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="bootstrap seeds")
    parser.add_argument("--kernels", nargs="+", default=["default", "fused"], choices=KERNELS,
                        help="torch Adam kernels")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="dotted BootstrapConfig override (repeatable)")
    parser.add_argument("--eval-set", default="arith?difficulty=3&size=1000", help="held-out source (test split)")
    parser.add_argument("--eval-prompts", type=int, default=400, help="held-out problems")
    parser.add_argument("--eval-samples", type=int, default=8, help="samples per held-out problem")
    parser.add_argument("--eval-seed", type=int, default=1234, help="sampling seed of every evaluation")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--out", default="runs/bench/bootstrap_seeds", help="output directory")
    args = parser.parse_args(argv)
    if args.eval_prompts < 1 or args.eval_samples < 8:
        parser.error("--eval-prompts must be ≥ 1 and --eval-samples ≥ 8 (pass@8 is reported)")
    from pipeline import configlib
    from pipeline.config import BootstrapConfig

    try:  # a bad --set fails here, before any cell trains
        configlib.load(BootstrapConfig, overrides=args.overrides)
    except configlib.ConfigError as error:
        parser.error(f"--set: {error}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    import torch

    from pipeline.data import load_prompts
    from pipeline.parallel.rendezvous import initialize_process_context
    from pipeline.rewards import GradingPool
    from recipes.cpu import grpo_cpu

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    heldout, _ = load_prompts(args.eval_set, split="test", limit=args.eval_prompts)
    context = initialize_process_context(seed=0)
    cells = []
    with GradingPool(**grpo_cpu().reward.pool_kwargs()) as pool:
        for seed in args.seeds:
            for kernel in args.kernels:
                path = out / "cells" / f"seed{seed}_{kernel}.json"
                if path.is_file():
                    cell = json.loads(path.read_text())
                else:
                    cell = run_cell(seed=seed, kernel=kernel, overrides=args.overrides, out=out, heldout=heldout,
                                    pool=pool, context=context, eval_samples=args.eval_samples,
                                    eval_seed=args.eval_seed)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(json.dumps(cell, indent=1))
                print(f"[bootstrap_seeds] seed {seed} {kernel}: pass@1 {cell['pass@1']:.3f} "
                      f"pass@8 {cell['pass@8']:.3f} loss {cell['final_loss_mean']:.3f} ({cell['seconds']:.0f} s)",
                      flush=True)
                cells.append(cell)
    (out / "bootstrap_seeds.json").write_text(json.dumps(
        {"settings": {**vars(args)}, "cells": cells}, indent=1))
    print(format_table(cells, args.kernels))


if __name__ == "__main__":
    main()
