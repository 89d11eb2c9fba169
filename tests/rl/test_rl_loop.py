"""The RL loop end to end on a tiny bootstrap policy: methods run, resume is exact."""

from __future__ import annotations

import pytest
import torch

from pipeline.config import AlgorithmConfig
from tests.distributed_utils import run_distributed
from tests.stages.test_bootstrap import OVERRIDES as BOOTSTRAP_OVERRIDES

# The tiny bootstrap policy solves no difficulty-3 problem; the format reward gives groups reward
# variance, so the runs change weights and comparing them proves something. A 40-problem
# held-out set: scoring 400 at steps 0 and N cost more than the 4 steps.
RL_OVERRIDES = [
    'data.train=["arith?difficulty=3&size=200"]', "reward.format_reward=0.1", "eval_set=arith?difficulty=3&size=40",
    "eval_samples=1",
    "prompts_per_step=4", "group_size=4", "max_new_tokens=24", "steps=4", "optim.total_steps=4", "optim.lr=1e-3",
    "reward.num_workers=1", "logging.progress=false", "logging.trackers=[]", "checkpoint.every_steps=2",
]


def _config(tmp, extra):
    from pipeline import configlib
    from pipeline.config import RLConfig

    return configlib.load(RLConfig, overrides=[
        *[f"bootstrap.{o}" for o in BOOTSTRAP_OVERRIDES], f"bootstrap.cache_dir={tmp}/cache",
        *RL_OVERRIDES, f"checkpoint.directory={tmp}/ckpt", f"logging.output_dir={tmp}/run", *extra,
    ])


def _weights(actor_module):
    return {k: v.detach().clone() for k, v in actor_module.state_dict().items() if not k.endswith("_extra_state")}


def _rl_worker(rank, world_size, tmp, extra, stop_after):
    from pipeline.metrics import read_metrics
    from pipeline.parallel.context import ParallelContext
    from pipeline.stages import rl as rl_stage

    cfg = _config(tmp, extra)
    context = ParallelContext.initialize(tensor_parallel=1, pipeline_parallel=1, seed=cfg.seed)
    captured = {}
    original_finish = rl_stage.finish

    def finish(run):
        captured["weights"] = _weights(run.actor.module)
        original_finish(run)

    rl_stage.finish = finish
    if stop_after is not None:
        rl_stage.run_rl(cfg, context=context, max_steps=stop_after)  # "killed" after stop_after steps
    last = rl_stage.run_rl(cfg, context=context)
    rows = read_metrics(f"{tmp}/run/metrics.jsonl")
    return {"weights": captured["weights"], "last": last, "rows": rows}


def _strip_times(rows):
    return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in rows]


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["algorithm.rollout_correction=tis", "algorithm.correction.level=sequence"]],
                         ids=["grpo", "grpo_with_sequence_tis"])
def test_resume_after_interruption_matches_uninterrupted_run(tmp_path, bootstrap_cache_dir, extra):
    shared = [f"bootstrap.cache_dir={bootstrap_cache_dir}", *extra]
    straight = run_distributed(_rl_worker, world_size=1, args=(str(tmp_path / "a"), shared, None))[0]
    resumed = run_distributed(_rl_worker, world_size=1, args=(str(tmp_path / "b"), shared, 2))[0]
    for name, value in straight["weights"].items():
        assert torch.equal(value, resumed["weights"][name]), name
    assert _strip_times(straight["rows"]) == _strip_times(resumed["rows"])
    steps = [row["step"] for row in straight["rows"]]
    assert steps == [0, 1, 2, 3, 4]  # step 0 is the initial held-out evaluation
    final = straight["rows"][-1]
    assert final["ledger/tokens_generated"] > final["ledger/tokens_with_gradient"] >= 0
    assert (tmp_path / "a" / "run" / "stats.parquet").is_file()
    assert (tmp_path / "a" / "run" / "plots" / "reward.png").is_file()
    if extra:  # the correction ran on every step and logged what it did
        assert all(0.0 <= row["correction/corrected_fraction"] <= 1.0 and row["correction/ratio_mean"] > 0
                   for row in straight["rows"][1:])


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    ["algorithm.sample_selector=d3s_cross", 'algorithm.token_weights=["d3s_topk", "cw_grpo"]',
     "algorithm.d3s.num_keep_init=2", "algorithm.d3s.num_keep_final=4", "algorithm.aggregation=d3s"],
    ["algorithm.loss=gspo", "algorithm.eps_low=0.0003", "algorithm.eps_high=0.0004", "algorithm.temperature=e3"],
    ["algorithm.sample_selector=pods", "algorithm.advantage=dr_grpo", "algorithm.kl_coef=0.05"],
    ["algorithm.sampling=dynamic", "algorithm.budget=e3", "algorithm.e3_budget.min_limit=2",
     "algorithm.e3_budget.max_limit=8", 'data.train=["arith?difficulty=1&size=6"]'],
    ["algorithm.budget=ada_est", "algorithm.ada_est.min_budget=2", "algorithm.ada_est.max_budget=8",
     'data.train=["arith?difficulty=1&size=6"]'],
    ["algorithm.rollout_correction=mis", "algorithm.correction.upper=1.001", "algorithm.correction.lower=0.999"],
])
def test_method_combinations_run_and_log_their_metrics(tmp_path, bootstrap_cache_dir, extra):
    outcome = run_distributed(_rl_worker, world_size=1, args=(
        str(tmp_path), [f"bootstrap.cache_dir={bootstrap_cache_dir}", *extra], None))[0]
    rows = outcome["rows"]
    assert len(rows) == 5
    last = rows[-1]
    assert all(not row.get("skipped_step", False) for row in rows[1:])
    if "algorithm.sample_selector=d3s_cross" in extra:
        assert last["ledger/samples_discarded"] > 0  # D³S kept 2..4 of 4 samples per group
        assert last["kept_token_ratio"] < 1.0
    if "algorithm.kl_coef=0.05" in extra:
        assert any(row["update/kl_ref"] > 0 for row in rows[2:])  # the policy moved away from the reference
    if "algorithm.temperature=e3" in extra:
        assert any(row.get("e3/temperature") not in (None, 1.0) for row in rows[1:])
    if "algorithm.sampling=dynamic" in extra:
        # 6 prompts, 4 per step: the first pass ends in step 2 and E3 widens its bounds.
        assert rows[1]["e3/g_max"] == 4.0 and rows[-1]["e3/g_max"] > 4.0
        assert all(row["dapo/rounds"] >= 1 for row in rows[1:])
    if "algorithm.rollout_correction=mis" in extra:
        # HF engine vs Megatron trainer kernels: a band of ±0.1% masks some tokens out of the loss.
        assert all(0.0 <= row["correction/corrected_fraction"] <= 1.0 for row in rows[1:])
        assert all(row["kept_token_ratio"] <= 1.0 - row["correction/corrected_fraction"] + 1e-9 for row in rows[1:])
    if "algorithm.budget=ada_est" in extra:
        assert any(row["budget/samples_per_prompt_max"] > 4 for row in rows[2:])  # revisited prompts get unequal budgets
        assert all(row["budget/mean"] == 4.0 for row in rows[1:])  # Σ N = B·G


