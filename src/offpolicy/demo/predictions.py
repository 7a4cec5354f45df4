"""The current pre-registration's predictions (docs/demo.md, "Pre-registration"), judged from the histories.

Primary outcome ``Y``: a run's mean exact held-out success over its evaluations after the start (``success_mean``
of :func:`offpolicy.demo.report.summarize`). Comparisons are paired over seeds (mean per-seed difference, 95 %
Student-t interval). A "below" / "above" claim is a hit when the interval lies entirely below / above 0; a "holds"
claim is a hit when the interval lies entirely inside ``[-MARGIN, +MARGIN]``. The grid is *void* (every verdict
"void") when the on-policy control's ``Y - start`` interval does not lie above 0 or any run skipped a step for a
non-finite gradient. One seed gives no interval: every verdict is then "undecided (one seed)".
"""

from __future__ import annotations

import math

from offpolicy.demo.report import DELTA, _interval_sign, _pair_text, aggregate, group_table, mean_ci, paired, summarize

#: Equivalence margin of the "holds" claims, in exact held-out success (registered before the grid).
MARGIN = DELTA
#: A corrected arm "removes drift" when its |<u, q - p>| is below this fraction of GRPO's on the same fleet.
DRIFT_FRACTION = 0.05


def _verdict(ok: bool | None, n: int) -> str:
    if ok is None:
        return "not run"
    if n < 2:
        return "undecided (one seed)"
    return "hit" if ok else "miss"


def _within(d: dict | None) -> bool | None:
    if d is None or math.isnan(d["ci"]):
        return None
    return -MARGIN <= d["diff"] - d["ci"] and d["diff"] + d["ci"] <= MARGIN


