"""`winnow curate`: arguments, and the counts and output paths it prints (the stage: ``pipeline.stages.curate``)."""

from __future__ import annotations

import argparse


def add_curate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="YAML", help="a YAML file of options to load first")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="dotted overrides applied last, e.g. policy=runs/sft num_samples=8 "
                             "rules.hard_subset=[1,2]")


def run_curate_command(args: argparse.Namespace) -> int:
    """`winnow curate [--config YAML] [key=value ...]`: run, then print the counts and where the outputs are."""
    from pipeline import configlib
    from pipeline.config import CurateConfig
    from pipeline.stages.curate import run_curate
    from pipeline.stats.curation import KEPT_FILE, MANIFEST_FILE, PASS_RATES_FILE, PLOT_FILE, REPORT_FILE

    cfg = configlib.load(CurateConfig, yaml_path=args.config, overrides=args.overrides)
    result = run_curate(cfg)
    print(format_counts(result.counts))
    for name in (KEPT_FILE, PASS_RATES_FILE, REPORT_FILE, PLOT_FILE, MANIFEST_FILE):
        print(f"  {name:<20} {result.output_dir / name}")
    return 0


def format_counts(counts: dict[str, int]) -> str:
    """The counts per rule as a text table: prompts each rule dropped and how many remain after it."""
    from pipeline.stages.curate_rules import RULE_ORDER

    rows = [("loaded", "", counts["total"])]
    remaining = counts["total"]
    for rule in RULE_ORDER:
        remaining -= counts[rule]
        rows.append((rule, f"{counts[rule]:,}", remaining))
    rows.append(("kept", "", counts["kept"]))
    width = max(len(name) for name, _, _ in rows)
    lines = [f"{'rule':<{width}}  {'dropped':>9}  {'remaining':>9}"]
    lines += [f"{name:<{width}}  {dropped:>9}  {left:>9,}" for name, dropped, left in rows]
    return "\n".join(lines)
