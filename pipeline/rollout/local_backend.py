"""The local rollout backend's part of the table (``pipeline.rollout.backends``): engines in this process.

The trainer's engine is a Hugging Face model of the policy's architecture on global rank 0,
decoded by ``LocalEngine`` and synced in process (``LocalSyncedEngine``); with
``rollout.max_staleness=1`` the same engine runs in a process of its own
(``pipeline.rollout.process_engine``), so it generates while the trainer updates. Its EOS is
the tokenizer's; the model's other stop tokens travel with each request
(``SamplingParams.stop_token_ids``). The scoring engine decodes the scored policy's own
model, loaded by the stage.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pipeline.configlib import ConfigError
from pipeline.models.tokenizer import pad_token_id

if TYPE_CHECKING:
    from pipeline.config import RolloutConfig
    from pipeline.models.spec import ModelSpec
    from pipeline.rollout.backends import ScoredPolicy
    from pipeline.rollout.local import LocalEngine
    from pipeline.rollout.weight_sync import SyncedEngine

__all__ = ["scoring_engine", "trainer_engine"]


def trainer_engine(cfg: RolloutConfig, *, spec: ModelSpec, tokenizer: Any,
                   tokenizer_dir: Path) -> SyncedEngine:  # noqa: ARG001 - the engine reads no tokenizer files
    """The policy's architecture with random weights until the first sync, on rank 0's GPU when there is one."""
    from pipeline.rollout.weight_sync import MB, LocalSyncedEngine, build_hf_model

    bucket_bytes = cfg.sync_bucket_mb * MB
    if cfg.max_staleness > 0:
        from pipeline.rollout.process_engine import ProcessEngine, ProcessSyncedEngine, split_threads

        # The two processes overlap while the engine generates ahead: each keeps to its share of the cores.
        trainer_threads, engine_threads = split_threads()
        engine = ProcessEngine(spec, eos_token_ids=tokenizer.eos_token_id, pad_token_id=pad_token_id(tokenizer),
                               num_threads=engine_threads)
        return ProcessSyncedEngine(engine, bucket_bytes=bucket_bytes, trainer_threads=trainer_threads)
    from pipeline.rollout.local import LocalEngine

    # On a GPU machine the in-process engine decodes on this rank's GPU (rank 0), as evaluation's does.
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    engine = LocalEngine(build_hf_model(spec).to(device), eos_token_ids=tokenizer.eos_token_id,
                         pad_token_id=pad_token_id(tokenizer), show_progress=False)
    return LocalSyncedEngine(engine, bucket_bytes=bucket_bytes)


def scoring_engine(rollout: RolloutConfig, policy: ScoredPolicy, *, max_batch_rows: int,  # noqa: ARG001 - no servers
                   show_progress: bool) -> LocalEngine:
    """``LocalEngine`` over the scored policy's model, which the stage loaded in this process."""
    from pipeline.rollout.local import LocalEngine

    if policy.hf_model is None:
        raise ConfigError("rollout.engine: local generates in this process and needs the policy's weights")
    return LocalEngine(policy.hf_model, eos_token_ids=policy.eos_token_ids, pad_token_id=policy.pad_token_id,
                       max_batch_rows=max_batch_rows, show_progress=show_progress)
