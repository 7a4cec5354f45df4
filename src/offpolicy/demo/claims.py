"""The kinds of pre-registered claim and how a registration is judged from the histories (the registrations
themselves are data: :mod:`offpolicy.demo.predictions`).

Each claim is a frozen dataclass whose ``find`` measures it on the :class:`Evidence` of a grid and returns a
:class:`Finding` (what was measured, whether it holds, the interval half-width it rests on), or None where the
registration leaves its row out. :func:`judge` renders a :class:`Registration`'s findings as a markdown table.

Comparisons are paired over seeds (:func:`offpolicy.demo.report.paired`). A direction claim (``want`` -1 / +1) is a
hit when the 95 % interval lies entirely below / above 0 (``want`` 0: it contains 0); an equivalence claim is a hit
when the interval lies entirely inside ``[-margin, +margin]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from offpolicy.demo.report import (ConfigSummary, PairedDifference, RunSummary, _fmt, _interval_sign, _pair_text,
                                   aggregate, group_table, mean_ci, paired, summarize, t_cdf, t_quantile)


@dataclass(frozen=True)
class Evidence:
    """A grid's histories (``results``), their per-run rows and the per-configuration rows by configuration."""

    results: list[dict]
    summary: list[RunSummary]
    configs: dict[str, ConfigSummary]

    @classmethod
    def of(cls, results: list[dict]) -> Evidence:
        summary = [summarize(r) for r in results]
        return cls(results, summary, {a.config: a for a in aggregate(summary)})

    def pair(self, a: str, b: str, key: str) -> PairedDifference | None:
        """The paired difference ``a - b`` of ``key``; None unless both configurations ran."""
        return paired(self.summary, a, b, key) if a in self.configs and b in self.configs else None


@dataclass(frozen=True)
class Finding:
    """One row of a verdict table: ``ok`` None when the claim was not run; ``ci`` the half-width of the interval
    the verdict rests on (nan: one seed, no interval; 0 where the claim needs none)."""

    label: str
    measured: str
    ok: bool | None
    ci: float = 0.0
    #: The two-sided p-value that matches the interval rule (< 0.05 exactly when an interval claim hits), for
    #: Holm's correction; None for a claim judged by a rule without an interval, or with fewer than 2 seeds.
    p: float | None = None


def direction_p(d: PairedDifference | None, want: int) -> float | None:
    """``2 P(T > |t|)`` when the mean difference has the wanted sign (``want`` +-1), else 1; None without an
    interval. It is < 0.05 exactly when the 95 % interval excludes 0 on the wanted side."""
    if d is None or d.seeds < 2 or not d.ci > 0 or want == 0:
        return None
    df = d.seeds - 1
    t = d.diff / (d.ci / t_quantile(0.975, df))
    return min(1.0, 2 * (1 - t_cdf(abs(t), df))) if t * want > 0 else 1.0


def equivalence_p(d: PairedDifference | None, margin: float) -> float | None:
    """Two one-sided tests at 2.5 % each: ``2 max(p_low, p_high)``, < 0.05 exactly when the 95 % interval lies
    inside ``±margin``; None without an interval."""
    if d is None or d.seeds < 2 or not d.ci > 0:
        return None
    df = d.seeds - 1
    se = d.ci / t_quantile(0.975, df)
    p_low = 1 - t_cdf((d.diff + margin) / se, df)
    p_high = 1 - t_cdf((margin - d.diff) / se, df)
    return min(1.0, 2 * max(p_low, p_high))


def holm(ps: list[float], alpha: float = 0.05) -> list[bool]:
    """Holm's step-down procedure: which of the hypotheses with p-values ``ps`` are rejected at family-wise
    ``alpha`` (sorted ascending, the i-th smallest (0-based) is compared with ``alpha / (m - i)``, stopping at the
    first that fails)."""
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    keep = [False] * len(ps)
    for rank, i in enumerate(order):
        if ps[i] > alpha / (len(ps) - rank):
            break
        keep[i] = True
    return keep


class Claim(Protocol):
    label: str

    def find(self, ev: Evidence) -> Finding | None: ...


@dataclass(frozen=True)
class Direction:
    """``a - b`` of ``key`` lies below (``want`` -1) or above (+1) 0; a missing interval counts as a miss."""

    label: str
    a: str
    b: str
    want: int
    key: str = "success_mean"

    def find(self, ev: Evidence) -> Finding:
        d = ev.pair(self.a, self.b, self.key)
        ok = None if d is None else (_interval_sign(d) == self.want if not math.isnan(d.ci) else False)
        return Finding(self.label, f"{self.key} {self.a} - {self.b}: {_pair_text(d)}", ok,
                       p=direction_p(d, self.want))


