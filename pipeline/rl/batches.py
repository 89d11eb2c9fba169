"""Where each step's batch comes from: the loop's one choice about staleness, made once per run.

``BATCH_SOURCES`` holds one entry per ``rollout.max_staleness`` mode (``staleness_mode``), built
once by ``setup_run`` with the run, and the loop (``pipeline/stages/rl.py``) calls it at the same
points whatever the mode:

``now``    (``max_staleness=0``) the step filters, budgets and generates its own batch with the
           current weights, updates, then pushes the new weights to the engine.
``ahead``  (``max_staleness=1``) step t+1's batch is generated while step t updates, with the
           weights one update old; the push happens at the start of the next step, after the batch
           in flight is complete, and a checkpoint holds that batch (docs/rl.md, One-step-off-policy
           rollouts).

Every call is collective, made at the same points of the loop on every rank:

``start()``                    once, after the engine holds the weights the run starts from;
``prepare(step, timer)``       the step's ``PreparedStep`` (timed as the step's phases);
``updated(version, timer)``    the update is done and no stop was asked for: weights ``version``
                               are the actor's;
``before_scoring(version)``    the held-out set is scored next, on weights ``version``;
``metrics(prepared)``          the source's columns of the step's row;
``complete()``                 a checkpoint is written next: nothing may be half-generated;
``state()`` / ``load_state()`` what the checkpoint holds of the source (the batch in flight);
``close()``                    at the end of the run, on success or error.
"""

from __future__ import annotations

import abc
from typing import Any

import torch

from pipeline.config import RLConfig
from pipeline.parallel.rendezvous import broadcast_from_rank0
from pipeline.rl.registry import Registry
from pipeline.rl.setup import PreparedStep, Run
from pipeline.rl.step import PhaseTimer, StepPlan, generate_and_grade_on_rank0, plan_step, sample_step
from pipeline.rollout.weight_sync import sync_actor_to_engine

BATCH_SOURCES = Registry("batch source")

# rollout.max_staleness → the BATCH_SOURCES entry that generates at that staleness.
STALENESS_MODES: tuple[str, ...] = ("now", "ahead")


def staleness_mode(max_staleness: int) -> str:
    """The ``BATCH_SOURCES`` name of ``rollout.max_staleness`` (the config bounds it to the modes)."""
    return STALENESS_MODES[max_staleness]


def build_batch_source(run: Run) -> BatchSource:
    """The run's batch source, chosen by ``run.cfg.rollout.max_staleness``."""
    return BATCH_SOURCES.build(staleness_mode(run.cfg.rollout.max_staleness), run.cfg, run)


