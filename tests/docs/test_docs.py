"""Docs cannot drift: shown commands parse, named source files exist, and configuration.md matches the dataclasses."""

import re
import shlex
from pathlib import Path

import pytest

from pipeline.cli import COMMAND_CONFIGS, build_parser
from pipeline.configdocs import render_configuration_markdown

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE_BLOCK = re.compile(r"```(?:bash|sh|console)\n(.*?)```", re.S)


def shown_winnow_commands():
    for doc in DOCS:
        for block in CODE_BLOCK.findall(doc.read_text()):
            for line in block.splitlines():
                line = line.split("  #")[0].strip()
                words = shlex.split(line) if line else []
                if words and Path(words[0]).name == "winnow":
                    yield pytest.param(words[1:], id=f"{doc.name}: {line}")


@pytest.mark.parametrize("argv", list(shown_winnow_commands()))
def test_every_documented_command_parses(argv):
    parser = build_parser()
    try:
        parser.parse_args(argv)
    except SystemExit as exit_:  # --help exits 0; a parse error exits 2
        assert exit_.code == 0, argv


def test_configuration_md_matches_the_dataclasses():
    written = (ROOT / "docs" / "configuration.md").read_text()
    assert written == render_configuration_markdown(COMMAND_CONFIGS), (
        "docs/configuration.md is stale: run `winnow config docs --out docs/configuration.md`"
    )


SOURCE_PATH = re.compile(r"\b((?:pipeline|tools|recipes|tests|slurm)/[A-Za-z0-9_/.-]+\.(?:py|sh|md|yaml|toml))")


def test_every_source_file_the_docs_name_exists():
    """A module that moves takes its mentions with it: a stale path in a doc is a broken pointer."""
    missing = sorted({f"{doc.name}: {path}" for doc in DOCS for path in SOURCE_PATH.findall(doc.read_text())
                      if not (ROOT / path).exists()})
    assert not missing, "\n".join(missing)
