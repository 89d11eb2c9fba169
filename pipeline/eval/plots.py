"""PNG plots of evaluation results: pass@k curves with bootstrap bands, and run comparisons.

Figures are drawn on matplotlib's Agg canvas directly (``matplotlib.figure.Figure``
with ``FigureCanvasAgg``), never through ``pyplot``: no global backend switch, no
display needed, and nothing leaks between figures in a long-running process.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipeline.io import atomic_write

__all__ = ["plot_comparison", "plot_pass_at_k"]

_FIGURE_DPI = 120


def _curve(metrics: Mapping[str, Any]) -> tuple[list[int], list[float], list[float] | None, list[float] | None]:
    """ks, pass@k values and (when every k has one) the interval bounds of one metrics mapping."""
    ks = sorted(int(name.removeprefix("pass@")) for name in metrics if name.startswith("pass@"))
    entries = [metrics[f"pass@{k}"] for k in ks]
    values = [entry["value"] for entry in entries]
    if entries and all(entry.get("ci") is not None for entry in entries):
        return ks, values, [e["ci"][0] for e in entries], [e["ci"][1] for e in entries]
    return ks, values, None, None


def _draw_curve(axes, metrics: Mapping[str, Any], *, label: str, color) -> None:
    ks, values, low, high = _curve(metrics)
    if not ks:
        return
    axes.plot(ks, values, marker="o", label=label, color=color)
    if low is not None:
        axes.fill_between(ks, low, high, alpha=0.2, color=color, linewidth=0)


def _style(axes, *, title: str) -> None:
    axes.set_xscale("log", base=2)
    axes.xaxis.set_major_formatter("{x:.0f}")
    axes.set_xlabel("k")
    axes.set_ylabel("pass@k")
    axes.set_ylim(-0.02, 1.02)
    axes.set_title(title)
    axes.grid(True, alpha=0.3)


def _save(figure, path: str | Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure)
    return atomic_write(path, lambda tmp: figure.savefig(tmp, format="png", dpi=_FIGURE_DPI, bbox_inches="tight"))


def plot_pass_at_k(results: Mapping[str, Any], path: str | Path) -> Path:
    """One axes: a pass@k curve per benchmark (log₂ k) with its bootstrap band."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.4, 4.4))
    axes = figure.add_subplot()
    colors = colormaps["tab10"]
    for index, (name, entry) in enumerate(results["benchmarks"].items()):
        _draw_curve(axes, entry["metrics"], label=f"{name} ({entry['num_problems']})", color=colors(index % 10))
    confidence = results.get("confidence", 0.95)
    _style(axes, title=f"pass@k, n = {results.get('num_samples')} ({confidence:.0%} bootstrap bands)")
    if axes.has_data():
        axes.legend(fontsize="small")
    return _save(figure, path)


def plot_comparison(runs: Mapping[str, Mapping[str, Any]], path: str | Path) -> Path:
    """Several runs on one figure: a panel per benchmark, a pass@k curve with band per run."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    if not runs:
        raise ValueError("plot_comparison needs at least one run")
    benchmarks = list(dict.fromkeys(name for results in runs.values() for name in results["benchmarks"]))
    num_columns = min(3, max(1, len(benchmarks)))
    num_rows = max(1, math.ceil(len(benchmarks) / num_columns))
    figure = Figure(figsize=(4.4 * num_columns, 3.6 * num_rows))
    panels = figure.subplots(num_rows, num_columns, squeeze=False)
    colors = colormaps["tab10"]
    for panel, benchmark in zip(panels.flat, benchmarks):
        for index, (label, results) in enumerate(runs.items()):
            entry = results["benchmarks"].get(benchmark)
            if entry is not None:
                _draw_curve(panel, entry["metrics"], label=label, color=colors(index % 10))
        _style(panel, title=benchmark)
        if panel.has_data():
            panel.legend(fontsize="small")
        else:
            panel.text(0.5, 0.5, "no problems evaluated", ha="center", va="center", transform=panel.transAxes)
    for panel in list(panels.flat)[len(benchmarks) :]:
        panel.set_visible(False)
    figure.tight_layout()
    return _save(figure, path)
