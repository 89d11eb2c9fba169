"""Actor checkpoints: exact resume, resharding across layouts, corruption and crash fallbacks."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.distributed_utils import run_distributed
from tests.trainer.test_actor import _actor, _batch


def _weights(actor) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in actor.module.state_dict().items() if not k.endswith("_extra_state")}


def _resume_worker(rank, world_size, directory):
    from pipeline.checkpoint.manager import CheckpointManager
    from pipeline.trainer.losses import CrossEntropyLoss

    batch, loss = _batch(), CrossEntropyLoss()
    manager = CheckpointManager(directory, keep_last=2)
    actor = _actor(1, 1, micro_batch_tokens=10_000)
    for _ in range(2):
        actor.train_step(batch, loss)
    manager.save(2, actor=actor, state={"data_position": 17}, tensors={"counts": torch.arange(4)})
    # Uninterrupted: two more steps, with fresh random draws after the save.
    uninterrupted = [actor.train_step(batch, loss).loss for _ in range(2)]
    draw_after_save = torch.rand(3)
    final_weights = _weights(actor)

    fresh = _actor(1, 1, micro_batch_tokens=10_000, context=actor.context)
    with torch.no_grad():  # make sure the weights really come from the checkpoint
        for parameter in fresh.module.parameters():
            parameter.add_(1.0)
    loaded = manager.load(manager.newest_valid(), actor=fresh)
    resumed = [fresh.train_step(batch, loss).loss for _ in range(2)]
    draw_after_load = torch.rand(3)
    same_weights = all(torch.equal(final_weights[k], v) for k, v in _weights(fresh).items())
    return {"uninterrupted": uninterrupted, "resumed": resumed, "same_weights": same_weights,
            "rng_equal": torch.equal(draw_after_save, draw_after_load), "step": loaded.step,
            "state": loaded.state, "counts": loaded.tensors["counts"],
            "schedule": fresh.schedule.state_dict()}


def test_resume_is_bit_identical(tmp_path):
    (result,) = run_distributed(_resume_worker, world_size=1, args=(str(tmp_path),))
    assert result["resumed"] == result["uninterrupted"]  # exact, not approximate
    assert result["same_weights"]
    assert result["rng_equal"]
    assert result["step"] == 2 and result["state"] == {"data_position": 17}
    assert result["counts"].tolist() == [0, 1, 2, 3]
    assert result["schedule"] == {"step_count": 4}
    assert (tmp_path / "latest").read_text().strip() == "step_00000002"


def _save_worker(rank, world_size, tp, pp, directory):
    from pipeline.checkpoint.manager import CheckpointManager
    from pipeline.trainer.losses import CrossEntropyLoss

    actor = _actor(tp, pp, micro_batch_tokens=36)
    actor.train_step(_batch(), CrossEntropyLoss())
    CheckpointManager(directory, keep_last=3, rank=rank, world_size=world_size).save(1, actor=actor)
    return actor.compute_logprobs(_batch())


def _load_worker(rank, world_size, tp, pp, directory):
    from pipeline.checkpoint.manager import CheckpointManager

    actor = _actor(tp, pp, micro_batch_tokens=36)
    manager = CheckpointManager(directory, keep_last=3, rank=rank, world_size=world_size)
    manager.load(manager.newest_valid(), actor=actor)
    return actor.compute_logprobs(_batch())


@pytest.mark.distributed
@pytest.mark.parametrize("saved, loaded", [((1, 1), (2, 1)), ((2, 1), (1, 2))])
def test_checkpoint_loads_under_another_layout(tmp_path, saved, loaded):
    expected = run_distributed(_save_worker, world_size=saved[0] * saved[1], args=(*saved, str(tmp_path)))[0]
    for got in run_distributed(_load_worker, world_size=loaded[0] * loaded[1], args=(*loaded, str(tmp_path))):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def _two_checkpoints_worker(rank, world_size, directory):
    from pipeline.checkpoint.manager import CheckpointManager

    actor = _actor(1, 1, micro_batch_tokens=10_000)
    manager = CheckpointManager(directory, keep_last=2)
    for step in (1, 2, 3):
        manager.save(step, actor=actor)
    return manager.list_steps()


@pytest.fixture(scope="module")
def saved_checkpoints(tmp_path_factory):
    directory = tmp_path_factory.mktemp("checkpoints")
    (steps,) = run_distributed(_two_checkpoints_worker, world_size=1, args=(str(directory),))
    assert steps == [2, 3]  # keep_last=2 pruned step 1
    return directory


@pytest.fixture
def two_checkpoints(saved_checkpoints, tmp_path):
    copy = tmp_path / "checkpoints"
    shutil.copytree(saved_checkpoints, copy)
    return copy


def _largest_file(path: Path) -> Path:
    return max((p for p in path.rglob("*") if p.is_file() and p.name != "manifest.json"), key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("damage", ["truncate", "delete", "flip_byte", "no_manifest"])
def test_corrupted_newest_checkpoint_falls_back(two_checkpoints, damage, caplog):
    from pipeline.checkpoint.manager import CheckpointManager

    newest = two_checkpoints / "step_00000003"
    victim = _largest_file(newest) if damage != "flip_byte" else newest / "state.json"
    if damage == "truncate":
        os.truncate(victim, victim.stat().st_size // 2)
    elif damage == "delete":
        victim.unlink()
    elif damage == "flip_byte":
        data = bytearray(victim.read_bytes())
        data[-3] ^= 0x01
        victim.write_bytes(bytes(data))
    else:
        (newest / "manifest.json").unlink()
    manager = CheckpointManager(two_checkpoints, keep_last=2)
    assert manager.newest_valid() == two_checkpoints / "step_00000002"
    assert "unusable" in caplog.text and "step_00000003" in caplog.text


def _failing_save_worker(rank, world_size, directory):
    import pipeline.checkpoint.manager as checkpoint

    actor = _actor(1, 1, micro_batch_tokens=10_000)
    manager = checkpoint.CheckpointManager(directory, keep_last=3)
    manager.save(1, actor=actor)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    checkpoint.save_file = disk_full
    try:
        manager.save(2, actor=actor)
    except checkpoint.CheckpointWriteError as error:
        return str(error), manager.list_steps(), (Path(directory) / "latest").read_text().strip()
    return None


def test_write_failure_keeps_previous_checkpoint(tmp_path):
    (outcome,) = run_distributed(_failing_save_worker, world_size=1, args=(str(tmp_path),))
    message, steps, latest = outcome
    assert "No space left" in message and "previous checkpoint is intact" in message
    assert steps == [1] and latest == "step_00000001"


def test_manifest_records_model_spec_layer_spec_and_optimizer(saved_checkpoints):
    import json

    manifest = json.loads((saved_checkpoints / "step_00000003" / "manifest.json").read_text())
    assert manifest["model_spec"]["vocab_size"] == 64 and manifest["model_spec"]["num_layers"] == 2
    assert manifest["layer_spec"]["name"] == "local"
    assert manifest["layout"] == {"tensor_parallel": 1, "pipeline_parallel": 1, "data_parallel": 1}
    assert manifest["optimizer"] == {"distributed": False}  # a resume checks it before loading (test_reshard.py)
