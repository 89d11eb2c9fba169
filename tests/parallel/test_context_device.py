"""The context's device follows its backend, not the machine: gloo keeps a CUDA machine's run on the CPU.

A CUDA machine is simulated by reporting ``torch.cuda.is_available()`` as ``True``; nothing
here touches a GPU (a gloo context must not), so a wrong device choice shows as a CUDA
device on a parameter or as a failing ``set_device`` call.
"""

from __future__ import annotations

import pytest
import torch

from pipeline.models.factory import build_gpt_model, model_device
from pipeline.models.spec import ModelSpec
from pipeline.parallel import cpu_compat
from pipeline.parallel.context import ParallelContext, device_for_backend

SPEC = ModelSpec(family="qwen2", vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_layers=1,
                 num_attention_heads=4, num_query_groups=2, max_position_embeddings=32, qkv_bias=True)


@pytest.mark.parametrize("has_cuda", [False, True])
def test_gloo_is_the_cpu_on_any_machine(has_cuda):
    assert device_for_backend("gloo", local_rank=3, has_cuda=has_cuda) == torch.device("cpu")


def test_nccl_is_this_ranks_gpu():
    assert device_for_backend("nccl", local_rank=3, has_cuda=True) == torch.device("cuda", 3)


@pytest.mark.parametrize(("backend", "match"), [("nccl", "needs CUDA"), ("mpi", "expected 'nccl' or 'gloo'")])
def test_unusable_backend_is_refused(backend, match):
    with pytest.raises(ValueError, match=match):
        device_for_backend(backend, local_rank=0, has_cuda=False)


def test_default_model_device_is_the_gpu_only_without_the_cpu_layer(monkeypatch):
    assert not cpu_compat.is_enabled()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert model_device() == torch.device("cuda", 2)
    monkeypatch.setattr(cpu_compat, "is_enabled", lambda: True)
    assert model_device() == torch.device("cpu")


def test_gloo_context_on_a_cuda_machine_builds_and_runs_a_cpu_model(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def no_gpu(device):
        raise AssertionError(f"a gloo context selected GPU {device}")

    monkeypatch.setattr(torch.cuda, "set_device", no_gpu)
    context = ParallelContext.initialize(tensor_parallel=1, pipeline_parallel=1, seed=0, rank=0, world_size=1,
                                         backend="gloo")
    try:
        assert context.device == torch.device("cpu")
        # The CPU layer is on although CUDA "exists", which it still reports.
        assert cpu_compat.is_enabled() and torch.cuda.is_available()
        model = build_gpt_model(SPEC, parallel_context=context, seed=1)
        assert model.config.use_cpu_initialization and not model.config.masked_softmax_fusion
        assert {p.device.type for p in model.parameters()} == {"cpu"}
        ids = torch.randint(0, SPEC.vocab_size, (2, 8))  # (B, T)
        positions = torch.arange(8).expand(2, 8)  # (B, T)
        mask = torch.ones(1, 1, 8, 8, dtype=torch.bool).triu(1)  # (1, 1, T, T)
        logits = model(ids, positions, mask)  # (B, T, V)
        # megatron moves RoPE's frequencies to torch.cuda.current_device() at the first forward.
        assert logits.device.type == "cpu" and model.rotary_pos_emb.inv_freq.device.type == "cpu"
        total = context.dp_sum(torch.tensor(2.0))
        assert total.item() == 2.0
        # Where TE is installed too, the actor of a CPU context still takes the local spec.
        from pipeline.config import TrainerConfig
        from pipeline.models import layer_spec
        from pipeline.trainer.actor import Actor

        monkeypatch.setattr(layer_spec, "transformer_engine_available", lambda: True)
        actor = Actor(spec=SPEC, context=context, trainer=TrainerConfig(), optim=None, seed=1)
        assert actor.layer_spec_choice.name == "local"
        assert {p.device.type for p in actor.module.parameters()} == {"cpu"}
    finally:
        context.destroy()
    assert not cpu_compat.is_enabled()
