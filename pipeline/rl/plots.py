"""PNG curves of a run's metrics against step (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path

from pipeline.metrics import read_metrics

CURVES = {
    "reward": ("reward_mean", "mean reward"),
    "entropy": ("entropy", "token entropy (nats)"),
    "temperature": ("temperature", "sampling temperature τ"),
    "usefulness": ("usefulness", "share of groups with non-zero advantage"),
    "token_ratio": ("kept_token_ratio", "share of generated tokens with gradient"),
}


def plot_run(metrics_path: str | Path, directory: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row for row in read_metrics(metrics_path) if "reward_mean" in row]
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (key, label) in CURVES.items():
        points = [(row["step"], row[key]) for row in rows if isinstance(row.get(key), (int, float))]
        if not points:
            continue
        figure, axis = plt.subplots(figsize=(6, 3.5))
        axis.plot(*zip(*points), linewidth=1.5)
        axis.set_xlabel("step")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        figure.tight_layout()
        path = directory / f"{name}.png"
        figure.savefig(path, dpi=100)
        plt.close(figure)
        written.append(path)
    return written
