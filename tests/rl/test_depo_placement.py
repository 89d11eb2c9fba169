"""Where DEPO's estimator runs: on the rank that samples only, its decisions broadcast to every rank.

A rank that does not sample builds no estimator, never scores or trains one, checkpoints nothing
of it and ignores the sampling rank's state on load; both ranks of a two-rank run act on the same
selections, which equal a one-rank run's, and a resume from the sampling rank's checkpoint is exact.
The estimator's dropout draws from a stream of its own, so where it runs does not move the actor's
random streams.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from pipeline import configlib
from pipeline.config import AlgorithmConfig
from pipeline.errors import CheckpointError
from pipeline.estimator.model import DifficultyEstimator
from pipeline.estimator.online import OnlineEstimator
from pipeline.rl.registry import MethodSetting, StepEnd
from pipeline.rl.sampling import DepoFilter
from pipeline.stats.store import PromptStatsStore
from tests.distributed_utils import run_distributed
from tests.estimator.digits import one_thread  # noqa: F401 (a fixture)
from tests.rl.test_depo_filter import _checkpoint_round_trip, digits_pool, rollout_batch

pytestmark = pytest.mark.usefixtures("one_thread")

GROUP_SIZE = 8
BATCH_SIZE = 8
NUM_PROMPTS = 96
# Drops start at step 2; audits roll some would-be drops out anyway.
SETTINGS = {"warmup_steps": 2, "audit_fraction": 0.3, "threshold": 0.2, "replay_size": 64, "calibration_window": 32}
DECISION = ("indices", "predicted", "dropped", "metrics")


def build_filter(texts: list[str], **placement) -> DepoFilter:
    cfg = AlgorithmConfig(prompt_filter="depo")
    cfg.depo = configlib.from_dict(type(cfg.depo), {**configlib.to_dict(cfg.depo), **SETTINGS})
    stats = PromptStatsStore([f"p{i}" for i in range(len(texts))])
    return DepoFilter(cfg, MethodSetting(total_steps=100, group_size=GROUP_SIZE, temperature=1.0, texts=texts,
                                         stats=stats, seed=0, **placement))


def run_steps(depo: DepoFilter, rates: torch.Tensor, steps: range) -> list[dict]:
    """Filter, roll out (a seeded Bernoulli policy) and update, as the RL loop does; one row per step."""
    rows = []
    for step in steps:
        generator = torch.Generator().manual_seed(1000 + step)
        candidates = torch.randperm(rates.numel(), generator=generator)[: depo.num_candidates(BATCH_SIZE)]
        selected, metrics = depo(candidates, batch_size=BATCH_SIZE, step=step)
        outcomes = (torch.rand(selected.indices.numel(), GROUP_SIZE, generator=generator, dtype=torch.float64)
                    < rates[selected.indices][:, None]).double()
        learned = depo.update(StepEnd(step=step, mean_entropy=1.0, epoch_ended=False,
                                      pool=rollout_batch(selected.indices, outcomes), selected=selected,
                                      question_logprobs=None))
        rows.append({"indices": selected.indices.tolist(), "predicted": selected.predicted_pass_rate.tolist(),
                     "dropped": selected.dropped.tolist(), "metrics": metrics, "learned": learned,
                     "stats": depo.stats.column("estimator_prediction").nan_to_num(-1.0).tolist()})
    return rows


# ================================================================ one process, the placement injected


def test_a_filter_on_a_rank_that_does_not_sample_never_builds_or_runs_an_estimator(tmp_path, monkeypatch):
    texts, rates = digits_pool(NUM_PROMPTS)
    sent: list = []
    sender = build_filter(texts, broadcast_from_sampling_rank=lambda decision: sent.append(decision) or decision)
    expected = run_steps(sender, rates, range(4))
    assert all(decision is not None for decision in sent) and len(sent) == 4
    assert any(row["dropped"] for row in expected)  # the steps after warm-up drop prompts
    state = _checkpoint_round_trip(sender, tmp_path)

    def refuse(*args, **kwargs):
        raise AssertionError("a rank that does not sample touched an estimator")

    for name in ("__init__", "predict", "learn", "state_dict", "load_state_dict"):
        monkeypatch.setattr(OnlineEstimator, name, refuse)
    monkeypatch.setattr(DifficultyEstimator, "__init__", refuse)
    decisions = iter(sent)

    def receive(decision):
        assert decision is None, "a rank that does not sample sent a decision"
        return next(decisions)

    receiver = build_filter(texts, is_sampling_rank=False, broadcast_from_sampling_rank=receive)
    assert receiver.online is None and receiver.trainer is None
    received = run_steps(receiver, rates, range(4))
    for mine, theirs in zip(received, expected, strict=True):
        assert {key: mine[key] for key in DECISION} == {key: theirs[key] for key in DECISION}
        assert mine["stats"] == theirs["stats"]  # the same statistics store on every rank
        assert mine["learned"] == {} and theirs["learned"]["estimator/num_updates"] > 0
    assert receiver.state_dict() == {"tensors": {}, "json": {}}
    receiver.load_state_dict(state)  # the sampling rank's checkpoint: read, and ignored
    old = {key: value for key, value in state["json"].items() if key not in ("replay", "calibration")}
    with pytest.raises(CheckpointError, match="replay buffer"):  # an old one is refused on every rank alike
        receiver.load_state_dict({"tensors": state["tensors"], "json": old})


def test_the_estimator_is_built_on_the_cpu_then_moved_to_the_sampling_device(monkeypatch):
    moved = []
    original = DifficultyEstimator.to
    monkeypatch.setattr(DifficultyEstimator, "to",
                        lambda self, device: (moved.append((device, self.device)), original(self, device))[1])
    build_filter(["a", "bb"], sampling_device=torch.device("cpu", 0))
    assert moved == [(torch.device("cpu", 0), torch.device("cpu"))]  # once, from where it was seeded and built


def test_training_the_estimator_leaves_the_process_random_streams_alone():
    """Dropout draws from (seed, step), not from the actor's generators: only rank 0 trains the estimator, and
    megatron needs the default generators equal on every tensor-parallel rank."""
    texts, rates = digits_pool(NUM_PROMPTS)
    first, second = build_filter(texts), build_filter(texts)
    torch.manual_seed(1)
    before = torch.get_rng_state()
    first_rows = run_steps(first, rates, range(3))
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(2)  # another position of the actor's stream: the same estimator
    second_rows = run_steps(second, rates, range(3))
    assert [row["learned"] for row in first_rows] == [row["learned"] for row in second_rows]
    for name, tensor in first.trainer.model.state_dict().items():
        assert torch.equal(second.trainer.model.state_dict()[name], tensor), name


# ================================================================ two gloo ranks


def _two_rank_worker(rank, world_size, directory):
    import torch.distributed as dist

    from pipeline.parallel.rendezvous import broadcast_from_rank0

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    built = []
    original_init = OnlineEstimator.__init__

    def counting_init(self, *args, **kwargs):
        built.append(rank)
        original_init(self, *args, **kwargs)

    OnlineEstimator.__init__ = counting_init
    try:
        texts, rates = digits_pool(NUM_PROMPTS)
        # The placement setup_run gives every rank (pipeline/rl/setup.py).
        placement = {"is_sampling_rank": rank == 0, "sampling_device": torch.device("cpu"),
                     "broadcast_from_sampling_rank": partial(broadcast_from_rank0, world_size=world_size)}
        straight = build_filter(texts, **placement)
        rows = run_steps(straight, rates, range(5))
        # A run stopped after step 2 and resumed: the checkpoint holds rank 0's state, every rank reads it.
        stopped = build_filter(texts, **placement)
        run_steps(stopped, rates, range(3))
        if rank == 0:
            _checkpoint_round_trip(stopped, directory)
        dist.barrier()
        resumed = build_filter(texts, **placement)
        resumed.load_state_dict(_read_state(directory))
        resumed_rows = run_steps(resumed, rates, range(3, 5))
        weights = ({name: tensor.clone() for name, tensor in resumed.trainer.model.state_dict().items()}
                   if rank == 0 else None)
        straight_weights = ({name: tensor.clone() for name, tensor in straight.trainer.model.state_dict().items()}
                            if rank == 0 else None)
    finally:
        OnlineEstimator.__init__ = original_init
        dist.destroy_process_group()
    return {"built": len(built), "rows": rows, "resumed_rows": resumed_rows, "weights": weights,
            "straight_weights": straight_weights}


def _read_state(directory) -> dict:
    import json

    from safetensors.torch import load_file

    return {"tensors": load_file(str(directory / "t.st")), "json": json.loads((directory / "s.json").read_text())}


@pytest.mark.distributed
def test_two_ranks_act_on_rank_0s_decisions_and_match_one_rank(tmp_path):
    texts, rates = digits_pool(NUM_PROMPTS)
    single = run_steps(build_filter(texts), rates, range(5))
    ranks = run_distributed(_two_rank_worker, world_size=2, args=(tmp_path,), timeout_s=120.0)
    assert [rank["built"] for rank in ranks] == [3, 0]  # straight, stopped, resumed: on rank 0 only
    for step, (zero, one, alone) in enumerate(zip(ranks[0]["rows"], ranks[1]["rows"], single, strict=True)):
        assert {key: zero[key] for key in DECISION} == {key: one[key] for key in DECISION} == \
            {key: alone[key] for key in DECISION}, step
        assert zero["stats"] == one["stats"] == alone["stats"], step
        assert zero["learned"] == alone["learned"] and one["learned"] == {}, step
    for rank in ranks:  # resumed from rank 0's checkpoint: steps 3 and 4 as in the uninterrupted run
        assert [{key: row[key] for key in DECISION} for row in rank["resumed_rows"]] == \
            [{key: row[key] for key in DECISION} for row in rank["rows"][3:]]
    for name, tensor in ranks[0]["straight_weights"].items():
        assert torch.equal(ranks[0]["weights"][name], tensor), name


# ================================================================ the RL loop, one rank and two

# Generating ahead (rollout.max_staleness=1): the filter runs on the main thread while rank 0's worker
# thread is idle, between the push and the launch, and its broadcast must meet the other ranks there.
DEPO_LOOP = ["algorithm.prompt_filter=depo", "algorithm.depo.warmup_steps=2", "algorithm.depo.threshold=0.3",
             "rollout.max_staleness=1"]
EXACT = ("depo/filter_active", "depo/replay_entries", "estimator/num_updates", "flops/estimator",
         "tokens/estimator", "flops/cumulative/estimator")


def _loop_worker(rank, world_size, tmp, cache):
    from pipeline.metrics import read_metrics
    from pipeline.parallel.context import ParallelContext
    from pipeline.stages.rl import run_rl
    from tests.rl.test_rl_loop import _config

    cfg = _config(tmp, [f"bootstrap.cache_dir={cache}", *DEPO_LOOP])
    context = ParallelContext.initialize(tensor_parallel=1, pipeline_parallel=1, seed=cfg.seed)
    devices = []
    original_init = OnlineEstimator.__init__

    def recording_init(self, trainer, *args, **kwargs):
        devices.append(str(trainer.model.device))
        original_init(self, trainer, *args, **kwargs)

    OnlineEstimator.__init__ = recording_init
    try:
        run_rl(cfg, context=context)
    finally:
        OnlineEstimator.__init__ = original_init
    return {"estimators": devices, "rows": read_metrics(f"{tmp}/run/metrics.jsonl") if rank == 0 else None}


@pytest.mark.slow
@pytest.mark.distributed
def test_a_two_rank_depo_run_logs_the_one_rank_runs_filter_and_estimator(tmp_path, bootstrap_cache_dir):
    cache = str(bootstrap_cache_dir)
    single = run_distributed(_loop_worker, world_size=1, args=(str(tmp_path / "one"), cache), timeout_s=600.0)[0]
    ranks = run_distributed(_loop_worker, world_size=2, args=(str(tmp_path / "two"), cache), timeout_s=600.0)
    assert single["estimators"] == ["cpu"] and [rank["estimators"] for rank in ranks] == [["cpu"], []]
    rows_single, rows = single["rows"], ranks[0]["rows"]
    assert [row["step"] for row in rows] == [row["step"] for row in rows_single] == [0, 1, 2, 3, 4]
    assert [row["depo/filter_active"] for row in rows[1:]] == [0.0, 0.0, 1.0, 1.0]
    for one, two in zip(rows_single[1:], rows[1:], strict=True):
        # The same prompts filtered, rolled out and learned from; the estimator charged once a step, not per rank.
        assert {key: two[key] for key in EXACT} == {key: one[key] for key in EXACT}, two["step"]
        assert two["reward_mean"] == one["reward_mean"] and two["filter_ratio"] == one["filter_ratio"], two["step"]
        for key in [key for key in one if key.startswith(("depo/", "estimator/"))]:
            # The actor's question log-probs (L_distill's target) under data parallelism: fp32 summation order.
            assert two[key] == pytest.approx(one[key], rel=1e-3, abs=1e-6, nan_ok=True), (two["step"], key)
