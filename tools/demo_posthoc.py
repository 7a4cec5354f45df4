"""Paired comparisons of a demo grid that its registration did not name: **post hoc**, never a verdict.

    .venv/bin/python tools/demo_posthoc.py docs/demo_results/full_gridA/seed*.runs.json.gz > posthoc.md

Reads the histories the report reads (``offpolicy demo --report-only``) and prints, per pair, the mean per-seed
difference with its 95 % Student-t interval (``offpolicy.demo.report.paired``) for the primary outcome ``Y``
(``success_mean``) and for the per-run scalars named below: what the mixed fleet's numerics add (the mixed against
the homogeneous fleet, arm by arm: on top of the shared staleness where the runs have one, alone where their
staleness is 0), what top-p costs each arm, and each arm against the on-policy
control; then each configuration's change of entropy (last tenth of the steps minus the first), how many
optimizer steps the gradient clip acted on (``clipped`` in each step's history) with the smallest pre-clip norm,
and Holm's step-down correction over the registration's interval claims (the registration named no correction for
its 17 predictions; the claims judged by a rule, not an interval, get no p-value and are listed as such).

Grid C's histories (``grid`` "C"; its registration applies Holm's correction itself, in ``tables.md``) get their own
pairs, chosen before the grid's data was read: GRPO and routing replay + TIS at each weight format against the
on-policy control (numerics alone, format by format), routing replay + TIS against GRPO at the same format, each
NVFP4 arm against its control (top-p arms on the nucleus outcome ``Y_p`` against the on-policy top-p control, and on
the full-distribution ``Y`` against the on-policy control: the confound of grids A and B, shown, not judged), the
staleness-4 runs against their staleness-0 counterparts; the mean KL and route-flip share of routing replay + TIS
against GRPO per format; then per configuration the entropy change, the share of sampled tokens MIS's band masked
(``masked_frac``; 0 for arms without MIS), and the clipping count; and, where the seeds ran on more than one kind of
machine (each file's ``meta``: CPU, torch's CPU capability, the warm-up it loaded), every registered interval claim's
paired difference on each machine's seeds alone.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

from offpolicy.demo.claims import Direction, Equivalent
from offpolicy.demo.predictions import CURRENT, GRID_C
from offpolicy.demo.report import PairedDifference, mean_ci, paired, summarize, t_cdf, t_quantile

ALPHA = 0.05

ARMS = ("grpo", "grpo_mis", "sc", "grpo_topp_noreplay", "grpo_topp", "sc_mis", "sc_mis_topp")
TOP_P = (("grpo_topp", "grpo"), ("grpo_topp_noreplay", "grpo"), ("sc_mis_topp", "sc_mis"))


def _row(d: PairedDifference | None, why: str) -> str:
    if d is None:
        return f"| {why} | - | - | 0 | - |"
    lo, hi = d.diff - d.ci, d.diff + d.ci
    side = "below 0" if hi < 0 else "above 0" if lo > 0 else "includes 0"
    return f"| {why} | {d.a} - {d.b} | {d.diff:+.4f} ± {d.ci:.4f} | {d.seeds} | {side} |"


def claim_p_value(claim, rows) -> tuple[float, str] | None:
    """The two-sided p-value that matches the registration's interval rule for ``claim``, or None when the claim is
    not an interval claim (or did not run). A direction claim hits when the 95 % interval excludes 0 on the wanted
    side: ``p = 2 P(T > |t|)`` when the mean has the wanted sign, else 1. A "holds" claim hits when the 95 % interval
    lies inside ``±margin`` (two one-sided tests at 2.5 % each): ``p = 2 max(p_low, p_high)``. Both are < 0.05
    exactly when the registered verdict is a hit."""
    if isinstance(claim, Direction):
        d = paired(rows, claim.a, claim.b, claim.key)
    elif isinstance(claim, Equivalent):
        d = paired(rows, claim.a, claim.b, "success_mean")
    else:
        return None
    if d is None or d.seeds < 2 or not d.ci > 0:
        return None
    df = d.seeds - 1
    se = d.ci / t_quantile(0.975, df)
    if isinstance(claim, Direction):
        t = d.diff / se
        p = 2 * (1 - t_cdf(abs(t), df)) if t * claim.want > 0 else 1.0
        return min(p, 1.0), f"{d.diff:+.4f} ± {d.ci:.4f}, t = {t:+.2f}"
    p_low = 1 - t_cdf((d.diff + claim.margin) / se, df)
    p_high = 1 - t_cdf((claim.margin - d.diff) / se, df)
    return min(2 * max(p_low, p_high), 1.0), f"{d.diff:+.4f} ± {d.ci:.4f}, margin ±{claim.margin}"


def holm_table(rows) -> list[str]:
    """Holm's step-down correction at family-wise 0.05 over the registration's interval claims."""
    tested, untested = [], []
    for claim in CURRENT.claims:
        got = claim_p_value(claim, rows)
        (tested if got is not None else untested).append((claim.label, got))
    order = sorted(range(len(tested)), key=lambda i: tested[i][1][0])
    keep, going = {}, True
    for rank, i in enumerate(order):
        going = going and tested[i][1][0] <= ALPHA / (len(tested) - rank)
        keep[i] = going
    out = [f"Holm's correction over the {len(tested)} registered interval claims (post hoc: the registration named "
           f"no correction; family-wise {ALPHA}):", "",
           "| prediction | difference | p | registered verdict | after Holm |", "|---|---|---|---|---|"]
    for i, (label, (p, text)) in enumerate(tested):
        out.append(f"| {label} | {text} | {p:.2g} | {'hit' if p < ALPHA else 'miss'} | "
                   f"{'hit' if keep[i] else 'miss'} |")
    hits = sum(p < ALPHA for _, (p, _) in tested)
    out += ["", f"{sum(keep.values())} of {hits} interval hits survive Holm's correction. Judged by a rule, with no "
            f"p-value: {'; '.join(label.split(' ')[0] for label, _ in untested)}."]
    return out


FORMATS_C = ("bf16", "fp8", "nvfp4", "mxfp4")


def _clipping(results: list[dict]) -> str:
    """How many optimizer steps the clip acted on (each step's ``clipped``), with the smallest pre-clip norm."""
    steps = [h for r in results for h in r["history"]]
    clipped = sum(bool(h["clipped"]) for h in steps)
    smallest = min(h["grad_norm_preclip"] for h in steps)
    return (f"Gradient clipping: {clipped:,} of {len(steps):,} optimizer steps clipped; "
            f"smallest pre-clip gradient norm {smallest:.3g}.")


def _pairs(title: str, key: str, pairs: list[tuple[str, str, str]], rows) -> list[str]:
    out = [f"Paired differences of {title} (`{key}`):", "",
           "| question | pair | difference | seeds | 95 % interval |", "|---|---|---|---|---|"]
    return out + [_row(paired(rows, a, b, key), why) for why, a, b in pairs] + [""]


def report_grid_c(results: list[dict], rows, paths: list[str]) -> str:
    """Grid C's post-hoc pairs (see the module docstring); no Holm table: its registration corrects in tables.md."""
    seeds = sorted({r.seed for r in rows})
    nv = "@mixed:nvfp4"
    out = [f"Post hoc (not registered; no verdict rests on it): {len(results)} runs, seeds {seeds[0]} .. "
           f"{seeds[-1]} ({len(seeds)}), from {len(paths)} file(s). Grid C: the registered verdicts, with Holm's "
           "correction, are in tables.md.", ""]
    rr = [("routing replay + TIS against GRPO, same format", f"rr_tis@mixed:{f}", f"grpo@mixed:{f}")
          for f in FORMATS_C]
    y = [("numerics alone, by format", f"grpo@mixed:{f}", "grpo@onpolicy") for f in FORMATS_C]
    y += [("routing replay + TIS against the control", f"rr_tis@mixed:{f}", "grpo@onpolicy") for f in FORMATS_C]
    y += rr
    y += [("NVFP4 arm against the control", f"{a}{nv}", "grpo@onpolicy") for a in ("grpo_mis", "sc", "sc_mis")]
    y += [("top-p arm on Y against the full control (the A/B confound)", a, "grpo@onpolicy")
          for a in ("grpo_topp@onpolicy", f"sc_mis_topp{nv}", f"sc_mis_topp_rr{nv}")]
    y += [("what top-p changes, on Y", f"sc_mis_topp{nv}", f"sc_mis{nv}"),
          ("staleness 4 on top of NVFP4, against the control", f"grpo{nv}~st4", "grpo@onpolicy"),
          ("staleness 4 alone, homogeneous against homogeneous", "grpo@homogeneous~st4", "grpo@homogeneous")]
    yp = [("top-p arm on Y_p against the on-policy top-p control", f"sc_mis_topp_rr{nv}", "grpo_topp@onpolicy"),
          ("the two on-policy controls on Y_p", "grpo_topp@onpolicy", "grpo@onpolicy")]
    out += _pairs("Y, mean exact held-out success after the start", "success_mean", y, rows)
    out += _pairs("Y_p, mean exact held-out success under the trainer's nucleus after the start",
                  "success_topp_mean", yp, rows)
    out += _pairs("mean full-distribution KL(q || p) per token", "kl_full", rr, rows)
    out += _pairs("mean route-flip share", "route_flip", rr, rows)
    out += ["Per configuration (mean over seeds): entropy change (last tenth minus first tenth of the steps), share of "
            "sampled tokens MIS's band [0.2, 5] masked (`masked_frac`; 0 for arms without MIS):", "",
            "| configuration | entropy change | MIS masked share | seeds |", "|---|---|---|---|"]
    for config in dict.fromkeys(r.config for r in rows):
        mean, ci = mean_ci([r.final_entropy - r.entropy_start for r in rows if r.config == config])
        masked = mean_ci([sum(h["masked_frac"] for h in r["history"]) / len(r["history"])
                          for row, r in zip(rows, results) if row.config == config])
        out.append(f"| {config} | {mean:+.4f} ± {ci:.4f} | {masked[0]:.4g} ± {masked[1]:.2g} | "
                   f"{sum(r.config == config for r in rows)} |")
    out += ["", _clipping(results)]
    machines = dict.fromkeys(r["machine"] for r in results)
    if len(machines) > 1:
        out += ["", "By machine: the registered interval claims' paired differences on each machine's seeds alone "
                "(the grid's verdicts are read on all seeds together):", "",
                "| prediction | pair | " + " | ".join(machines) + " |", "|---|---|" + "---|" * len(machines)]
        by = {m: [row for row, r in zip(rows, results) if r["machine"] == m] for m in machines}
        for claim in GRID_C.claims:
            if not isinstance(claim, (Direction, Equivalent)):
                continue
            cells = []
            for m in machines:
                d = paired(by[m], claim.a, claim.b, claim.key)
                cells.append(f"{d.diff:+.4f} ± {d.ci:.4f} (n = {d.seeds})" if d else "-")
            out.append(f"| {claim.label.split(' ')[0]} | {claim.key} {claim.a} - {claim.b} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def report(paths: list[str]) -> str:
    results = []
    for path in paths:
        if not Path(path).is_file():
            raise SystemExit(f"not a file: {path} (expected a demo output's runs.json.gz)")
        with gzip.open(path, "rt") as f:
            data = json.load(f)
        meta = data.get("meta", {})
        machine = (f"{meta.get('cpu', '?')}, {meta.get('torch_cpu_capability', '?')}, warm-up success "
                   f"{meta.get('warmup', {}).get('success', float('nan')):.4f}")
        results += [dict(r, machine=machine) for r in data["runs"]]
    rows = [summarize(r) for r in results]
    if any(r.get("grid") == "C" for r in results):
        return report_grid_c(results, rows, paths)
    stale = any(r["config"]["staleness"] > 0 for r in results)
    numerics = "numerics on top of staleness" if stale else "numerics alone (staleness 0)"
    seeds = sorted({r.seed for r in rows})
    out = [f"Post hoc (not registered; no verdict rests on it): {len(results)} runs, seeds {seeds[0]} .. "
           f"{seeds[-1]} ({len(seeds)}), from {len(paths)} file(s).", ""]
    for key, title in (("success_mean", "Y, mean exact held-out success after the start"),
                       ("kl_full", "mean full-distribution KL(q || p) per token"),
                       ("final_entropy", "entropy, last tenth of the steps")):
        out += [f"Paired differences of {title} (`{key}`):", "",
                "| question | pair | difference | seeds | 95 % interval |", "|---|---|---|---|---|"]
        for arm in ARMS:
            out.append(_row(paired(rows, f"{arm}@mixed", f"{arm}@homogeneous", key), numerics))
        for fleet in ("mixed", "homogeneous"):
            for with_p, without in TOP_P:
                out.append(_row(paired(rows, f"{with_p}@{fleet}", f"{without}@{fleet}", key), "what top-p changes"))
        if key == "success_mean":
            for fleet in ("mixed", "homogeneous"):
                for arm in ARMS:
                    out.append(_row(paired(rows, f"{arm}@{fleet}", "grpo@onpolicy", key), "against the control"))
        out.append("")
    out += ["Entropy over training (last tenth minus first tenth of the steps, mean over seeds):", "",
            "| configuration | change | seeds |", "|---|---|---|"]
    for config in dict.fromkeys(r.config for r in rows):
        mean, ci = mean_ci([r.final_entropy - r.entropy_start for r in rows if r.config == config])
        out.append(f"| {config} | {mean:+.4f} ± {ci:.4f} | {sum(r.config == config for r in rows)} |")
    out += ["", _clipping(results), ""]
    out += holm_table(rows)
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    sys.stdout.write(report(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
