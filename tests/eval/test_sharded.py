"""The shared sharded sample-and-grade engine: device and stop-token rules, planning, read-or-sample, seeding."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pipeline.configlib import ConfigError
from pipeline.data.records import Prompt
from pipeline.errors import UserError
from pipeline.eval.policy import LoadedPolicy
from pipeline.eval.sharded import (
    SamplingOptions,
    Shard,
    ShardSampler,
    fits_context,
    plan_shards,
    resolve_device,
    run_shard,
    stop_token_ids,
)


@pytest.fixture(scope="module")
def bootstrap_tokenizer():
    """The CPU demo's kind of tokenizer: ``train_tokenizer`` on arithmetic, as bootstrap trains it."""
    from pipeline.models.tokenizer import train_tokenizer

    return train_tokenizer([f"What is {a} + {b}? \\boxed{{{a + b}}}" for a in range(20) for b in range(20)],
                           vocab_size=48)


def _prompts(count: int) -> list[Prompt]:
    return [Prompt(id=f"p{i}", problem=f"What is {i} + {i}?", answer=str(2 * i), source="test") for i in range(count)]


def _policy(source: str, *, generation_eos=None, config_eos=None, tokenizer_eos=None) -> LoadedPolicy:
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=generation_eos),
                            config=SimpleNamespace(eos_token_id=config_eos))
    return LoadedPolicy(model, SimpleNamespace(eos_token_id=tokenizer_eos), None, source)


# ----------------------------------------------------------------------------- the two rules


