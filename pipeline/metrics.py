"""Run metrics: one JSONL line per logged step, mirrored to TensorBoard scalars.

The JSONL file is the source of truth (plots, comparisons and resume read it);
TensorBoard is a convenience view. A line's ``step`` counts completed steps, and a
checkpoint saved after step k includes line k; on resume from k the writer drops the
lines after k (written after that checkpoint), so a resumed run's file equals an
uninterrupted one's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/Inf; keep them visible as strings
    return value


class MetricsWriter:
    def __init__(self, directory: str | Path, *, tensorboard: bool = True, resume_from_step: int | None = None) -> None:
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
        self._tensorboard = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(str(self.directory / "tensorboard"))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tensorboard is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tensorboard.add_scalar(key, value, step)

    def close(self) -> None:
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