@dataclass(frozen=True)
class Equivalent:
    """``a - b`` of ``key`` (the primary outcome by default) lies within ``±margin`` ("holds")."""

    label: str
    a: str
    margin: float
    b: str = "grpo@onpolicy"
    key: str = "success_mean"

    def find(self, ev: Evidence) -> Finding:
        d = ev.pair(self.a, self.b, self.key)
        within = d is not None and not math.isnan(d.ci) and -self.margin <= d.diff - d.ci and \
            d.diff + d.ci <= self.margin
        return Finding(self.label, f"{self.key} {self.a} - {self.b}: {_pair_text(d)}; margin ±{self.margin}",
                       None if d is None else within, p=equivalence_p(d, self.margin))


@dataclass(frozen=True)
class DriftRemoved:
    """``config``'s drift probe ``|<u, q - p>|`` is below ``fraction`` of ``base``'s at both signs."""

    label: str
    config: str
    base: str
    fraction: float
    names: tuple[str, str]

    def find(self, ev: Evidence) -> Finding:
        c, g = ev.configs.get(self.config), ev.configs.get(self.base)
        if c is None or g is None:
            return Finding(self.label, "not run", None)
        keys = ("drift_along_pos", "drift_along_neg")
        ok = all(abs(c.mean(k)) < self.fraction * abs(g.mean(k)) for k in keys)
        return Finding(self.label, f"{self.names[0]} {c.mean(keys[0]):.3g} / {c.mean(keys[1]):.3g}; "
                                   f"{self.names[1]} {g.mean(keys[0]):.3g} / {g.mean(keys[1]):.3g}", ok)


@dataclass(frozen=True)
class DriftSigns:
    """``config``'s update moves p toward q at a > 0 and away at a < 0."""

    label: str
    config: str

    def find(self, ev: Evidence) -> Finding:
        g = ev.configs.get(self.config)
        if g is None:
            return Finding(self.label, "not run", None)
        pos, neg = g.mean("drift_along_pos"), g.mean("drift_along_neg")
        return Finding(self.label, f"{pos:.3g} / {neg:.3g}", pos > 0 > neg)


@dataclass(frozen=True)
class LowestKL:
    """``config`` has the lowest mean full-distribution KL of the mixed-fleet arms at weight format ``fmt`` (the
    study's per-group formats by default), untagged runs only."""

    label: str
    config: str
    fmt: str = "seed"

    def find(self, ev: Evidence) -> Finding:
        mixed = [a for a in ev.configs.values()
                 if a.fleet == "mixed" and a.weight_format == self.fmt and "~" not in a.config]
        if not mixed:
            return Finding(self.label, "not run", None)
        best = min(mixed, key=lambda a: a.mean("kl_full"))
        return Finding(self.label, f"lowest: {best.config} ({best.mean('kl_full'):.3g})",
                       None if self.config not in ev.configs else best.config == self.config)


@dataclass(frozen=True)
class KLRatio:
    """``a``'s mean full-distribution KL is at least ``at_least`` times ``b``'s. ``show_means``: the earlier
    registration's row (both means, the ratio to one decimal, no row when not run)."""

    label: str
    a: str
    b: str
    at_least: float
    show_means: bool = False

    def find(self, ev: Evidence) -> Finding | None:
        a, b = ev.configs.get(self.a), ev.configs.get(self.b)
        if a is None or b is None:
            return None if self.show_means else Finding(self.label, "not run", None)
        ratio = a.mean("kl_full") / b.mean("kl_full")
        text = (f"{_fmt(a.mean('kl_full'))} / {_fmt(b.mean('kl_full'))} = {ratio:.1f}x" if self.show_means
                else f"{ratio:.2f}x")
        return Finding(self.label, text, ratio >= self.at_least)


@dataclass(frozen=True)
class Rises:
    """The mean of ``key`` over seeds rises strictly through ``configs`` (in the given order)."""

    label: str
    configs: tuple[str, ...]
    key: str

    def find(self, ev: Evidence) -> Finding:
        rows = [ev.configs.get(c) for c in self.configs]
        if any(r is None for r in rows):
            return Finding(self.label, "not run", None)
        vals = [r.mean(self.key) for r in rows]
        return Finding(self.label, f"{self.key}: " + " < ".join(f"{c} {_fmt(v)}" for c, v in zip(self.configs, vals)),
                       all(a < b for a, b in zip(vals, vals[1:])))


