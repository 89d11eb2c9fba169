"""The bootstrap stage trains a tokenizer and a base policy from nothing, and caches them."""

from __future__ import annotations

import json

import pytest

from tests.distributed_utils import run_distributed

OVERRIDES = [
    'sources=["arith?difficulty=1&size=100", "arith?difficulty=3&size=300"]',
    "model.hidden_size=32", "model.ffn_hidden_size=64", "model.num_layers=2",
    "model.num_attention_heads=2", "model.num_query_groups=2",
    "optim.total_steps=40", "optim.warmup_steps=5", "batch_size=16", "progress=false",
]


def _bootstrap_worker(rank, world_size, cache_dir):
    from pipeline import configlib
    from pipeline.config import BootstrapConfig
    from pipeline.parallel.context import ParallelContext
    from pipeline.stages.bootstrap import run_bootstrap

    cfg = configlib.load(BootstrapConfig, overrides=[*OVERRIDES, f"cache_dir={cache_dir}"])
    context = ParallelContext.initialize(tensor_parallel=1, pipeline_parallel=1, seed=cfg.seed)
    first = run_bootstrap(cfg, context=context)
    second = run_bootstrap(cfg, context=context)
    return first.cached, second.cached, str(first.directory), first.summary


@pytest.mark.slow
def test_bootstrap_trains_and_caches(tmp_path):
    from pipeline.metrics import read_metrics
    from pipeline.models.tokenizer import load_tokenizer
    from pipeline.checkpoint.manager import CheckpointManager

    (outcome,) = run_distributed(_bootstrap_worker, world_size=1, args=(str(tmp_path),))
    first_cached, second_cached, directory, summary = outcome
    assert (first_cached, second_cached) == (False, True)
    losses = [row["loss"] for row in read_metrics(f"{directory}/metrics.jsonl")]
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses  # from ~log|V| towards the data
    tokenizer = load_tokenizer(f"{directory}/tokenizer")
    text = "What is 12 + 7 * 3? 7 * 3 = 21; 12 + 21 = 33. \\boxed{33}"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert tokenizer.tokenize("is 9072")[-4:] == ["9", "0", "7", "2"]  # digits are never merged
    manager = CheckpointManager(f"{directory}/checkpoints", keep_last=1)
    path = manager.newest_valid()
    assert path is not None and path.name == "step_00000040"
    assert json.loads((path / "manifest.json").read_text())["model_spec"]["vocab_size"] == summary["vocab_size"]


def test_the_cache_key_ignores_speed_and_memory_knobs_only():
    from pipeline.config import BootstrapConfig
    from pipeline.stages.bootstrap import config_hash

    base = BootstrapConfig()
    same = BootstrapConfig(progress=False, cache_dir="elsewhere")
    same.trainer.logprob_chunk_size, same.trainer.logprob_buffer_mib, same.trainer.max_skipped_steps = 64, 8, 9
    assert config_hash(same) == config_hash(base)
    different = BootstrapConfig()
    different.trainer.micro_batch_tokens = 1024
    assert config_hash(different) != config_hash(base)
