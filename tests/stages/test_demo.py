"""`winnow demo` end to end on a tiny configuration: every phase runs and reports."""

from __future__ import annotations

import pytest

from tests.distributed_utils import run_distributed
from tests.rl.test_rl_loop import RL_OVERRIDES
from tests.stages.test_bootstrap import OVERRIDES as BOOTSTRAP_OVERRIDES


def _demo_worker(rank, world_size, tmp):
    from pipeline import configlib
    from pipeline.config import DemoConfig
    from pipeline.parallel.context import ParallelContext
    from pipeline.stages.demo import run_demo

    cfg = configlib.load(DemoConfig, overrides=[
        *[f"rl.bootstrap.{o}" for o in BOOTSTRAP_OVERRIDES], f"rl.bootstrap.cache_dir={tmp}/cache",
        *[f"rl.{o}" for o in RL_OVERRIDES], f"rl.checkpoint.directory={tmp}/ckpt", f"rl.logging.output_dir={tmp}/rl",
        'eval_sets=["arith?difficulty=1&size=8", "gsm8k"]', "limit=4", "num_samples=2", "ks=[1, 2]",
        "max_new_tokens=24", "reward.num_workers=1",
    ])
    lines: list[str] = []
    context = ParallelContext.initialize(tensor_parallel=1, pipeline_parallel=1, seed=0)
    result = run_demo(cfg, context=context, out=lines.append)
    return result, lines


@pytest.mark.slow
def test_demo_runs_every_phase(tmp_path):
    result, lines = run_distributed(_demo_worker, world_size=1, args=(str(tmp_path),))[0]
    text = "\n".join(lines)
    for phase in ("[1/5]", "[2/5]", "[3/5]", "[4/5]", "[5/5]", "done in"):
        assert phase in text, text
    assert "gsm8k: all 4 problems are longer than the model's context; skipped" in text
    assert set(result["pass_at_k"]) == {"arith?difficulty=1&size=8"}
    assert result["mismatch"]["max_abs_diff"] < 1e-4  # fp32 actor and engine agree
    assert 0.0 <= result["rl"]["pass@1_after"] <= 1.0
    assert (tmp_path / "rl" / "plots" / "reward.png").is_file()
