"""One test per behaviour of the megatron-core CPU compatibility layer, plus megatron's own call sites.

The call-site tests run the megatron-core 0.16.1 functions that needed each
patch; if an upgrade adds a CUDA assumption the layer does not cover, they fail
here rather than deep inside a training step. The distributed call sites
(pipeline p2p ``synchronize``, the schedules' ``device="cuda"`` counters, the
tied-embedding ``.cuda()`` in ``LanguageModule``) run in ``test_tp_pp_parity.py``.
"""

from __future__ import annotations

import threading

import pytest
import torch

from pipeline.parallel import cpu_compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the layer is a no-op with CUDA")


@pytest.fixture
def compat():
    """The layer enabled for one test, and the previous state restored afterwards."""
    was_enabled = cpu_compat.is_enabled()
    cpu_compat.disable()
    assert cpu_compat.enable() is True
    try:
        yield
    finally:
        cpu_compat.disable()
        if was_enabled:
            cpu_compat.enable()


@pytest.fixture
def no_compat():
    was_enabled = cpu_compat.is_enabled()
    cpu_compat.disable()
    try:
        yield
    finally:
        if was_enabled:
            cpu_compat.enable()


def test_without_the_layer_cuda_calls_fail(no_compat):
    # The premise of the layer: on this machine these are errors.
    with pytest.raises((RuntimeError, AssertionError)):
        torch.empty(2, device="cuda")
    with pytest.raises((RuntimeError, AssertionError)):
        torch.cuda.current_device()


def test_current_device_is_cpu(compat):
    assert torch.cuda.current_device() == torch.device("cpu")
    assert torch.empty(3, device=torch.cuda.current_device()).device.type == "cpu"


def test_megatron_activation_checkpoint_saves_and_replays_its_rng_states(compat):
    # megatron's recompute (trainer.recompute) saves every generator's state in the forward and
    # restores it before recomputing; without a CUDA generator that must still round-trip.
    from megatron.core.tensor_parallel import random as megatron_random

    cpu_state, cuda_state, tracker_states = megatron_random._get_all_rng_states()
    assert cuda_state.numel() == 0 and cpu_state.dtype == torch.uint8
    drawn = torch.rand(3)
    megatron_random._set_all_rng_states(cpu_state, cuda_state, tracker_states)
    assert torch.equal(torch.rand(3), drawn)  # the CPU generator, restored, replays the same draw


def test_synchronize_is_a_noop(compat):
    assert torch.cuda.synchronize() is None
    assert torch.cuda.synchronize(0) is None


def test_tensor_cuda_and_module_cuda_stay_on_cpu(compat):
    x = torch.arange(6.0).reshape(2, 3)
    assert x.cuda() is x  # already on the (only) device: no copy
    assert x.cuda(0, non_blocking=True).device.type == "cpu"
    linear = torch.nn.Linear(3, 2).cuda()
    assert linear.weight.device.type == "cpu"
    assert torch.equal(linear(x), torch.nn.functional.linear(x, linear.weight, linear.bias))


def test_tensor_type_spells_cpu_types_the_cuda_way(compat):
    x = torch.ones(2)
    assert x.type() == "torch.cuda.FloatTensor"
    assert x.bfloat16().type() == "torch.cuda.BFloat16Tensor"
    assert x.to_sparse().type() == "torch.cuda.sparse.FloatTensor"
    # The cast form: CUDA spellings cast on the CPU, other arguments are untouched.
    assert x.type("torch.cuda.DoubleTensor").dtype == torch.float64
    assert x.type(torch.float16).dtype == torch.float16
    assert x.type("torch.HalfTensor").dtype == torch.float16
    y = torch.zeros(2, dtype=torch.float64)
    assert x.type(y.type()).dtype == torch.float64 and x.type(y.type()).device.type == "cpu"


@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("cuda"), torch.device("cuda", 0), 0])
def test_device_mode_rewrites_cuda_device_arguments(compat, device):
    assert torch.empty(2, device=device).device.type == "cpu"
    assert torch.zeros(2, 3, device=device, dtype=torch.float64).dtype == torch.float64
    assert torch.tensor([1.0, 2.0], device=device).device.type == "cpu"
    assert torch.ones(2).new_zeros(3, device=device).device.type == "cpu"
    x = torch.ones(2, dtype=torch.float32)
    assert x.to(device).device.type == "cpu"
    assert x.to(device, torch.float64).dtype == torch.float64
    assert x.to(device=device, dtype=torch.float16).dtype == torch.float16


def test_device_mode_leaves_other_devices_and_arguments_alone(compat):
    assert torch.empty(2, device="meta").device.type == "meta"
    x = torch.ones(2)
    assert x.to(torch.float64).dtype == torch.float64  # positional dtype is not a device
    assert x.to(torch.ones(1, dtype=torch.float16)).dtype == torch.float16
    assert cpu_compat.is_cuda_device(True) is False  # bool is an int subclass, never a device


