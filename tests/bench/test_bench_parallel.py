"""The layout benchmark end to end on a toy model: four layouts timed, first-step losses agree, report written.

Runtime: ~20 s on 2 idle cores (seven spawned ranks, each importing megatron), more under load: slow.
"""

from __future__ import annotations

import json
import math

import pytest

from tools.bench import parallel

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_four_layouts_time_the_same_model(tmp_path):
    returned = parallel.main(["--hidden", "32", "--layers", "2", "--heads", "4", "--vocab", "64", "--batch", "2",
                              "--seq", "16", "--repeats", "1", "--rounds", "1", "--out", str(tmp_path)])

    report = json.loads((tmp_path / "parallel.json").read_text())
    assert report["settings"]["threads"] == report["machine"]["threads"] == 2
    assert (tmp_path / "parallel.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = report["results"]
    assert result == json.loads(json.dumps(returned))
    layouts = result["layouts"]
    assert set(layouts) == {"TP=1", "TP=2", "PP=2", "DP=2"}
    for name, entry in layouts.items():
        assert entry["num_ranks"] * entry["threads_per_rank"] == 2, name  # every layout gets the 2 cores
        assert len(entry["step_wall_s"]) == 1 and all(math.isfinite(t) and t > 0 for t in entry["step_wall_s"]), name
        # One row per micro-batch: PP=2's pipeline sees both micro-batches, like TP; DP=2's ranks one row each.
        assert entry["num_micro_batches"] == (1 if name == "DP=2" else 2), name
    assert layouts["TP=1"]["ratio_median"] == 1.0
    reference = layouts["TP=1"]["first_step_loss"]
    # A fresh init predicts a near-uniform distribution over the 64 tokens.
    assert abs(reference - math.log(64)) < 0.2
    assert layouts["TP=2"]["first_step_loss"] == pytest.approx(reference, rel=1e-4)
    # PP=2 loads TP=1's weights and repeats its arithmetic stage by stage: the same loss exactly.
    assert layouts["PP=2"]["first_step_loss"] == reference
    # DP=2: each rank trains one of the two rows; their losses sum to the full batch's.
    assert layouts["DP=2"]["first_step_loss"] == pytest.approx(reference, rel=1e-5)
    assert result["loss_agreement"]
