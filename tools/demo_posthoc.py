"""Paired comparisons of a demo grid that its registration did not name: **post hoc**, never a verdict.

    .venv/bin/python tools/demo_posthoc.py docs/demo_results/full_gridA/seed*.runs.json.gz > posthoc.md

Reads the histories the report reads (``offpolicy demo --report-only``) and prints, per pair, the mean per-seed
difference with its 95 % Student-t interval (``offpolicy.demo.report.paired``) for the primary outcome ``Y``
(``success_mean``) and for the per-run scalars named below: what the mixed fleet's numerics add (the mixed against
the homogeneous fleet, arm by arm: on top of the shared staleness where the runs have one, alone where their
staleness is 0), what top-p costs each arm, and each arm against the on-policy
control; then each configuration's change of entropy (last tenth of the steps minus the first), and how many
optimizer steps the gradient clip acted on (``clipped`` in each step's history) with the smallest pre-clip norm.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

from offpolicy.demo.report import PairedDifference, mean_ci, paired, summarize

ARMS = ("grpo", "grpo_mis", "sc", "grpo_topp_noreplay", "grpo_topp", "sc_mis", "sc_mis_topp")
TOP_P = (("grpo_topp", "grpo"), ("grpo_topp_noreplay", "grpo"), ("sc_mis_topp", "sc_mis"))


def _row(d: PairedDifference | None, why: str) -> str:
    if d is None:
        return f"| {why} | - | - | 0 | - |"
    lo, hi = d.diff - d.ci, d.diff + d.ci
    side = "below 0" if hi < 0 else "above 0" if lo > 0 else "includes 0"
    return f"| {why} | {d.a} - {d.b} | {d.diff:+.4f} ± {d.ci:.4f} | {d.seeds} | {side} |"


def report(paths: list[str]) -> str:
    results = []
    for path in paths:
        if not Path(path).is_file():
            raise SystemExit(f"not a file: {path} (expected a demo output's runs.json.gz)")
        with gzip.open(path, "rt") as f:
            results += json.load(f)["runs"]
    rows = [summarize(r) for r in results]
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
    steps = [h for r in results for h in r["history"]]
    clipped = sum(bool(h["clipped"]) for h in steps)
    smallest = min(h["grad_norm_preclip"] for h in steps)
    out += ["", f"Gradient clipping: {clipped:,} of {len(steps):,} optimizer steps clipped; "
                f"smallest pre-clip gradient norm {smallest:.3g}."]
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    sys.stdout.write(report(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
