"""PNG plots of a diagnose run (matplotlib, Agg backend): log-ratio histograms per group, KL by staleness."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from offpolicy.diagnose.divergence import EXTREME_BAND, Divergence


def ratio_histograms(log_ratio: Tensor, group_index: Tensor, group_names: tuple[str, ...], path: Path) -> Path:
    """One histogram of ``log r`` per sampler group, with the extreme band's edges marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    fin = torch.isfinite(log_ratio)
    lo, hi = float(torch.log(torch.tensor(EXTREME_BAND[0]))), float(torch.log(torch.tensor(EXTREME_BAND[1])))
    span = max(abs(lo), abs(hi), float(log_ratio[fin].abs().max()) if bool(fin.any()) else 1.0)
    bins = torch.linspace(-span, span, 61).tolist()
    for g, name in enumerate(group_names):
        sel = (group_index == g) & fin
        if bool(sel.any()):
            ax.hist(log_ratio[sel].double().numpy(), bins=bins, alpha=0.5, label=f"{name} ({int(sel.sum())})")
    for x in (lo, hi):
        ax.axvline(x, color="k", ls="--", lw=0.8)
    ax.set_xlabel("log r = log p_trainer(y) - log q_sampler(y)")
    ax.set_ylabel("tokens")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("importance ratios per sampler group (dashed: r = 0.2 and 5)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def kl_by_staleness(by_staleness: dict[int, Divergence], path: Path) -> Path:
    """k1 and k3 against staleness (``current_version - version``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted(by_staleness)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(keys, [by_staleness[k].k3 for k in keys], "o-", label="k3")
    ax.plot(keys, [by_staleness[k].k1 for k in keys], "s--", label="k1")
    ax.set_xlabel("staleness (weight versions behind)")
    ax.set_ylabel("KL(q || p) per token")
    ax.set_xticks(keys)
    ax.legend()
    ax.set_title("sampler-trainer KL by staleness")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
