"""The streamed weight sync on two gloo ranks: bounded memory per rank at TP=2 and PP=2, and the disk transport.

The model's full state is ≥ 8× the bucket, so a sync that gathered the model anywhere
would break the bound. Memory is measured with ``tests.rollout.memory_probe.StoragePeak``:
the peak of tensor storage allocated during the sync on each rank (gathered shards,
merged and unfused tensors, relayed buckets, pickled headers), the actor's own parameters
and the local engine's model (written in place) excluded. The stated bound is
``weight_export.extra_memory_bound``: 2 × the bucket + 2 × the largest unsharded parameter.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.distributed_utils import run_distributed

VOCAB = 128
BUCKET_BYTES = 128 * 1024


def _spec():
    from pipeline.models.spec import ModelSpec

    # 8 layers of hidden 64: 1.2 MB of fp32 weights, 9.5 buckets; the largest tensor (fc1, 64 KB) is half a bucket, so the bound is 3 buckets.
    return ModelSpec(family="llama", vocab_size=VOCAB, hidden_size=64, ffn_hidden_size=128, num_layers=8,
                     num_attention_heads=4, num_query_groups=2, max_position_embeddings=64)


def _actor(tp: int, pp: int):
    from pipeline.config import OptimConfig, TrainerConfig
    from pipeline.parallel.context import ParallelContext
    from pipeline.trainer.actor import Actor

    context = ParallelContext.initialize(tensor_parallel=tp, pipeline_parallel=pp, seed=0)
    return Actor(spec=_spec(), context=context, trainer=TrainerConfig(micro_batch_tokens=1000),
                 optim=OptimConfig(lr=1e-2), seed=0)


class _DiskServers:
    """Stands in for servers' ``WeightSink``: records which folder they were told to load."""

    def __init__(self) -> None:
        self.loaded: list[tuple[str, int]] = []

    def load_from_disk(self, folder: str, *, version: int) -> None:
        self.loaded.append((folder, version))


def _worker(rank, world_size, tp, pp, weights_dir, tokenizer_dir):
    from pipeline.rollout.local import LocalEngine
    from pipeline.rollout.weight_export import extra_memory_bound
    from pipeline.rollout.weight_sync import (
        DiskSyncedEngine,
        LocalSyncedEngine,
        actor_hf_state,
        build_hf_model,
        sync_actor_to_engine,
    )
    from tests.rollout.memory_probe import StoragePeak

    actor = _actor(tp, pp)
    full_bytes = sum(t.numel() * t.element_size() for t in build_hf_model(actor.spec).state_dict().values())
    engine = (LocalSyncedEngine(LocalEngine(build_hf_model(actor.spec), show_progress=False),
                                bucket_bytes=BUCKET_BYTES) if rank == 0 else None)
    # The engine's model is written in place: its parameters are no new memory either.
    existing = [*actor.module.state_dict().values(), *(engine.engine.model.parameters() if rank == 0 else ())]
    probe = StoragePeak(exclude=existing)
    with probe:
        sync_actor_to_engine(actor, engine, version=1)
    synced = ({name: t.detach().clone() for name, t in engine.engine.model.state_dict().items()}
              if rank == 0 else None)
    result = {"peak": probe.peak, "bound": extra_memory_bound(actor, bucket_bytes=BUCKET_BYTES),
              "full_bytes": full_bytes, "synced": synced}
    if weights_dir is None:
        return result
    reference = actor_hf_state(actor)
    result["reference"] = {name: t.clone() for name, t in reference} if reference is not None else None
    servers = _DiskServers()
    disk = (DiskSyncedEngine(servers, sink=servers, weights_dir=weights_dir, spec=actor.spec,
                             tokenizer_dir=tokenizer_dir, bucket_bytes=BUCKET_BYTES) if rank == 0 else None)
    sync_actor_to_engine(actor, disk, version=2)
    result["loaded"] = servers.loaded
    return result


def _check_memory(outcomes):
    for rank, outcome in enumerate(outcomes):
        assert outcome["full_bytes"] >= 8 * BUCKET_BYTES
        # The bound itself is far below one copy of the model, let alone world-size copies.
        assert outcome["bound"] <= 3 * BUCKET_BYTES < outcome["full_bytes"] / 3
        assert 0 < outcome["peak"] <= outcome["bound"], (rank, outcome["peak"], outcome["bound"])


@pytest.mark.slow
@pytest.mark.distributed
def test_tensor_parallel_sync_stays_within_the_memory_bound():
    outcomes = run_distributed(_worker, world_size=2, args=(2, 1, None, None))
    _check_memory(outcomes)
    assert outcomes[1]["synced"] is None


def _tokenizer(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(20)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(folder)
    return folder


@pytest.mark.slow
@pytest.mark.distributed
def test_pipeline_parallel_sync_bounded_and_disk_export_loads_bit_exact(tmp_path):
    from transformers import AutoModelForCausalLM

    weights_dir = tmp_path / "weights"
    outcomes = run_distributed(_worker, world_size=2,
                               args=(1, 2, str(weights_dir), str(_tokenizer(tmp_path / "tokenizer"))))
    _check_memory(outcomes)
    reference = outcomes[0]["reference"]
    # The local engine got every tensor of both stages, bit for bit.
    assert {k: v for k, v in outcomes[0]["synced"].items()}.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(outcomes[0]["synced"][name], tensor), name

    export = weights_dir / "v2"
    assert outcomes[0]["loaded"] == [(str(export), 2)]
    assert not list(weights_dir.glob(".*")), "the staging folder was published, not left behind"
    index = json.loads((export / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    # Each stage wrote its own files; one index names them all.
    assert {f.split("-")[1] for f in files} == {"pp000", "pp001"}
    assert files == sorted(p.name for p in export.glob("*.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(export, local_files_only=True, dtype=torch.float32)
    loaded = model.state_dict()
    assert loaded.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(loaded[name], tensor), name
