"""`winnow train-estimator`: arguments and what it prints (the stage: ``pipeline.stages.train_estimator``)."""

from __future__ import annotations

import argparse


def add_train_estimator_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="YAML", help="a YAML file of options to load first")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="dotted overrides applied last, e.g. curation_dir=runs/curate encoder=tiny epochs=5")


def run_train_estimator_command(args: argparse.Namespace) -> int:
    """`winnow train-estimator [--config YAML] [key=value ...]`: train, print the held-out numbers and outputs."""
    from pathlib import Path

    from pipeline import configlib
    from pipeline.config import TrainEstimatorConfig
    from pipeline.stages.train_estimator import CALIBRATION_FILE, ESTIMATOR_DIR, PLOT_FILE, run_train_estimator

    cfg = configlib.load(TrainEstimatorConfig, yaml_path=args.config, overrides=args.overrides)
    run_train_estimator(cfg)
    output_dir = Path(cfg.output_dir)
    for name in (ESTIMATOR_DIR, CALIBRATION_FILE, PLOT_FILE):
        print(f"  {name:<18} {output_dir / name}")
    return 0
