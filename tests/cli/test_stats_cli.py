"""`winnow stats show`: table, summary line and errors, on a Parquet file written by the store."""

from __future__ import annotations

import argparse

import pytest
import torch

from pipeline.errors import UserError
from pipeline.stats import PromptStatsStore
from pipeline.cli.stats import (
    STATS_FILE_NAME,
    add_stats_show_arguments,
    format_stats_table,
    resolve_stats_path,
    run_stats_show,
)

LONG_ID = "math/train/" + "x" * 40


def write_stats(path) -> None:
    """p0 0/4, long 4/4 (rank 0.5, estimator 0.9, curated 0.75 of 8), p2 2/8 (last seen 7), p3\\t 1/2, p4 unseen."""
    store = PromptStatsStore(["p0", LONG_ID, "p2", "p3\tnewline\n", "p4"], ema_decay=0.9)
    store.record_rollouts(prompt_ids=["p0", LONG_ID, "p2", "p3\tnewline\n"], num_samples=torch.tensor([4, 4, 8, 2]),
                          num_correct=torch.tensor([0, 4, 2, 1]), reward_sum=torch.tensor([0.0, 4.0, 2.0, 1.0]), step=3)
    store.record_rollouts(prompt_ids=["p2"], num_samples=torch.tensor([0]), num_correct=torch.tensor([0]),
                          reward_sum=torch.tensor([0.0]), step=7)
    store.set_column("e3_rank", prompt_ids=[LONG_ID], values=torch.tensor([0.5], dtype=torch.float64))
    store.set_column("estimator_prediction", prompt_ids=[LONG_ID], values=torch.tensor([0.9], dtype=torch.float64))
    store.seed_from_curation(prompt_ids=[LONG_ID], pass_rates=torch.tensor([0.75], dtype=torch.float64),
                             num_samples=torch.tensor([8]))
    store.to_parquet(path)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_stats_show_arguments(parser)
    return parser.parse_args(argv)


def test_show_prints_aligned_table_and_summary(tmp_path, capsys):
    write_stats(tmp_path / "stats.parquet")
    assert run_stats_show(parse([str(tmp_path / "stats.parquet"), "--top", "3"])) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{tmp_path / 'stats.parquet'}: top 3 by pass_rate (descending), ≥ 0 samples"
    table = lines[1:5]
    # The long id is cut to 31 characters and "…"; right-aligned numbers end every line at one column.
    assert table == [
        "prompt                            samples  correct   pass  ema pass  e3 rank  est. pred  cur. pass  last seen",
        "math/train/xxxxxxxxxxxxxxxxxxxx…        4        4  1.000     0.833    0.500      0.900      0.750          3",
        "p3?newline?                             2        1  0.500     0.500        -          -          -          3",
        "p2                                      8        2  0.250     0.304        -          -          -          7",
    ]
    # p2's EMA: one decay by the step-7 zero-sample draw → N = 7.2, K = 1.8, p̂ = 2.8/9.2 = 0.304…
    # summary: 4 of 5 seen, 18 samples, mean (0 + 1 + 0.25 + 0.5)/4 = 0.4375
    assert lines[5] == (
        "5 prompts, 4 seen, 18 samples; mean pass rate 0.438; pass rate 0: 25.0%, 1: 25.0%, "
        "in between: 50.0% of seen prompts"
    )
    assert len(lines) == 6


def test_show_on_a_run_directory_ascending_with_min_samples(tmp_path, capsys):
    write_stats(tmp_path / STATS_FILE_NAME)
    assert run_stats_show(parse([str(tmp_path), "--by", "pass_rate", "--ascending", "--min-samples", "4"])) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("top 3 by pass_rate (ascending), ≥ 4 samples")
    assert [line.split()[0] for line in lines[2:5]] == ["p0", "p2", "math/train/xxxxxxxxxxxxxxxxxxxx…"]


def test_show_with_no_eligible_prompt(tmp_path, capsys):
    write_stats(tmp_path / STATS_FILE_NAME)
    run_stats_show(parse([str(tmp_path), "--min-samples", "100"]))
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "(no prompt has ≥ 100 samples)"
    assert lines[2].startswith("5 prompts, 4 seen")


def test_show_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such run directory or stats file"):
        run_stats_show(parse([str(tmp_path / "nope")]))
    with pytest.raises(FileNotFoundError, match=f"no {STATS_FILE_NAME} in this run directory"):
        run_stats_show(parse([str(tmp_path)]))
    write_stats(tmp_path / STATS_FILE_NAME)
    with pytest.raises(UserError, match="cannot sort by 'hardness'; choose one of: .*e3_rank.*ema_pass_rate"):
        run_stats_show(parse([str(tmp_path), "--by", "hardness"]))
    with pytest.raises(UserError, match="n must be an int ≥ 0"):
        run_stats_show(parse([str(tmp_path), "--top", "-1"]))
    assert resolve_stats_path(tmp_path) == tmp_path / STATS_FILE_NAME


def test_table_of_no_rows_is_just_the_header():
    assert format_stats_table([]).split() == [
        "prompt", "samples", "correct", "pass", "ema", "pass", "e3", "rank", "est.", "pred", "cur.", "pass", "last", "seen",
    ]
