"""docs/reproducing.md's reproduction commands run as shown, and the presets it names are the registry's.

A ```bash block right after an ``<!-- dryrun -->`` line holds commands a user runs as written.
Each of its lines runs in this process, in doc order, through its entry point
(``pipeline.cli.main``, ``pipeline.cli.presets.main``: no new interpreter per line), in a
temporary folder where the doc's absolute paths live: ``/models/<name>`` is a folder holding the
published ``config.json`` of that model (``<name>.json`` of the planner tests' fixtures, no
weights) and ``/lustre/...`` an empty shared filesystem. Any other absolute path fails the test,
so nothing is written outside the temporary folder.

* ``winnow launch`` lines get ``--dryrun``: they must exit 0 having checked the plan of every
  GPU rl stage against the model's ``config.json`` (a "verdict: FITS", nothing "not checked"),
  write every stage's scripts (a SLURM job's ``<stage>_sbatch.sh`` too) and call no SLURM
  command: ``sbatch``, ``srun`` and the rest are stubs on ``PATH`` that record a call.
* ``winnow convert hf-to-megatron`` has no dry run and needs the weights, which no test holds.
  Its line must parse with winnow's own parser, name the command's handler, and be the
  conversion a later multi-rank rl launch needs: a rank-parallel rl stage whose ``policy`` is a
  Hugging Face folder trains from ``<logging.output_dir>/initial_policy`` converted from that
  folder at its TP/PP layout (``pipeline.stages.rl.convert_hf_policy``), and stops without it.
* Every other line fails the test as a command it cannot dry-run.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.launch.test_plan import FIXTURES as MODEL_CONFIGS

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "reproducing.md"
MARKED_BLOCK = re.compile(r"^<!-- dryrun -->\n```bash\n(.*?)^```", re.S | re.M)
# The doc's absolute roots and what stands for them here: the model folders and the shared filesystem.
PLACEHOLDER_ROOTS = ("models", "lustre")
PLACEHOLDER = re.compile(r"(?<![\w./-])/(" + "|".join(PLACEHOLDER_ROOTS) + r")/")
MODEL_DIR = re.compile(r"(?<![\w./-])/models/([A-Za-z0-9._-]+)")
SLURM_COMMANDS = ("sbatch", "srun", "scontrol", "squeue", "sacct", "scancel", "salloc")


def marked_commands(text: str) -> list[str]:
    """The lines of every ``<!-- dryrun -->`` block, comments and blank lines dropped."""
    lines = []
    for block in MARKED_BLOCK.findall(text):
        lines += [line.split("  #")[0].strip() for line in block.splitlines() if line.split("  #")[0].strip()]
    return lines


@dataclass
class DryRun:
    """The temporary world the doc's commands run in, and what they leave in it."""

    root: Path
    slurm_calls: Path
    # (Hugging Face folder, output folder) → (TP, PP) of each `winnow convert hf-to-megatron` seen so far.
    conversions: dict[tuple[Path, Path], tuple[int, int]] = field(default_factory=dict)

    def localize(self, line: str) -> str:
        return PLACEHOLDER.sub(lambda match: f"{self.root}/{match.group(1)}/", line)

    def paths_outside(self, words: list[str]) -> list[str]:
        """Absolute paths among ``words`` (also as a ``KEY=VALUE`` value or a list item) not under ``root``."""
        outside = []
        for word in words:
            value = word.split("=", 1)[1] if re.match(r"^[\w.-]+=", word) else word
            for item in value.strip("[]").split(","):
                if item.startswith("/") and not Path(item).is_relative_to(self.root):
                    outside.append(item)
        return outside


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``tmp_path`` as the working directory, with SLURM's commands stubbed to record any call."""
    stubs = tmp_path / "slurm-stubs"
    stubs.mkdir()
    calls = tmp_path / "slurm-calls.txt"
    for name in SLURM_COMMANDS:
        stub = stubs / name
        stub.write_text(f'#!/bin/sh\necho "{name} $*" >> "{calls}"\nexit 1\n')
        stub.chmod(0o755)
    monkeypatch.setenv("PATH", f"{stubs}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.chdir(tmp_path)
    # nemo-run's dry run makes its job folders through invoke, which mirrors stdin: pytest's is unreadable.
    with open(os.devnull) as no_input:
        monkeypatch.setattr(sys, "stdin", no_input)
        yield DryRun(root=tmp_path, slurm_calls=calls)


def _model_folders(lines: list[str], world: DryRun) -> None:
    """Each ``/models/<name>`` the commands name, as a folder with the model's published ``config.json``."""
    for name in sorted({name for line in lines for name in MODEL_DIR.findall(line)}):
        fixture = MODEL_CONFIGS / f"{name}.json"
        assert fixture.is_file(), f"/models/{name}: no config.json fixture {fixture.relative_to(ROOT)} to stand for it"
        folder = world.root / "models" / name
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(fixture.read_text())


def _run(entry_point, argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """Exit status and output of ``entry_point(argv)``, an argparse exit counted as its status."""
    try:
        code = entry_point(argv)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _check_convert(argv: list[str], world: DryRun) -> None:
    from pipeline.cli import build_parser
    from pipeline.cli.convert import run_hf_to_megatron

    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:
        pytest.fail(f"winnow {shlex.join(argv)}: the parser refuses it (exit {exit_.code})")
    assert args.handler is run_hf_to_megatron, f"winnow {shlex.join(argv)}: not the hf-to-megatron command"
    world.conversions[(Path(args.hf).absolute(), Path(args.out).absolute())] = (args.tp, args.pp)


def _check_launch(argv: list[str], output: str, world: DryRun) -> None:
    """The dry run wrote each stage's scripts, checked each GPU rl plan and ran nothing."""
    from pipeline.cli import build_parser
    from pipeline.launch.campaign import CampaignPlan, CampaignStatus
    from pipeline.stages.rl import CONVERTED_POLICY_DIR

    command = f"winnow {shlex.join(argv)}"
    assert not world.slurm_calls.exists(), f"{command}: the dry run called SLURM: {world.slurm_calls.read_text()}"
    found = re.search(r"^dry run: task scripts under (\S+)$", output, re.M)
    assert found, f"{command}: no task scripts reported:\n{output}"
    scripts = Path(found.group(1))
    args = build_parser().parse_args(argv)
    assert args.output_dir, f"{command}: name --output-dir, a folder every node shares"
    plan = CampaignPlan.load(args.output_dir)
    for stage in plan.stages:
        expected = [f"{stage.name}.sh"] + ([f"{stage.name}_sbatch.sh"] if args.executor == "slurm" else [])
        written = {path.name for path in scripts.rglob("*.sh")}
        assert set(expected) <= written, f"{command}: {stage.name}: wrote {sorted(written)}, not {expected}"
    states = {name: entry.get("state") for name, entry in CampaignStatus(plan.output_dir).read().items()}
    assert set(states.values()) <= {"pending"}, f"{command}: the dry run changed stage states: {states}"

    gpu_rl = [stage for stage in plan.stages if stage.kind == "rl" and stage.resources.gpus_per_node > 0]
    assert "not checked" not in output, f"{command}: a plan was not checked:\n{output}"
    assert output.count("verdict: FITS") == len(gpu_rl), f"{command}: the plan of each GPU rl stage must fit:\n{output}"
    for stage in gpu_rl:
        # The plan counts GPUs, not ranks: a TP=4 preset on 2 ranks fits on paper and fails at start.
        resources, parallel = stage.resources, stage.config.parallel
        model_parallel = parallel.tensor_parallel * parallel.pipeline_parallel
        assert resources.ranks_per_node == resources.gpus_per_node, (
            f"{command}: {stage.name}: {resources.ranks_per_node} ranks on {resources.gpus_per_node} GPUs per node; "
            "one rank per GPU (--ranks-per-node)")
        assert (resources.nodes * resources.ranks_per_node) % model_parallel == 0, (
            f"{command}: {stage.name}: {resources.nodes * resources.ranks_per_node} ranks cannot hold TP×PP = "
            f"{model_parallel}")

    for stage in plan.stages:
        ranks = stage.resources.nodes * stage.resources.ranks_per_node
        policy = stage.config.policy if stage.kind == "rl" else None
        if policy is None or ranks == 1 or not (Path(policy) / "config.json").is_file():
            continue
        parallel = stage.config.parallel
        target = (Path(policy).absolute(), (Path(stage.config.logging.output_dir) / CONVERTED_POLICY_DIR).absolute())
        layout = (parallel.tensor_parallel, parallel.pipeline_parallel)
        assert world.conversions.get(target) == layout, (
            f"{command}: {stage.name} runs {ranks} ranks from the Hugging Face folder {policy}; it needs "
            f"`winnow convert hf-to-megatron --hf {policy} --out {target[1]} --tp {layout[0]} --pp {layout[1]}` "
            f"shown before it; shown: {world.conversions}"
        )


def test_the_doc_marks_commands_to_dry_run():
    """The page's three steps are among them: convert the model, launch one preset, launch a campaign."""
    lines = marked_commands(DOC.read_text())
    assert lines, f"{DOC.name}: no command block marked <!-- dryrun -->"
    kinds = {" ".join(shlex.split(line)[1:3]) for line in lines}
    assert {"launch stage", "launch campaign", "convert hf-to-megatron"} <= kinds, kinds


def test_marked_commands_dry_run(world: DryRun, capsys: pytest.CaptureFixture[str]):
    from pipeline.cli import main as winnow
    from pipeline.cli.presets import main as write_preset

    lines = marked_commands(DOC.read_text())
    assert lines, f"{DOC.name}: no command block marked <!-- dryrun -->"
    _model_folders(lines, world)
    for line in lines:
        words = shlex.split(world.localize(line))
        outside = world.paths_outside(words)
        assert not outside, f"{line}: paths the test cannot place: {outside} (use /models/<name> or /lustre/...)"
        program = Path(words[0]).name
        if program.startswith("python") and words[1:3] == ["-m", "recipes"]:
            code, output = _run(write_preset, words[3:], capsys)
        elif program == "winnow" and words[1:3] == ["convert", "hf-to-megatron"]:
            _check_convert(words[1:], world)
            continue
        elif program == "winnow" and words[1] == "launch" and words[2] in ("stage", "campaign"):
            argv = words[1:] + ([] if "--dryrun" in words else ["--dryrun"])
            code, output = _run(winnow, argv, capsys)
            assert code == 0, f"{line}\nexit {code}:\n{output}"
            _check_launch(argv, output, world)
            continue
        elif program == "winnow" and words[1] in ("config", "plan"):
            code, output = _run(winnow, words[1:], capsys)
        else:
            pytest.fail(f"{line}: no dry run for this command; run it here or leave it out of <!-- dryrun --> blocks")
        assert code == 0, f"{line}\nexit {code}:\n{output}"


def test_every_preset_the_doc_names_exists_and_every_preset_is_listed():
    """The tables' names are registry names: literal, ``<m>`` patterns over the section's models, ``A … B`` runs.

    A run ``A … B`` stands for the presets from A to B in registry order (``--list`` order).
    """
    from recipes.papers import MODELS, PAPER_PRESETS

    names = list(PAPER_PRESETS)
    listed: set[str] = set()
    unknown = []
    for section in re.split(r"^## ", DOC.read_text(), flags=re.M)[1:]:
        title = section.splitlines()[0]
        models_line = re.search(r"^Models `<m>`:(.*?)(?:\n\n|\Z)", section, re.S | re.M)
        models = [word for word in re.findall(r"`([a-z0-9_]+)`", models_line.group(1)) if word in MODELS
                  ] if models_line else []
        for row in re.findall(r"^\| (`.*?) \|", section, re.M):
            for first, last in re.findall(r"`([a-z0-9_]+)` … `([a-z0-9_]+)`", row):
                if first in PAPER_PRESETS and last in PAPER_PRESETS:
                    listed.update(names[names.index(first):names.index(last) + 1])
            for written in re.findall(r"`([a-z0-9_<>]+)`", row):
                expanded = [written.replace("<m>", model) for model in models] if "<m>" in written else [written]
                found = [name for name in expanded if name in PAPER_PRESETS]
                if not found:
                    unknown.append(f"{title}: `{written}`" + (f" over models {models}" if "<m>" in written else ""))
                listed.update(found)
    assert not unknown, "presets the doc names that recipes/papers.py does not have:\n" + "\n".join(unknown)
    missing = [name for name in names if name not in listed]
    assert not missing, f"presets {DOC.name} does not list: {missing}"