def test_device_rule(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu" and resolve_device("cpu") == "cpu"
    for choice in ("cuda", "cuda:1"):
        with pytest.raises(ConfigError, match=rf"device: '{choice}' requested but CUDA is not available"):
            resolve_device(choice)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda" and resolve_device("cuda:1") == "cuda:1"


def test_stop_tokens_of_a_hugging_face_folder_add_the_models_own():
    assert stop_token_ids(_policy("hf:/x", generation_eos=[7, 5], config_eos=3, tokenizer_eos=9)) == [5, 7, 9]
    assert stop_token_ids(_policy("hf:/x", config_eos=3, tokenizer_eos=9)) == [3, 9]  # no generation config value
    assert stop_token_ids(_policy("hf:/x", generation_eos=4)) == [4]


def test_stop_tokens_of_a_winnow_checkpoint_are_the_tokenizers():
    # The HF model built from a ModelSpec carries transformers' default ids (Llama: 2), meaningless here.
    policy = _policy("megatron:/run/step_00000003", generation_eos=2, config_eos=2, tokenizer_eos=40)
    assert stop_token_ids(policy) == [40]


def test_the_demo_gets_the_same_stop_tokens_under_either_old_rule(bootstrap_tokenizer):
    """Curate used the tokenizer's EOS for winnow checkpoints; evaluate added the model config's.
    For the demo (a Llama spec, the bootstrap tokenizer) both are [2]: its <eos> is token 2 and
    so is Llama's default, so unifying the rules changes no demo output."""
    from transformers import AutoConfig

    from pipeline.models.spec import ModelSpec
    from pipeline.rollout.weight_sync import build_hf_model

    default_eos = AutoConfig.for_model("llama").eos_token_id
    assert bootstrap_tokenizer.eos_token_id == default_eos == 2
    spec = ModelSpec(family="llama", vocab_size=64, hidden_size=16, ffn_hidden_size=32, num_layers=1,
                     num_attention_heads=2, num_query_groups=2, max_position_embeddings=32)
    policy = LoadedPolicy(build_hf_model(spec), bootstrap_tokenizer, spec, "megatron:/cache/x/checkpoints/step_1")
    assert stop_token_ids(policy) == [2]
    assert stop_token_ids(LoadedPolicy(policy.hf_model, bootstrap_tokenizer, spec, "hf:/exported")) == [2]


# ----------------------------------------------------------------------------- planning


def test_fits_context_keeps_prompt_plus_new_tokens_within_the_context(bootstrap_tokenizer):
    from pipeline.data.templates import prompt_token_ids

    prompts = [Prompt(id=f"p{i}", problem="What is " + " + ".join(["1"] * (i + 1)) + "?", answer="1", source="test")
               for i in range(6)]
    lengths = [len(prompt_token_ids(bootstrap_tokenizer, p, template="raw")) for p in prompts]
    limit = lengths[3] + 4  # prompt 3 fits exactly with 4 new tokens
    mask = fits_context(prompts, tokenizer=bootstrap_tokenizer, template="raw", max_new_tokens=4,
                        max_positions=limit)
    np.testing.assert_array_equal(mask, [length + 4 <= limit for length in lengths])
    assert mask[3] and not mask[4]
    assert fits_context(prompts, tokenizer=bootstrap_tokenizer, template="raw", max_new_tokens=4,
                        max_positions=None).all()


def test_plan_shards_cuts_in_order_with_per_index_seeds_and_paths(tmp_path):
    prompts = _prompts(7)
    shards = plan_shards(prompts, shard_size=3, seed_of=lambda i: 100 + i, path_of=lambda i: tmp_path / f"s{i}")
    assert [[p.id for p in shard.prompts] for shard in shards] == [["p0", "p1", "p2"], ["p3", "p4", "p5"], ["p6"]]
    assert [(s.index, s.seed, s.path) for s in shards] == [(i, 100 + i, tmp_path / f"s{i}") for i in range(3)]
    assert plan_shards([], shard_size=3, seed_of=int, path_of=Path) == []


# ----------------------------------------------------------------------------- read or sample


class _FakeSampler:
    def __init__(self, *, fail: bool = False) -> None:
        self.num_calls = 0
        self.fail = fail

    def sample(self, shard):
        self.num_calls += 1
        if self.fail:
            raise RuntimeError("simulated crash")
        return [SimpleNamespace(prompt=p, num_correct=1) for p in shard.prompts]


def _read(path):
    ids = path.read_text().split()
    return ids, ids


def _write(shard, results):
    ids = [r.prompt.id for r in results]
    shard.path.write_text(" ".join(ids))
    return ids


def test_run_shard_samples_once_then_reads_back(tmp_path):
    shard = Shard(index=2, prompts=_prompts(3), seed=5, path=tmp_path / "shard")
    sampler = _FakeSampler()
    first = run_shard(shard, sampler=sampler, read=_read, write=_write, error=UserError, plan_name="x")
    second = run_shard(shard, sampler=sampler, read=_read, write=_write, error=UserError, plan_name="x")
    assert (first.rows, first.reused) == (["p0", "p1", "p2"], False)
    assert (second.rows, second.reused) == (["p0", "p1", "p2"], True)
    assert sampler.num_calls == 1

    other = Shard(index=2, prompts=_prompts(2), seed=5, path=tmp_path / "shard")
    with pytest.raises(UserError, match=r"holds other problems than shard 2 of bench; delete it"):
        run_shard(other, sampler=sampler, read=_read, write=_write, error=UserError, plan_name="bench")


def test_run_shard_reports_a_failure_and_writes_nothing(tmp_path):
    shard = Shard(index=0, prompts=_prompts(2), seed=5, path=tmp_path / "shard")
    seen = []
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_shard(shard, sampler=_FakeSampler(fail=True), read=_read, write=_write, error=UserError, plan_name="x",
                  on_failure=seen.append)
    assert [str(error) for error in seen] == ["simulated crash"] and not shard.path.exists()


def test_sampler_is_reproducible_per_shard_seed_and_stops_on_the_policys_tokens(bootstrap_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(bootstrap_tokenizer), hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=64, eos_token_id=bootstrap_tokenizer.eos_token_id,
                         pad_token_id=bootstrap_tokenizer.pad_token_id)
    torch.manual_seed(0)
    policy = LoadedPolicy(LlamaForCausalLM(config).eval(), bootstrap_tokenizer, config, "hf:/tiny")
    pool = SimpleNamespace(grade_batch=lambda items: [SimpleNamespace(is_correct=False, reason="wrong")] * len(items))
    options = SamplingOptions(num_samples=3, max_new_tokens=6, temperature=1.0, top_p=1.0, template="raw")

    def responses(seed: int) -> list[list[str]]:
        sampler = ShardSampler(policy, options=options, grading_pool=lambda: pool, show_progress=False)
        assert sampler.engine.eos_token_ids == tuple(stop_token_ids(policy))
        shard = Shard(index=0, prompts=_prompts(2), seed=seed, path=Path("unused"))
        results = sampler.sample(shard)
        assert [(r.prompt.id, r.num_samples) for r in results] == [("p0", 3), ("p1", 3)]
        for result in results:
            assert len(result.response_lengths) == 3 and all(1 <= n <= 6 for n in result.response_lengths)
            assert result.num_generated_tokens == sum(result.response_lengths)
        return [r.responses for r in results]

    assert responses(11) == responses(11)
    assert responses(11) != responses(12)


def test_sample_and_grade_keeps_each_responses_length_in_sample_order(bootstrap_tokenizer):
    from pipeline.eval.runner import sample_and_grade
    from pipeline.rollout.types import Completion, SamplingParams

    def length(prompt_id: str, sample_index: int) -> int:  # distinct for every sample
        return 1 + 3 * int(prompt_id[1:]) + sample_index

    class _Engine:
        def generate(self, requests, params):
            return [Completion(prompt_id=request.prompt_id, sample_index=index,
                               token_ids=torch.full((length(request.prompt_id, index),), 5, dtype=torch.int64),
                               logprobs=torch.zeros(length(request.prompt_id, index)), finish_reason="stop",
                               weight_version=0)
                    for request in requests for index in range(request.num_samples)]

    pool = SimpleNamespace(grade_batch=lambda items: [SimpleNamespace(is_correct=True, reason="ok")] * len(items))
    results = sample_and_grade(engine=_Engine(), tokenizer=bootstrap_tokenizer, prompts=_prompts(2), num_samples=3,
                               params=SamplingParams(max_new_tokens=16), pool=pool, template="raw")
    assert [r.response_lengths for r in results] == [[1, 2, 3], [4, 5, 6]]
    assert [r.num_generated_tokens for r in results] == [6, 15]
    assert [len(r.responses) for r in results] == [3, 3]
