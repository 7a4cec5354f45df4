"""Summaries, tables, files and plots of a demo run (a list of per-run result dicts from :func:`train.run`).

Per run: final reward (mean of the last tenth of the steps), best reward (best 10-step moving average), held-out
pass@1 / pass@k at the end, mean sampler-trainer KL (k3 on sampled tokens, and exact from the full
distributions), mean total-variation distance (the size of uncorrected GRPO's drift), peak gradient norm (before
clipping), final entropy, mean extreme-ratio share. Per arm and fleet: the mean and spread over seeds. Per sampler
group: the seed's table (share of samples, share of extreme-ratio tokens, KL), for every arm on the mixed fleet.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path

SUMMARY_KEYS = ("final_reward", "best_reward", "pass@1", "pass@k", "kl_k3", "kl_exact", "tv", "peak_grad_norm",
                "final_entropy", "extreme_ratio_frac", "staleness")
CURVES = (("reward", "training reward"), ("kl_k3", "sampler-trainer KL (k3)"), ("grad_norm", "gradient norm"),
          ("entropy", "entropy"), ("extreme_ratio_frac", "share of ratios outside [0.2, 5]"))


def _tail(xs: list[float]) -> list[float]:
    n = max(1, min(len(xs), max(5, len(xs) // 10)))
    return xs[-n:]


def _moving(xs: list[float], w: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= w:
            acc -= xs[i - w]
        out.append(acc / min(i + 1, w))
    return out


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(result: dict) -> dict:
    """One row of scalars for one run."""
    h = result["history"]
    col = {k: [r[k] for r in h] for k in h[0]}
    last = result["evals"][-1]
    k = result["config"]["pass_k"]
    w = min(10, len(h))
    return {
        "run_id": result["run_id"], "arm": result["config"]["arm"], "label": result["label"],
        "fleet": result["config"]["fleet"], "seed": result["config"]["seed"], "steps": len(h),
        "final_reward": _mean(_tail(col["reward"])),
        "best_reward": max(_moving(col["reward"], w)),
        "pass@1": last["pass@1"], "pass@k": last[f"pass@{k}"],
        "best_pass@k": max(e[f"pass@{k}"] for e in result["evals"]),
        "kl_k3": _mean(col["kl_k3"]), "kl_exact": _mean(col["kl_exact"]), "tv": _mean(col["tv"]),
        "peak_grad_norm": max(col["grad_norm"]), "final_entropy": _mean(_tail(col["entropy"])),
        "extreme_ratio_frac": _mean(col["extreme_ratio_frac"]), "staleness": _mean(col["staleness"]),
        "skipped_steps": sum(bool(s) for s in col["skipped"]), "seconds": result["seconds"],
    }


def aggregate(rows: list[dict]) -> list[dict]:
    """Mean and sample standard deviation over seeds for each (arm, fleet), in first-seen order."""
    order: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        order.setdefault((r["arm"], r["fleet"]), []).append(r)
    out = []
    for (arm, fleet), rs in order.items():
        agg = {"arm": arm, "label": rs[0]["label"], "fleet": fleet, "seeds": len(rs)}
        for key in SUMMARY_KEYS:
            vals = [r[key] for r in rs]
            agg[key] = _mean(vals)
            agg[key + "_std"] = statistics.stdev(vals) if len(vals) > 1 else 0.0
        out.append(agg)
    return out


def group_table(results: list[dict]) -> list[dict]:
    """Per (arm, fleet, group): the seed's per-group quantities, averaged over seeds."""
    acc: dict[tuple[str, str, str], list[dict]] = {}
    for res in results:
        for g in res["groups"]:
            acc.setdefault((res["config"]["arm"], res["config"]["fleet"], g["group"]), []).append(g)
    out = []
    for (arm, fleet, name), gs in acc.items():
        row = {"arm": arm, "fleet": fleet, "group": name}
        for key in ("weights", "kv", "compute", "attention"):
            row[key] = gs[0][key]
        for key in ("capacity_share", "share_samples", "share_extreme", "extreme_frac", "kl_k3", "kl_exact", "tv",
                    "staleness"):
            row[key] = _mean([g[key] for g in gs])
        out.append(row)
    return out


