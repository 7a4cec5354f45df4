"""The figure of a live fleet run: reward, per-group KL, per-staleness KL and step time over the steps of the
``history.json`` that ``examples/live_fleet.py`` writes (matplotlib, the ``demo`` extra)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path


def history_series(history: Mapping[str, object]) -> dict[str, dict[str, list[float]]]:
    """The plotted series, one value per step (``nan`` where a step has none, e.g. a staleness it did not see).

    Returns:
        ``{"reward": {"reward": [...]}, "group KL": {group name: [...]}, "staleness KL": {"staleness s": [...]},
        "step time": {"seconds": [...]}}``; KL is the ``kl_k3`` estimate of KL(q || p) per token.
    """
    steps = history["steps"]
    if not steps:
        raise ValueError("history_series: history['steps'] is empty")
    names = [g["name"] for g in history["groups"]]
    stale = sorted({int(k.split("/")[1]) for s in steps for k in s["metrics"]
                    if k.startswith("staleness/") and k.endswith("/kl_k3")})

    def col(key: str) -> list[float]:
        return [float(s["metrics"].get(key, math.nan)) for s in steps]

    return {
        "reward": {"reward": [float(s["reward"]) for s in steps]},
        "group KL": {name: col(f"group/{i}/kl_k3") for i, name in enumerate(names)},
        "staleness KL": {f"staleness {k}": col(f"staleness/{k}/kl_k3") for k in stale},
        "step time": {"seconds": [float(s["seconds"]) for s in steps]},
    }


def write_history_plot(history: Mapping[str, object], path: str | os.PathLike) -> Path:
    """Write the four panels of :func:`history_series` (x: optimizer step) as a PNG at ``path``.

    Raises ``ImportError`` naming the extra when matplotlib is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("write_history_plot needs matplotlib: pip install 'offpolicy[demo]'") from exc
    series = history_series(history)
    ylabels = {"reward": "training reward (mean over the batch)", "group KL": "KL(q || p) per token, k3",
               "staleness KL": "KL(q || p) per token, k3", "step time": "seconds per step"}
    plt.rcParams.update({"font.size": 11})
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    for ax, (title, lines) in zip(axes.flat, series.items()):
        for label, ys in lines.items():
            ax.plot(range(len(ys)), ys, "-o", ms=3, lw=1.5, label=label)
        if title.endswith("KL"):  # k3 is 0 on a converged batch: linear below 1e-6, logarithmic above
            ax.set_yscale("symlog", linthresh=1e-6)
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabels[title])
        ax.grid(alpha=0.3)
        if len(lines) > 1 or title.endswith("KL"):
            ax.legend(fontsize=8)
    fig.suptitle(f"live fleet: {history.get('command', '')}", fontsize=10)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
