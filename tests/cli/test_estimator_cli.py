"""`winnow train-estimator`: arguments reach the config; it prints where the outputs are."""

from __future__ import annotations

import argparse

from pipeline.cli.estimator import add_train_estimator_arguments, run_train_estimator_command


def test_command_loads_yaml_then_overrides_and_prints_the_outputs(monkeypatch, tmp_path, capsys):
    import pipeline.stages.train_estimator as train_estimator

    seen = {}
    monkeypatch.setattr(train_estimator, "run_train_estimator", lambda cfg: seen.setdefault("cfg", cfg))
    yaml_file = tmp_path / "estimator.yaml"
    yaml_file.write_text("encoder: tiny\nepochs: 5\n")
    parser = argparse.ArgumentParser()
    add_train_estimator_arguments(parser)
    args = parser.parse_args(["--config", str(yaml_file), "curation_dir=runs/curate", "epochs=2",
                              f"output_dir={tmp_path / 'out'}"])
    assert run_train_estimator_command(args) == 0
    cfg = seen["cfg"]
    assert (cfg.curation_dir, cfg.encoder, cfg.epochs) == ("runs/curate", "tiny", 2)
    printed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in printed] == ["estimator", "calibration.json", "calibration.png"]
    assert printed[1].split()[1] == str(tmp_path / "out" / "calibration.json")