@dataclass(frozen=True)
class GroupShares:
    """On ``config``, the NVFP4 groups' share of extreme-ratio tokens exceeds their share of samples and the BF16
    groups' falls below it (row ``not_run_label`` when no group ran)."""

    label: str
    config: str
    not_run_label: str

    def find(self, ev: Evidence) -> Finding:
        gt = [g for g in group_table(ev.results) if g.config == self.config]
        if not gt:
            return Finding(self.not_run_label, "not run", None)
        nv = [g for g in gt if g.weights == "nvfp4"]
        bf = [g for g in gt if g.weights == "bf16"]
        nv_s, nv_e = sum(g.share_samples for g in nv), sum(g.share_extreme for g in nv)
        bf_s, bf_e = sum(g.share_samples for g in bf), sum(g.share_extreme for g in bf)
        return Finding(self.label, f"NVFP4 samples {nv_s:.3f} extreme {nv_e:.3f}; BF16 samples {bf_s:.3f} extreme "
                                   f"{bf_e:.3f}", nv_e > nv_s and bf_e < bf_s)


@dataclass(frozen=True)
class ControlRises:
    """The on-policy control's exact success change has an interval above 0 (earlier registration)."""

    label: str
    config: str = "grpo@onpolicy"

    def find(self, ev: Evidence) -> Finding:
        c = ev.configs.get(self.config)
        if c is None:
            return Finding(self.label, "not run", None)
        change, ci = c.mean("success_change"), c.ci("success_change")
        return Finding(self.label, f"exact success change {_fmt(change, ci, 4)}", change - ci > 0, ci)


@dataclass(frozen=True)
class NoCollapse:
    """No run collapses and none blows up (earlier registration)."""

    label: str

    def find(self, ev: Evidence) -> Finding:
        n_col = sum(s.collapsed for s in ev.summary)
        n_kl = sum(s.kl_blowup for s in ev.summary)
        return Finding(self.label, f"{n_col} of {len(ev.summary)} runs collapse, {n_kl} blow up",
                       n_col == 0 and n_kl == 0)


@dataclass(frozen=True)
class FinalDirection:
    """The paired final exact success ``a - b`` lies below (``want`` -1), above (+1) or around (0) zero (earlier
    registration)."""

    label: str
    a: str
    b: str
    want: int

    def find(self, ev: Evidence) -> Finding:
        d = ev.pair(self.a, self.b, "success_end")
        return Finding(self.label, f"paired final exact success {self.a} - {self.b}: {_pair_text(d)}",
                       None if d is None else _interval_sign(d) == self.want, 0.0 if d is None else d.ci)


@dataclass(frozen=True)
class EarlierDrift:
    """The earlier registration's drift probe (a = -1 only): GRPO's ``<u, q - p>`` is negative in every run and
    larger on the mixed than on the homogeneous fleet, GRPO+MIS moves mass onto masked ids in every run, and the
    score-centred arms' drift is below ``fraction`` of GRPO's on the mixed fleet."""

    label: str
    fraction: float

    def find(self, ev: Evidence) -> Finding:
        agg = ev.configs
        g_m, g_h, m_mis = agg.get("grpo@mixed"), agg.get("grpo@homogeneous"), agg.get("grpo_mis@mixed")
        sc = [agg[k] for k in ("sc_mis@mixed", "sc_mis_topp@mixed") if k in agg]
        if g_m is None or g_h is None or m_mis is None or not sc:
            return Finding(self.label, "not run", None)
        runs = {c: [s for s in ev.summary if s.config == c] for c in agg}
        along_neg = all(s.value("drift_along") < 0 for k in ("grpo@mixed", "grpo@homogeneous") for s in runs[k])
        mis_up = all(s.value("drift_masked_mass") > 0 for s in runs["grpo_mis@mixed"])
        sc_small = all(abs(a.mean("drift_along")) < self.fraction * abs(g_m.mean("drift_along")) for a in sc)
        text = (f"<u, q-p>: GRPO mixed {_fmt(g_m.mean('drift_along'), None, 3)}, homogeneous "
                f"{_fmt(g_h.mean('drift_along'), None, 3)}; GRPO+MIS d p(masked) "
                f"{_fmt(m_mis.mean('drift_masked_mass'))}; "
                + ", ".join(f"{a.config} <u, q-p> {_fmt(a.mean('drift_along'))}" for a in sc))
        return Finding(self.label, text, along_neg and abs(g_m.mean("drift_along")) > abs(g_h.mean("drift_along"))
                       and mis_up and sc_small)