def _fmt(x, digits: int = 3) -> str:
    if isinstance(x, float):
        if math.isnan(x):
            return "n/a"
        return f"{x:.{digits}f}"
    return str(x)


def markdown_table(rows: list[dict], cols: list[tuple[str, str]], std: bool = False) -> str:
    """A Markdown table of ``rows`` with ``cols`` = (key, header); ``std`` appends ``+- key_std`` when present."""
    head = "| " + " | ".join(h for _, h in cols) + " |"
    sep = "|" + "|".join("---" for _ in cols) + "|"
    lines = [head, sep]
    for r in rows:
        cells = []
        for key, _ in cols:
            cell = _fmt(r[key])
            if std and isinstance(r.get(key + "_std"), float) and r.get("seeds", 1) > 1:
                cell += f" ± {_fmt(r[key + '_std'])}"
            cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tables_text(results: list[dict], pass_k: int) -> str:
    """The arm table and the per-group tables, as Markdown."""
    arms = aggregate([summarize(r) for r in results])
    cols = [("label", "arm"), ("fleet", "fleet"), ("seeds", "seeds"), ("final_reward", "final reward"),
            ("best_reward", "best reward"), ("pass@1", "held-out pass@1"), ("pass@k", f"held-out pass@{pass_k}"),
            ("kl_k3", "mean KL (k3)"), ("tv", "mean TV (drift)"), ("peak_grad_norm", "peak grad norm"),
            ("final_entropy", "final entropy"), ("extreme_ratio_frac", "extreme-ratio share")]
    parts = ["## Arms (mean ± std over seeds)", "", markdown_table(arms, cols, std=True)]
    groups = group_table(results)
    gcols = [("group", "group"), ("weights", "weights"), ("kv", "KV"), ("share_samples", "share of samples"),
             ("share_extreme", "share of extreme-ratio tokens"), ("extreme_frac", "extreme-ratio share in group"),
             ("kl_k3", "KL (k3)"), ("staleness", "mean staleness")]
    for arm, fleet in dict.fromkeys((g["arm"], g["fleet"]) for g in groups):
        rows = [g for g in groups if g["arm"] == arm and g["fleet"] == fleet]
        label = next(r["label"] for r in results if r["config"]["arm"] == arm)
        parts += ["", f"## Per sampler group: {label} on the {fleet} fleet", "", markdown_table(rows, gcols)]
    return "\n".join(parts) + "\n"


