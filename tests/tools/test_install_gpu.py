"""`make install-gpu` (tools/install_gpu.sh): the CUDA toolkit is checked first, the TE build gets its headers."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "install_gpu.sh"


def _fake_nvcc(root: Path, release: str) -> Path:
    (root / "bin").mkdir(parents=True)
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
                    f"echo 'Cuda compilation tools, release {release}, V{release}.88'\n")
    nvcc.chmod(0o755)
    return root


def _install(tmp_path: Path, *args: str, cuda_home: Path, venv: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CUDA_HOME": str(cuda_home), "VENV": str(venv), "PYTHON": "false"}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60, check=False)


def test_no_toolkit_stops_before_installing_anything(tmp_path):
    venv = tmp_path / "venv"
    result = _install(tmp_path, cuda_home=tmp_path / "no-cuda", venv=venv)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("error: make install-gpu builds Transformer Engine"), result.stderr
    assert "no bin/nvcc" in result.stderr and "CUDA 13" in result.stderr
    assert result.stdout == "" and not venv.exists()


def test_a_cuda_12_toolkit_is_refused_naming_its_release(tmp_path):
    result = _install(tmp_path, cuda_home=_fake_nvcc(tmp_path / "cuda-12", "12.4"), venv=tmp_path / "venv")
    assert result.returncode == 2
    assert "is CUDA 12.4" in result.stderr and "CUDA 13 toolkit" in result.stderr
    assert not (tmp_path / "venv").exists()


def test_the_build_gets_ninja_the_venv_headers_and_no_build_isolation(tmp_path):
    cuda = _fake_nvcc(tmp_path / "cuda-13", "13.0")
    venv = tmp_path / "venv"
    for package in ("nccl", "cudnn"):
        (venv / "lib" / "python3.11" / "site-packages" / "nvidia" / package / "include").mkdir(parents=True)
    result = _install(tmp_path, "--dry-run", cuda_home=cuda, venv=venv)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"CUDA toolkit: {cuda} (release 13.0)"
    environment = next(line for line in lines if line.startswith("build environment:"))
    for package in ("nccl", "cudnn"):
        assert str(venv / "lib" / "python3.11" / "site-packages" / "nvidia" / package / "include") in environment
    commands = [line[2:] for line in lines if line.startswith("+ ")]
    assert any("ninja" in command.split() for command in commands[:2]), commands  # before anything is built
    te_build = next(command for command in commands if "'.[gpu,dev]'" in command or ".[gpu,dev]" in command)
    assert "--no-build-isolation" in te_build and "-c constraints-gpu.txt" in te_build


def test_an_unknown_argument_is_a_user_error(tmp_path):
    result = _install(tmp_path, "--fast", cuda_home=tmp_path, venv=tmp_path / "venv")
    assert result.returncode == 2 and result.stderr.startswith("error: tools/install_gpu.sh: unknown argument --fast")