class BatchSource(abc.ABC):
    """Base of every ``BATCH_SOURCES`` entry; the calls the loop makes (module docstring)."""

    def __init__(self, cfg: RLConfig, run: Run) -> None:
        self.cfg, self.run = cfg, run

    def start(self) -> None:
        return None

    @abc.abstractmethod
    def prepare(self, step: int, timer: PhaseTimer) -> PreparedStep:
        """The step's plan and its graded batch (generated now, or taken from the one generated ahead)."""

    def updated(self, *, version: int, timer: PhaseTimer) -> None:  # noqa: ARG002 - a source may wait
        return None

    def before_scoring(self, *, version: int) -> None:  # noqa: ARG002 - the engine may hold them already
        return None

    def metrics(self, prepared: PreparedStep) -> dict[str, float]:  # noqa: ARG002
        return {}

    def complete(self) -> None:
        return None

    def state(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return {}, {}

    def load_state(self, state: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:  # noqa: ARG002
        return None

    def close(self) -> None:
        return None


@BATCH_SOURCES.register("now")
class GenerateNow(BatchSource):
    """``max_staleness=0``: generate the step's batch with the current weights, update, push the new ones."""

    def prepare(self, step: int, timer: PhaseTimer) -> PreparedStep:
        with timer("filter"):
            plan = plan_step(self.run, step)
        with timer("generate_and_grade"):
            return sample_step(self.run, plan)

    def updated(self, *, version: int, timer: PhaseTimer) -> None:
        with timer("sync"):
            sync_actor_to_engine(self.run.actor, self.run.engine, version=version)

    def load_state(self, state: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:  # noqa: ARG002
        if GenerateAhead.STATE_KEY in state:
            # Its prompts were drawn from the stream already: dropping it would skip them.
            raise ValueError(f"rollout.max_staleness: the checkpoint holds step "
                             f"{state[GenerateAhead.STATE_KEY]['step']}'s batch, generated ahead of its update; "
                             "resume it with rollout.max_staleness=1")


@BATCH_SOURCES.register("ahead")
class GenerateAhead(BatchSource):
    """``max_staleness=1``: step t+1's batch is generated while step t updates.

    Global rank 0 runs the sampler (its rounds, its grading) on one worker thread, against
    the engine in its own process; every rank plans the step (filter, budgets) on its main
    thread, and the finished batch reaches the other ranks, with the stream position the
    sampler's extra draws left, at ``collect``. Planning holds a collective (DEPO's decision,
    made on rank 0, is broadcast by the filter), so every rank plans at the same point: after
    the push, which collects first, so no worker runs then and the worker itself makes no
    collective call. The worker's only shared state is the prompt stream (DAPO's top-up draws)
    and the grading pool, which the loop leaves alone until ``collect``. The
    engine's weights change only in ``push``, which first collects, so a batch is generated
    with one version from its first round to its last; the loop pushes the actor's weights
    right before launching the next batch, so that version is one update behind the step
    that trains on it (the first step after a start, launched and collected at once, is on
    policy).

    The batch in flight is held on every rank after ``collect`` and written by every
    checkpoint (``PreparedStep.to_state``): token ids, engine log-probs and decoded texts,
    about 16 bytes a generated token, so at most about 70 MB of CPU memory per rank at 7B on
    8×H100 with 128 prompts × 8 samples × 4,096 new tokens, broadcast from rank 0 once a step
    (about a second, next to the update it overlaps).
    """

    STATE_KEY = "in_flight"

    def __init__(self, cfg: RLConfig, run: Run) -> None:
        super().__init__(cfg, run)
        self.worker = None
        self.future = None
        self.version: int | None = None  # the weight version the engine holds, known from ``start``
        self.in_flight: PreparedStep | None = None  # the next step's batch, complete

    def start(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        run = self.run
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-ahead") \
            if run.context.rank == 0 else None
        version = run.engine.weight_version if run.engine is not None else None
        self.version = broadcast_from_rank0(version, world_size=run.context.world_size)

    def prepare(self, step: int, timer: PhaseTimer) -> PreparedStep:
        with timer("generate_wait"):
            prepared = self.take(step)
        with timer("sync"):
            self.push(version=step + 1)
        if step + 1 < self.cfg.steps:
            with timer("filter"):
                self.launch(plan_step(self.run, step + 1))
        return prepared

    def before_scoring(self, *, version: int) -> None:
        self.push(version=version)  # score this step's weights, not the ones generating ahead

    def metrics(self, prepared: PreparedStep) -> dict[str, float]:
        # It overlapped the previous step: not one of this step's phases.
        return {"time/generate_ahead": prepared.generate_seconds}

    def complete(self) -> None:
        self.collect()  # the checkpoint holds the next step's batch, complete

    def state(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        if self.in_flight is None:
            return {}, {}
        state, tensors = self.in_flight.to_state()
        return {self.STATE_KEY: state}, tensors

    def load_state(self, state: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        if self.STATE_KEY in state:
            self.in_flight = PreparedStep.from_state(state[self.STATE_KEY], tensors)

    def launch(self, plan: StepPlan) -> None:
        """Start generating ``plan``'s step with the engine's current weights."""
        assert self.future is None and self.in_flight is None, "one batch in flight at a time"
        self.future = self.worker.submit(sample_step, self.run, plan, generate=generate_and_grade_on_rank0) \
            if self.worker is not None else plan

    def collect(self) -> None:
        """Wait for the batch in flight (if any) and hand it, with the stream position, to every rank."""
        if self.future is None:
            return
        future, self.future = self.future, None
        payload = (future.result(), self.run.stream.state_dict()) if self.worker is not None else None
        prepared, stream = broadcast_from_rank0(payload, world_size=self.run.context.world_size)
        self.run.stream.load_state_dict(stream)
        self.in_flight = prepared

    def take(self, step: int) -> PreparedStep:
        """Step ``step``'s batch: collected, loaded from the checkpoint, or (nothing in flight) generated now."""
        self.collect()
        if self.in_flight is None:
            self.launch(plan_step(self.run, step))
            self.collect()
        prepared, self.in_flight = self.in_flight, None
        assert prepared.step == step, (prepared.step, step)
        return prepared

    def push(self, *, version: int) -> None:
        """The actor's weights to the engine as ``version``, after the batch in flight is complete."""
        self.collect()
        if self.version < version:
            sync_actor_to_engine(self.run.actor, self.run.engine, version=version)
            self.version = version

    def close(self) -> None:
        if self.worker is not None:
            self.worker.shutdown(wait=True, cancel_futures=True)
        if self.run.engine is not None:
            self.run.engine.close()