def test_backward_passes_rely_on_the_process_wide_patches(compat):
    # torch.autograd.backward/grad and Tensor.backward are themselves overridable, so the
    # function mode is suspended while they run: inside a backward pass only the
    # process-wide patches apply. megatron's backward code allocates through
    # current_device() and .cuda(), which they cover; a literal device="cuda" there
    # would not be rewritten (documented limitation, asserted here so a torch change
    # that lifts it is noticed).
    class AllocatesInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.literal = torch.empty(1, device="cuda")  # forward runs under the mode
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            scale = torch.full_like(grad, 2.0, device=torch.cuda.current_device()).cuda()
            if AllocatesInBackward.needs_literal_cuda:
                torch.empty(1, device="cuda")
            return grad * scale

    x = torch.ones(3, requires_grad=True)
    AllocatesInBackward.needs_literal_cuda = False
    AllocatesInBackward.apply(x).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))

    x.grad = None
    AllocatesInBackward.needs_literal_cuda = True
    with pytest.raises((RuntimeError, AssertionError)):
        AllocatesInBackward.apply(x).sum().backward()


def test_device_mode_is_per_thread_and_enable_covers_a_new_thread(compat):
    outcome: dict[str, object] = {}

    def run():
        try:
            torch.empty(1, device="cuda")
            outcome["before"] = "ok"
        except (RuntimeError, AssertionError):
            outcome["before"] = "raised"
        # The process-wide patches are already there; the device mode is not.
        outcome["current_device"] = torch.cuda.current_device()
        cpu_compat.enable()
        outcome["after"] = torch.empty(1, device="cuda").device.type
        cpu_compat.disable()  # pops this thread's mode and the process-wide patches

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert outcome == {"before": "raised", "current_device": torch.device("cpu"), "after": "cpu"}
    cpu_compat.enable()  # restore the patches for this thread's fixture teardown


def test_enable_is_idempotent_and_disable_restores(no_compat):
    original = (torch.cuda.current_device, torch.cuda.synchronize, torch.Tensor.cuda, torch.Tensor.type,
                torch.cuda.random.get_rng_state)
    assert cpu_compat.enable() and cpu_compat.enable()
    assert cpu_compat.is_enabled()
    cpu_compat.disable()  # one disable undoes both enables
    assert not cpu_compat.is_enabled()
    assert (torch.cuda.current_device, torch.cuda.synchronize, torch.Tensor.cuda, torch.Tensor.type,
            torch.cuda.random.get_rng_state) == original
    assert "cuda" not in torch.Tensor.__dict__ and "type" not in torch.Tensor.__dict__
    assert torch.ones(1).type() == "torch.FloatTensor"
    with pytest.raises((RuntimeError, AssertionError)):
        torch.empty(1, device="cuda")
    cpu_compat.disable()  # disabling twice is harmless


def test_disable_refuses_to_pop_a_foreign_mode(compat):
    class Other(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Other():
        with pytest.raises(RuntimeError, match="another torch function mode"):
            cpu_compat.disable()
    assert cpu_compat.is_enabled()


def test_noop_when_cuda_is_available(no_compat, monkeypatch):
    original = torch.cuda.current_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_compat.enable() is False
    assert not cpu_compat.is_enabled()
    assert torch.cuda.current_device is original


# megatron-core's own call sites.


def test_megatron_rotary_embedding_on_current_device(compat):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=False)
    assert rope.inv_freq.device.type == "cpu"
    emb = rope(max_seq_len=5)  # moves inv_freq "to the GPU" on first use
    assert emb.shape == (5, 1, 1, 8) and emb.device.type == "cpu"


def test_megatron_global_memory_buffer_on_current_device(compat):
    from megatron.core.utils import GlobalMemoryBuffer

    buffer = GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "mpu")
    assert buffer.shape == (2, 3) and buffer.device.type == "cpu"


def test_megatron_default_causal_mask_with_literal_cuda_device(compat):
    from megatron.core.transformer.utils import get_default_causal_mask

    mask = get_default_causal_mask(4)
    assert mask.device.type == "cpu"
    assert torch.equal(mask, torch.ones(4, 4, dtype=torch.bool).triu(1))


def test_megatron_grad_clipping_type_check_and_cuda_buffer(compat):
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
    params[0].grad = torch.tensor([3.0, 0.0, 0.0])
    params[1].grad = torch.tensor([0.0, 4.0])
    clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=5.0)  # asserts grad.type() is CUDA fp32
    scale = 1.0 / (5.0 + 1e-6)
    torch.testing.assert_close(params[0].grad, torch.tensor([3.0 * scale, 0.0, 0.0]))
    torch.testing.assert_close(params[1].grad, torch.tensor([0.0, 4.0 * scale]))
