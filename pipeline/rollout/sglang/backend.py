"""The SGLang rollout backend's part of the table (``pipeline.rollout.backends``): its engines, its servers' flags.

The trainer's engine is an ``SGLangEngine`` on ``rollout.servers`` whose weights follow the
actor through ``SGLangWeights``: a folder under ``rollout.weights_dir`` (``sync=disk``) or the
update group (``sync=distributed``: NCCL with CUDA, else gloo). The scoring engine attaches to
the running servers and has them load the scored policy once. Both programs that serve this
backend (``sglang.launch_server`` and winnow's CPU stand-in) take the same flags.

Heavy imports (``httpx``, ``torch``) wait for the function that needs them: a rollout node
imports this module for its serve command.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.configlib import ConfigError

if TYPE_CHECKING:
    from pipeline.config import RolloutConfig
    from pipeline.models.spec import ModelSpec
    from pipeline.rollout.backends import ScoredPolicy, ServerLaunch
    from pipeline.rollout.sglang.generation import SGLangEngine
    from pipeline.rollout.weight_sync import SyncedEngine

__all__ = ["SERVED_WEIGHT_VERSION", "scoring_engine", "serve_arguments", "trainer_engine"]

# The label of the scored weights on the servers: above the version 0 a server starts with,
# so every completion says it came from the policy the stage loaded.
SERVED_WEIGHT_VERSION = 1


def trainer_engine(cfg: RolloutConfig, *, spec: ModelSpec, tokenizer: Any,  # noqa: ARG001 - the servers hold theirs
                   tokenizer_dir: Path) -> SyncedEngine:
    """The client of ``cfg.servers``, wrapped in the weight-sync transport ``cfg.sync`` names."""
    import torch

    from pipeline.rollout.sglang.client import SGLangClientConfig
    from pipeline.rollout.sglang.generation import SGLangEngine
    from pipeline.rollout.sglang.weights import SGLangWeights, UpdateGroupSettings, update_group_address
    from pipeline.rollout.weight_sync import MB, DiskSyncedEngine, DistributedSyncedEngine

    bucket_bytes = cfg.sync_bucket_mb * MB
    engine = SGLangEngine(cfg.servers, config=SGLangClientConfig.from_rollout(cfg))
    if cfg.sync == "distributed":
        # Its collective timeout follows the client's admin timeout (weights.collective_timeout_s); each
        # server's tp_size is checked against server_tensor_parallel at the first contact.
        group = UpdateGroupSettings(backend="nccl" if torch.cuda.is_available() else "gloo",
                                    master_address=update_group_address(cfg.servers),
                                    ranks_per_server=cfg.server_tensor_parallel)
        return DistributedSyncedEngine(engine, sink=SGLangWeights(engine.pool, update_group=group),
                                       bucket_bytes=bucket_bytes)
    return DiskSyncedEngine(engine, sink=SGLangWeights(engine.pool), weights_dir=cfg.weights_dir, spec=spec,
                            tokenizer_dir=tokenizer_dir, bucket_bytes=bucket_bytes)


def scoring_engine(rollout: RolloutConfig, policy: ScoredPolicy, *,
                   max_batch_rows: int, show_progress: bool) -> SGLangEngine:  # noqa: ARG001 - the servers batch
    """The running servers, serving ``policy`` as ``SERVED_WEIGHT_VERSION``; ``close`` leaves them running.

    The servers load the policy explicitly rather than being trusted to have started with it: a
    server started on the base model scores any checkpoint of the same architecture, and a
    restarted server cannot silently score other weights.
    """
    from pipeline.rollout.sglang.client import SGLangClientConfig
    from pipeline.rollout.sglang.generation import SGLangEngine
    from pipeline.rollout.sglang.weights import SGLangWeights

    if policy.served_folder is None:
        raise ConfigError("rollout.engine: SGLang servers load the scored policy from a Hugging Face folder, and "
                          "this caller gives none")
    folder = policy.served_folder()
    engine = SGLangEngine.attach(rollout.servers,
                                 config=SGLangClientConfig.from_rollout(rollout, show_progress=show_progress))
    try:
        SGLangWeights(engine.pool).load_from_disk(str(folder), version=SERVED_WEIGHT_VERSION)
    except BaseException:
        engine.close()
        raise
    return engine


def serve_arguments(launch: ServerLaunch) -> list[str]:
    """The flags one server of a rollout node starts with (flag names as ``sglang.launch_server`` takes them)."""
    return ["--model-path", launch.model_path, "--tokenizer-path", launch.tokenizer, "--host", launch.host,
            "--port", str(launch.port), "--tp-size", str(launch.tensor_parallel),
            "--base-gpu-id", str(launch.base_gpu_id), "--max-running-requests", str(launch.max_running_requests),
            *launch.extra_args]
