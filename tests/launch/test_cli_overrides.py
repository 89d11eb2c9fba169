"""`KEY=VALUE` overrides may come before, between or after a command's options (runtime ~2 s)."""

from __future__ import annotations

import pytest

from pipeline.cli import build_parser, main


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("steps: 3\nseed: 5\n")
    return path


def _shown(capsys, argv) -> dict[str, str]:
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    return dict(line.split(": ", 1) for line in lines if line.startswith(("steps:", "seed:", "max_new_tokens:")))


def test_config_show_takes_overrides_on_either_side_of_config(config_file, capsys):
    after = _shown(capsys, ["config", "show", "rl", "--config", str(config_file), "seed=7", "max_new_tokens=9"])
    before = _shown(capsys, ["config", "show", "rl", "seed=7", "max_new_tokens=9", "--config", str(config_file)])
    split = _shown(capsys, ["config", "show", "rl", "seed=7", "--config", str(config_file), "max_new_tokens=9"])
    # The YAML's steps stays; the overrides beat the YAML's seed wherever they were typed.
    assert after == before == split == {"steps": "3", "seed": "7", "max_new_tokens": "9"}


def test_launch_stage_collects_overrides_around_options(config_file):
    parser = build_parser()
    args = parser.parse_args(["launch", "stage", "rl", "a=1", "--config", str(config_file), "--executor", "slurm",
                               "b=2", "--ranks-per-node", "2", "c=3"])
    assert args.overrides == ["a=1", "b=2", "c=3"]
    assert (args.kind, args.config, args.executor, args.ranks_per_node) == ("rl", str(config_file), "slurm", 2)
    assert (args.group, args.command) == ("launch", "stage")
    campaign = parser.parse_args(["launch", "campaign", "--recipe", "cpu-tiny", "rl-grpo.steps=1", "--dryrun"])
    assert (campaign.overrides, campaign.recipe, campaign.dryrun) == (["rl-grpo.steps=1"], "cpu-tiny", True)


def test_unknown_options_still_fail(capsys):
    with pytest.raises(SystemExit) as raised:
        build_parser().parse_args(["config", "show", "rl", "seed=1", "--bogus"])
    assert raised.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
