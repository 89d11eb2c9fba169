"""Everything the RL loop holds, built once from the config, and its checkpointed state.

``setup_run`` builds it from an ``InitialPolicy`` the caller resolved (the ``rl`` stage
bootstraps or resolves a checkpoint; this floor never runs another stage).
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pipeline import configlib
from pipeline.checkpoint.artifact import load_weights
from pipeline.checkpoint.manager import CheckpointManager, check_resume_layout
from pipeline.config import RLConfig
from pipeline.data import Prompt, load_prompts
from pipeline.data.sources import parse_spec
from pipeline.data.templates import prompt_token_ids
from pipeline.metrics import MetricsWriter
from pipeline.models.spec import ModelSpec
from pipeline.models.tokenizer import load_tokenizer, pad_token_id, stop_token_ids
from pipeline.parallel.rendezvous import broadcast_from_rank0
from pipeline.rl.methods import Methods, build_methods
from pipeline.rl.registry import MethodSetting
from pipeline.rl.rollouts import RolloutBatch
from pipeline.rl.sampling import Sampled, Sampling, SelectedPrompts, build_sampling
from pipeline.rl.stream import PromptStream
from pipeline.rollout.backends import rollout_backend
from pipeline.stats.flops import FlopCounter
from pipeline.stats.store import PromptStatsStore
from pipeline.trainer.actor import Actor

if TYPE_CHECKING:
    from pipeline.rl.batches import BatchSource

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

    def record(self, *, tokens_generated: int, tokens_with_gradient: int, prompts_filtered: int,
               samples_discarded: int, zero_variance_groups: int, groups: int) -> None:
        """Add one step's counts."""
        self.tokens_generated += tokens_generated
        self.tokens_with_gradient += tokens_with_gradient
        self.prompts_filtered += prompts_filtered
        self.samples_discarded += samples_discarded
        self.zero_variance_groups += zero_variance_groups
        self.groups += groups

    def state_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for name in self.__slots__:
            setattr(self, name, int(state[name]))


