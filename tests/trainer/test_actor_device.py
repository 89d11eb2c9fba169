"""Device placement on the GPU path, shown on a CPU.

On CUDA the actor's batches, positions, causal mask and every tensor it hands to a
collective must be on ``context.device`` (NCCL refuses CPU tensors: "no backend type
associated with device type cpu"). Every collective goes through
``pipeline.parallel.reducers``, which checks the device first; these tests give the
checks a device the tensors are not on (``cuda``: no GPU needed to compare devices, or
``meta``: tensors with shapes and no data) and show that the actor places each tensor.
"""

from __future__ import annotations

import ast
import dataclasses
import types
from pathlib import Path

import pytest
import torch

from pipeline.parallel.reducers import DeviceMismatchError, check_device
from pipeline.trainer.actor import Actor, model_inputs
from pipeline.trainer.batch import TrainBatch
from tests.distributed_utils import one_rank_context

CUDA = torch.device("cuda", 0)
META = torch.device("meta")


@pytest.fixture(scope="module")
def context():
    with one_rank_context() as ctx:
        yield ctx


def _batch() -> TrainBatch:
    tokens = torch.arange(1, 13).reshape(3, 4)
    mask = torch.tensor([[False, True, True, False]] * 3)
    return TrainBatch(tokens=tokens, response_mask=mask, advantages=torch.ones(3, 4), token_mask=mask)


def test_check_device_names_the_collective_and_both_devices():
    check_device(torch.zeros(2), torch.device("cpu"), op="x")
    check_device(torch.zeros(2), None, op="x")  # no device: no check
    with pytest.raises(DeviceMismatchError, match=r"dp_sum: tensor of shape \(2,\) is on cpu, .* run on cuda:0"):
        check_device(torch.zeros(2), CUDA, op="dp_sum")
    with pytest.raises(DeviceMismatchError, match="no backend type associated with device type cpu"):
        check_device(torch.zeros(2), torch.device("cuda"), op="dp_sum")


def test_every_collective_of_the_context_checks_the_device(context):
    assert context.device == torch.device("cpu")
    value = torch.ones(3)
    assert torch.equal(context.dp_sum(value), value) and torch.equal(context.world_min(value), value)
    on_gpu = dataclasses.replace(context, device=CUDA)  # what a CUDA rank's context holds
    calls = [
        ("dp_sum", lambda: on_gpu.dp_sum(value)),
        ("world_min", lambda: on_gpu.world_min(value)),
        ("broadcast_from_last_stage", lambda: on_gpu.broadcast_from_last_stage(value)),
        ("GroupReducer.sum", lambda: on_gpu.tp_vocab_reducer().sum(value)),
        ("GroupReducer.max", lambda: on_gpu.tp_vocab_reducer().max(value)),
    ]
    for name, call in calls:
        with pytest.raises(DeviceMismatchError, match=name):
            call()


def test_the_actor_issues_no_collective_of_its_own():
    """Every collective goes through the context, so every one is device-checked."""
    source = (Path(__file__).resolve().parents[2] / "pipeline" / "trainer" / "actor.py").read_text()
    imported = {alias.name for node in ast.walk(ast.parse(source)) if isinstance(node, (ast.Import, ast.ImportFrom))
                for alias in node.names} | {node.module for node in ast.walk(ast.parse(source))
                                            if isinstance(node, ast.ImportFrom) and node.module}
    assert not any(name == "torch.distributed" or name.startswith("torch.distributed.") for name in imported)


def test_micro_batches_and_model_inputs_are_on_the_device():
    batch = _batch()
    assert batch.to(torch.device("cpu")) is batch  # the CPU run: no copy at all
    moved = batch.to(META)
    for field in dataclasses.fields(moved):
        value = getattr(moved, field.name)
        assert value is None or value.device == META, field.name
    tokens, positions, mask = model_inputs(moved)
    assert tokens.device == positions.device == mask.device == META
    assert positions.shape == (3, 4) and mask.shape == (1, 1, 4, 4)
    cpu_tokens, cpu_positions, cpu_mask = model_inputs(batch)
    assert torch.equal(cpu_positions, torch.arange(4).expand(3, 4))
    assert torch.equal(cpu_mask[0, 0], torch.ones(4, 4, dtype=torch.bool).triu(1))


class _RecordingContext:
    """A context on ``meta`` whose collectives record their input's device and answer on the CPU."""

    def __init__(self) -> None:
        self.device = META
        self.is_pipeline_last = True
        self.seen: list[tuple[str, torch.device]] = []

    def dp_sum(self, tensor, *, with_context_parallel=False):
        self.seen.append(("dp_sum", tensor.device))
        return torch.ones(tensor.shape, dtype=tensor.dtype)

    def world_min(self, tensor):
        self.seen.append(("world_min", tensor.device))
        return torch.ones(tensor.shape, dtype=tensor.dtype)

    def broadcast_object_from_last_stage(self, payload):
        return payload


def test_the_actor_builds_collective_inputs_on_the_device():
    actor = object.__new__(Actor)  # only the reduction helpers: no model needed
    actor.context = _RecordingContext()
    actor.device = actor.context.device
    metrics = actor._reduce_metrics([{"loss": torch.tensor(0.5), "entropy": torch.tensor(1.0)}])
    assert set(metrics) == {"loss", "entropy"}
    assert actor._all_ranks_finite(True) is True
    assert actor.context.seen == [("dp_sum", META), ("dp_sum", META), ("world_min", META)]


def test_a_cpu_actor_runs_with_the_checks_on(context):
    from pipeline.config import OptimConfig, TrainerConfig
    from pipeline.models.spec import ModelSpec
    from pipeline.trainer.losses import CrossEntropyLoss

    spec = ModelSpec(family="llama", vocab_size=32, hidden_size=16, ffn_hidden_size=32, num_layers=1,
                     num_attention_heads=2, num_query_groups=2, max_position_embeddings=16)
    actor = Actor(spec=spec, context=context, trainer=TrainerConfig(micro_batch_tokens=8),
                  optim=OptimConfig(lr=1e-3), seed=0)
    assert actor.device == context.device and actor.context.tp_vocab_reducer().device == context.device
    result = actor.train_step(_batch(), CrossEntropyLoss())
    assert not result.skipped and result.num_micro_batches == 2
    logprobs = actor.compute_logprobs(_batch())
    assert logprobs.device == torch.device("cpu") and logprobs.shape == (3, 4)
