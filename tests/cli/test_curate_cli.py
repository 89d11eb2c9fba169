"""`winnow curate`: arguments reach the config; the counts table and output paths it prints."""

from __future__ import annotations

import argparse
import re

import numpy as np

from pipeline import configlib
from pipeline.cli.curate import add_curate_arguments, format_counts, run_curate_command
from pipeline.stages import curate_rules as rules
from pipeline.stages.curate import KEPT_FILE, MANIFEST_FILE, CurateConfig, CurationResult

COUNTS = {"total": 10, rules.REFERENCE_FAILS: 1, rules.DUPLICATE: 0, rules.TOO_LONG: 2, rules.TRIVIAL: 3,
          rules.IMPOSSIBLE: 1, rules.OUTSIDE_HARD_SUBSET: 0, "kept": 3}


def test_format_counts_subtracts_each_rule_in_order():
    lines = format_counts(COUNTS).splitlines()
    assert re.fullmatch(r"rule\s+dropped\s+remaining", lines[0])
    assert [line.split()[0] for line in lines[1:]] == ["loaded", *rules.RULE_ORDER, "kept"]
    remaining = {line.split()[0]: int(line.split()[-1]) for line in lines[1:]}
    # 10 loaded; − 1 reference − 0 duplicate − 2 too long − 3 trivial − 1 impossible − 0 outside = 3.
    assert [remaining[rule] for rule in rules.RULE_ORDER] == [9, 9, 7, 4, 3, 3]
    assert remaining["loaded"] == 10 and remaining["kept"] == 3


def test_command_loads_yaml_then_overrides_and_prints_the_outputs(monkeypatch, tmp_path, capsys):
    import pipeline.stages.curate as curate

    seen = {}

    def fake_run_curate(cfg):
        seen["cfg"] = cfg
        return CurationResult(
            output_dir=tmp_path, prompt_ids=[], specs=[], sources=[], num_samples=np.zeros(0, np.int64),
            num_correct=np.zeros(0, np.int64), pass_rates=np.zeros(0), kept_mask=np.zeros(0, bool),
            drop_reasons=[], samples_per_prompt=4, counts=COUNTS,
        )

    monkeypatch.setattr(curate, "run_curate", fake_run_curate)
    config_path = tmp_path / "curate.yaml"
    config_path.write_text(configlib.dump_yaml(configlib.load(CurateConfig, overrides=["num_samples=4", "seed=3"])))
    parser = argparse.ArgumentParser()
    add_curate_arguments(parser)
    args = parser.parse_args(["--config", str(config_path), "policy=runs/sft", "rules.hard_subset=[1, 1]"])
    assert run_curate_command(args) == 0
    cfg = seen["cfg"]
    assert (cfg.policy, cfg.num_samples, cfg.seed, cfg.rules.hard_subset) == ("runs/sft", 4, 3, (1, 1))
    printed = capsys.readouterr().out
    assert re.search(r"^kept\s+3$", printed, re.MULTILINE)
    assert str(tmp_path / KEPT_FILE) in printed and str(tmp_path / MANIFEST_FILE) in printed
