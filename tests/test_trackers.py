"""Experiment trackers: wandb (offline) and MLflow (a local file store) receive what the metrics writer logs.

The writer is driven as the RL loop drives it: created with the run's config, one ``log``
per step (the ``ledger/*`` counts among the metrics), the plots drawn, ``close``; then
resumed from a checkpoint at step 2, as a relaunched run is, and closed again.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from pipeline.io import package_versions
from pipeline.metrics import RUN_IDS_FILE, MetricsWriter, read_metrics

pytest.importorskip("wandb", reason="the tracking extra: pip install 'winnow[tracking]'")
pytest.importorskip("mlflow", reason="the tracking extra: pip install 'winnow[tracking]'")

RUN_CONFIG = {"algorithm": {"advantage": "grpo"}, "steps": 4, "logging": {"trackers": ["wandb", "mlflow"]}}


def _step_metrics(step: int) -> dict[str, float]:
    return {"reward_mean": 0.125 * step, "ledger/tokens_generated": 1000 * step, "eval/pass@1": 0.25}


@pytest.fixture
def trackers_env(tmp_path, monkeypatch):
    """wandb offline and MLflow on a file store, both under tmp_path: nothing leaves the machine or the test."""
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this opt-in
    yield tmp_path
    import wandb

    wandb.teardown()  # stops the wandb service this process started


def _run(directory: Path, *, steps: range, resume_from_step: int | None) -> None:
    writer = MetricsWriter(directory, trackers=["wandb", "mlflow"], run_config=RUN_CONFIG,
                           resume_from_step=resume_from_step)
    for step in steps:
        writer.log(step, _step_metrics(step))
    (directory / "config.yaml").write_text("steps: 4\n")
    (directory / "plots").mkdir(exist_ok=True)
    (directory / "plots" / "reward_mean.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    writer.close()


def _wandb_records(path: Path) -> list:
    """The records of an offline run file: wandb's LevelDB-style log (7-byte header, 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    position, pending, records = 7, b"", []
    while position + 7 <= len(data):
        left = 32768 - position % 32768
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if left < 7 or (length == 0 and kind == 0):  # block trailer padding
            position += left
            continue
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_wandb_and_mlflow_receive_config_metrics_artifacts_and_a_resumed_run_appends(trackers_env):
    run_dir = trackers_env / "run"
    _run(run_dir, steps=range(1, 4), resume_from_step=None)
    ids = json.loads((run_dir / RUN_IDS_FILE).read_text())
    _run(run_dir, steps=range(3, 5), resume_from_step=2)  # relaunched from the checkpoint of step 2
    assert json.loads((run_dir / RUN_IDS_FILE).read_text()) == ids
    assert [line["step"] for line in read_metrics(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]

    # MLflow: one run, the config as params, every step's metrics, the run's files.
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    experiment = client.get_experiment_by_name("winnow")
    runs = client.search_runs([experiment.experiment_id])
    assert [run.info.run_id for run in runs] == [ids["mlflow"]]
    params = runs[0].data.params
    assert params["algorithm.advantage"] == "grpo" and params["packages.torch"] == package_versions()["torch"]
    assert params["git_commit"]
    history = client.get_metric_history(ids["mlflow"], "ledger/tokens_generated")
    assert sorted({(m.step, m.value) for m in history}) == [(s, 1000.0 * s) for s in range(1, 5)]
    assert len(client.get_metric_history(ids["mlflow"], "eval/pass_at_1")) >= 4  # MLflow refuses "@" in names
    artifacts = {a.path for a in client.list_artifacts(ids["mlflow"])} | {
        a.path for a in client.list_artifacts(ids["mlflow"], "plots")}
    assert {"config.yaml", "metrics.jsonl", "plots/reward_mean.png"} <= artifacts
    assert client.get_run(ids["mlflow"]).info.status == "FINISHED"

    # wandb: two offline sessions of the same run id (`wandb sync` merges them), the second from step 3.
    # A second session started within the same second gets a "-1" suffix on its folder.
    sessions = sorted((run_dir / "wandb").glob(f"offline-run-*-{ids['wandb']}*/run-{ids['wandb']}.wandb"))
    assert len(sessions) == 2
    steps, config, artifact_files = [], {}, set()
    for session in sessions:
        for record in _wandb_records(session):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
            elif kind == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item}
                steps.append((items["_step"], items["ledger/tokens_generated"]))
            elif kind == "artifact":
                artifact_files |= {entry.path for entry in record.artifact.manifest.contents}
    assert steps == [(1, 1000), (2, 2000), (3, 3000), (3, 3000), (4, 4000)]
    assert config["algorithm.advantage"] == "grpo" and config["packages.torch"] == package_versions()["torch"]
    assert {"config.yaml", "metrics.jsonl", "plots/reward_mean.png"} <= artifact_files


def test_a_new_run_starts_new_tracked_runs(trackers_env):
    run_dir = trackers_env / "run"
    _run(run_dir, steps=range(1, 2), resume_from_step=None)
    first = json.loads((run_dir / RUN_IDS_FILE).read_text())
    _run(run_dir, steps=range(1, 2), resume_from_step=None)  # not a resume: the directory is reused
    second = json.loads((run_dir / RUN_IDS_FILE).read_text())
    assert first["mlflow"] != second["mlflow"] and first["wandb"] != second["wandb"]


def test_an_unknown_tracker_is_refused(tmp_path):
    with pytest.raises(ValueError, match="logging.trackers: unknown"):
        MetricsWriter(tmp_path, trackers=["neptune"])
