"""The policy `winnow rl` starts from (``pipeline.stages.rl.initial_policy``)."""

from __future__ import annotations

import pytest

from pipeline.config import RLConfig


def test_rl_refuses_an_unconverted_hugging_face_policy(tmp_path):
    from pipeline.stages.rl import initial_policy

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    cfg = RLConfig(policy=str(tmp_path))
    with pytest.raises(ValueError, match="winnow convert hf-to-megatron"):
        initial_policy(cfg, context=None)
