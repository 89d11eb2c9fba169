"""The planner's tiny-model table against the memory the actor measurably holds (tools/bench/plan_memory.py)."""

from __future__ import annotations

import pytest

from tools.bench.plan_memory import CASES, COMPONENTS, TOLERANCE, run_case


@pytest.mark.parametrize("case", ["tiny", "qwen3-tiny"])  # qwen3: per-head q/k norms, heads wider than h / a
def test_tiny_model_prediction_matches_measured_memory_per_component(case):
    result = run_case(CASES[case], timeout_s=300)
    (rank,) = result["ranks"]
    for key in COMPONENTS:
        assert rank["measured"][key] > 0, key
        assert abs(rank["errors"][key]) <= TOLERANCE, (key, rank["predicted"][key], rank["measured"][key])
