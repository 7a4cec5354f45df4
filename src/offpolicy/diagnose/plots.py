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


#: one colour per attribution part (semantics, staleness, format, routing, residual)
PART_COLOURS = ("#d62728", "#1f77b4", "#ff7f0e", "#2ca02c", "#7f7f7f")


def attribution_bars(report, path: Path, parts: tuple[str, ...]) -> Path:
    """Stacked bars, one per sampler group (and one for all tokens): each part's Shapley contribution to the
    group's mean ``|log r|`` in nats (a negative contribution, a part that cancels another, is drawn below 0),
    the bar's total written above it; ``parts`` in stacking order (``offpolicy.diagnose.attribution.PARTS``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [s for s in report.slices if s.kind in ("all", "group")][: MAX_GROUPS_DRAWN + 1]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(rows) + 2.5), 4))
    x = list(range(len(rows)))
    up = [0.0] * len(rows)
    down = [0.0] * len(rows)
    for part, colour in zip(parts, PART_COLOURS):
        vals = [s.parts[part]["mean_abs_log_r"] for s in rows]
        pos = [max(v, 0.0) for v in vals]
        neg = [min(v, 0.0) for v in vals]
        ax.bar(x, pos, bottom=up, color=colour, label=part, edgecolor="white", lw=0.5)
        ax.bar(x, neg, bottom=down, color=colour, edgecolor="white", lw=0.5, hatch="//")
        up = [a + b for a, b in zip(up, pos)]
        down = [a + b for a, b in zip(down, neg)]
    for i, s in enumerate(rows):
        ax.text(i, up[i], f"{s.total['mean_abs_log_r']:.3g}", ha="center", va="bottom", fontsize=8)
    labels = [plot_label(s.label) + (f"\n{s.format}" if s.format else "") for s in rows]
    ax.set_xticks(x)
    ax.set_xticklabels(labels, fontsize=8)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_ylabel("mean |log r| (nats), Shapley parts")
    ax.set_title("why is r != 1? mismatch per sampler group, split by cause (Shapley)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def attribution_history(reports, path: Path, parts: tuple[str, ...]) -> Path:
    """Each part's contribution to the mean ``|log r|`` of all tokens against the training step, one report (or
    its ``attribution.json`` dict) per step, stacked; ``parts`` as in :func:`attribution_bars`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = []
    for r in reports:
        d = r if isinstance(r, dict) else r.as_dict()
        if d.get("step") is None:
            raise ValueError("--history: every attribution report needs a 'step' (pass --step when it is made)")
        overall = next(s for s in d["slices"] if s["kind"] == "all")
        points.append((int(d["step"]), [overall["parts"][p]["mean_abs_log_r"] or 0.0 for p in parts]))
    points.sort(key=lambda p: p[0])
    steps = [p[0] for p in points]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.stackplot(steps, *[[p[1][j] for p in points] for j in range(len(parts))], labels=parts,
                 colors=PART_COLOURS, alpha=0.85)
    ax.set_xlabel("training step")
    ax.set_ylabel("mean |log r| (nats), Shapley parts")
    ax.set_title("mismatch by cause over training")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
