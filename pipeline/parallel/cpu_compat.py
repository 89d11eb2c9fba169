"""CPU compatibility layer for megatron-core: run the GPU code paths on CPU + gloo.

megatron-core assumes a CUDA device in many places that are not otherwise
device-specific (measured on 0.16.1):

* ``torch.cuda.current_device()`` used as an allocation device: RoPE inverse
  frequencies, the global memory buffer of local attention, tensor-parallel
  gather buffers, pipeline p2p shape/activation buffers, DDP grad buffers;
* literal ``device="cuda"`` / ``.cuda()``: the pipeline schedules' token
  counters, grad-norm clipping, the optimizer's found-inf tensors, the
  dist-checkpointing exchange utilities;
* ``torch.cuda.synchronize()`` in p2p communication and ``parallel_state``;
* ``Tensor.type()`` compared with ``"torch.cuda.FloatTensor"`` and friends in
  the optimizer;
* ``torch.cuda.random.get_rng_state()`` in activation recompute
  (``tensor_parallel.checkpoint`` saves every generator's state to replay dropout).

This module is the only place that papers over that. ``enable()`` does nothing
when CUDA is available, so GPU runs execute megatron unmodified. On a
CPU-only machine it installs exactly the patches listed in ``PATCHES``:

``current_device``
    ``torch.cuda.current_device`` returns ``torch.device("cpu")``. A device
    object rather than an ordinal, so allocations made from threads where the
    function mode below is not active also land on the CPU.
``synchronize``
    ``torch.cuda.synchronize`` is a no-op: CPU kernels are synchronous.
``tensor_cuda``
    ``torch.Tensor.cuda`` (and hence ``nn.Module.cuda``) moves to CPU, i.e.
    returns the tensor itself for a CPU tensor.
``tensor_type``
    ``Tensor.type()`` (the query form, no argument) spells a CPU tensor's type
    the CUDA way (``"torch.cuda.FloatTensor"``): megatron's optimizer asserts
    on those strings (``clip_grad_by_total_norm_fp32``, the bf16/fp16
    ``Float16OptimizerWithFloat16Params``, ``DistributedOptimizer``). The cast
    form accepts the CUDA spelling back (``x.type("torch.cuda.FloatTensor")``
    casts on the CPU), so ``a.type(b.type())`` keeps working.
``cuda_rng_state``
    ``torch.cuda.random.get_rng_state`` returns an empty byte tensor: there is no
    CUDA generator to save. Restoring goes through ``torch.cuda._lazy_call``, which
    queues the call until CUDA initialises, i.e. never on a CPU machine; the CPU
    generator megatron saves next to it is restored as usual.
``device_mode``
    A ``torch.overrides.TorchFunctionMode`` rewrites every CUDA device argument
    of a torch call (``device="cuda"``, ``"cuda:N"``, ``torch.device("cuda")``,
    an integer ordinal, or the positional device of ``Tensor.to``) to CPU.
    Two limits of function modes: they are thread-local, so the rewrite
    applies to the thread that called ``enable()`` (call it again from any
    other thread that drives megatron code); and they are suspended while an
    overridable Python-level function runs, notably ``torch.autograd.backward``,
    ``torch.autograd.grad`` and ``Tensor.backward``. Backward passes therefore
    see only the four process-wide patches above, which is what megatron's
    backward code needs (it allocates through ``current_device()``).

Version-sensitive: the list above is what 0.16.1 needs. ``tests/parallel/
test_cpu_compat.py`` exercises each patch against megatron's own call sites so
that an upgrade which adds a new CUDA assumption fails there, not deep inside a
training step. ``disable()`` checks the function-mode stack through
``torch.overrides._get_current_function_mode_stack`` (private, stable since
torch 2.1) to refuse popping a mode it does not own.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["PATCHES", "disable", "enable", "is_enabled", "is_cuda_device"]

logger = logging.getLogger(__name__)

PATCHES: tuple[str, ...] = ("current_device", "synchronize", "tensor_cuda", "tensor_type", "cuda_rng_state",
                            "device_mode")

_CPU = torch.device("cpu")


def is_cuda_device(device: Any) -> bool:
    """Whether ``device`` (a str, ``torch.device`` or ordinal) names a CUDA device."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    # A bare ordinal means a CUDA device to torch; bool is an int subclass but never a device.
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of every torch call to CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": _CPU}
        # Factories take the device by keyword; Tensor.to also takes it positionally.
        if func is torch.Tensor.to and len(args) > 1 and is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


def _current_device() -> torch.device:
    return _CPU