class StopRequest:
    """SIGTERM/SIGUSR1 (SLURM's pre-timeout signal) ask for a checkpoint at the next safe point.

    Each rank hears the signal on its own, at its own moment: ``requested`` is the loop's
    decision, the same on every rank.
    """

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

    def requested(self, *, world_size: int) -> bool:
        """Whether any rank has received a stop signal so far; collective, the same answer on every rank.

        The loop's next steps (skip the weight push, checkpoint, leave) hold collectives, so ranks that
        decided on their own would wait for each other forever. One all-gather of a bool per call, about
        a millisecond at 8×H100 (none at one rank).
        """
        from pipeline.parallel.rendezvous import all_gather_objects

        return any(all_gather_objects(self.received is not None, world_size=world_size))

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@dataclass(slots=True)
class PreparedStep:
    """One step's prompts and graded samples, ready for its update.

    With ``rollout.max_staleness=1`` the loop prepares step t+1's (filter, budgets, then
    generation and grading on a worker thread) while step t updates, and a checkpoint
    written between them holds it (``to_state``): its samples were generated with weights
    the checkpointed actor no longer has, so they are kept, not regenerated.
    """

    step: int
    seed: int
    temperature: float  # generated at it, and trained at it
    num_candidates: int  # prompts the filter saw
    selected: SelectedPrompts
    sampled: Sampled
    metrics: dict[str, float]  # the filter's, the budget's and the sampler's
    epoch_ended: bool  # a draw for this step completed a pass over the data
    generate_seconds: float = 0.0  # wall time of its generation and grading (not checkpointed)

    PREFIX = "in_flight"

    def to_state(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """(JSON, tensors named ``in_flight.*``) for the checkpoint."""
        selected = self.selected
        tensors = {f"{self.PREFIX}.selected.indices": selected.indices.clone(),
                   f"{self.PREFIX}.selected.dropped": selected.dropped.clone()}
        if selected.predicted_pass_rate is not None:
            tensors[f"{self.PREFIX}.selected.predicted_pass_rate"] = selected.predicted_pass_rate.clone()
        state = {"step": self.step, "seed": self.seed, "temperature": self.temperature,
                 "num_candidates": self.num_candidates, "metrics": {k: float(v) for k, v in self.metrics.items()},
                 "sampler_metrics": {k: float(v) for k, v in self.sampled.metrics.items()},
                 "epoch_ended": self.epoch_ended}
        for part in ("pool", "train", "baseline"):
            state[part], part_tensors = getattr(self.sampled, part).to_state(f"{self.PREFIX}.{part}")
            tensors.update(part_tensors)
        return state, tensors

    @classmethod
    def from_state(cls, state: dict[str, Any], tensors: dict[str, torch.Tensor]) -> PreparedStep:
        prefix = cls.PREFIX
        parts = {part: RolloutBatch.from_state(state[part], tensors, f"{prefix}.{part}")
                 for part in ("pool", "train", "baseline")}
        selected = SelectedPrompts(tensors[f"{prefix}.selected.indices"].clone(),
                                   tensors.get(f"{prefix}.selected.predicted_pass_rate"),
                                   tensors[f"{prefix}.selected.dropped"].clone())
        return cls(step=int(state["step"]), seed=int(state["seed"]), temperature=float(state["temperature"]),
                   num_candidates=int(state["num_candidates"]), selected=selected,
                   sampled=Sampled(**parts, metrics=dict(state["sampler_metrics"])), metrics=dict(state["metrics"]),
                   epoch_ended=bool(state["epoch_ended"]))


@dataclass(slots=True)
class Run:
    cfg: RLConfig
    context: Any
    actor: Actor
    reference: Actor | None  # frozen initial policy for the KL term, when algorithm.kl_coef > 0
    engine: Any  # the rollout backend's trainer_engine on global rank 0; None on every other rank
    # The grading pool: only where grading happens, global rank 0 (it grades every rollout and the
    # held-out evaluation; the other ranks receive the graded samples). reward.num_workers
    # processes: 32 per rank would be 512 idle processes on 2 × 8 GPUs.
    pool: Any  # None on every other rank
    tokenizer: Any
    pad_token_id: int  # the tokenizer's pad, else its EOS (Llama 3 has no pad token)
    stop_token_ids: tuple[int, ...]  # the model's generation_config EOS ids + the tokenizer's EOS
    prompts: list[Prompt]
    prompt_token_ids: list[list[int]]
    eval_prompts: list[Prompt]
    methods: Methods
    sampling: Sampling
    stream: PromptStream
    stats: PromptStatsStore
    ledger: Ledger
    checkpoints: CheckpointManager
    writer: MetricsWriter | None
    start_step: int
    output_dir: Path
    consecutive_skipped: int = 0  # steps skipped in a row for non-finite gradients
    # Where each step's batch comes from (``pipeline/rl/batches.py``), built with the run by ``setup_run``;
    # it checkpoints what it holds (a batch generated ahead) with the run.
    batches: BatchSource | None = None
    # The metrics row of a scored step a stop checkpointed before its weights reached the engine: the
    # resumed run pushes them, scores the held-out set and logs the row (``pipeline.stages.rl``).
    row_awaiting_eval: dict[str, Any] | None = None
    # The step FLOPs, cumulative (``pipeline.rl.step.count_step_flops``), checkpointed with the run.
    flops: FlopCounter = field(default_factory=FlopCounter)

    def state(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """JSON state and tensors of everything but the actor (which the manager saves itself)."""
        stats = self.stats.state_dict()
        sampling_state, sampling_tensors = self.sampling.state()
        state = {
            "stream": self.stream.state_dict(),
            "ledger": self.ledger.state_dict(),
            "methods": self.methods.state_dict(),
            "sampling": sampling_state,
            "stats_meta": stats["meta"],
            "consecutive_skipped": self.consecutive_skipped,
            "flops": self.flops.state_dict(),
        }
        batch_state, batch_tensors = self.batches.state()
        state.update(batch_state)
        if self.row_awaiting_eval is not None:
            state["row_awaiting_eval"] = dict(self.row_awaiting_eval)
        return state, {**{f"stats.{k}": v for k, v in stats["tensors"].items()}, **sampling_tensors,
                       **batch_tensors}

    def load_state(self, state: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        self.stream.load_state_dict(state["stream"])
        self.ledger.load_state_dict(state["ledger"])
        self.methods.load_state_dict(state["methods"])
        stats_tensors = {k.removeprefix("stats."): v for k, v in tensors.items() if k.startswith("stats.")}
        self.stats.load_state_dict({"meta": state["stats_meta"], "tensors": stats_tensors})
        self.sampling.load_state(state["sampling"], tensors)
        self.consecutive_skipped = int(state["consecutive_skipped"])
        self.batches.load_state(state, tensors)
        self.row_awaiting_eval = state.get("row_awaiting_eval")
        self.flops.load_state_dict(state.get("flops"))  # None: a checkpoint saved before the count


@dataclass(frozen=True, slots=True)
class InitialPolicy:
    spec: ModelSpec
    weights: Path  # a verified winnow checkpoint step directory
    tokenizer_dir: Path


def seed_stats_from_curation(stats: PromptStatsStore, curation, *, source: str) -> None:
    """Record a curation's measured pass rates (``prompt_ids``, ``pass_rates``, ``num_samples``) for the
    training prompts it sampled; ``source`` names it in the error when it measured none of them."""
    known = set(stats.prompt_ids)
    rows = [i for i, prompt_id in enumerate(curation.prompt_ids) if prompt_id in known and curation.num_samples[i] > 0]
    if not rows:
        raise ValueError(f"curation_dir: {source} measured none of the {stats.num_prompts} training prompts "
                         "(is data.train the curation's kept.jsonl?)")
    stats.seed_from_curation(prompt_ids=[curation.prompt_ids[i] for i in rows],
                             pass_rates=torch.from_numpy(curation.pass_rates[rows]),
                             num_samples=torch.from_numpy(curation.num_samples[rows]))


def load_eval_prompts(cfg: RLConfig) -> list[Prompt]:
    """The held-out set: a benchmark's or synthetic source's test split (unless the spec names a
    split), a file whole; ``eval_limit`` keeps a random subset drawn with ``seed``."""
    parsed = parse_spec(cfg.eval_set)
    split = None if parsed.kind == "file" or parsed.split is not None else "test"
    prompts, _ = load_prompts(cfg.eval_set, split=split, limit=cfg.eval_limit, seed=cfg.seed,
                              shuffle=cfg.eval_limit is not None)
    return prompts


def setup_run(cfg: RLConfig, *, policy: InitialPolicy, context, batch_source: Callable[[Run], BatchSource],
              curation=None) -> Run:
    """Build the run (actor, engine, data, methods, statistics) and resume it from its newest checkpoint.

    ``batch_source``: builds the run's batch source from the run (``pipeline.rl.batches.build_batch_source``,
    which this floor cannot import: it builds on the run); it is built before the resume, which
    restores what it holds. ``curation``: a loaded curation (``prompt_ids``, ``pass_rates``,
    ``num_samples``) whose pass rates seed the statistics store before any method reads it
    (``cfg.curation_dir``). The methods are built from ``cfg`` exactly as saved in the run folder.
    """
    from pipeline.rewards import GradingPool

    output_dir = Path(cfg.logging.output_dir)
    if context.rank == 0:
        configlib.save_resolved(cfg, output_dir)
    tokenizer = load_tokenizer(policy.tokenizer_dir)
    spec = policy.spec
    checkpoints = CheckpointManager(cfg.checkpoint.directory, keep_last=cfg.checkpoint.keep_last,
                                    rank=context.rank, world_size=context.world_size)
    resume_from = checkpoints.newest_valid() if cfg.checkpoint.resume != "never" else None
    if cfg.checkpoint.resume == "must" and resume_from is None:
        raise FileNotFoundError(f"checkpoint.resume=must but no valid checkpoint under {cfg.checkpoint.directory}")
    if resume_from is not None:  # a layout this checkpoint cannot take is refused before anything is built
        distributed = cfg.trainer.distributed_optimizer
        check_resume_layout(resume_from, tensor_parallel=context.tensor_parallel,
                            pipeline_parallel=context.pipeline_parallel, data_parallel=context.data_parallel,
                            distributed_optimizer=context.data_parallel > 1 if distributed is None else distributed)
    actor = Actor(spec=spec, context=context, trainer=cfg.trainer, optim=cfg.optim, seed=cfg.seed)

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
    eval_prompts = load_eval_prompts(cfg)
    stats = PromptStatsStore([p.id for p in prompts], ema_decay=cfg.algorithm.ada_est.ema_decay)
    if curation is not None:
        seed_stats_from_curation(stats, curation, source=str(cfg.curation_dir))
    # The rank that samples (the engine's, below) runs the methods' own models (DEPO's estimator) on its
    # device (its GPU under NCCL, the CPU under gloo) and broadcasts their decisions to the other ranks.
    setting = MethodSetting(total_steps=cfg.steps, group_size=cfg.group_size, temperature=cfg.temperature,
                            vocab_size=spec.vocab_size, max_new_tokens=cfg.max_new_tokens,
                            texts=[p.problem for p in prompts], stats=stats, seed=cfg.seed,
                            is_sampling_rank=context.rank == 0, sampling_device=context.device,
                            broadcast_from_sampling_rank=partial(broadcast_from_rank0, world_size=context.world_size))
    methods = build_methods(cfg.algorithm, setting)
    sampling = build_sampling(cfg.algorithm, setting)
    reference = None
    if cfg.algorithm.kl_coef > 0:
        reference = Actor(spec=spec, context=context, trainer=cfg.trainer, optim=None, seed=cfg.seed)
        load_weights(policy.weights, reference.module)
    # Only global rank 0 drives the engine; the other ranks receive its graded samples.
    engine = rollout_backend(cfg.rollout.engine).trainer_engine(
        cfg.rollout, spec=spec, tokenizer=tokenizer, tokenizer_dir=policy.tokenizer_dir) if context.rank == 0 else None
    run = Run(
        cfg=cfg, context=context, actor=actor, reference=reference, engine=engine,
        pool=GradingPool(**cfg.reward.pool_kwargs()) if context.rank == 0 else None, tokenizer=tokenizer, pad_token_id=pad_token_id(tokenizer),
        stop_token_ids=stop_token_ids(tokenizer, folders=[policy.tokenizer_dir]), prompts=prompts,
        prompt_token_ids=encoded_prompts, eval_prompts=eval_prompts, methods=methods, sampling=sampling,
        stream=PromptStream(len(prompts), seed=cfg.seed), stats=stats,
        ledger=Ledger(), checkpoints=checkpoints, writer=None, start_step=0, output_dir=output_dir,
    )
    run.batches = batch_source(run)
    if resume_from is not None:
        loaded = checkpoints.load(resume_from, actor=actor)
        run.load_state(loaded.state, loaded.tensors)
        run.start_step = loaded.step
        logger.info("resumed from %s at step %d", resume_from, loaded.step)
    else:
        load_weights(policy.weights, actor.module)
    if context.rank == 0:
        run.writer = MetricsWriter(output_dir, trackers=cfg.logging.trackers, run_config=configlib.to_dict(cfg),
                                   resume_from_step=run.start_step if resume_from is not None else None)
    return run
