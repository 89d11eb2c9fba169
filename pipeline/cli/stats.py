"""`winnow stats show RUN`: the per-prompt statistics of a run as an aligned table and a summary.

RUN is a run directory holding ``stats.parquet`` (the RL stage exports it at the end)
or the path of such a Parquet file. Example::

    winnow stats show runs/grpo-demo --top 20 --by pass_rate --ascending --min-samples 8
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from pipeline.stats.store import COLUMNS, DERIVED_COLUMNS, PromptStatsStore

__all__ = [
    "STATS_FILE_NAME",
    "add_stats_show_arguments",
    "format_stats_summary",
    "format_stats_table",
    "resolve_stats_path",
    "run_stats_show",
]

STATS_FILE_NAME = "stats.parquet"
PROMPT_ID_WIDTH = 32

# (header, row key, formatter); every cell but the prompt id is right-aligned.
_TABLE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("samples", "num_samples", "count"),
    ("correct", "num_correct", "count"),
    ("pass", "pass_rate", "rate"),
    ("ema pass", "ema_pass_rate", "rate"),
    ("e3 rank", "e3_rank", "rate"),
    ("est. pred", "estimator_prediction", "rate"),
    ("cur. pass", "curation_pass_rate", "rate"),
    ("last seen", "last_seen_step", "step"),
)


def add_stats_show_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", metavar="RUN", help=f"a run directory holding {STATS_FILE_NAME}, or a stats Parquet file")
    parser.add_argument("--top", type=int, default=20, metavar="N", help="how many prompts to list (default 20)")
    parser.add_argument(
        "--by", default="pass_rate", metavar="COLUMN",
        help=f"column to order by (default pass_rate): {', '.join([*COLUMNS, *DERIVED_COLUMNS])}",
    )
    parser.add_argument("--ascending", action="store_true", help="smallest first (default: largest first)")
    parser.add_argument("--min-samples", type=int, default=0, metavar="N", help="list only prompts with ≥ N samples")
    parser.add_argument("--prior-alpha", type=float, default=1.0, metavar="A",
                        help="Beta prior α of the EMA pass rate (default 1)")
    parser.add_argument("--prior-beta", type=float, default=1.0, metavar="B",
                        help="Beta prior β of the EMA pass rate (default 1)")


def resolve_stats_path(run: str | Path) -> Path:
    """RUN as given: a directory means its ``stats.parquet``; a missing file raises ``FileNotFoundError``."""
    path = Path(run)
    if path.is_dir():
        path = path / STATS_FILE_NAME
        if not path.is_file():
            raise FileNotFoundError(f"{run}: no {STATS_FILE_NAME} in this run directory (the RL stage writes it at the end)")
    elif not path.is_file():
        raise FileNotFoundError(f"{run}: no such run directory or stats file")
    return path


def _format_cell(value: Any, kind: str) -> str:
    if kind == "count":
        return f"{value:,}"
    if kind == "step":
        return "-" if value < 0 else str(value)
    return "-" if math.isnan(value) else f"{value:.3f}"


def _display_id(prompt_id: str, width: int) -> str:
    shown = prompt_id if len(prompt_id) <= width else prompt_id[: width - 1] + "…"
    # Ids come from user data; a newline or tab would break the table.
    return "".join(char if char.isprintable() else "?" for char in shown)


def format_stats_table(rows: list[dict[str, Any]], *, id_width: int = PROMPT_ID_WIDTH) -> str:
    """Rows from ``PromptStatsStore.top`` as an aligned text table (NaN and never-seen print ``-``)."""
    header = ["prompt", *(title for title, _, _ in _TABLE_COLUMNS)]
    body = [
        [_display_id(row["prompt_id"], id_width), *(_format_cell(row[key], kind) for _, key, kind in _TABLE_COLUMNS)]
        for row in rows
    ]
    widths = [max(len(line[column]) for line in [header, *body]) for column in range(len(header))]
    lines = [
        "  ".join(cell.ljust(width) if column == 0 else cell.rjust(width)
                  for column, (cell, width) in enumerate(zip(line, widths))).rstrip()
        for line in [header, *body]
    ]
    return "\n".join(lines)


def _percent(share: float) -> str:
    return "n/a" if math.isnan(share) else f"{100.0 * share:.1f}%"


def format_stats_summary(summary: dict[str, float]) -> str:
    """``PromptStatsStore.summary()`` as one line."""
    mean = summary["mean_pass_rate"]
    return (
        f"{int(summary['num_prompts']):,} prompts, {int(summary['num_prompts_seen']):,} seen, "
        f"{int(summary['num_samples']):,} samples; mean pass rate {'n/a' if math.isnan(mean) else f'{mean:.3f}'}; "
        f"pass rate 0: {_percent(summary['share_pass_rate_0'])}, 1: {_percent(summary['share_pass_rate_1'])}, "
        f"in between: {_percent(summary['share_pass_rate_mixed'])} of seen prompts"
    )


def stats_show_inputs(args: argparse.Namespace) -> object:
    """What `pipeline.stages.preflight` checks first: RUN holds a readable statistics store."""
    from pipeline.stages.preflight import StatsInputs

    return StatsInputs(run=args.run, stats_file=STATS_FILE_NAME)


def run_stats_show(args: argparse.Namespace) -> int:
    path = resolve_stats_path(args.run)
    store = PromptStatsStore.from_parquet(path)
    rows = store.top(
        args.top, by=args.by, ascending=args.ascending, min_samples=args.min_samples,
        prior_alpha=args.prior_alpha, prior_beta=args.prior_beta,
    )
    order = "ascending" if args.ascending else "descending"
    print(f"{path}: top {len(rows)} by {args.by} ({order}), ≥ {args.min_samples} samples")
    if rows:
        print(format_stats_table(rows))
    else:
        print(f"(no prompt has ≥ {args.min_samples} samples)")
    print(format_stats_summary(store.summary()))
    return 0
