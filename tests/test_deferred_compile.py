"""megatron's fused kernels are compiled on first call, not on import (pipeline/deferred_compile.py)."""

from __future__ import annotations

import subprocess
import sys

import torch

from pipeline.deferred_compile import deferred_compile


def test_importing_megatron_through_winnow_does_not_import_inductor() -> None:
    probe = (
        "import sys, pipeline, megatron.core, megatron.core.jit as jit\n"
        "from pipeline.deferred_compile import deferred_compile\n"
        "from megatron.core.fusions.fused_bias_gelu import bias_gelu\n"
        "assert jit.jit_fuser is deferred_compile, jit.jit_fuser\n"
        "assert 'torch._inductor' not in sys.modules\n"
        "assert bias_gelu.__name__ == 'bias_gelu'\n"
    )
    subprocess.run([sys.executable, "-W", "ignore", "-c", probe], check=True)


def test_the_function_is_compiled_once_on_its_first_call_with_the_decorator_arguments(monkeypatch) -> None:
    calls: list[dict] = []

    def recording_compile(fn, **kwargs):
        calls.append(kwargs)
        return lambda *args: fn(*args) * 10

    monkeypatch.setattr(torch, "compile", recording_compile)

    @deferred_compile
    def double(x):
        return 2 * x

    @deferred_compile(dynamic=False)
    def triple(x):
        return 3 * x

    assert calls == [] and double.__name__ == "double"
    assert double(1) == 20 and double(2) == 40  # the compiled function runs, compiled once
    assert triple(1) == 30
    assert calls == [{}, {"dynamic": False}]
