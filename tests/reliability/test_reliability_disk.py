"""A checkpoint write that fails on disk: the previous checkpoint stays intact and the error says why.

The fault is real, not a patched Python function: ``RLIMIT_FSIZE`` makes the kernel refuse
every write past a size with ``EFBIG``, as a full or read-only disk refuses them with
``ENOSPC``/``EROFS``. (Making the directory read-only would prove nothing in CI, which runs
as root and ignores permissions.) The limit picks which writer meets the failure first:
megatron's ``common.pt`` (torch.save's C++ stream), the DCP ``.distcp`` shards, or
``tensors.safetensors``. The rename that publishes the checkpoint is refused by patching
``Path.rename`` with ``EROFS``, the one failure a size limit cannot cause.

``tests/checkpoint/test_manager.py::test_write_failure_keeps_previous_checkpoint`` patches
``save_file`` to raise ``OSError``; the real writers raise ``RuntimeError``,
``CheckpointException`` and ``SafetensorError`` instead, which used to escape as raw
tracebacks (this suite found that). Runtime: 30-50 s each on a loaded 2-core machine (both slow).
"""

from __future__ import annotations

import errno
import resource
import signal
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tests.distributed_utils import run_distributed
from tests.reliability.test_reliability_numerics import tiny_rl_config
from tests.trainer.test_actor import _actor

# The tensors saved with each checkpoint: 400 kB, larger than every other file (~65 kB .distcp
# shards, ~27 kB rank JSON), so a 200 kB limit fails only tensors.safetensors.
RUN_TENSORS = {"stats.num_seen": torch.zeros(100_000)}
FILE_SIZE_LIMITS = {"common.pt": 0, "weights shards": 2_000, "tensors.safetensors": 200_000}


@contextmanager
def file_size_limit(num_bytes: int):
    """Every write of this process past ``num_bytes`` in a file fails with EFBIG, root included."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (num_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous_handler)


@contextmanager
def read_only_publish():
    """The rename that publishes ``step_N.tmp`` as ``step_N`` fails with EROFS (a remount read-only
    between the last write and the rename); every other rename, such as DCP's own, works."""
    original = Path.rename

    def rename(self, target):
        if self.name.startswith("step_") and self.name.endswith(".tmp"):
            raise OSError(errno.EROFS, "Read-only file system", str(target))
        return original(self, target)

    Path.rename = rename
    try:
        yield
    finally:
        Path.rename = original


def _weights(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items() if not k.endswith("_extra_state")}


def _failing_writes_worker(rank, world_size, directory):
    from pipeline.checkpoint.artifact import load_weights
    from pipeline.checkpoint.manager import CheckpointManager
    from pipeline.errors import CheckpointWriteError

    actor = _actor(1, 1, micro_batch_tokens=10_000)
    fresh = _actor(1, 1, micro_batch_tokens=10_000, context=actor.context)
    saved = _weights(actor.module)
    faults = {name: (lambda limit=limit: file_size_limit(limit)) for name, limit in FILE_SIZE_LIMITS.items()}
    faults["publish (read-only)"] = read_only_publish
    outcomes = {}
    for name, fault in faults.items():
        manager = CheckpointManager(Path(directory) / name, keep_last=3)
        manager.save(1, actor=actor, tensors=RUN_TENSORS)
        with fault():
            try:
                manager.save(2, actor=actor, tensors=RUN_TENSORS)
                message = None
            except CheckpointWriteError as error:
                message = str(error)
        newest = manager.newest_valid()
        with torch.no_grad():  # the weights must come from the checkpoint
            for parameter in fresh.module.parameters():
                parameter.add_(1.0)
        load_weights(newest, fresh.module)
        restored = all(torch.equal(saved[k], v) for k, v in _weights(fresh.module).items())
        outcomes[name] = {
            "message": message, "newest": newest.name, "restored": restored,
            "entries": sorted(p.name for p in manager.directory.iterdir()),
            "latest": (manager.directory / "latest").read_text().strip(),
            "recovered": manager.save(2, actor=actor, tensors=RUN_TENSORS).name,  # once the disk is back
            "newest_after": manager.newest_valid().name,
        }
    return outcomes


