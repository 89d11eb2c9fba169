"""What every benchmark leaves behind: ``<out>/<name>.json`` (settings, machine, results) and a ``<out>/<name>.png``.

The chart is one or more horizontal bar panels stacked in one figure: a bar per
variant (a median time, a throughput, a ratio), optional markers on the bars (the
fastest run of each variant) and labelled reference lines (a target, a baseline).
Both files are written atomically through ``pipeline.io``, so an interrupted run never
leaves half a file where the last good one was.
"""

from __future__ import annotations

import dataclasses
import os
import platform
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeline.io import atomic_write, atomic_write_json

__all__ = ["Panel", "machine", "plot_panels", "save"]

_FIGURE_DPI = 120
_MARKER_STYLE = {"marker": "D", "color": "black", "s": 22, "zorder": 3}
_LINE_STYLES = ("--", ":", "-.")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Panel:
    """One horizontal bar chart: a bar per variant, top to bottom in the mapping's order."""

    title: str
    xlabel: str  # names the unit
    bars: Mapping[str, float]
    markers: Mapping[str, float] = dataclasses.field(default_factory=dict)  # variant -> x, e.g. its fastest run
    marker_label: str = "fastest run"
    lines: Mapping[str, float] = dataclasses.field(default_factory=dict)  # legend label -> x, e.g. a target
    log_scale: bool = False  # for variants orders of magnitude apart


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), None)
    except OSError:
        return None


def machine(*, threads: int | None = None) -> dict[str, Any]:
    """The machine a benchmark ran on; ``threads`` defaults to torch's intra-op thread count in this process."""
    import torch

    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads() if threads is None else threads,
        "cpu_count": os.cpu_count(),
        # What this process may run on (a container or taskset can allow fewer than the machine has).
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_model": _cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def _draw_panel(axes, panel: Panel) -> None:
    names = list(panel.bars)
    rows = range(len(names))
    values = [panel.bars[name] for name in names]
    axes.barh(rows, values, color="tab:blue", alpha=0.8)
    axes.set_yticks(list(rows), names)
    axes.invert_yaxis()  # the first variant on top, as in the printed table
    for row, (name, value) in enumerate(zip(names, values)):
        label = f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"  # 2,210 rather than 2.21e+03
        # Past the bar's marker too, where it lies beyond the bar, so the two never overlap.
        axes.annotate(label, (max(value, panel.markers.get(name, value)), row), xytext=(6, 0),
                      textcoords="offset points", va="center", fontsize=8)
    marked = [name for name in names if name in panel.markers]
    if marked:
        axes.scatter([panel.markers[name] for name in marked], [names.index(name) for name in marked],
                     label=panel.marker_label, **_MARKER_STYLE)
    for index, (label, x) in enumerate(panel.lines.items()):
        axes.axvline(x, color=f"C{index + 1}", linestyle=_LINE_STYLES[index % len(_LINE_STYLES)], linewidth=1.5,
                     label=label)
    everything = [*values, *panel.markers.values(), *panel.lines.values()]
    right = max([*everything, 0.0])
    if panel.log_scale:
        axes.set_xscale("log")
        left = min((x for x in everything if x > 0), default=1.0)
        axes.set_xlim(left / 2, 3 * max(right, left))  # room for the value labels
    else:
        axes.set_xlim(0, 1.2 * right if right > 0 else 1)
    axes.set_xlabel(panel.xlabel)
    axes.set_title(panel.title, fontsize=10)
    axes.grid(axis="x", alpha=0.3)
    if marked or panel.lines:
        # Outside the axes, to the right: inside it would hide a bar or its value label.
        axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


def _machine_line(info: Mapping[str, Any]) -> str:
    cpus = f"{info['usable_cpus']} of {info['cpu_count']} CPUs" if info["usable_cpus"] != info["cpu_count"] \
        else f"{info['cpu_count']} CPUs"
    return f"{info['cpu_model'] or info['platform']}, {cpus}, {info['threads']} torch threads, torch {info['torch']}"


def plot_panels(path: str | Path, *, title: str, panels: Sequence[Panel], machine_info: Mapping[str, Any]) -> Path:
    """Stack ``panels`` in one PNG titled with the benchmark and the machine it ran on."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not panels:
        raise ValueError("plot_panels needs at least one panel")
    heights = [1.2 + 0.4 * len(panel.bars) for panel in panels]
    figure = Figure(figsize=(10, 0.8 + sum(heights)), layout="constrained")
    axes = figure.subplots(len(panels), 1, squeeze=False, height_ratios=heights)[:, 0]
    for each, panel in zip(axes, panels):
        _draw_panel(each, panel)
    figure.suptitle(f"{title}\n{_machine_line(machine_info)}", fontsize=11)
    FigureCanvasAgg(figure)  # no display needed, whatever matplotlib's default backend
    return atomic_write(path, lambda tmp: figure.savefig(tmp, format="png", dpi=_FIGURE_DPI, bbox_inches="tight"))


def save(out: str | Path, name: str, *, settings: Mapping[str, Any], results: Mapping[str, Any], title: str,
         panels: Sequence[Panel], threads: int | None = None) -> tuple[Path, Path]:
    """Write ``<out>/<name>.json`` and ``<out>/<name>.png``, print their paths and return them."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine(threads=threads)
    json_path = out / f"{name}.json"
    payload = {"benchmark": name, "settings": dict(settings), "machine": info, "results": dict(results)}
    atomic_write_json(json_path, payload, indent=1)
    png_path = plot_panels(out / f"{name}.png", title=title, panels=panels, machine_info=info)
    print(f"wrote {json_path} and {png_path}")
    return json_path, png_path
