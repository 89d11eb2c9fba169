"""Resuming under another layout: exact where megatron can reshard, refused from the manifest where it cannot.

The distributed optimizer's ``dp_reshardable`` state is saved at DP=2 and loaded at DP=1 and 4:
weights, fp32 master weights, Adam moments and step come back bit for bit (assembled per
parameter from every rank's shard, here in the test process: a few KB for the tiny model). A
TP/PP change with that optimizer, or a change of optimizer kind, is refused before any tensor is
read, with one ``error:`` line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from tests.distributed_utils import run_distributed
from tests.trainer.test_actor import SEED, _batch, _spec

SAVED_LAYOUT = {"tensor_parallel": 1, "pipeline_parallel": 1, "data_parallel": 2}
DISTRIBUTED = {"distributed": True, "sharding_type": "dp_reshardable"}
REGULAR = {"distributed": False}


def _actor(tp: int, pp: int, *, precision: str, distributed_optimizer: bool | None):
    from pipeline.config import OptimConfig, TrainerConfig
    from pipeline.parallel.context import ParallelContext
    from pipeline.trainer.actor import Actor

    context = ParallelContext.initialize(tensor_parallel=tp, pipeline_parallel=pp, seed=SEED)
    trainer = TrainerConfig(micro_batch_tokens=36, logprob_chunk_size=16, precision=precision,
                            distributed_optimizer=distributed_optimizer)
    return Actor(spec=_spec(), context=context, trainer=trainer, optim=OptimConfig(lr=1e-2), seed=SEED)


def _weights(actor) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in actor.module.state_dict().items() if not k.endswith("_extra_state")}


def _optimizer_shards(actor) -> list[tuple[str, int, int, dict[str, torch.Tensor]]]:
    """This rank's (parameter name, flat start, flat end, {fp32 master "param", exp_avg, exp_avg_sq, step})."""
    names = {id(parameter): name for name, parameter in actor.module.named_parameters()}
    shards = []
    for inner in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        for buffer_ranges in inner.gbuf_ranges:
            for bucket_ranges in buffer_ranges.values():
                for bucket in bucket_ranges:
                    for model_param, ranges in bucket["param_map"].items():
                        tensors = inner._get_main_param_and_optimizer_states(model_param)
                        shards.append((names[id(model_param)], ranges["param"].start, ranges["param"].end,
                                       {key: value.detach().clone() for key, value in tensors.items()}))
    return shards


def _state(actor) -> dict:
    return {"shards": _optimizer_shards(actor), "weights": _weights(actor), "schedule": actor.schedule.state_dict()}


def _next_step(actor) -> dict:
    from pipeline.trainer.losses import CrossEntropyLoss

    result = actor.train_step(_batch(), CrossEntropyLoss())
    return {"loss": result.loss, "grad_norm": result.grad_norm}


def _save_worker(rank, world_size, precision, directory):
    from pipeline.checkpoint.manager import CheckpointManager
    from pipeline.trainer.losses import CrossEntropyLoss

    actor = _actor(1, 1, precision=precision, distributed_optimizer=True)
    for _ in range(2):
        actor.train_step(_batch(), CrossEntropyLoss())
    CheckpointManager(directory, keep_last=3, rank=rank, world_size=world_size).save(2, actor=actor)
    return {**_state(actor), **_next_step(actor)}  # the uninterrupted run goes on


def _load_worker(rank, world_size, precision, directory):
    from pipeline.checkpoint.manager import CheckpointManager

    actor = _actor(1, 1, precision=precision, distributed_optimizer=True)
    manager = CheckpointManager(directory, keep_last=3, rank=rank, world_size=world_size)
    manager.load(manager.newest_valid(), actor=actor)
    return {**_state(actor), **_next_step(actor)}


def _assemble(results: list[dict]) -> dict[tuple[str, str], torch.Tensor]:
    """Every parameter's whole flat optimizer tensors, from the ranks' shards; each shard must tile it exactly."""
    pieces: dict[tuple[str, str], list[tuple[int, int, torch.Tensor]]] = {}
    for result in results:
        for name, start, end, tensors in result["shards"]:
            for key, value in tensors.items():
                if key == "step":  # one scalar per parameter on every rank holding part of it
                    pieces.setdefault((name, key), []).append((0, 1, value.reshape(1)))
                else:
                    pieces.setdefault((name, key), []).append((start, end, value))
    whole = {}
    for (name, key), parts in pieces.items():
        parts.sort(key=lambda part: part[0])
        if key == "step":
            assert all(torch.equal(part[2], parts[0][2]) for part in parts), (name, parts)
            whole[(name, key)] = parts[0][2]
            continue
        ends = [0] + [end for _, end, _ in parts[:-1]]
        assert [start for start, _, _ in parts] == ends, f"{name}.{key}: shards {[(s, e) for s, e, _ in parts]}"
        whole[(name, key)] = torch.cat([tensor for _, _, tensor in parts])
    return whole


