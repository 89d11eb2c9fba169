"""Train an RL run in chunks between held-out evaluations, resumable at any point: the races' common loop.

``tools.bench.race`` (fixed evaluation steps) and ``tools.bench.methods`` (until a FLOPs budget)
both train a run ``run_rl`` chunk by chunk, score the checkpoint each chunk ends on, and keep the
scores in ``curve.jsonl``. A killed benchmark resumes from the newest valid checkpoint with the
scores it had; a chunk trained but not yet scored is scored first.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

Point = dict[str, Any]


def read_curve(path: Path) -> list[Point]:
    """The scored points of ``curve.jsonl`` (none when it does not exist)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def reuse_or_run(path: Path, run: Callable[[], Point], *, label: str, log: Callable[[str], Any]) -> Point:
    """A finished run's result: read from ``path`` when a previous invocation wrote it, else ``run()`` and write it."""
    if path.is_file():
        log(f"{label}: reusing {path}")
        return json.loads(path.read_text())
    log(f"{label}: running")
    result = run()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return result


def train_in_chunks(cfg, *, context, curve_path: Path, first_point: Callable[[], Point],
                    score: Callable[[Any, int, Point], Point], next_step: Callable[[int, Point], int | None],
                    label: str) -> list[Point]:
    """Train ``cfg`` until ``next_step(done, last point)`` is None; return the curve of scored points.

    ``first_point()`` scores the start (called only when the curve has no point yet);
    ``score(policy, step, previous point)`` scores the checkpoint at ``step`` (``policy`` from
    ``pipeline.eval.policy.load_policy``), without the ``step`` key, which is added here.
    A run stopped early by SIGTERM/SIGUSR1 (``run_rl`` checkpoints and returns) ends the process
    with a message to rerun, which resumes.
    """
    from pipeline.checkpoint.manager import CheckpointManager
    from pipeline.eval.policy import load_policy
    from pipeline.stages.bootstrap import run_bootstrap
    from pipeline.stages.rl import run_rl

    checkpoints = CheckpointManager(cfg.checkpoint.directory, keep_last=1)

    def checkpoint_step() -> int:
        newest = checkpoints.newest_valid()
        return int(newest.name.removeprefix("step_")) if newest is not None else 0

    done = checkpoint_step()
    curve = [point for point in read_curve(curve_path) if point["step"] <= done] or [{**first_point(), "step": 0}]
    tokenizer_dir = run_bootstrap(cfg.bootstrap, context=context).tokenizer_dir  # RL checkpoints carry none

    def score_checkpoint(step: int) -> None:
        policy = load_policy(cfg.checkpoint.directory, tokenizer=tokenizer_dir, context=context)
        curve.append({**score(policy, step, curve[-1]), "step": step})
        curve_path.parent.mkdir(parents=True, exist_ok=True)
        curve_path.write_text("".join(json.dumps(point) + "\n" for point in curve))

    if done > curve[-1]["step"]:  # stopped after training a chunk, before scoring it
        score_checkpoint(done)
    while (target := next_step(done, curve[-1])) is not None:
        run_rl(cfg, context=context, max_steps=target - done)
        done = checkpoint_step()
        if done < target:  # run_rl honoured SIGTERM/SIGUSR1 and checkpointed early
            raise SystemExit(f"{label} stopped at step {done}; rerun to resume")
        score_checkpoint(done)
    return curve