@pytest.mark.slow
def test_a_failed_checkpoint_write_keeps_the_previous_checkpoint_and_reports_the_cause(tmp_path):
    outcomes = run_distributed(_failing_writes_worker, world_size=1, timeout_s=300, args=(str(tmp_path),))[0]
    assert outcomes.keys() == {*FILE_SIZE_LIMITS, "publish (read-only)"}
    for name, outcome in outcomes.items():
        message = outcome["message"]
        assert message is not None, f"{name}: the save did not fail"
        assert "step_00000002" in message and "the previous checkpoint is intact" in message, message
        if name == "publish (read-only)":
            assert "Read-only file system" in message, message
        elif name != "common.pt":  # torch.save's C++ stream drops the errno ("iostream error")
            assert "File too large" in message, message
        assert outcome["latest"] == "step_00000001", name
        assert outcome["newest"] == "step_00000001" and outcome["restored"], name
        if name == "publish (read-only)":
            # The complete directory could not be renamed; nothing names it, the next save replaces it.
            assert outcome["entries"] == ["latest", "step_00000001", "step_00000002.tmp"], name
        else:
            # A failed write gives its partial files back at once: on a full disk, that space matters.
            assert outcome["entries"] == ["latest", "step_00000001"], name
        assert outcome["recovered"] == outcome["newest_after"] == "step_00000002", name


FAILING_SAVE_STEP = 4


def _disk_full_mid_run_worker(rank, world_size, tmp, cache_dir):
    from pipeline.checkpoint.manager import CheckpointManager
    from pipeline.errors import CheckpointWriteError
    from pipeline.metrics import read_metrics
    from pipeline.parallel.context import ParallelContext
    from pipeline.stages import rl as rl_stage

    cfg = tiny_rl_config(tmp, cache_dir, ["checkpoint.every_steps=2", "eval_set=arith?difficulty=3&size=8"])
    context = ParallelContext.initialize(tensor_parallel=1, pipeline_parallel=1, seed=cfg.seed)
    original_save = CheckpointManager.save
    disk_full = [True]

    def save(manager, step, **kwargs):
        if step == FAILING_SAVE_STEP and disk_full[0]:
            with file_size_limit(0):
                return original_save(manager, step, **kwargs)
        return original_save(manager, step, **kwargs)

    CheckpointManager.save = save
    try:
        rl_stage.run_rl(cfg, context=context)
        message = None
    except CheckpointWriteError as error:
        message = str(error)
    directory = Path(cfg.checkpoint.directory)
    at_failure = {"entries": sorted(p.name for p in directory.iterdir()),
                  "newest": CheckpointManager(directory, keep_last=3).newest_valid().name}
    disk_full[0] = False
    rl_stage.run_rl(cfg, context=context)
    rows = read_metrics(Path(cfg.logging.output_dir) / "metrics.jsonl")
    return {"message": message, "at_failure": at_failure, "steps": [row["step"] for row in rows],
            "latest": (directory / "latest").read_text().strip()}


@pytest.mark.slow
def test_disk_full_mid_run_stops_the_stage_with_the_cause_and_the_relaunch_resumes(tmp_path, bootstrap_cache_dir):
    outcome = run_distributed(_disk_full_mid_run_worker, world_size=1, timeout_s=600,
                              args=(str(tmp_path), str(bootstrap_cache_dir)))[0]
    message = outcome["message"]
    assert message is not None and f"step_{FAILING_SAVE_STEP:08d}" in message, message
    assert "the previous checkpoint is intact" in message
    assert outcome["at_failure"] == {"entries": ["latest", "step_00000002"], "newest": "step_00000002"}
    assert outcome["steps"] == [0, 1, 2, 3, 4]  # resumed at 2; the rows of steps 3-4 were replaced, not doubled
    assert outcome["latest"] == "step_00000004"