def _synchronize(device: Any = None) -> None:
    del device  # CPU kernels complete before the call that launched them returns.


def _cuda_rng_state(device: Any = "cuda") -> torch.Tensor:
    del device  # no CUDA generator exists; the CPU generator is saved separately
    return torch.empty(0, dtype=torch.uint8)


def _tensor_cuda(
    self: torch.Tensor,
    device: Any = None,
    non_blocking: bool = False,
    memory_format: torch.memory_format = torch.preserve_format,
) -> torch.Tensor:
    del device  # every CUDA ordinal maps to the one CPU device
    return self.to(_CPU, non_blocking=non_blocking, memory_format=memory_format)


def _tensor_type(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
    original = _INSTALLED.tensor_methods["type"]
    if dtype is None:
        name = original(self)
        # The device mode hands the C method back to torch.Tensor.type, i.e. to this
        # function, so the name may already be respelled.
        if self.device.type == "cpu" and not name.startswith("torch.cuda."):
            return name.replace("torch.", "torch.cuda.", 1)
        return name
    if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
        dtype = dtype.replace("torch.cuda.", "torch.", 1)
    return original(self, dtype, non_blocking, **kwargs)


_TENSOR_PATCHES: dict[str, Callable[..., Any]] = {"cuda": _tensor_cuda, "type": _tensor_type}


@dataclass(slots=True)
class _Installed:
    current_device: Callable[..., Any]
    synchronize: Callable[..., Any]
    cuda_rng_state: Callable[..., Any]
    tensor_methods: dict[str, Any]
    # Methods torch.Tensor defines itself (restored by assignment) rather than
    # inherits from TensorBase (restored by deleting the override).
    tensor_own_methods: frozenset[str]


_INSTALLED: _Installed | None = None
_LOCK = threading.Lock()
_THREAD = threading.local()


def is_enabled() -> bool:
    """Whether the process-wide patches are installed and this thread has the device mode."""
    return _INSTALLED is not None and getattr(_THREAD, "mode", None) is not None


def enable(*, with_cuda: bool = False) -> bool:
    """Install the CPU compatibility patches; idempotent, a no-op when CUDA is available.

    ``with_cuda``: install them on a CUDA machine too, for a context that computes on the CPU
    there (gloo): megatron moves RoPE's inverse frequencies to ``torch.cuda.current_device()``
    at the first forward and builds its optimizer's found-inf and grad-norm tensors with
    ``device="cuda"``, whatever device the weights are on. Returns whether the layer is active.
    """
    global _INSTALLED
    if torch.cuda.is_available() and not with_cuda:
        return False
    with _LOCK:
        if _INSTALLED is None:
            _INSTALLED = _Installed(
                current_device=torch.cuda.current_device,
                synchronize=torch.cuda.synchronize,
                cuda_rng_state=torch.cuda.random.get_rng_state,
                tensor_methods={name: getattr(torch.Tensor, name) for name in _TENSOR_PATCHES},
                tensor_own_methods=frozenset(name for name in _TENSOR_PATCHES if name in torch.Tensor.__dict__),
            )
            torch.cuda.current_device = _current_device
            torch.cuda.synchronize = _synchronize
            torch.cuda.random.get_rng_state = _cuda_rng_state
            for name, patch in _TENSOR_PATCHES.items():
                setattr(torch.Tensor, name, patch)
            logger.info("megatron-core CPU compatibility layer enabled: %s", ", ".join(PATCHES))
    if getattr(_THREAD, "mode", None) is None:
        mode = _CudaToCpuMode()
        mode.__enter__()
        _THREAD.mode = mode
    return True


def disable() -> None:
    """Remove the patches and this thread's device mode (for tests); a no-op if not enabled."""
    global _INSTALLED
    mode = getattr(_THREAD, "mode", None)
    if mode is not None:
        stack = torch.overrides._get_current_function_mode_stack()
        if not stack or stack[-1] is not mode:
            raise RuntimeError(
                "cpu_compat.disable(): another torch function mode was entered after enable() "
                "and is still active; exit it first"
            )
        mode.__exit__(None, None, None)
        _THREAD.mode = None
    with _LOCK:
        if _INSTALLED is None:
            return
        torch.cuda.current_device = _INSTALLED.current_device
        torch.cuda.synchronize = _INSTALLED.synchronize
        torch.cuda.random.get_rng_state = _INSTALLED.cuda_rng_state
        for name, original in _INSTALLED.tensor_methods.items():
            if name in _INSTALLED.tensor_own_methods:
                setattr(torch.Tensor, name, original)
            else:
                delattr(torch.Tensor, name)
        _INSTALLED = None