@dataclass(frozen=True)
class DoseResponse:
    """On the mixed fleet, GRPO's KL rises through ``formats`` and the paired final exact success of the last
    format minus the first lies below 0 (earlier registration)."""

    label: str
    formats: tuple[str, ...]

    def find(self, ev: Evidence) -> Finding:
        sweep = [ev.configs.get(f"grpo@mixed:{f}") for f in self.formats]
        if any(x is None for x in sweep):
            return Finding(self.label, "not run (sweep incomplete)", None)
        kls = [x.mean("kl_full") for x in sweep]
        d = paired(ev.summary, f"grpo@mixed:{self.formats[-1]}", f"grpo@mixed:{self.formats[0]}")
        return Finding(self.label, "KL " + " < ".join(f"{f} {_fmt(k)}" for f, k in zip(self.formats, kls))
                       + f"; paired final exact success {self.formats[-1]} - {self.formats[0]}: {_pair_text(d)}",
                       all(a < b for a, b in zip(kls, kls[1:])) and _interval_sign(d) == -1, d.ci)


@dataclass(frozen=True)
class Registration:
    """A pre-registration: its claims in table order. With ``void_rule`` (the current registration) the grid is
    void when the ``control``'s ``Y - start`` interval does not lie above 0 or any run skipped a step for a
    non-finite gradient, and one seed leaves every verdict undecided; without it (the earlier registration) a
    verdict is undecided where its own interval is missing."""

    claims: tuple[Claim, ...]
    void_rule: bool
    control: str = "grpo@onpolicy"
    #: Holm's step-down correction (family-wise 0.05) over the claims with a p-value: a last column "after Holm".
    holm: bool = False


def judge(results: list[dict], registration: Registration, ran_only: bool = False) -> str:
    """A markdown table: prediction, what was measured, verdict (hit / miss / undecided / not run / void); with the
    void rule, a line before it that applies the rule. ``ran_only``: leave out the claims whose configurations did
    not run (a run that makes only part of a grid, as the quick demo), with a line that counts them."""
    ev = Evidence.of(results)
    findings = [f for f in (c.find(ev) for c in registration.claims) if f is not None]
    left_out = 0
    if ran_only:
        left_out = sum(f.ok is None for f in findings)
        findings = [f for f in findings if f.ok is not None]
    note = ([f"{left_out} other registered claim(s) need configurations this run does not make: left out.", ""]
            if left_out else [])
    header = ["| prediction | measured | verdict |", "|---|---|---|"]
    if not registration.void_rule:
        return "\n".join(note + header + [f"| {f.label} | {f.measured} | {_interval_verdict(f)} |"
                                          for f in findings]) + "\n"
    n = min((a.seeds for a in ev.configs.values()), default=0)
    control = [s for s in ev.summary if s.config == registration.control]
    rise, rise_ci = mean_ci([s.success_mean - s.success_start for s in control])
    skipped = sum(any(h.get("skipped") for h in r["history"]) for r in results)
    void = bool(control) and n >= 2 and (not rise - rise_ci > 0 or skipped > 0)
    spread = f"± {rise_ci:.4f}" if n >= 2 else f"(n = {n}, no interval)"
    lines = [f"Void rule: on-policy control Y - start {rise:+.4f} {spread}; {skipped} run(s) skipped a "
             f"step -> {'VOID' if void else 'not void'}", ""] + note
    verdicts = ['void' if void and f.ok is not None else _seeds_verdict(f.ok, n) for f in findings]
    if not registration.holm:
        lines += header + [f"| {f.label} | {f.measured} | {v} |" for f, v in zip(findings, verdicts)]
        return "\n".join(lines) + "\n"
    tested = [i for i, f in enumerate(findings) if f.p is not None]
    kept = dict(zip(tested, holm([findings[i].p for i in tested])))
    lines += ["| prediction | measured | verdict | p | after Holm |", "|---|---|---|---|---|"]
    for i, (f, v) in enumerate(zip(findings, verdicts)):
        after = "-" if i not in kept else ("void" if void else "hit" if kept[i] else "miss")
        lines.append(f"| {f.label} | {f.measured} | {v} | {'-' if f.p is None else f'{f.p:.2g}'} | {after} |")
    lines += ["", f"Holm's correction (family-wise 0.05) over the {len(tested)} claims with an interval; the other "
                  f"claims are judged by their rule alone."]
    return "\n".join(lines) + "\n"


def _seeds_verdict(ok: bool | None, n: int) -> str:
    if ok is None:
        return "not run"
    if n < 2:
        return "undecided (one seed)"
    return "hit" if ok else "miss"


def _interval_verdict(f: Finding) -> str:
    if f.ok is None:
        return "not run"
    if math.isnan(f.ci):
        return "undecided (one seed: no interval)"
    return "hit" if f.ok else "miss"