DEFAULT_COMBINATION = [
    "algorithm.sampling=ada_seq", "algorithm.advantage=global_baseline", "algorithm.ada_seq.max_samples=12",
    "algorithm.prompt_filter=depo", "algorithm.depo.warmup_steps=2", "algorithm.depo.threshold=0.3",
    "algorithm.sample_selector=d3s_cross", 'algorithm.token_weights=["d3s_topk", "cw_grpo"]',
    "algorithm.d3s.num_keep_init=2", "algorithm.d3s.num_keep_final=4", "algorithm.aggregation=d3s",
    "algorithm.temperature=e3",
]


@pytest.mark.slow
def test_default_combination_runs_and_resumes_exactly(tmp_path, bootstrap_cache_dir):
    """DEPO + Ada-Seq-BALANCE + D³S + CW-GRPO + E3 temperature: every stateful part survives a restart."""
    extra = [f"bootstrap.cache_dir={bootstrap_cache_dir}", *DEFAULT_COMBINATION]
    straight = run_distributed(_rl_worker, world_size=1, args=(str(tmp_path / "a"), extra, None))[0]
    resumed = run_distributed(_rl_worker, world_size=1, args=(str(tmp_path / "b"), extra, 3))[0]
    for name, value in straight["weights"].items():
        assert torch.equal(value, resumed["weights"][name]), name
    assert _strip_times(straight["rows"]) == _strip_times(resumed["rows"])
    rows = straight["rows"]
    # Every step's FLOPs, the estimator's included, are counted and survive the restart (compared above).
    assert all(row["flops/total"] > 0 and row["flops/estimator"] > 0 for row in rows[1:])
    assert rows[-1]["flops/cumulative/total"] == pytest.approx(sum(row["flops/total"] for row in rows[1:]))
    assert [row["depo/filter_active"] for row in rows[1:]] == [0.0, 0.0, 1.0, 1.0]
    assert rows[-1]["estimator/num_updates"] == 4.0 * AlgorithmConfig().depo.minibatches  # 4 steps
    assert all(row["ada/pool_size_mean"] >= 4 for row in rows[1:])
    assert all(row["balanced/kept_fraction"] <= 1.0 for row in rows[1:])


@pytest.mark.slow
def test_old_logprobs_from_the_update_forward_trains_like_a_recompute(tmp_path, bootstrap_cache_dir):
    """One update per batch: π_old from the update's own pass gives the recomputed run's weights."""
    two_steps = [f"bootstrap.cache_dir={bootstrap_cache_dir}", "steps=2", "optim.total_steps=2"]
    recomputed = run_distributed(_rl_worker, world_size=1, args=(str(tmp_path / "a"), two_steps, None))[0]
    reused = run_distributed(_rl_worker, world_size=1, args=(
        str(tmp_path / "b"), [*two_steps, "trainer.old_logprobs=update_forward"], None))[0]
    for name, value in recomputed["weights"].items():
        torch.testing.assert_close(reused["weights"][name], value, rtol=0, atol=1e-6, msg=name)
    assert "mismatch/mean_abs" in recomputed["rows"][-1] and "mismatch/mean_abs" not in reused["rows"][-1]
    assert reused["rows"][-1]["entropy"] > 0
