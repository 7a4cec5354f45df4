"""PNG plots of a diagnose run (matplotlib, Agg backend): log-ratio histograms per group, KL by staleness."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from offpolicy.diagnose.divergence import EXTREME_BAND, Divergence
from offpolicy.diagnose.findings import short_label

#: groups drawn one by one in the histogram (the largest); the rest are drawn together as "other groups"
MAX_GROUPS_DRAWN = 8


def plot_label(name: str) -> str:
    """A group name as a legend label: bounded (:func:`short_label`) and with ``$`` escaped, so matplotlib never
    reads it as mathtext."""
    return short_label(name).replace("$", r"\$")


def ratio_histograms(log_ratio: Tensor, group_index: Tensor, group_names: tuple[str, ...], path: Path) -> Path:
    """One histogram of ``log r`` per sampler group (the :data:`MAX_GROUPS_DRAWN` largest; the others pooled),
    with the extreme band's edges marked; labels bounded by :func:`plot_label`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    fin = torch.isfinite(log_ratio)
    lo, hi = float(torch.log(torch.tensor(EXTREME_BAND[0]))), float(torch.log(torch.tensor(EXTREME_BAND[1])))
    span = max(abs(lo), abs(hi), float(log_ratio[fin].abs().max()) if bool(fin.any()) else 1.0)
    bins = torch.linspace(-span, span, 61).tolist()
    counts = torch.bincount(group_index[fin], minlength=len(group_names))
    drawn = [g for g in torch.argsort(counts, descending=True, stable=True).tolist() if counts[g] > 0]
    rest = drawn[MAX_GROUPS_DRAWN:]
    for g in drawn[:MAX_GROUPS_DRAWN]:
        sel = (group_index == g) & fin
        ax.hist(log_ratio[sel].double().numpy(), bins=bins, alpha=0.5,
                label=f"{plot_label(group_names[g])} ({int(sel.sum())})")
    if rest:
        sel = torch.isin(group_index, torch.tensor(rest)) & fin
        ax.hist(log_ratio[sel].double().numpy(), bins=bins, alpha=0.5,
                label=f"{len(rest)} other groups ({int(sel.sum())})")
    for x in (lo, hi):
        ax.axvline(x, color="k", ls="--", lw=0.8)
    ax.set_xlabel("log r = log p_trainer(y) - log q_sampler(y)")
    ax.set_ylabel("tokens")
    ax.set_yscale("log")
    if drawn:
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
    if len(keys) <= 20:
        ax.set_xticks(keys)
    ax.legend()
    ax.set_title("sampler-trainer KL by staleness")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
