"""Megatron actor → local engine: synced weights give the actor's own log-probs, and updates land."""

from __future__ import annotations

import pytest
import torch

from tests.distributed_utils import run_distributed
from tests.trainer.test_actor import _actor, _batch


def _sync_worker(rank, world_size, tp, pp):
    from pipeline.rl.rollouts import to_train_batch
    from pipeline.rollout.local import LocalEngine
    from pipeline.rollout.mismatch import logprob_mismatch
    from pipeline.rollout.types import GenerationRequest, SamplingParams
    from pipeline.rollout.weight_sync import LocalSyncedEngine, build_hf_model, sync_actor_to_engine
    from pipeline.trainer.losses import CrossEntropyLoss

    actor = _actor(tp, pp, micro_batch_tokens=10_000, lr=3e-2)
    # A bucket of 4 KiB: the tiny model (~40 KiB) streams in many buckets. The engine sits on the
    # actor's device: on a GPU machine the sync is then device to device and decoding runs there.
    engine = (LocalSyncedEngine(LocalEngine(build_hf_model(actor.spec, device=actor.device), show_progress=False),
                                bucket_bytes=4096)
              if actor.context.rank == 0 else None)
    prompts = [[1, 5, 9], [2, 7], [3, 3, 3, 4]]
    requests = [GenerationRequest(prompt_id=str(i), prompt_token_ids=p, num_samples=2) for i, p in enumerate(prompts)]
    params = SamplingParams(max_new_tokens=6, temperature=0.8, seed=11, ignore_eos=True)

    def sample_and_compare():
        completions = engine.generate(requests, params) if engine is not None else None
        payload = [completions]
        if world_size > 1:
            torch.distributed.broadcast_object_list(payload, src=0)
        completions = payload[0]
        group_ids = torch.arange(len(prompts)).repeat_interleave(2)
        batch, engine_logprobs = to_train_batch(prompts, completions, group_ids, pad_id=0)
        trainer_logprobs = actor.compute_logprobs(batch, temperature=0.8)
        _, mismatch = logprob_mismatch(engine_logprobs, trainer_logprobs, mask=batch.response_mask)
        return [c.token_ids.tolist() for c in completions], float(mismatch["max_abs_diff"])

    sync_actor_to_engine(actor, engine, version=1)
    before_tokens, before_mismatch = sample_and_compare()
    for _ in range(3):
        actor.train_step(_batch(), CrossEntropyLoss())
    sync_actor_to_engine(actor, engine, version=2)
    after_tokens, after_mismatch = sample_and_compare()
    version = engine.weight_version if engine is not None else 2
    return before_tokens, after_tokens, before_mismatch, after_mismatch, version


def _spec():
    from pipeline.models.spec import ModelSpec

    return ModelSpec(family="qwen2", vocab_size=32, hidden_size=16, ffn_hidden_size=32, num_layers=1,
                     num_attention_heads=2, num_query_groups=1, max_position_embeddings=16)


def _buckets(model, device):
    named = [(name, torch.zeros(p.shape, device=device)) for name, p in model.named_parameters()]
    return [named[:2], named[2:]]


def _recorded_consume(synced, buckets, monkeypatch):
    handed = []
    monkeypatch.setattr(synced.engine, "update_weights",
                        lambda pairs, *, version: handed.extend(tensor for _, tensor in pairs))
    synced.consume(iter(buckets), version=1)
    return handed


