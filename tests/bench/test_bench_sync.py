"""The sync benchmark end to end on a toy model at TP=1: both paths timed, the same engine weights, the step share.

Runtime: two one-rank runs, each importing megatron: ~15 s on 2 idle cores, more under load: slow.
"""

from __future__ import annotations

import json
import math

import pytest

from tools.bench import sync

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_streamed_and_gather_sync_the_same_weights(tmp_path):
    returned = sync.main(["--hidden", "32", "--layers", "2", "--heads", "4", "--vocab", "64", "--seq", "16",
                          "--batch", "2", "--repeats", "1", "--bucket-mb", "0.01", "--layouts", "TP=1",
                          "--out", str(tmp_path)])

    report = json.loads((tmp_path / "sync.json").read_text())
    assert (tmp_path / "sync.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = report["results"]
    assert result == json.loads(json.dumps(returned))
    assert set(result["runs"]) == {"TP=1 streamed", "TP=1 gather"}
    # Both paths leave the engine with bit-identical weights (SHA-256 of its state dict).
    assert result["same_weights"]
    digests = {entry["digest"] for entry in result["runs"].values()}
    assert len(digests) == 1 and len(digests.pop()) == 64
    for entry in result["runs"].values():
        assert len(entry["wall_s"]) == 1 and all(math.isfinite(t) and t > 0 for t in entry["wall_s"])
        assert len(entry["peak_mb_per_rank"]) == 1 and entry["peak_mb"] >= 0
    assert 0 < result["sync_share"] < 1 and result["step_s"] > 0
    # 2 layers of hidden 32 (ffn 64, 2 KV groups of 8), vocab 64, untied: the HF tensor count of the map.
    assert result["num_parameters"] == 2 * 64 * 32 + 32 + 2 * (32 + 32 * 32 + 2 * 16 * 32 + 32 * 32 + 32 + 3 * 64 * 32)
