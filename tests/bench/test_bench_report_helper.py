"""The benchmarks' shared report: the JSON round-trips, the PNG is a real image of the bars it was given.

Runtime: about 2 s (one torch import, three small figures).
"""

from __future__ import annotations

import json
import math

import pytest

from tools.bench import report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

PANELS = [
    report.Panel(title="step time", xlabel="ms per step", bars={"baseline": 120.0, "ours": 95.5},
                 markers={"baseline": 110.0, "ours": 90.25}),
    report.Panel(title="ours / baseline", xlabel="ratio", bars={"median": 0.8}, lines={"target ≤ 1.0": 1.0}),
]


def test_save_round_trips_the_json_and_writes_a_real_png(tmp_path, capsys):
    settings = {"repeats": 3, "out": str(tmp_path), "threads": None, "sizes": [1, 2]}
    results = {"median_s": {"baseline": 0.12, "ours": 0.0955}, "ratio": 0.0955 / 0.12, "ratio_target": 1.0}

    json_path, png_path = report.save(tmp_path / "nested" / "out", "demo", settings=settings, results=results,
                                      title="demo bench", panels=PANELS, threads=3)

    assert (json_path, png_path) == (tmp_path / "nested/out/demo.json", tmp_path / "nested/out/demo.png")
    text = json_path.read_text()
    written = json.loads(text)
    assert text == json.dumps(written, indent=1) + "\n"  # the format earlier reports were written in
    assert written["benchmark"] == "demo"
    assert written["settings"] == settings
    assert written["results"] == results  # floats survive exactly
    machine = written["machine"]
    assert machine["threads"] == 3  # as passed, not this process's torch setting
    assert set(machine) >= {"torch", "threads", "cpu_count", "usable_cpus", "platform", "python"}
    assert machine["cpu_count"] >= 1 and machine["platform"]
    # Atomic writes leave no temporary file next to the outputs.
    assert sorted(p.name for p in json_path.parent.iterdir()) == ["demo.json", "demo.png"]
    assert capsys.readouterr().out.strip().endswith(f"wrote {json_path} and {png_path}")

    data = png_path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    from PIL import Image

    with Image.open(png_path) as image:
        image.load()  # decodes every pixel: a truncated file fails here
        width, height = image.size
        extrema = image.convert("L").getextrema()
    assert width >= 600 and height >= 400
    assert extrema[0] < 100 < extrema[1]  # dark text/bars on a white background, not a blank canvas


def test_machine_defaults_to_this_process_torch_threads():
    import torch

    assert report.machine()["threads"] == torch.get_num_threads()
    assert report.machine()["torch"] == torch.__version__


def test_a_panel_draws_its_bars_markers_and_lines():
    from matplotlib.figure import Figure

    axes = Figure().subplots()
    report._draw_panel(axes, report.Panel(title="t", xlabel="ms", bars={"a": 3.0, "b": 5.0, "c": 1234.5},
                                          markers={"b": 4.0}, lines={"target": 2.0, "bound": 6.5}))
    assert [bar.get_width() for bar in axes.patches] == [3.0, 5.0, 1234.5]
    assert [text.get_text() for text in axes.texts] == ["3", "5", "1,234"]  # each bar's value, readable
    assert [label.get_text() for label in axes.get_yticklabels()] == ["a", "b", "c"]
    assert axes.yaxis_inverted()  # first variant on top
    (markers,) = axes.collections
    assert markers.get_offsets().tolist() == [[4.0, 1.0]]  # b's marker, on b's row
    assert [line.get_xdata()[0] for line in axes.get_lines()] == [2.0, 6.5]
    assert sorted(text.get_text() for text in axes.get_legend().get_texts()) == ["bound", "fastest run", "target"]
    assert axes.get_xlim()[1] >= 1234.5  # every line and bar stays in view
    assert axes.get_xlabel() == "ms" and axes.get_title() == "t"


def test_log_scale_panel_keeps_every_value_in_view():
    from matplotlib.figure import Figure

    axes = Figure().subplots()
    report._draw_panel(axes, report.Panel(title="memory", xlabel="MiB", bars={"chunked": 300.0, "full": 1.0e4},
                                          lines={"gradients": 192.0}, log_scale=True))
    low, high = axes.get_xlim()
    assert axes.get_xscale() == "log"
    assert 0 < low < 192.0 and high > 1.0e4
    assert all(math.isfinite(x) for x in (low, high))


def test_plot_panels_needs_a_panel(tmp_path):
    with pytest.raises(ValueError, match="at least one panel"):
        report.plot_panels(tmp_path / "x.png", title="x", panels=[], machine_info=report.machine())