@pytest.mark.parametrize("device", ["meta", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_engine_on_the_buckets_device_takes_them_without_a_host_copy(device, monkeypatch):
    # "meta" stands in for a GPU on the CPU: a host copy of a meta tensor would be a different object.
    from pipeline.rollout.local import LocalEngine
    from pipeline.rollout.weight_sync import LocalSyncedEngine, build_hf_model

    engine = LocalEngine(build_hf_model(_spec(), device=device), show_progress=False)
    assert {p.device.type for p in engine.model.parameters()} == {device}
    synced = LocalSyncedEngine(engine, bucket_bytes=4096)
    assert synced.staging_device().type == device
    buckets = _buckets(engine.model, device)
    handed = _recorded_consume(synced, buckets, monkeypatch)
    assert [id(t) for t in handed] == [id(t) for bucket in buckets for _, t in bucket]


def test_any_other_engine_gets_host_tensors(monkeypatch):
    # The process engine's children read host shared memory: its transport stages through the CPU.
    from pipeline.rollout.weight_sync import LocalSyncedEngine, build_hf_model

    class ProcessLike:
        def update_weights(self, pairs, *, version):
            raise AssertionError("replaced by the recorder")

    model = build_hf_model(_spec(), device="meta")
    synced = LocalSyncedEngine(ProcessLike(), bucket_bytes=4096)
    assert synced.staging_device() == torch.device("cpu")
    buckets_device = "cuda" if torch.cuda.is_available() else "cpu"
    handed = _recorded_consume(synced, _buckets(model, buckets_device), monkeypatch)
    assert len(handed) == len(list(model.parameters())) and {t.device.type for t in handed} == {"cpu"}


def test_synced_engine_reproduces_actor_logprobs_and_follows_updates():
    before, after, mismatch_before, mismatch_after, version = run_distributed(_sync_worker, world_size=1, args=(1, 1))[0]
    # fp32 on CPU: the engine's KV-cached log-probs equal the actor's recomputation.
    assert mismatch_before < 1e-4 and mismatch_after < 1e-4
    assert before != after  # the same seed samples other tokens after three large SGD steps
    assert version == 2


@pytest.mark.distributed
def test_sync_gathers_tensor_parallel_shards():
    outcomes = run_distributed(_sync_worker, world_size=2, args=(2, 1))
    _, _, mismatch_before, mismatch_after, version = outcomes[0]
    assert mismatch_before < 1e-4 and mismatch_after < 1e-4 and version == 2


class _RecordingSink:
    """A ``WeightSink`` that records its calls; ``refuse_bucket`` makes that bucket's delivery fail."""

    def __init__(self, *, refuse_bucket: int | None = None) -> None:
        self.calls: list[tuple] = []
        self.refuse_bucket = refuse_bucket

    def load_from_disk(self, folder, *, version):
        self.calls.append(("load", folder, version))

    def begin_update(self, *, version):
        self.calls.append(("begin", version))

    def send_bucket(self, bucket, *, version):
        index = sum(call[0] == "send" for call in self.calls)
        self.calls.append(("send", [name for name, _ in bucket], version))
        if index == self.refuse_bucket:
            from pipeline.rollout.types import RolloutError

            raise RolloutError("the update group failed: a server left")

    def end_update(self, *, version, completed):
        self.calls.append(("end", version, completed))

    def close(self):
        self.calls.append(("close",))


def _named_buckets(count: int):
    return [[(f"model.b{i}.weight", torch.zeros(2))] for i in range(count)]


def test_the_streamed_transport_hands_every_bucket_to_its_sink_in_one_update():
    from pipeline.rollout.types import WeightSink
    from pipeline.rollout.weight_sync import DistributedSyncedEngine

    sink = _RecordingSink()
    assert isinstance(sink, WeightSink)
    synced = DistributedSyncedEngine(object(), sink=sink, bucket_bytes=4096)
    synced.consume(iter(_named_buckets(3)), version=4)
    assert sink.calls == [("begin", 4), ("send", ["model.b0.weight"], 4), ("send", ["model.b1.weight"], 4),
                          ("send", ["model.b2.weight"], 4), ("end", 4, True)]


def test_a_failed_bucket_drains_the_rest_ends_the_update_incomplete_and_raises_once():
    from pipeline.rollout.types import RolloutError
    from pipeline.rollout.weight_sync import DistributedSyncedEngine

    sink = _RecordingSink(refuse_bucket=1)
    synced = DistributedSyncedEngine(object(), sink=sink, bucket_bytes=4096)
    taken = []
    buckets = (taken.append(i) or bucket for i, bucket in enumerate(_named_buckets(4)))
    with pytest.raises(RolloutError, match="weight sync to version 2 failed; the next sync starts a new update: the "
                                           "update group failed: a server left"):
        synced.consume(buckets, version=2)
    # Every bucket was taken (the other trainer ranks finish their part), none sent after the failure.
    assert taken == [0, 1, 2, 3]
    assert sink.calls == [("begin", 2), ("send", ["model.b0.weight"], 2), ("send", ["model.b1.weight"], 2),
                          ("end", 2, False)]


def test_an_update_that_cannot_begin_takes_the_buckets_and_ends_nothing():
    from pipeline.rollout.types import RolloutError
    from pipeline.rollout.weight_sync import DistributedSyncedEngine

    class Unreachable(_RecordingSink):
        def begin_update(self, *, version):
            raise RolloutError("no server answered")

    sink = Unreachable()
    synced = DistributedSyncedEngine(object(), sink=sink, bucket_bytes=4096)
    taken = []
    with pytest.raises(RolloutError, match="no server answered"):
        synced.consume((taken.append(i) or b for i, b in enumerate(_named_buckets(2))), version=1)
    assert taken == [0, 1] and sink.calls == []
