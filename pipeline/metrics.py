"""Run metrics: one JSONL line per logged step, mirrored to the experiment trackers.

The JSONL file is the source of truth (plots, comparisons and resume read it); the
trackers are views of it. A line's ``step`` counts completed steps, and a checkpoint saved
after step k includes line k; on resume from k the writer drops the lines after k (written
after that checkpoint), so a resumed run's file equals an uninterrupted one's.

Trackers come from ``TRACKERS`` by name: ``tensorboard`` (scalars under ``tensorboard/``),
``wandb`` and ``mlflow`` (optional: ``pip install 'winnow[tracking]'``). Each receives, once,
the run's config with the git commit and the package versions; every logged step's numeric
metrics (the ``ledger/*`` token counts among them); and at close the run's files (the
resolved config, ``metrics.jsonl``, ``stats.parquet`` and ``plots/*.png`` where present) as
artifacts. A writer exists on rank 0 only (the loop creates it there), so a tracked run is one
run whatever the world size. The external trackers' run ids are kept in
``<output_dir>/trackers.json``; a resumed writer reads them back and appends to the same
tracked runs instead of starting new ones.

Cost: one JSON line and one tracker call per logged step (a few hundred bytes at 7B on
8×H100: the metrics are scalars, whatever the model size); the artifacts are uploaded once.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from pipeline.io import atomic_write_json, git_commit, package_versions

RUN_IDS_FILE = "trackers.json"
# Files of a run directory logged as artifacts at close, where present.
ARTIFACT_FILES = ("config.yaml", "metrics.jsonl", "stats.parquet")
ARTIFACT_FOLDERS = ("plots",)
PROJECT = "winnow"  # the wandb project and MLflow experiment unless WANDB_PROJECT / MLFLOW_EXPERIMENT_NAME say otherwise


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/Inf; keep them visible as strings
    return value


def _numeric(record: Mapping[str, Any]) -> dict[str, float]:
    return {key: float(value) for key, value in record.items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


class Tracker(Protocol):
    """One experiment tracker. ``run_id``: the tracked run to continue (resume), else ``None``."""

    def start(self, *, directory: Path, config: Mapping[str, Any], run_id: str | None) -> str | None:
        """Open (or reopen) the tracked run; return its id to persist (``None``: nothing to resume)."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def log_artifacts(self, files: Sequence[tuple[Path, str]]) -> None:
        """``(file, folder inside the run's artifacts)`` pairs."""

    def close(self) -> None: ...


class TensorBoardTracker:
    def start(self, *, directory: Path, config: Mapping[str, Any], run_id: str | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(directory / "tensorboard"))
        return None

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)

    def log_artifacts(self, files: Sequence[tuple[Path, str]]) -> None:
        pass  # TensorBoard's files are the run directory itself

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    """Weights & Biases; ``WANDB_MODE=offline`` keeps the run under ``<output_dir>/wandb`` for ``wandb sync``."""

    def start(self, *, directory: Path, config: Mapping[str, Any], run_id: str | None) -> str:
        import wandb

        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), dir=str(directory),
                               name=directory.name, config=dict(config), id=run_id,
                               resume="must" if run_id is not None else None)
        return self._run.id

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        # A resumed run re-logs the steps after its checkpoint; wandb keeps the first value of a
        # step it has seen (the loop is deterministic, so they are equal) and warns.
        self._run.log(dict(metrics), step=step)

    def log_artifacts(self, files: Sequence[tuple[Path, str]]) -> None:
        import wandb

        if not files:
            return
        artifact = wandb.Artifact(f"run-{self._run.id}", type="run-outputs")
        for path, folder in files:
            artifact.add_file(str(path), name=f"{folder}/{path.name}" if folder else path.name)
        self._run.log_artifact(artifact)

    def close(self) -> None:
        self._run.finish()


# MLflow names may hold only alphanumerics and ``_-. :/``; ``eval/pass@1`` becomes ``eval/pass_at_1``.
_MLFLOW_NAME_REFUSED = re.compile(r"[^\w\-. :/]")


