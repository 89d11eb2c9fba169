"""Stage recipes: typed stage configs, and each stage as a NeMo-Run ``run.Partial``.

The CPU presets exist in two sizes: ``tiny`` (seconds per stage, the tests and CI) and
the demo size (the bootstrap policy of ``winnow demo``). The H100 presets size curation,
the estimator and evaluation for 7-8B policies served by SGLang. Each preset starts from
the typed defaults (or from another preset) and changes only what differs.

``stage_task(stage)`` wraps a typed ``Stage`` as ``run.Partial(run_stage, stage=run.Config(Stage, ...))``
(``rl_task(cfg)``: one rl stage), what ``nemo_run`` serializes, shows and lets its CLI override;
building it gives back the typed stage, so the two forms never drift.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pipeline.config import (
    BootstrapConfig,
    CurateConfig,
    CurateRulesConfig,
    EvalConfig,
    EvaluateConfig,
    ModelConfig,
    Resources,
    RewardConfig,
    TrainEstimatorConfig,
)
from pipeline.launch.campaign import Stage, run_stage

# ================================================================ CPU presets


def bootstrap_cpu(*, tiny: bool = False, cache_dir: str | None = None) -> BootstrapConfig:
    """The demo's base policy; ``tiny``: a 2-layer width-32 policy trained 40 steps (~10 s).

    ``cache_dir``: where the result is cached (null: ``BootstrapConfig``'s folder under the cache root,
    which `winnow bootstrap` and `winnow rl` use too).
    """
    cfg = BootstrapConfig(progress=False)
    if cache_dir is not None:
        cfg = dataclasses.replace(cfg, cache_dir=cache_dir)
    if not tiny:
        return cfg
    return dataclasses.replace(
        cfg, sources=["arith?difficulty=1&size=100", "arith?difficulty=3&size=300"], batch_size=16,
        model=ModelConfig(hidden_size=32, ffn_hidden_size=64, num_layers=2, num_attention_heads=2, num_query_groups=2),
        optim=dataclasses.replace(cfg.optim, total_steps=40, warmup_steps=5),
    )


def curate_cpu(*, tiny: bool = False) -> CurateConfig:
    """Difficulty-3 arithmetic sampled k=8 times, raw template (the bootstrap policy's format).

    3,000 prompts because RL trains on the kept ones only: about one in five lands in the
    learnable band, and 100 steps × 16 prompts over the 78 kept of 400 were 20 epochs, which
    overfit (held-out pass@1 0.485 → 0.42 for GRPO and the default alike); ~600 kept prompts
    keep it under three epochs.

    ``tiny``: 48 prompts, k=4, 16 new tokens, and every prompt kept (a 40-step policy
    solves almost nothing, and the later stages need prompts to train on).
    """
    cfg = CurateConfig(sources=["arith?difficulty=3&size=3000"], num_samples=8, max_new_tokens=48, template="raw",
                       reward=RewardConfig(num_workers=1), progress=False)
    if not tiny:
        return cfg
    return dataclasses.replace(
        cfg, sources=["arith?difficulty=3&size=48"], num_samples=4, max_new_tokens=16, shard_size=24,
        rules=CurateRulesConfig(trivial_threshold=None, drop_impossible=False),
    )


def estimator_cpu(*, tiny: bool = False) -> TrainEstimatorConfig:
    """The random tiny encoder (no download); ``tiny``: one epoch, a quarter held out."""
    cfg = TrainEstimatorConfig(encoder="tiny", epochs=3, batch_size=16, lr=1e-3, progress=False)
    return dataclasses.replace(cfg, epochs=1, holdout_fraction=0.25) if tiny else cfg


def evaluate_cpu(*, tiny: bool = False) -> EvaluateConfig:
    """Held-out difficulty-3 arithmetic, n=8; ``tiny``: 8 problems, n=2, 16 new tokens."""
    cfg = EvaluateConfig(
        eval=EvalConfig(benchmarks=["arith?difficulty=3&size=400"], num_samples=8, ks=[1, 2, 4, 8],
                        temperature=1.0, max_new_tokens=48, limit=100, bootstrap_samples=200),
        template="raw", reward=RewardConfig(num_workers=1), device="cpu", progress=False,
    )
    if not tiny:
        return cfg
    return dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, num_samples=2, ks=[1, 2], max_new_tokens=16,
                                                             limit=8, bootstrap_samples=20))


# ================================================================ H100 presets


def curate_h100(*, max_new_tokens: int) -> CurateConfig:
    """Reinforce-Ada's curation (§4.1, App. C.1): k=16 on the MATH train split, chat template.

    ``max_new_tokens``: the model's generation budget, the one its RL samples with: a prompt is
    sampled only when it fits the context with this many new tokens (Qwen2.5-Math has 4,096
    positions, so the papers' 4K would drop every prompt).
    """
    return CurateConfig(sources=["math"], split="train", num_samples=16, max_new_tokens=max_new_tokens,
                        template="chat", dtype="bfloat16", device="cuda", shard_size=1024,
                        reward=RewardConfig(num_workers=16), progress=False)


def estimator_h100() -> TrainEstimatorConfig:
    """DEPO's estimator: the pretrained MiniLM encoder on the curation's pass rates."""
    return TrainEstimatorConfig(encoder="minilm", epochs=3, batch_size=64, progress=False)


def evaluate_h100(*, max_new_tokens: int) -> EvaluateConfig:
    """The papers' benchmarks at n=32, T=0.6, top-p 0.95, in bf16 on a GPU.

    ``max_new_tokens``: the model's generation budget (the papers use 4K where the context
    allows it); a problem that does not fit with it is skipped, and more than
    ``eval.max_skipped_fraction`` of a benchmark skipped is an error.
    """
    return EvaluateConfig(
        eval=EvalConfig(benchmarks=["math500", "gsm8k", "minerva"], num_samples=32, max_new_tokens=max_new_tokens),
        template="chat", dtype="bfloat16", device="cuda", max_batch_rows=512,
        reward=RewardConfig(num_workers=16), progress=False,
    )


# ================================================================ NeMo-Run forms


def to_run_config(value: Any) -> Any:
    """A config dataclass as nested ``run.Config``s (lists, dicts and scalars pass through)."""
    import nemo_run as run

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return run.Config(type(value), **{field.name: to_run_config(getattr(value, field.name))
                                          for field in dataclasses.fields(value) if field.init})
    if isinstance(value, list):
        return [to_run_config(item) for item in value]
    if isinstance(value, tuple):
        return tuple(to_run_config(item) for item in value)
    return value


def stage_task(stage: Stage):
    """``run.Partial(run_stage, stage=...)``: calling the built partial runs the stage in that process."""
    import nemo_run as run

    return run.Partial(run_stage, stage=to_run_config(stage))


def rl_task(cfg, *, resources: Resources | None = None):
    """``stage_task`` of one rl stage named ``rl`` (``resources``: one rank by default)."""
    return stage_task(Stage(name="rl", kind="rl", config=cfg, resources=resources or Resources()))