def _write_csv(path: Path, rows: list[dict]) -> None:
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def write_outputs(results: list[dict], out: Path, meta: dict, plots: bool = True) -> dict[str, Path]:
    """Write ``results.json``, the CSV files, ``tables.md`` and (with matplotlib) the PNG plots into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    pass_k = results[0]["config"]["pass_k"]
    summary = [summarize(r) for r in results]
    files = {
        "results.json": out / "results.json", "summary.csv": out / "summary.csv", "arms.csv": out / "arms.csv",
        "groups.csv": out / "groups.csv", "history.csv": out / "history.csv", "evals.csv": out / "evals.csv",
        "tables.md": out / "tables.md",
    }
    with open(files["results.json"], "w") as f:
        json.dump({"meta": meta, "summary": summary, "arms": aggregate(summary), "groups": group_table(results),
                   "runs": results}, f, indent=1)
    _write_csv(files["summary.csv"], summary)
    _write_csv(files["arms.csv"], aggregate(summary))
    _write_csv(files["groups.csv"], [dict(run_id=r["run_id"], **g) for r in results for g in r["groups"]])
    _write_csv(files["history.csv"], [dict(run_id=r["run_id"], **h) for r in results for h in r["history"]])
    _write_csv(files["evals.csv"], [dict(run_id=r["run_id"], **e) for r in results for e in r["evals"]])
    files["tables.md"].write_text(tables_text(results, pass_k))
    if plots:
        files.update(write_plots(results, out))
    return files


def write_plots(results: list[dict], out: Path) -> dict[str, Path]:
    """``curves.png`` (reward, KL, grad norm, entropy, extreme-ratio share over steps, one line per arm and
    fleet, mean over seeds, 10-step moving average), ``pass_at_k.png`` and ``groups.png``. Empty without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    series: dict[tuple[str, str], list[dict]] = {}
    for r in results:
        series.setdefault((r["label"], r["config"]["fleet"]), []).append(r)
    labels = list(dict.fromkeys(lbl for lbl, _ in series))
    colors = {lbl: plt.get_cmap("tab10")(i % 10) for i, lbl in enumerate(labels)}
    style = {"mixed": "-", "homogeneous": "--"}
    files: dict[str, Path] = {}

    fleets = list(dict.fromkeys(fleet for _, fleet in series))
    fig, axes = plt.subplots(len(fleets), len(CURVES), figsize=(3.6 * len(CURVES), 3.0 * len(fleets)),
                             squeeze=False, sharex=True)
    for row, fleet in enumerate(fleets):
        for col, (key, title) in enumerate(CURVES):
            ax = axes[row][col]
            positive = False
            for (lbl, f), rs in series.items():
                if f != fleet:
                    continue
                n = min(len(r["history"]) for r in rs)
                mean = _moving([_mean([r["history"][i][key] for r in rs]) for i in range(n)], min(10, n))
                positive = positive or any(v > 0 for v in mean)
                ax.plot(range(1, n + 1), mean, color=colors[lbl], label=lbl, lw=1.3)
            ax.set_title(f"{title}\n({fleet} fleet)", fontsize=9)
            if key in ("grad_norm", "kl_k3", "extreme_ratio_frac") and positive:
                ax.set_yscale("log")
            if key in ("kl_k3", "extreme_ratio_frac") and positive:
                # Step 0 has no staleness: the homogeneous fleet's KL there is ~1e-13 (kernels only) and its
                # extreme share 0; the axis starts at 1e-4 so that the rest of the run stays readable.
                ax.set_ylim(bottom=1e-4)
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize=8)
            if row == len(fleets) - 1:
                ax.set_xlabel("step", fontsize=8)
    axes[0][0].legend(fontsize=7, loc="best")
    fig.suptitle("mean over seeds, 10-step moving average", fontsize=9)
    fig.tight_layout()
    files["curves.png"] = out / "curves.png"
    fig.savefig(files["curves.png"], dpi=100)
    plt.close(fig)

    k = results[0]["config"]["pass_k"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for (lbl, fleet), rs in series.items():
        steps = [e["step"] for e in rs[0]["evals"]]
        vals = [_mean([r["evals"][i][f"pass@{k}"] for r in rs]) for i in range(len(steps))]
        ax.plot(steps, vals, style.get(fleet, "-"), marker="o", ms=3, color=colors[lbl], label=f"{lbl} ({fleet})")
    ax.set_xlabel("step")
    ax.set_ylabel(f"held-out pass@{k} (trainer weights, full vocabulary)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    files["pass_at_k.png"] = out / "pass_at_k.png"
    fig.savefig(files["pass_at_k.png"], dpi=110)
    plt.close(fig)

    groups = [g for g in group_table(results) if g["fleet"] == "mixed"]
    if groups:
        arm = "sc_mis_topp" if any(g["arm"] == "sc_mis_topp" for g in groups) else groups[0]["arm"]
        rows = [g for g in groups if g["arm"] == arm]
        fig, ax = plt.subplots(figsize=(7, 3.8))
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [g["share_samples"] for g in rows], 0.4, label="share of samples")
        ax.bar([i + 0.2 for i in x], [g["share_extreme"] for g in rows], 0.4,
               label="share of tokens with ratio outside [0.2, 5]")
        ax.set_xticks(list(x), [f"{g['group']}" for g in rows], rotation=20, fontsize=8)
        label = next(r["label"] for r in results if r["config"]["arm"] == arm)
        ax.set_title(f"{label}, mixed fleet: per sampler group", fontsize=10)
        ax.legend(fontsize=8)
        fig.tight_layout()
        files["groups.png"] = out / "groups.png"
        fig.savefig(files["groups.png"], dpi=110)
        plt.close(fig)
    return files
