"""`winnow --help` and `winnow demo --help` describe what `winnow demo` runs, and their examples load."""

from __future__ import annotations

import re

import pytest

from pipeline import configlib
from pipeline.cli import COMMAND_CONFIGS, build_parser, main
from pipeline.launch.demo import VARIANTS


def _help(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines


def test_the_demo_help_names_the_campaign_and_every_variant(capsys):
    for text in (_help(["--help"], capsys), _help(["demo", "--help"], capsys)):
        demo = text[text.index("demo "):]
        assert "curation" in demo and "estimator" in demo
        assert f"three RL variants ({', '.join(VARIANTS)})" in demo


@pytest.mark.parametrize("command", ["rl", "demo", "bootstrap"])
def test_the_override_example_of_a_stage_loads_with_its_config(command):
    parser = build_parser()
    subparsers = next(action for action in parser._actions if action.choices and command in action.choices)
    example = re.search(r"e\.g\. (\S+)", subparsers.choices[command].format_help()).group(1)
    configlib.load(COMMAND_CONFIGS[command], overrides=[example])  # a wrong example raises ConfigError
