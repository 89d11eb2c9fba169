"""Everything the RL loop holds, built once from the config, and its checkpointed state."""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline import configlib
from pipeline.config import RLConfig
from pipeline.data import Prompt, load_prompts
from pipeline.metrics import MetricsWriter
from pipeline.models.spec import ModelSpec
from pipeline.models.tokenizer import load_tokenizer, prompt_token_ids
from pipeline.rl.methods import Methods, build_methods
from pipeline.rl.stream import PromptStream
from pipeline.stats.store import PromptStatsStore
from pipeline.trainer.actor import Actor
from pipeline.trainer.checkpoint import CheckpointManager, load_model_weights

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Ledger:
    """The quantities the sample-efficiency methods claim to improve, cumulative over the run."""

    tokens_generated: int = 0
    tokens_with_gradient: int = 0
    prompts_filtered: int = 0
    samples_discarded: int = 0
    zero_variance_groups: int = 0
    groups: int = 0

    def state_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for name in self.__slots__:
            setattr(self, name, int(state[name]))


class StopRequest:
    """SIGTERM/SIGUSR1 (SLURM's pre-timeout signal) ask for a checkpoint at the next safe point."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:  # noqa: ARG002
        self.received = signum

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@dataclass(slots=True)
class Run:
    cfg: RLConfig
    context: Any
    actor: Actor
    reference: Actor | None  # frozen initial policy for the KL term, when algorithm.kl_coef > 0
    engine: Any
    pool: Any
    tokenizer: Any
    prompts: list[Prompt]
    prompt_token_ids: list[list[int]]
    eval_prompts: list[Prompt]
    methods: Methods
    stream: PromptStream
    stats: PromptStatsStore
    ledger: Ledger
    checkpoints: CheckpointManager
    writer: MetricsWriter | None
    start_step: int
    output_dir: Path
    extras: dict[str, Any] = field(default_factory=dict)

    def state(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """JSON state and tensors of everything but the actor (which the manager saves itself)."""
        stats = self.stats.state_dict()
        state = {
            "stream": self.stream.state_dict(),
            "ledger": self.ledger.state_dict(),
            "methods": {name: obj.state_dict() for name, obj in self.methods.stateful.items()},
            "stats_meta": stats["meta"],
            "temperature": self.extras.get("temperature"),
        }
        return state, {f"stats.{k}": v for k, v in stats["tensors"].items()}

    def load_state(self, state: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        self.stream.load_state_dict(state["stream"])
        self.ledger.load_state_dict(state["ledger"])
        for name, obj in self.methods.stateful.items():
            obj.load_state_dict(state["methods"][name])
        stats_tensors = {k.removeprefix("stats."): v for k, v in tensors.items() if k.startswith("stats.")}
        self.stats.load_state_dict({"meta": state["stats_meta"], "tensors": stats_tensors})
        self.extras["temperature"] = state["temperature"]


def setup_run(cfg: RLConfig, *, context=None) -> Run:
    from pipeline.parallel.context import ParallelContext
    from pipeline.rewards import GradingPool
    from pipeline.rollout.local import LocalEngine
    from pipeline.rollout.weight_sync import build_hf_model
    from pipeline.stages.bootstrap import _single_process_rendezvous, run_bootstrap

    if context is None:
        context = ParallelContext.initialize(tensor_parallel=1, pipeline_parallel=1, seed=cfg.seed,
                                             **_single_process_rendezvous())
    output_dir = Path(cfg.logging.output_dir)
    if context.rank == 0:
        configlib.save_resolved(cfg, output_dir)
    base = run_bootstrap(cfg.bootstrap, context=context)
    tokenizer = load_tokenizer(base.tokenizer_dir)
    spec = ModelSpec(**base.summary["model_spec"])
    actor = Actor(spec=spec, context=context, trainer=cfg.trainer, optim=cfg.optim, seed=cfg.seed)
    checkpoints = CheckpointManager(cfg.checkpoint.directory, keep_last=cfg.checkpoint.keep_last,
                                    rank=context.rank, world_size=context.world_size)

    prompts: list[Prompt] = []
    for spec_text in cfg.data.train:
        loaded, _ = load_prompts(spec_text, split=cfg.data.split, limit=cfg.data.limit, seed=cfg.data.seed,
                                 on_bad_row=cfg.data.on_bad_row, max_field_chars=cfg.data.max_field_chars)
        prompts.extend(loaded)
    encoded_prompts = [prompt_token_ids(tokenizer, p, template=cfg.data.template) for p in prompts]
    budget = spec.max_position_embeddings - cfg.max_new_tokens
    too_long = [p.id for p, ids in zip(prompts, encoded_prompts) if len(ids) > budget]
    if too_long:
        raise ValueError(f"data.train: {len(too_long)} prompts (e.g. {too_long[0]}) exceed the model's context "
                         f"of {spec.max_position_embeddings} tokens with max_new_tokens={cfg.max_new_tokens}")
    eval_prompts, _ = load_prompts(cfg.eval_set, split="test")
    methods = build_methods(cfg.algorithm, total_steps=cfg.steps, group_size=cfg.group_size,
                            vocab_size=spec.vocab_size, temperature=cfg.temperature)
    initial_weights = CheckpointManager(base.checkpoint_dir, keep_last=1, rank=context.rank,
                                        world_size=context.world_size).newest_valid()
    reference = None
    if cfg.algorithm.kl_coef > 0:
        reference = Actor(spec=spec, context=context, trainer=cfg.trainer, optim=None, seed=cfg.seed)
        load_model_weights(initial_weights, reference.module)
    run = Run(
        cfg=cfg, context=context, actor=actor, reference=reference,
        engine=LocalEngine(build_hf_model(spec), eos_token_ids=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id, show_progress=False),
        pool=GradingPool(**cfg.reward.pool_kwargs()), tokenizer=tokenizer, prompts=prompts,
        prompt_token_ids=encoded_prompts, eval_prompts=eval_prompts, methods=methods,
        stream=PromptStream(len(prompts), seed=cfg.seed), stats=PromptStatsStore([p.id for p in prompts]),
        ledger=Ledger(), checkpoints=checkpoints, writer=None, start_step=0, output_dir=output_dir,
        extras={"temperature": cfg.temperature},
    )
    resume_from = checkpoints.newest_valid() if cfg.checkpoint.resume != "never" else None
    if cfg.checkpoint.resume == "must" and resume_from is None:
        raise FileNotFoundError(f"checkpoint.resume=must but no valid checkpoint under {cfg.checkpoint.directory}")
    if resume_from is not None:
        loaded = checkpoints.load(resume_from, actor=actor)
        run.load_state(loaded.state, loaded.tensors)
        run.start_step = loaded.step
        logger.info("resumed from %s at step %d", resume_from, loaded.step)
    else:
        load_model_weights(initial_weights, actor.module)
    if context.rank == 0:
        run.writer = MetricsWriter(output_dir, tensorboard=cfg.logging.tensorboard,
                                   resume_from_step=run.start_step if resume_from is not None else None)
    return run
