"""``python -m recipes``: write a paper preset (``recipes/papers.py``) as YAML for ``winnow rl --config``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pipeline import configlib
from pipeline.errors import EXIT_USER_ERROR
from recipes.papers import PAPER_PRESETS, write_yaml


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes",
                                     description="write a paper preset as YAML for `winnow rl --config`")
    parser.add_argument("name", nargs="?", help="preset name (see --list)")
    parser.add_argument("out", nargs="?", help="YAML file to write")
    parser.add_argument("--policy", default=None, help="Hugging Face folder of the paper's model")
    parser.add_argument("--list", action="store_true", help="print every preset and its source")
    args = parser.parse_args(argv)
    if args.list:
        for name, preset in PAPER_PRESETS.items():
            print(f"{name:48s} {preset.model.hf_id:40s} {preset.source}")
        return 0
    if args.name is None or args.out is None:
        parser.error("give a preset name and an output file, or --list")
    try:
        written = write_yaml(args.name, args.out, policy=args.policy)
    except configlib.ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    model = PAPER_PRESETS[args.name].model
    print(f"wrote {written}" + ("" if args.policy else f"; set policy= to a local copy of {model.hf_id}"))
    return 0