def judge(results: list[dict]) -> str:
    """A markdown table: prediction, what was measured, verdict (hit / miss / undecided / not run / void)."""
    summary = [summarize(r) for r in results]
    agg = {a["config"]: a for a in aggregate(summary)}
    n = min((a["seeds"] for a in agg.values()), default=0)
    rows: list[tuple[str, str, bool | None]] = []

    def pair(a: str, b: str, key: str = "success_mean") -> dict | None:
        return paired(summary, a, b, key) if a in agg and b in agg else None

    def sign_claim(label: str, a: str, b: str, want: int, key: str = "success_mean") -> None:
        d = pair(a, b, key)
        ok = None if d is None else (_interval_sign(d) == want if not math.isnan(d["ci"]) else False)
        rows.append((label, f"{key} {a} - {b}: {_pair_text(d)}", ok))

    def holds_claim(label: str, a: str, b: str = "grpo@onpolicy") -> None:
        d = pair(a, b)
        rows.append((label, f"success_mean {a} - {b}: {_pair_text(d)}; margin ±{MARGIN}",
                     None if d is None else bool(_within(d))))

    # Headline.
    sign_claim("H1 GRPO on the mixed fleet below the on-policy control", "grpo@mixed", "grpo@onpolicy", -1)
    holds_claim("H2 SC+MIS+top-p on the mixed fleet holds (equivalent to on-policy)", "sc_mis_topp@mixed")
    sign_claim("H3 SC+MIS+top-p above GRPO, mixed fleet", "sc_mis_topp@mixed", "grpo@mixed", 1)
    # The study's per-method observations ("Insights").
    sign_claim("S1 GRPO: pre-clip gradient norm grows more than SC+MIS+top-p's (mixed)", "grpo@mixed",
               "sc_mis_topp@mixed", 1, "grad_growth")
    sign_claim("S2a GRPO+MIS: gradient norm grows less than GRPO's (mixed)", "grpo_mis@mixed", "grpo@mixed", -1,
               "grad_growth")
    sign_claim("S2b GRPO+MIS: KL grows more than SC+MIS's (mixed)", "grpo_mis@mixed", "sc_mis@mixed", 1,
               "kl_growth")
    g = agg.get("grpo@mixed")
    sc = agg.get("sc@mixed")
    ok = None if g is None or sc is None else all(
        abs(sc[k]) < DRIFT_FRACTION * abs(g[k]) for k in ("drift_along_pos", "drift_along_neg"))
    rows.append(("S3a SC: drift removed (|<u, q-p>| < 5 % of GRPO's at both signs, mixed)",
                 "not run" if ok is None else
                 f"SC {sc['drift_along_pos']:.3g} / {sc['drift_along_neg']:.3g}; GRPO {g['drift_along_pos']:.3g} / "
                 f"{g['drift_along_neg']:.3g}", ok))
    sign_claim("S3b SC: KL grows more than SC+MIS's (mixed)", "sc@mixed", "sc_mis@mixed", 1, "kl_growth")
    sign_claim("S4a GRPO+top-p (replay): gradient norm grows less than GRPO's (mixed)", "grpo_topp@mixed",
               "grpo@mixed", -1, "grad_growth")
    sign_claim("S4b GRPO+top-p (replay): KL grows more than SC+MIS+top-p's (mixed)", "grpo_topp@mixed",
               "sc_mis_topp@mixed", 1, "kl_growth")
    holds_claim("S5a SC+MIS holds (equivalent to on-policy, mixed)", "sc_mis@mixed")
    sign_claim("S5b SC+MIS: KL grows less than GRPO's (mixed)", "sc_mis@mixed", "grpo@mixed", -1, "kl_growth")
    mixed = [a for a in agg.values() if a["fleet"] == "mixed" and a["weight_format"] == "seed"]
    best = min(mixed, key=lambda a: a["kl_full"]) if mixed else None
    rows.append(("S6 SC+MIS+top-p has the lowest mean KL of the mixed-fleet arms",
                 "not run" if best is None else f"lowest: {best['config']} ({best['kl_full']:.3g})",
                 None if best is None or "sc_mis_topp@mixed" not in agg else best["config"] == "sc_mis_topp@mixed"))
    sign_claim("S7 GRPO on the homogeneous fleet also below on-policy", "grpo@homogeneous", "grpo@onpolicy", -1)
    a, b = agg.get("sc_mis_topp@mixed"), agg.get("sc_mis_topp@homogeneous")
    rows.append(("S8 mixed / homogeneous KL (SC+MIS+top-p) >= 2",
                 "not run" if a is None or b is None else f"{a['kl_full'] / b['kl_full']:.2f}x",
                 None if a is None or b is None else a["kl_full"] / b["kl_full"] >= 2))
    gt = [r for r in group_table(results) if r["config"] == "sc_mis_topp@mixed"]
    if gt:
        nv = [r for r in gt if r["weights"] == "nvfp4"]
        bf = [r for r in gt if r["weights"] == "bf16"]
        nv_s, nv_e = sum(r["share_samples"] for r in nv), sum(r["share_extreme"] for r in nv)
        bf_s, bf_e = sum(r["share_samples"] for r in bf), sum(r["share_extreme"] for r in bf)
        rows.append(("S9 per group: NVFP4 over, BF16 under their share of samples in extreme-ratio tokens",
                     f"NVFP4 samples {nv_s:.3f} extreme {nv_e:.3f}; BF16 samples {bf_s:.3f} extreme {bf_e:.3f}",
                     nv_e > nv_s and bf_e < bf_s))
    else:
        rows.append(("S9 per group", "not run", None))
    ok = None if g is None else g["drift_along_pos"] > 0 > g["drift_along_neg"]
    rows.append(("D1 drift probe: GRPO moves p toward q at a > 0 and away at a < 0 (mixed)",
                 "not run" if g is None else f"{g['drift_along_pos']:.3g} / {g['drift_along_neg']:.3g}", ok))

    control = [s for s in summary if s["config"] == "grpo@onpolicy"]
    rise, rise_ci = mean_ci([s["success_mean"] - s["success_start"] for s in control])
    skipped = sum(any(h.get("skipped") for h in r["history"]) for r in results)
    void = bool(control) and n >= 2 and (not rise - rise_ci > 0 or skipped > 0)
    lines = [f"Void rule: on-policy control Y - start {rise:+.4f} ± {rise_ci:.4f}; {skipped} run(s) skipped a "
             f"step -> {'VOID' if void else 'not void'}", "", "| prediction | measured | verdict |", "|---|---|---|"]
    lines += [f"| {lab} | {txt} | {'void' if void and ok is not None else _verdict(ok, n)} |" for lab, txt, ok in rows]
    return "\n".join(lines) + "\n"
