"""The lent-machine session script (tools/gpu_session.sh), checked where CI runs (no GPU): it parses,
explains itself, and refuses bad input with one error line and exit 2 before installing anything."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_session.sh"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=30)


def test_the_script_parses_and_documents_its_options():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    helped = _run("--help")
    assert helped.returncode == 0
    for option in ("--wheels", "--out", "--python", "--configs", "STEP_S", "PYTEST_PATHS"):
        assert option in helped.stdout


def test_bad_input_is_one_error_line_and_exit_2(tmp_path):
    cases = [((), "--wheels: no folder given"), (("--wheels", str(tmp_path / "absent")), "--wheels: no folder"),
             (("--wheels", str(tmp_path), "--configs", "Nope-1B"), "--configs: no pipeline/models/published/configs/Nope-1B"),
             (("--frobnicate",), "unknown argument --frobnicate")]
    for args, message in cases:
        result = _run(*args, "--out", str(tmp_path / "out"))
        assert result.returncode == 2 and result.stdout == "", (args, result)
        assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ") and message in result.stderr
    assert not (tmp_path / "out").exists()  # nothing written before the input is checked