@contextmanager
def failing_rank_file(*, rank: int):
    """The kernel refuses (EFBIG) the write of this rank's own ``ranks/rank_N.json`` and nothing else:
    every other rank and every other file of this rank, megatron's and DCP's included, is written."""
    import pipeline.checkpoint.manager as checkpoint

    original = checkpoint._write_json

    def write(path, payload):
        if path.name == f"rank_{rank:05d}.json":
            with file_size_limit(0):
                return original(path, payload)
        return original(path, payload)

    checkpoint._write_json = write
    try:
        yield
    finally:
        checkpoint._write_json = original


# Each fault hits one rank of two: the other rank's writes succeed, and it must still learn of the failure.
ONE_RANK_FAULTS = {"rank 1's own JSON file": (1, lambda: failing_rank_file(rank=1)),
                   "rank 0's publishing rename": (0, read_only_publish)}


def _one_rank_fails_worker(rank, world_size, directory):
    from pipeline.checkpoint.artifact import load_weights
    from pipeline.checkpoint.manager import CheckpointManager
    from pipeline.errors import CheckpointWriteError

    actor = _actor(1, 1, micro_batch_tokens=10_000)
    fresh = _actor(1, 1, micro_batch_tokens=10_000, context=actor.context)
    saved = _weights(actor.module)
    outcomes = {}
    for name, (failing_rank, fault) in ONE_RANK_FAULTS.items():
        manager = CheckpointManager(Path(directory) / name, keep_last=3, rank=rank, world_size=world_size)
        manager.save(1, actor=actor)
        try:
            if rank == failing_rank:
                with fault():
                    manager.save(2, actor=actor)
            else:
                manager.save(2, actor=actor)
            message = None
        except CheckpointWriteError as error:
            message = str(error)
        actor.context.barrier()  # every rank has left save() before rank 0 reads the directory
        newest = manager.newest_valid()
        with torch.no_grad():  # the weights must come from the checkpoint
            for parameter in fresh.module.parameters():
                parameter.add_(1.0)
        load_weights(newest, fresh.module)
        outcomes[name] = {
            "message": message, "newest": newest.name,
            "restored": all(torch.equal(saved[k], v) for k, v in _weights(fresh.module).items()),
            "entries": sorted(p.name for p in manager.directory.iterdir()),
            "latest": (manager.directory / "latest").read_text().strip(),
        }
        actor.context.barrier()  # both ranks have looked before the next save changes the directory
        outcomes[name]["recovered"] = manager.save(2, actor=actor).name  # the fault gone, both save again
    return outcomes


@pytest.mark.distributed
def test_a_write_failure_on_one_rank_raises_on_every_rank_naming_it(tmp_path):
    # Before the fix the healthy rank waited forever at the barrier after the failed write or
    # publish: the run's timeout, not an assertion, would fail this test.
    outcomes = run_distributed(_one_rank_fails_worker, world_size=2, timeout_s=180, args=(str(tmp_path),))
    for name, (failing_rank, _) in ONE_RANK_FAULTS.items():
        messages = [outcome[name]["message"] for outcome in outcomes]
        assert messages[0] is not None and messages[0] == messages[1], (name, messages)  # every rank, one story
        assert f"failed on rank {failing_rank}: " in messages[0], messages[0]
        assert "step_00000002" in messages[0] and "the previous checkpoint is intact" in messages[0], messages[0]
        assert ("Read-only file system" if "publish" in name else "File too large") in messages[0], messages[0]
        for outcome in (o[name] for o in outcomes):
            assert outcome["latest"] == "step_00000001" and outcome["newest"] == "step_00000001", name
            assert outcome["restored"], name
            # A failed write gives its partial directory back; a failed rename leaves the complete one.
            partial = ["step_00000002.tmp"] if "publish" in name else []
            assert outcome["entries"] == ["latest", "step_00000001", *partial], name
            assert outcome["recovered"] == "step_00000002", name
