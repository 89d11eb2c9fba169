"""The RL loop under tensor and pipeline parallelism reproduces the single-rank run.

Same bootstrap policy, seed, prompts and config; only the actor's layout changes. Rank 0
generates and grades for every layout, so step 1's rollouts are identical and its loss and
gradient norm must agree to fp32 reduction-order rounding; later steps sample from weights
that differ by that rounding, which at these sizes leaves the samples unchanged.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed_utils import run_distributed
from tests.rl.test_rl_loop import _config

# D³S top-K reads the entropy, CW-GRPO the log-probs: both come from the vocab-parallel head.
METHODS = ["algorithm.sample_selector=d3s_cross", 'algorithm.token_weights=["d3s_topk", "cw_grpo"]',
           "algorithm.d3s.num_keep_init=2", "algorithm.d3s.num_keep_final=4", "algorithm.aggregation=d3s",
           "steps=3", "optim.total_steps=3", "checkpoint.every_steps=3"]


def _layout_worker(rank, world_size, tmp, cache, tensor_parallel, pipeline_parallel, extra):
    from pipeline.metrics import read_metrics
    from pipeline.models.tokenizer import load_tokenizer
    from pipeline.parallel.context import ParallelContext
    from pipeline.stages.rl import initial_policy
    from pipeline.stages.rl import run_rl

    from pipeline.rewards import GradingPool

    cfg = _config(tmp, [*METHODS, f"bootstrap.cache_dir={cache}", *extra])
    context = ParallelContext.initialize(tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel,
                                         seed=cfg.seed)
    pools = []  # the grading pools this rank starts: only global rank 0 grades
    start_pool = GradingPool.__init__
    GradingPool.__init__ = lambda self, *args, **kwargs: (pools.append(self), start_pool(self, *args, **kwargs))[1]
    try:
        run_rl(cfg, context=context)
    finally:
        GradingPool.__init__ = start_pool
    if rank:
        return {"pools": len(pools)}
    policy = initial_policy(cfg, context=context)
    return {"rows": read_metrics(f"{tmp}/run/metrics.jsonl"), "vocab": len(load_tokenizer(policy.tokenizer_dir)),
            "policy": str(policy.weights), "pools": len(pools)}


@pytest.mark.slow
@pytest.mark.distributed
def test_tensor_and_pipeline_parallel_rl_matches_one_rank(tmp_path, bootstrap_cache_dir):
    cache = str(bootstrap_cache_dir)
    single = run_distributed(_layout_worker, world_size=1, args=(str(tmp_path / "tp1"), cache, 1, 1, []))[0]
    assert single["vocab"] % 2 == 0  # reserved tokens (bootstrap.vocab_multiple) make TP=2 possible
    rows_single = single["rows"]
    # The TP=2 run starts from the bootstrap policy exported to Hugging Face and converted back
    # (`policy=DIR`, the path users with a GPU checkpoint take); both conversions are exact.
    from pipeline.checkpoint.convert import hf_to_megatron, megatron_to_hf

    megatron_to_hf(checkpoint=single["policy"], out=tmp_path / "hf", verify=False)
    hf_to_megatron(hf=tmp_path / "hf", out=tmp_path / "converted", tensor_parallel=2, verify=False)
    layouts = {"tp2": (2, 1, [f"policy={tmp_path / 'converted'}"]), "pp2": (1, 2, [])}
    for name, (tensor_parallel, pipeline_parallel, extra) in layouts.items():
        ranks = run_distributed(_layout_worker, world_size=2, args=(str(tmp_path / name), cache, tensor_parallel,
                                                                      pipeline_parallel, extra))
        rows = ranks[0]["rows"]
        assert [rank["pools"] for rank in ranks] == [1, 0], name  # no idle grading pool beside rank 1
        assert [row["step"] for row in rows] == [row["step"] for row in rows_single] == [0, 1, 2, 3]
        # Step 1: identical rollouts, so identical selection and the same loss up to fp32 summation order.
        assert rows[1]["reward_mean"] == rows_single[1]["reward_mean"]
        assert rows[1]["ledger/tokens_with_gradient"] == rows_single[1]["ledger/tokens_with_gradient"]
        for key in ("loss", "grad_norm", "entropy"):
            assert rows[1][key] == pytest.approx(rows_single[1][key], rel=1e-4, abs=1e-6), (name, key)
        for step in (2, 3):
            assert rows[step]["reward_mean"] == rows_single[step]["reward_mean"], (name, step)
            for key in ("loss", "grad_norm"):
                assert rows[step][key] == pytest.approx(rows_single[step][key], rel=1e-3, abs=1e-5), (name, step, key)
        torch.testing.assert_close(torch.tensor([rows[-1]["ledger/tokens_generated"]]),
                                   torch.tensor([rows_single[-1]["ledger/tokens_generated"]]), rtol=0, atol=0)
