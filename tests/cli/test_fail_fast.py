"""Every stage command checks its inputs before it trains or generates anything.

Each case points one input at something missing or malformed and runs the real ``winnow``
command in a subprocess: it must exit 2 with exactly one ``error:`` line naming that input,
print no traceback, and spend under 5 seconds (the bootstrap alone would take minutes, the
import of torch about two seconds). The 5 s bound is on the command's CPU time: on a shared
2-core machine its wall time measures the neighbours; wall time is only bounded loosely.
"""

from __future__ import annotations

import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.errors import EXIT_USER_ERROR

CPU_LIMIT_S = 5.0
WALL_LIMIT_S = 60.0  # a command that waits (on a server, a lock) rather than computes


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def _hf_folder_without_tokenizer(tmp: Path) -> str:
    folder = tmp / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    return str(folder)


# (case id, argv after `winnow`, the input the error line must name); argv may use {tmp}.
CASES = [
    ("data-inspect-missing", lambda t: ["data", "inspect", "missing.jsonl"], "source: unknown data source 'missing.jsonl'"),
    ("data-inspect-not-json", lambda t: ["data", "inspect", _write(t / "bad.jsonl", "{not json\n")], "source: "),
    ("rl-missing-train", lambda t: ["rl", "data.train=[missing.jsonl]", f"logging.output_dir={t}/rl"],
     "data.train[0]: unknown data source 'missing.jsonl'"),
    ("rl-output-under-a-file", lambda t: ["rl", f"logging.output_dir={_write(t / 'f', '')}/rl"],
     "logging.output_dir: "),
    ("rl-policy-without-tokenizer", lambda t: ["rl", f"policy={_hf_folder_without_tokenizer(t)}",
                                               f"logging.output_dir={t}/rl"], "tokenizer: no tokenizer files"),
    ("rl-dead-server", lambda t: ["rl", "rollout.engine=sglang", "rollout.servers=[http://127.0.0.1:9]",
                                  f"rollout.weights_dir={t}/w", f"logging.output_dir={t}/rl"],
     "rollout.servers: http://127.0.0.1:9 does not answer /health"),
    ("bootstrap-missing-source", lambda t: ["bootstrap", "sources=[missing.jsonl]"], "sources[0]: "),
    ("curate-missing-policy", lambda t: ["curate", f"policy={t}/nowhere", f"output_dir={t}/c"], "policy "),
    ("curate-malformed-source", lambda t: ["curate", "sources=[" + _write(t / "p.jsonl", "[1, 2]\n") + "]",
                                           f"policy={_hf_folder_without_tokenizer(t)}", "tokenizer=" + str(t),
                                           f"output_dir={t}/c"],
     None),  # two inputs are wrong here: see test_every_wrong_input_is_reported
    ("evaluate-not-a-checkpoint", lambda t: ["evaluate", str(t), f"output_dir={t}/e"], "policy: "),
    ("train-estimator-unfinished-curation", lambda t: ["train-estimator", f"curation_dir={t}", f"output_dir={t}/e"],
     "curation_dir: "),
    ("convert-missing-checkpoint", lambda t: ["convert", "megatron-to-hf", "--ckpt", f"{t}/none", "--out", f"{t}/o"],
     "--ckpt: "),
    ("convert-not-hf", lambda t: ["convert", "hf-to-megatron", "--hf", str(t), "--out", f"{t}/o"], "--hf: "),
    ("stats-not-parquet", lambda t: ["stats", "show", _write(t / "stats.parquet", "x")], "RUN: "),
    ("demo-missing-benchmark", lambda t: ["demo", "benchmarks=[missing.jsonl]", f"output_dir={t}/d"],
     "benchmarks[0]: "),
    ("launch-stage-missing-train", lambda t: ["launch", "stage", "rl", "data.train=[missing.jsonl]",
                                              "--output-dir", f"{t}/l"],
     "stages.rl.config.data.train[0]: "),
]


def _run(argv: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, float, float]:
    """``winnow ARGV`` started in ``cwd``, its CPU seconds (user + system) and wall seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "pipeline.cli", *argv], cwd=cwd, capture_output=True, text=True,
                            timeout=120)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return result, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall


@pytest.mark.parametrize("argv, named", [pytest.param(argv, named, id=name) for name, argv, named in CASES
                                         if named is not None])
def test_a_wrong_input_is_one_error_line_and_exit_2_in_seconds(tmp_path, argv, named):
    result, cpu_s, wall_s = _run(argv(tmp_path), tmp_path)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == EXIT_USER_ERROR, result.stderr
    assert len(errors) == 1, result.stderr
    assert errors[0].startswith(f"error: {named}") or f": {named}" in errors[0], errors[0]
    assert "Traceback" not in result.stderr + result.stdout
    assert cpu_s < CPU_LIMIT_S and wall_s < WALL_LIMIT_S, f"took {cpu_s:.1f} s of CPU, {wall_s:.1f} s of wall time"


def test_every_wrong_input_is_reported(tmp_path):
    """A row that is no object and a policy without tokenizer: both named, one line each, nothing run."""
    _, argv, _ = next(case for case in CASES if case[0] == "curate-malformed-source")
    result, _, _ = _run(argv(tmp_path), tmp_path)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == EXIT_USER_ERROR, result.stderr
    assert [line.split(":")[1].strip() for line in errors] == ["sources[0]", "tokenizer"], errors
    assert "not_an_object" in errors[0] or "not an object" in errors[0], errors[0]
    assert not (tmp_path / "c").exists()