@pytest.fixture(scope="module")
def saved_at_dp2(tmp_path_factory):
    """``saved(precision)``: a checkpoint of the distributed optimizer at TP=1, PP=1, DP=2 after two steps,
    with every rank's state at the save and the uninterrupted run's next step; each precision saved once."""
    saved: dict[str, tuple[Path, list[dict]]] = {}

    def save_once(precision: str) -> tuple[Path, list[dict]]:
        if precision not in saved:
            directory = tmp_path_factory.mktemp(f"dp2-{precision}")
            saved[precision] = directory, run_distributed(_save_worker, world_size=2, args=(precision, str(directory)))
        return saved[precision]

    return save_once


@pytest.mark.distributed
@pytest.mark.parametrize("precision, data_parallel", [("fp32", 1), ("fp32", 4), ("bf16", 1)])
def test_distributed_optimizer_resumes_bit_for_bit_at_another_dp_size(saved_at_dp2, precision, data_parallel):
    directory, uninterrupted = saved_at_dp2(precision)
    manifest = json.loads((directory / "step_00000002" / "manifest.json").read_text())
    assert manifest["optimizer"] == DISTRIBUTED and manifest["layout"] == SAVED_LAYOUT
    resumed = run_distributed(_load_worker, world_size=data_parallel, args=(precision, str(directory)))

    expected, got = _assemble(uninterrupted), _assemble(resumed)
    assert got.keys() == expected.keys()
    differing = [key for key in expected if not torch.equal(got[key], expected[key])]
    assert not differing, f"not bit-identical after the resume at DP={data_parallel}: {differing}"
    assert {key for _, key in expected} >= {"param", "exp_avg", "exp_avg_sq", "step"}
    for result in resumed:
        assert result["schedule"] == uninterrupted[0]["schedule"]
        assert result["weights"].keys() == uninterrupted[0]["weights"].keys()
        assert all(torch.equal(value, uninterrupted[0]["weights"][key]) for key, value in result["weights"].items())

    # The next step equals the uninterrupted run's up to the order in which DP ranks sum gradients
    # (fp32 rounding; bf16 also rounds each micro-batch's gradient before the sum). At the saving
    # DP size it is bit-identical: tests/trainer/test_data_parallel.py.
    reference = uninterrupted[0]
    for result in resumed:
        assert result["loss"] == pytest.approx(reference["loss"], rel=1e-6)
        assert result["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-6 if precision == "fp32" else 1e-3)


def _refused_load_worker(rank, world_size, tp, pp, directory):
    import pipeline.checkpoint.manager as checkpoint
    from pipeline.errors import CheckpointError

    actor = _actor(tp, pp, precision="fp32", distributed_optimizer=True)

    def weights_read(*args, **kwargs):
        raise AssertionError("the checkpoint's tensors were read before its layout was checked")

    checkpoint.load_sharded_weights = weights_read
    manager = checkpoint.CheckpointManager(directory, keep_last=3, rank=rank, world_size=world_size)
    try:
        manager.load(manager.newest_valid(), actor=actor)
    except CheckpointError as error:
        return str(error)
    return None


@pytest.mark.distributed
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_tp_or_pp_change_with_the_distributed_optimizer_is_refused_before_loading(saved_at_dp2, tp, pp):
    directory, _ = saved_at_dp2("fp32")
    step = directory / "step_00000002"
    for message in run_distributed(_refused_load_worker, world_size=tp * pp, args=(tp, pp, str(directory))):
        assert message is not None
        assert f"saved at TP=1, PP=1, DP=2 with the distributed optimizer, this run is at TP={tp}, PP={pp}, DP=1" \
            in message
        assert f"winnow convert megatron-to-hf --ckpt {step} --out {directory}-step_00000002-hf" in message
        assert f"--out {directory}-tp{tp}-pp{pp} --tp {tp} --pp {pp}" in message
        assert "optimizer state, learning-rate schedule and data position are not carried" in message


# ---------------------------------------------------------------- the check itself, from a manifest


def _checkpoint(tmp_path: Path, *, layout: dict, optimizer: dict | None = None, common: dict | None = None) -> Path:
    """A step directory holding what ``check_resume_layout`` reads: the manifest (and megatron's ``common.pt``)."""
    step = tmp_path / "checkpoints" / "step_00000007"
    (step / "weights").mkdir(parents=True)
    manifest = {"step": 7, "files": {}, "layout": layout, **({"optimizer": optimizer} if optimizer else {})}
    (step / "manifest.json").write_text(json.dumps(manifest))
    if common is not None:
        torch.save(common, step / "weights" / "common.pt")
    return step


def _check(step: Path, tp: int, pp: int, dp: int, *, distributed: bool) -> None:
    from pipeline.checkpoint.manager import check_resume_layout

    check_resume_layout(step, tensor_parallel=tp, pipeline_parallel=pp, data_parallel=dp,
                        distributed_optimizer=distributed)


@pytest.mark.parametrize("dp", [1, 2, 4, 8])
def test_a_dp_change_with_the_distributed_optimizer_is_allowed(tmp_path, dp):
    _check(_checkpoint(tmp_path, layout=SAVED_LAYOUT, optimizer=DISTRIBUTED), 1, 1, dp, distributed=True)


@pytest.mark.parametrize("tp, pp, dp", [(2, 1, 1), (1, 2, 4), (2, 2, 2)])
def test_the_regular_optimizer_loads_under_any_layout(tmp_path, tp, pp, dp):
    _check(_checkpoint(tmp_path, layout=SAVED_LAYOUT, optimizer=REGULAR), tp, pp, dp, distributed=False)


@pytest.mark.parametrize("distributed_now", [True, False])
def test_a_tp_change_from_the_distributed_optimizer_names_both_layouts_and_the_commands(tmp_path, distributed_now):
    from pipeline.errors import CheckpointError

    step = _checkpoint(tmp_path, layout=SAVED_LAYOUT, optimizer=DISTRIBUTED)
    with pytest.raises(CheckpointError) as refused:
        _check(step, 4, 1, 1, distributed=distributed_now)
    message = str(refused.value)
    now = "the distributed optimizer" if distributed_now else "the regular optimizer"
    assert f"saved at TP=1, PP=1, DP=2 with the distributed optimizer, this run is at TP=4, PP=1, DP=1 with {now}" \
        in message
    assert ("resume at TP=1, PP=1 (any DP)" + ("" if distributed_now else " with trainer.distributed_optimizer=true")
            + ", or convert") in message
    checkpoints = tmp_path / "checkpoints"
    assert (f"`winnow convert megatron-to-hf --ckpt {step} --out {checkpoints}-step_00000007-hf --dtype fp32 && winnow "
            f"convert hf-to-megatron --hf {checkpoints}-step_00000007-hf --out {checkpoints}-tp4-pp1 --tp 4 --pp 1`") \
        in message
    assert f"policy={checkpoints}-tp4-pp1" in message


@pytest.mark.parametrize("saved, now", [(DISTRIBUTED, False), (REGULAR, True)])
def test_a_change_of_optimizer_kind_names_the_setting_that_resumes(tmp_path, saved, now):
    from pipeline.errors import CheckpointError

    step = _checkpoint(tmp_path, layout=SAVED_LAYOUT, optimizer=saved)
    # The regular optimizer's state reshards to another TP too: only the optimizer kind is in the way.
    tp = 1 if saved["distributed"] else 2
    with pytest.raises(CheckpointError, match=f"set trainer.distributed_optimizer={str(saved['distributed']).lower()} "
                                              "to resume$"):
        _check(step, tp, 1, 1 if now is False else 2, distributed=now)


@pytest.mark.parametrize("common, refused", [
    ({"optimizer": {"param_state_sharding_type": "dp_reshardable"}}, True),
    ({"optimizer": {"param_groups": [], "state": {}}}, False),
])
def test_a_manifest_without_its_optimizer_is_read_from_megatrons_common_state(tmp_path, common, refused):
    """Checkpoints written before the manifest recorded the optimizer are judged by megatron's ``common.pt``."""
    from pipeline.errors import CheckpointError

    step = _checkpoint(tmp_path, layout=SAVED_LAYOUT, common=common)
    if refused:
        with pytest.raises(CheckpointError, match="with the distributed optimizer, this run is at TP=2"):
            _check(step, 2, 1, 1, distributed=False)
    else:
        _check(step, 2, 1, 1, distributed=False)


class _OpensAFileWhenUnpickled:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_an_old_manifest_never_unpickles_code_from_common_state(tmp_path):
    """The fallback reads ``common.pt`` with ``weights_only=True``: a crafted file tells nothing and runs nothing."""
    from pipeline.errors import CheckpointError

    marker = tmp_path / "code_ran"
    step = _checkpoint(tmp_path, layout=SAVED_LAYOUT, common={"optimizer": _OpensAFileWhenUnpickled(str(marker))})
    _check(step, 1, 1, 1, distributed=False)  # unknown optimizer, same TP/PP: left to megatron's load, which refuses it
    with pytest.raises(CheckpointError, match=r"saved at TP=1, PP=1, DP=2, this run is at TP=2"):
        _check(step, 2, 1, 1, distributed=True)  # this run's distributed optimizer cannot take another TP/PP
    assert not marker.exists()


def test_a_refusal_is_one_error_line_and_exit_status_2(tmp_path, capsys):
    """How ``winnow rl`` reports it: a ``UserError``, not a transient failure that a SLURM job would requeue."""
    from pipeline.cli.common import run_handler
    from pipeline.errors import EXIT_USER_ERROR

    step = _checkpoint(tmp_path, layout=SAVED_LAYOUT, optimizer=DISTRIBUTED)
    status = run_handler(argparse.Namespace(handler=lambda args: _check(step, 1, 2, 1, distributed=True) or 0))
    assert status == EXIT_USER_ERROR
    error = capsys.readouterr().err
    assert error.startswith(f"error: cannot resume from {step}: ") and error.count("\n") == 1
