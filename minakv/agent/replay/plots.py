"""Plots of a replay: per-round latency, active context length and cumulative cost, one line per policy.

matplotlib is an optional extra (`pip install -e .[plots]`), imported only here and only when plotting,
with the non-interactive Agg backend (no display needed). Without it the replay still writes its JSON;
`plot` says so and returns no files.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

PANELS = (  # (series in per_round, y label, file name)
    ("latency_s", "mean request latency (s)", "latency.png"),
    ("active_tokens", "mean active context (tokens)", "active_context.png"),
    ("cumulative_cost", "cumulative cost (all tasks)", "cost.png"),
)


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot(summaries: Sequence[dict], out_dir: str | Path, title: str = "") -> list[Path]:
    """One PNG per panel in out_dir; [] (and a message) without matplotlib."""
    if not have_matplotlib():
        print("plots skipped: matplotlib is not installed (pip install 'minakv[plots]')", flush=True)
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for key, label, name in PANELS:
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for s in summaries:
            series = s["per_round"]
            points = [(r, v) for r, v in zip(series["round"], series[key], strict=True) if v is not None]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", markersize=3, label=s["policy"])
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
        if title:
            ax.set_title(title, fontsize=9)
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        paths.append(out / name)
    return paths
