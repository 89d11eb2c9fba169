"""The GPU install path and smoke test, checked where CI runs (no GPU).

The pins must be installable together: torch as sglang 0.5.23 pins it, Transformer Engine
inside the range megatron-core 0.16.1 declares, both read from the installed packages'
own metadata. The smoke must use the Python it is given, and report every check on its own.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.strip().lower()] = version.strip()
    return pins


def _requirement(dist: str, name: str, *, extra: str | None = None) -> Requirement:
    for raw in metadata.requires(dist) or []:
        requirement = Requirement(raw)
        if requirement.name.lower() != name:
            continue
        if extra is None and requirement.marker is None:
            return requirement
        if extra is not None and requirement.marker is not None and requirement.marker.evaluate({"extra": extra}):
            return requirement
    raise AssertionError(f"{dist} declares no {name} requirement")


def test_gpu_pins_satisfy_sglang_and_megatron():
    pins = _pins(ROOT / "constraints-gpu.txt")
    torch_required = _requirement("sglang", "torch")
    assert Version(pins["torch"]) in torch_required.specifier, (pins["torch"], str(torch_required))
    assert pins["sglang"] == metadata.version("sglang") and pins["megatron-core"] == metadata.version("megatron-core")
    te_range = _requirement("megatron-core", "transformer-engine", extra="dev").specifier
    for name in ("transformer-engine", "transformer-engine-cu13", "transformer-engine-torch"):
        assert Version(pins[name]) in te_range, (name, pins[name], str(te_range))
    transformers_required = _requirement("sglang", "transformers")
    assert Version(pins["transformers"]) in transformers_required.specifier
    # CPU installs keep their own pins.
    assert _pins(ROOT / "constraints.txt")["torch"] == "2.13.0"


def test_the_gpu_extra_pins_te_inside_megatrons_range():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    requirements = {Requirement(r).name: Requirement(r) for r in extra}
    te_range = _requirement("megatron-core", "transformer-engine", extra="dev").specifier
    te = requirements["transformer-engine"]
    assert {"pytorch", "core_cu13"} <= te.extras
    # Every version the extra allows lies in megatron's range: compare the bounds.
    assert te.specifier.contains("2.11.0") and not te.specifier.contains("2.12.0") and not te.specifier.contains("2.8.0")
    assert te_range.contains("2.11.0") and not te_range.contains("2.12.0")
    assert str(requirements["sglang"].specifier) == "==0.5.23"
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^install-gpu:\n\t.*bash tools/install_gpu.sh$", makefile, re.M)
    installs = [line for line in (ROOT / "tools" / "install_gpu.sh").read_text().splitlines() if "pip install" in line]
    assert installs and all("-c constraints-gpu.txt" in line for line in installs)


def test_the_smoke_uses_the_python_it_is_given_and_reports_each_check(tmp_path):
    script = (ROOT / "tools" / "gpu_smoke.sh").read_text()
    assert "PYTHON:-.venv/bin/python" not in script
    result = subprocess.run(
        ["bash", str(ROOT / "tools" / "gpu_smoke.sh"), "--python", sys.executable, "--fp8", "current",
         "--skip-sglang", "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"gpu_smoke: using {sys.executable}")
    statuses = dict(re.match(r"(PASS|FAIL|SKIP)\s+([\w-]+):", line).group(2, 1) for line in lines[1:-1])
    assert list(statuses) == ["environment", "setup", "local-bf16", "te-bf16", "te-weight-sync", "te-load-converted",
                              "fp8", "sglang", "sglang-update-group"]
    # On this CPU machine: the probe fails with its reason, everything else is skipped, no traceback.
    assert statuses["environment"] == "FAIL" and "no CUDA device" in lines[1]
    assert set(list(statuses.values())[1:]) == {"SKIP"}
    assert "Traceback" not in result.stdout + result.stderr and result.returncode == 1
    assert lines[-1] == "0 passed, 8 skipped, 1 failed: environment"
    assert (tmp_path / "environment.log").is_file()


def test_a_failing_check_does_not_stop_the_others(tmp_path, monkeypatch, capsys):
    sys.path.insert(0, str(ROOT))
    from tools import gpu_smoke

    monkeypatch.setattr(gpu_smoke, "RESULTS", {})
    gpu_smoke.run_check("a", tmp_path, lambda: 1 / 0)
    gpu_smoke.run_check("b", tmp_path, lambda: "fine")
    gpu_smoke.run_check("c", tmp_path, lambda: "never", needs=("a",))
    assert gpu_smoke.RESULTS == {"a": "FAIL", "b": "PASS", "c": "SKIP"}
    out = capsys.readouterr().out
    assert "ZeroDivisionError" in out and "ZeroDivisionError" in (tmp_path / "a.log").read_text()
