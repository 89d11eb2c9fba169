"""`winnow evaluate` and `winnow evaluate-compare`: arguments and printing (the stage: ``pipeline.stages.evaluate``).

The policy is named as for every other stage, ``policy=DIR``, or as the first positional
argument: ``winnow evaluate DIR`` and ``winnow evaluate policy=DIR`` are the same run.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from pipeline.errors import UserError

# A dotted override (``eval.num_samples=8``); a path with a slash before its first "=" is not one.
_OVERRIDE = re.compile(r"^[A-Za-z_][\w.-]*=")


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="YAML", help="a YAML file of options to load first")
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE",
        help="dotted overrides applied last, e.g. policy=runs/rl eval.num_samples=8",
    )


def add_evaluate_arguments(parser: argparse.ArgumentParser) -> None:
    """``winnow evaluate [POLICY] [--tokenizer DIR] [--config YAML] [key=value ...]``."""
    parser.add_argument(
        "policy", nargs="?", default=None,
        help="a Hugging Face folder, a winnow run/checkpoint directory, or a bootstrap cache entry "
             "(or policy=DIR among the overrides)",
    )
    parser.add_argument(
        "--tokenizer", metavar="DIR", default=None, help="tokenizer folder (default: found next to the policy)"
    )
    _add_config_arguments(parser)


def policy_and_overrides(positional: str | None, overrides: list[str]) -> tuple[str | None, list[str]]:
    """The policy path given as POLICY or ``policy=DIR`` (taken verbatim), and the other overrides.

    argparse hands the first ``KEY=VALUE`` to the optional POLICY positional; unless a folder
    of that name exists, it goes back to the overrides.
    """
    overrides = list(overrides)
    if positional is not None and _OVERRIDE.match(positional) and not Path(positional).is_dir():
        overrides.insert(0, positional)
        positional = None
    named = [text.partition("=")[2] for text in overrides if text.partition("=")[0].strip() == "policy"]
    rest = [text for text in overrides if text.partition("=")[0].strip() != "policy"]
    given = ([positional] if positional is not None else []) + named
    if len(given) > 1:
        raise UserError(f"the policy is named {len(given)} times ({', '.join(given)}); give it once, "
                        "as POLICY or as policy=DIR")
    return (given[0] if given else None), rest


def run_evaluate_command(args: argparse.Namespace) -> int:
    import dataclasses

    from pipeline import configlib
    from pipeline.config import EvaluateConfig
    from pipeline.stages.evaluate import run_evaluate

    policy, overrides = policy_and_overrides(args.policy, args.overrides)
    cfg = configlib.load(EvaluateConfig, yaml_path=args.config, overrides=overrides)
    # Set after loading: a path is not YAML (`a: b` or `[x]` would parse as data).
    cfg = dataclasses.replace(cfg, policy=policy if policy is not None else cfg.policy,
                              tokenizer=args.tokenizer or cfg.tokenizer)
    run_evaluate(cfg)
    return 0


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    """``winnow evaluate-compare RUN_A RUN_B [--bootstrap-samples N] [--seed S] [--plot PNG]``."""
    parser.add_argument("run_a", help="the baseline: an evaluation output directory or its results.json")
    parser.add_argument("run_b", help="the candidate; differences are B − A")
    parser.add_argument("--bootstrap-samples", type=int, default=1000, help="resamples for the intervals (0: none)")
    parser.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    parser.add_argument("--plot", metavar="PNG", default=None, help="also draw both runs' pass@k curves here")


def run_compare_command(args: argparse.Namespace) -> int:
    from pipeline.eval.plots import plot_comparison
    from pipeline.eval.report import compare, format_comparison, load_results

    if args.bootstrap_samples < 0:
        raise UserError(f"--bootstrap-samples must be ≥ 0, got {args.bootstrap_samples}")
    results_a, results_b = load_results(args.run_a), load_results(args.run_b)
    rows = compare(results_a, results_b, bootstrap_samples=args.bootstrap_samples, seed=args.seed)
    if not rows:
        raise UserError(f"{args.run_a} and {args.run_b} share no evaluated benchmark")
    print(f"A = {args.run_a}\nB = {args.run_b}\n")
    print(format_comparison(rows), end="")
    if args.plot:
        print(f"\nplot: {plot_comparison({'A': results_a, 'B': results_b}, args.plot)}")
    return 0
