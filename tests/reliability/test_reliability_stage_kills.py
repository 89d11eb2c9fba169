"""kill -9 of `winnow curate` and `winnow evaluate` mid-run: finished shards kept, the rest redone once.

The stages' own tests (``tests/stages/test_curate.py``, ``tests/stages/test_evaluate.py``)
resume after an exception raised inside the process. Here a real ``winnow`` process is
SIGKILLed as soon as its first shard file appears (usually in the middle of the next
shard's generation or write), then relaunched with the same command:

* every shard file that existed at the kill is read back, never rewritten: same inode,
  same mtime, same bytes; the relaunch's manifest marks exactly those ``reused``;
* every other shard is generated once (one ``generated``/``done`` entry each), no ``.tmp``
  file is left behind, and no process the killed stage started still runs;
* the final outputs equal those of an uninterrupted run of the same command (shards
  byte for byte or table for table, pass rates, kept set, report; pass@k and intervals).

The policy is the random 2-layer Llama of ``tests/stages/test_evaluate.py``; one benchmark or
source of 12 problems in shards of 2 leaves ~5 shards to redo after the kill.
Runtime: about 30 s per stage (three launches, ~8 s of imports and policy loading each).
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from tests.reliability.test_reliability_interruptions import (
    RUN_TIMEOUT_S,
    STARTUP_TIMEOUT_S,
    _assert_nothing_left,
    _launch_command,
    _log_tail,
    _wait_for_exit,
)
from tests.stages.test_curate import _outputs as curation_outputs
from tests.stages.test_evaluate import hf_policy  # noqa: F401 - a fixture

SPEC = "arith?difficulty=1&size=12"
NUM_SHARDS = 6  # 12 problems in shards of 2
COMMON = ["template=raw", "shard_size=2", "progress=false", "reward.num_workers=1"]


def _evaluate_arguments(policy: Path, output_dir: Path) -> list[str]:
    return ["evaluate", str(policy), f"output_dir={output_dir}", *COMMON, f'eval.benchmarks=["{SPEC}"]',
            "eval.split=train", "eval.num_samples=4", "eval.ks=[1,2,4]", "eval.max_new_tokens=8",
            "eval.bootstrap_samples=50"]


def _curate_arguments(policy: Path, output_dir: Path) -> list[str]:
    return ["curate", f'sources=["{SPEC}"]', f"policy={policy}", f"output_dir={output_dir}", *COMMON,
            # A random policy solves nothing: keep every prompt (curation keeping none is an error).
            "num_samples=4", "max_new_tokens=8", "rules.drop_impossible=false", "rules.trivial_threshold=null"]


def _run(tmp: Path, arguments: list[str], attempt: str) -> None:
    process = _launch_command(tmp, arguments, attempt)
    assert _wait_for_exit(process, tmp, RUN_TIMEOUT_S) == 0, _log_tail(tmp)


def _shard_files(shards_dir: Path) -> list[Path]:
    return sorted(shards_dir.glob("shard_*")) if shards_dir.is_dir() else []


def _snapshot(paths: list[Path]) -> dict[str, tuple[int, int, bytes]]:
    return {path.name: (path.stat().st_ino, path.stat().st_mtime_ns, path.read_bytes()) for path in paths}


def _kill_after_the_first_shard(tmp: Path, arguments: list[str], shards_dir: Path) -> dict[str, tuple[int, int, bytes]]:
    """Launch, SIGKILL once a shard file exists; the finished shards' identities at the kill."""
    process = _launch_command(tmp, arguments, "killed")
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not any(path.suffix != ".tmp" for path in _shard_files(shards_dir)):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"no shard written while the run was alive:\n{_log_tail(tmp)}")
        time.sleep(0.001)
    process.send_signal(signal.SIGKILL)
    assert _wait_for_exit(process, tmp, 60.0) == -signal.SIGKILL
    _assert_nothing_left(tmp, "killed")  # the grading pool's forkserver and worker died with the stage
    finished = [path for path in _shard_files(shards_dir) if path.suffix != ".tmp"]
    assert 1 <= len(finished) < NUM_SHARDS, "the kill landed after the run finished; use more shards"
    return _snapshot(finished)


