"""megatron-core's ``@jit_fuser`` functions are compiled on their first call, not when megatron is imported.

megatron-core 0.16.1 sets ``megatron.core.jit.jit_fuser = torch.compile`` and decorates about
twenty fused element-wise functions with it while ``import megatron.core`` runs. Decorating with
``torch.compile`` imports TorchDynamo and Inductor (``torch._inductor.compile_fx``): 1.1 s of the
3.7 CPU-seconds that ``import megatron.core`` takes (measured with ``python -X importtime`` on the
2-core build machine, torch 2.13 CPU). Every trainer rank, node role and serve role pays it, most of
them for functions they never call (the fused bias-GeLU/GeGLU/SwiGLU kernels are off in every winnow
layer spec, and the CPU trainer calls none). torch.compile itself compiles lazily, on the first
call, so deferring the ``torch.compile(fn)`` call to that first call changes nothing a run computes:
the function is compiled with the same arguments by the same torch, just not before it is needed.

``install()`` (run by ``pipeline/__init__.py``, before any winnow module imports megatron) adds an
import hook for exactly ``megatron.core.jit``: after megatron's own module body ran, a ``jit_fuser``
that is ``torch.compile`` is replaced by ``deferred_compile``. A ``jit_fuser`` megatron set to
anything else (``torch.jit.script`` on an old torch, the no-op after ``disable_jit_fuser``) is
left alone. Nothing here imports torch or megatron.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

JIT_MODULE = "megatron.core.jit"


def deferred_compile(fn: Callable | None = None, /, **compile_kwargs: Any) -> Callable:
    """``torch.compile(fn, **compile_kwargs)``, called the first time ``fn`` is; usable as a decorator
    with or without arguments, like ``torch.compile``."""
    if fn is None:
        return lambda function: deferred_compile(function, **compile_kwargs)
    compiled: Callable | None = None

    @functools.wraps(fn)
    def compile_on_first_call(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        if compiled is None:
            import torch

            compiled = torch.compile(fn, **compile_kwargs)
        return compiled(*args, **kwargs)

    return compile_on_first_call


class _DeferJitFuserLoader(importlib.abc.Loader):
    """Runs megatron's ``jit`` module as its own loader would, then defers its ``torch.compile``."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        import torch  # megatron's module body imported it already

        if getattr(module, "jit_fuser", None) is torch.compile:
            module.jit_fuser = deferred_compile


class _DeferJitFuserFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if name != JIT_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _DeferJitFuserLoader(spec.loader)
        return spec


def install() -> None:
    """Add the import hook (once). Too late if megatron's ``jit`` module is imported already: then nothing changes."""
    if not any(isinstance(finder, _DeferJitFuserFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _DeferJitFuserFinder())