def mlflow_name(key: str) -> str:
    return _MLFLOW_NAME_REFUSED.sub("_", key.replace("@", "_at_"))


class MlflowTracker:
    """MLflow: the tracking URI MLflow resolves (``MLFLOW_TRACKING_URI``, a server or a local store)."""

    def start(self, *, directory: Path, config: Mapping[str, Any], run_id: str | None) -> str:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient()
        if run_id is None:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
            experiment = self._client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(name)
            run_id = self._client.create_run(experiment_id, run_name=directory.name).info.run_id
            # MLflow params are write-once strings of at most 6,000 characters: logged on the first start only.
            params = [Param(mlflow_name(key), str(value)[:6000]) for key, value in config.items()]
            for begin in range(0, len(params), 100):  # log_batch takes at most 100 params a call
                self._client.log_batch(run_id, params=params[begin:begin + 100])
        else:
            self._client.update_run(run_id, status="RUNNING")
        self._run_id = run_id
        return run_id

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(mlflow_name(key), value, now, step) for key, value in metrics.items() if math.isfinite(value)]
        for begin in range(0, len(batch), 1000):  # log_batch takes at most 1,000 metrics a call
            self._client.log_batch(self._run_id, metrics=batch[begin:begin + 1000])

    def log_artifacts(self, files: Sequence[tuple[Path, str]]) -> None:
        for path, folder in files:
            self._client.log_artifact(self._run_id, str(path), artifact_path=folder or None)

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


TRACKERS: dict[str, Callable[[], Tracker]] = {
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "mlflow": MlflowTracker,
}


def run_metadata(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """What a tracked run records once: its config (flattened to dotted keys), the git commit and package versions."""
    flat = _flatten(config or {})
    flat["git_commit"] = git_commit()
    flat.update({f"packages.{name}": version for name, version in package_versions().items()})
    return flat


class MetricsWriter:
    """``metrics.jsonl`` plus the trackers named in ``trackers`` (``TRACKERS`` names).

    ``run_config``: the run's resolved config (``configlib.to_dict``), logged once with the
    git commit and package versions. ``resume_from_step``: continue a run (see the module
    docstring); ``None`` starts a new one.
    """

    def __init__(self, directory: str | Path, *, trackers: Iterable[str] = (),
                 run_config: Mapping[str, Any] | None = None, resume_from_step: int | None = None) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / "metrics.jsonl"
        if resume_from_step is not None and self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", -1) <= resume_from_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        elif resume_from_step is None and self.path.exists():
            self.path.unlink()
        self._file = self.path.open("a")
        names = list(dict.fromkeys(trackers))
        unknown = sorted(set(names) - set(TRACKERS))
        if unknown:
            raise ValueError(f"logging.trackers: unknown {unknown}; known: {sorted(TRACKERS)}")
        ids_path = self.directory / RUN_IDS_FILE
        run_ids = json.loads(ids_path.read_text()) if resume_from_step is not None and ids_path.is_file() else {}
        metadata = run_metadata(run_config) if any(name != "tensorboard" for name in names) else {}
        self._trackers: dict[str, Tracker] = {}
        for name in names:
            tracker = TRACKERS[name]()
            run_id = tracker.start(directory=self.directory, config=metadata, run_id=run_ids.get(name))
            if run_id is not None:
                run_ids[name] = run_id
            self._trackers[name] = tracker
        if run_ids:
            atomic_write_json(ids_path, run_ids)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        numeric = _numeric(record)
        for tracker in self._trackers.values():
            tracker.log(step, numeric)

    def artifacts(self) -> list[tuple[Path, str]]:
        """The run's files that exist now, as ``(file, artifact folder)``."""
        files = [(self.directory / name, "") for name in ARTIFACT_FILES if (self.directory / name).is_file()]
        for folder in ARTIFACT_FOLDERS:
            files += [(path, folder) for path in sorted((self.directory / folder).glob("*")) if path.is_file()]
        return files

    def close(self) -> None:
        self._file.close()
        files = self.artifacts()
        for tracker in self._trackers.values():
            tracker.log_artifacts(files)
            tracker.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