def _assert_kept_and_redone_once(shards_dir: Path, at_kill: dict, statuses: list[str], *, redone: str) -> None:
    after = _snapshot(_shard_files(shards_dir))
    assert not [name for name in after if name.endswith(".tmp")]
    assert len(after) == NUM_SHARDS
    for name, identity in at_kill.items():
        assert after[name] == identity, f"{name} was rewritten by the relaunch"
    kept_stems = {Path(name).stem for name in at_kill}
    assert statuses == ["reused" if f"shard_{index:05d}" in kept_stems else redone for index in range(NUM_SHARDS)]


@pytest.mark.slow
def test_kill_9_of_evaluate_keeps_finished_shards_and_redoes_the_rest_once(tmp_path, hf_policy):  # noqa: F811
    from pipeline.stages.evaluate import benchmark_directory

    reference_dir, output_dir = tmp_path / "uninterrupted" / "out", tmp_path / "killed" / "out"
    _run(tmp_path / "uninterrupted", _evaluate_arguments(hf_policy, reference_dir), "uninterrupted")
    shards_dir = output_dir / benchmark_directory(SPEC)
    at_kill = _kill_after_the_first_shard(tmp_path / "killed", _evaluate_arguments(hf_policy, output_dir), shards_dir)
    assert json.loads((output_dir / "manifest.json").read_text())["status"] == "running"

    _run(tmp_path / "killed", _evaluate_arguments(hf_policy, output_dir), "relaunched")
    manifest = json.loads((output_dir / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    statuses = [shard["status"] for shard in manifest["benchmarks"][SPEC]["shards"]]
    _assert_kept_and_redone_once(shards_dir, at_kill, statuses, redone="done")

    reference_shards = _shard_files(reference_dir / benchmark_directory(SPEC))
    assert [path.name for path in reference_shards] == [path.name for path in _shard_files(shards_dir)]
    for path in reference_shards:
        assert (shards_dir / path.name).read_bytes() == path.read_bytes(), path.name
    results = json.loads((output_dir / "results.json").read_text())
    reference = json.loads((reference_dir / "results.json").read_text())
    assert results["benchmarks"] == reference["benchmarks"] and results["aggregate"] == reference["aggregate"]


@pytest.mark.slow
def test_kill_9_of_curate_keeps_finished_shards_and_redoes_the_rest_once(tmp_path, hf_policy):  # noqa: F811
    reference_dir, output_dir = tmp_path / "uninterrupted" / "out", tmp_path / "killed" / "out"
    _run(tmp_path / "uninterrupted", _curate_arguments(hf_policy, reference_dir), "uninterrupted")
    at_kill = _kill_after_the_first_shard(tmp_path / "killed", _curate_arguments(hf_policy, output_dir),
                                          output_dir / "shards")
    assert not (output_dir / "manifest.json").exists()  # written last: the curation is visibly incomplete

    _run(tmp_path / "killed", _curate_arguments(hf_policy, output_dir), "relaunched")
    manifest = json.loads((output_dir / "manifest.json").read_text())
    statuses = [shard["status"] for shard in manifest["shards"]]
    _assert_kept_and_redone_once(output_dir / "shards", at_kill, statuses, redone="generated")

    shards, pass_rates, kept, report = curation_outputs(output_dir)
    reference_shards, reference_pass_rates, reference_kept, reference_report = curation_outputs(reference_dir)
    assert shards.keys() == reference_shards.keys() and len(shards) == NUM_SHARDS
    for name, table in shards.items():
        assert table.equals(reference_shards[name], check_metadata=True), name
    assert pass_rates.equals(reference_pass_rates) and kept == reference_kept and report == reference_report
