"""Activation recompute (``trainer.recompute``): the same losses and gradients, computed twice."""

from __future__ import annotations

import pytest

from tests.distributed_utils import run_distributed
from tests.trainer.test_actor import SEED, _batch, _spec


def _recompute_worker(rank, world_size, recompute):
    from pipeline.config import OptimConfig, TrainerConfig
    from pipeline.parallel.context import ParallelContext
    from pipeline.trainer.actor import Actor
    from pipeline.trainer.losses import CrossEntropyLoss

    context = ParallelContext.initialize(tensor_parallel=1, pipeline_parallel=1, seed=SEED)
    actor = Actor(spec=_spec(), context=context, optim=OptimConfig(lr=1e-2), seed=SEED,
                  trainer=TrainerConfig(micro_batch_tokens=30, logprob_chunk_size=16, recompute=recompute))
    config = actor.module.config
    steps = [actor.train_step(_batch(), CrossEntropyLoss()) for _ in range(3)]
    return ([s.loss for s in steps], [s.grad_norm for s in steps],
            (config.recompute_granularity, config.recompute_method, config.recompute_num_layers))


def test_recompute_changes_memory_not_the_update():
    results = {mode: run_distributed(_recompute_worker, world_size=1, args=(mode,))[0]
               for mode in ("none", "selective", "full")}
    assert results["none"][2] == (None, None, None)
    assert results["selective"][2][0] == "selective"
    assert results["full"][2] == ("full", "uniform", 1)
    for mode in ("selective", "full"):  # the same arithmetic, replayed: identical to the bit
        assert results[mode][0] == results["none"][0], mode
        assert results[mode][1] == results["none"][1], mode
    assert results["none"][0][-1] < results["none"][0][0] - 0.05  # and it trains


@pytest.mark.parametrize("value", ["partial", "layer"])
def test_recompute_names_only_megatron_granularities(value):
    from pipeline import configlib
    from pipeline.config import RLConfig

    with pytest.raises(configlib.ConfigError, match="trainer.recompute"):
        configlib.load(RLConfig, overrides=[f"trainer.recompute={value}"])
