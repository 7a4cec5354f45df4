"""Summaries, paired comparisons, files and figures of a demo run (a list of per-run result dicts of
:func:`offpolicy.demo.train.run`).

A *configuration* is an arm on a fleet with a weight format; its runs differ only in their random seed, and every
configuration of one invocation uses the same seeds, so two configurations compare *paired*, seed by seed.

Per run (:func:`summarize`): exact held-out success at the start, the end and its change; the collapse flags of the
pre-registered criterion (see :data:`COLLAPSE_FRACTION`, :data:`KL_GROWTH`); mismatch on full distributions
(``kl_full``, ``extreme_full``) and, separately, the loss's view (support-renormalised for top-p arms); the drift
probe's mean read-outs; the mean step KL; peak gradient norm; final entropy.
Per configuration (:func:`aggregate`): mean and 95 % t-interval over seeds. Paired (:func:`paired`): the mean
per-seed difference of the final exact success between two configurations, with its 95 % t-interval.

Each table's rows are a dataclass (:class:`RunSummary`, :class:`ConfigSummary`, :class:`PairedDifference`,
:class:`GroupRow`, :class:`SeedSpread`); their ``columns()`` name the CSV and markdown columns. The pre-registered
predictions are data in :mod:`offpolicy.demo.predictions`, judged by :mod:`offpolicy.demo.claims`.
"""

from __future__ import annotations

import csv
import gzip
import json
import math
import functools
import statistics
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable

from offpolicy.demo.arms import ARMS

#: A run *collapses* when its final exact held-out success falls below this fraction of its start.
COLLAPSE_FRACTION = 0.5
#: A run's full-distribution KL *blows up* when its last-tenth mean is at least this multiple of its first-tenth
#: mean (the mixed-fleet study: "in collapse the mismatch grows threefold or more").
KL_GROWTH = 3.0
#: The KL blow-up criterion is applied only where the first tenth's KL exceeds this: below it the KL is float noise
#: (the on-policy control's is about 1e-11) and a ratio of noise means nothing.
KL_FLOOR = 1e-6
#: One colour per arm across every figure (the on-policy control is its own arm here).
ARM_COLORS = {"onpolicy": "#000000", "onpolicy_topp": "#7f7f7f", "sc_mis_topp_rr": "#17becf",
              "rr_tis": "#bcbd22", "grpo": "#d62728", "grpo_mis": "#ff7f0e", "sc": "#9467bd",
              "grpo_topp": "#8c564b", "grpo_topp_noreplay": "#e377c2", "sc_mis": "#1f77b4", "sc_mis_topp": "#2ca02c"}


def config_key(cfg: dict) -> str:
    """``arm@fleet`` (``arm@fleet:format`` when the mixed fleet's weight format is swept; ``~tag`` after it when the
    run has a tag, as grid C's staleness-4 contrast)."""
    fmt = cfg.get("weight_format", "seed")
    suffix = f":{fmt}" if cfg["fleet"] == "mixed" and fmt != "seed" else ""
    tag = f"~{cfg['tag']}" if cfg.get("tag") else ""
    return f"{cfg['arm']}@{cfg['fleet']}{suffix}{tag}"


def color_key(cfg: dict) -> str:
    """The :data:`ARM_COLORS` key of a run: its arm, or for the on-policy fleet its control (``onpolicy``; the
    on-policy top-p control ``onpolicy_topp``)."""
    if cfg["fleet"] == "onpolicy":
        return "onpolicy" if cfg["arm"] == "grpo" else "onpolicy_topp"
    return cfg["arm"]


def main_format(configs) -> str:
    """The mixed fleet's weight format of a run's main configurations: ``seed`` (the study's formats per group)
    when any mixed configuration uses it, else the format most of them share (grid C and its quick demo: NVFP4).
    Mixed-fleet configurations at another format are the weight-format sweep."""
    fmts = [c.get("weight_format", "seed") for c in configs if c["fleet"] == "mixed"]
    if not fmts or "seed" in fmts:
        return "seed"
    return max(dict.fromkeys(fmts), key=fmts.count)


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def _moving(xs: list[float], w: int) -> list[float]:
    """Trailing moving average over ``w`` points (fewer at the start)."""
    return [_mean(xs[max(0, i + 1 - w): i + 1]) for i in range(len(xs))]


def _tenth(xs: list[float], last: bool) -> list[float]:
    n = max(1, len(xs) // 10)
    return xs[-n:] if last else xs[:n]


def _t_density(x: float, df: int) -> float:
    """Student-t density with ``df`` degrees of freedom at ``x``."""
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return math.exp(log_c - (df + 1) / 2 * math.log1p(x * x / df))


def t_cdf(x: float, df: int) -> float:
    """``P(T <= x)`` (``x < 0`` by symmetry): one half plus the density's integral over ``[0, x]`` by composite Simpson's
    rule on 4,096 panels (the density is smooth, so the error is far below the 4 digits the report prints)."""
    if x < 0:
        return 1.0 - t_cdf(-x, df)
    n = 4096
    h = x / n
    inner = sum((4 if i % 2 else 2) * _t_density(i * h, df) for i in range(1, n))
    return 0.5 + h / 3 * (_t_density(0.0, df) + inner + _t_density(x, df))


@functools.lru_cache(maxsize=None)
def t_quantile(p: float, df: int) -> float:
    """The Student-t quantile ``t`` with ``P(T <= t) = p`` for ``0.5 <= p < 1`` and any ``df >= 1`` (bisection on
    the CDF to 1e-9; 2.0452 at ``p = 0.975, df = 29``)."""
    if not 0.5 <= p < 1 or df < 1:
        raise ValueError(f"t_quantile: need 0.5 <= p < 1 and df >= 1, got p={p}, df={df}")
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, 2 * hi
    while hi - lo > 1e-9:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def mean_ci(xs: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its two-sided 95 % Student-t interval (nan half-width for one value)."""
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return float("nan"), float("nan")
    if len(xs) == 1:
        return xs[0], float("nan")
    t = t_quantile(0.975, len(xs) - 1)
    return statistics.fmean(xs), t * statistics.stdev(xs) / math.sqrt(len(xs))


def _grad_norms(col: dict) -> list[float]:
    """The pre-clip gradient norms of a history (the earlier regime's histories call them ``grad_norm``)."""
    return col["grad_norm_preclip"] if "grad_norm_preclip" in col else col["grad_norm"]


def is_earlier_regime(results: list[dict]) -> bool:
    """Whether ``results`` are the earlier regime's histories (staleness 0.5, drift probe at a = -1 only), judged
    against that regime's registration; they carry ``grad_norm`` where the current ones carry
    ``grad_norm_preclip``."""
    return bool(results) and "grad_norm" in results[0]["history"][0]


def _columns(row) -> dict:
    """A row's named columns in field order, for the CSV files and the markdown tables; a ``dict`` field (the drift
    read-outs, a configuration's estimates) spreads into its own columns in place, an :class:`Estimate` into
    ``<key>`` and ``<key>_ci``."""
    out: dict = {}
    for f in fields(row):
        value = getattr(row, f.name)
        if isinstance(value, dict):
            for k, v in value.items():
                out.update({k: v.mean, f"{k}_ci": v.ci} if isinstance(v, Estimate) else {k: v})
        else:
            out[f.name] = value
    return out


@dataclass(frozen=True)
class RunSummary:
    """One run's scalars (:func:`summarize`). ``success_mean`` is the registered primary outcome: the mean exact
    held-out success over the evaluations after the start (step > 0); ``drift`` holds the drift probe's mean
    read-outs by their record names (``drift_along_pos`` ..., or the earlier regime's ``drift_along`` ...)."""

    run_id: str
    config: str
    arm: str
    label: str
    fleet: str
    weight_format: str
    seed: int
    steps: int
    success_start: float
    success_end: float
    success_change: float
    success_mean: float
    success_min: float
    pass1_end: float
    train_reward_end: float
    collapsed: bool
    kl_full: float
    kl_growth: float
    kl_blowup: bool
    extreme_full: float
    tv: float
    kl_k3_loss: float
    extreme_loss: float
    step_kl: float
    staleness: float
    drift: dict[str, float]
    peak_grad_norm: float
    grad_growth: float
    entropy_start: float
    final_entropy: float
    #: Outcomes only newer histories hold (absent from grids A and B, so their tables keep their columns):
    #: ``success_topp_mean`` (mean exact success under the trainer's nucleus after the start), ``route_flip`` (mean
    #: share of (token, layer) routes the trainer's router would flip, MoE only), ``abs_log_ratio`` (mean |log r|
    #: of the sampled tokens, full distributions), ``clipped`` (share of optimizer steps whose pre-clip gradient norm
    #: exceeded the clip: histories that record it, grids A and B included).
    extra: dict[str, float] = field(default_factory=dict)

    def value(self, key: str) -> float:
        """The scalar named ``key`` (a field, a ``drift_*`` read-out, or one of :attr:`extra`)."""
        if key.startswith("drift_"):
            return self.drift[key]
        return self.extra[key] if key in self.extra else getattr(self, key)

    def columns(self) -> dict:
        return _columns(self)


def summarize(result: dict) -> RunSummary:
    """One row of scalars for one run (a per-run result dict of :func:`offpolicy.demo.train.run`)."""
    h, ev, cfg = result["history"], result["evals"], result["config"]
    col = {k: [r[k] for r in h] for k in h[0]}
    start, end = ev[0]["success_exact"], ev[-1]["success_exact"]
    kl_first, kl_last = _mean(_tenth(col["kl_full"], False)), _mean(_tenth(col["kl_full"], True))
    gn = _grad_norms(col)
    gn_first = _mean(_tenth(gn, False))
    return RunSummary(
        run_id=result["run_id"], config=config_key(cfg), arm=cfg["arm"], label=result["label"],
        fleet=cfg["fleet"], weight_format=cfg["weight_format"], seed=cfg["seed"], steps=len(h),
        success_start=start, success_end=end, success_change=end - start,
        success_mean=_mean([e["success_exact"] for e in ev if e["step"] > 0]),
        success_min=min(e["success_exact"] for e in ev),
        pass1_end=ev[-1]["pass@1"], train_reward_end=_mean(_tenth(col["reward"], True)),
        collapsed=end < COLLAPSE_FRACTION * start,
        kl_full=_mean(col["kl_full"]), kl_growth=kl_last / kl_first if kl_first > KL_FLOOR else float("nan"),
        kl_blowup=kl_first > KL_FLOOR and kl_last >= KL_GROWTH * kl_first,
        extreme_full=_mean(col["extreme_full"]), tv=_mean(col["tv"]),
        kl_k3_loss=_mean(col["kl_k3_loss"]), extreme_loss=_mean(col["extreme_loss"]),
        step_kl=_mean(col["step_kl"]), staleness=_mean(col["staleness"]),
        drift={k: _mean([e[k] for e in ev]) for k in ev[0] if k.startswith("drift_")},
        peak_grad_norm=max(gn), grad_growth=max(gn) / gn_first if gn_first > 0 else float("nan"),
        entropy_start=_mean(_tenth(col["entropy"], False)), final_entropy=_mean(_tenth(col["entropy"], True)),
        extra=_extra(h, ev),
    )


def _extra(h: list[dict], ev: list[dict]) -> dict[str, float]:
    out = {}
    if "success_exact_topp" in ev[0]:
        out["success_topp_mean"] = _mean([e["success_exact_topp"] for e in ev if e["step"] > 0])
    if "route_flip" in h[0] and not math.isnan(h[0]["route_flip"]):
        out["route_flip"] = _mean([r["route_flip"] for r in h])
    if "abs_log_ratio" in h[0]:
        out["abs_log_ratio"] = _mean([r["abs_log_ratio"] for r in h])
    if "clipped" in h[0]:
        out["clipped"] = _mean([float(r["clipped"]) for r in h])
    return out


AGG_KEYS = ("success_start", "success_end", "success_change", "success_mean", "pass1_end", "train_reward_end",
            "kl_full", "kl_growth", "extreme_full", "kl_k3_loss", "extreme_loss", "step_kl", "peak_grad_norm",
            "grad_growth", "entropy_start", "final_entropy")


@dataclass(frozen=True)
class Estimate:
    """A mean over seeds and the half-width of its 95 % interval (nan for one seed)."""

    mean: float
    ci: float


@dataclass(frozen=True)
class ConfigSummary:
    """One configuration over its seeds (:func:`aggregate`): how many seeds collapsed or blew up, and an
    :class:`Estimate` per key of :data:`AGG_KEYS` and per drift read-out."""

    config: str
    arm: str
    label: str
    fleet: str
    weight_format: str
    seeds: int
    collapsed: int
    kl_blowup: int
    estimates: dict[str, Estimate]

    def mean(self, key: str) -> float:
        return self.estimates[key].mean

    def ci(self, key: str) -> float:
        return self.estimates[key].ci

    def columns(self) -> dict:
        return _columns(self)


def aggregate(summary: list[RunSummary]) -> list[ConfigSummary]:
    """Per configuration, in the order of first appearance: seeds, collapses and the estimates."""
    by: dict[str, list[RunSummary]] = {}
    for s in summary:
        by.setdefault(s.config, []).append(s)
    out = []
    for key, rows in by.items():
        first = rows[0]
        out.append(ConfigSummary(
            config=key, arm=first.arm, label=first.label, fleet=first.fleet, weight_format=first.weight_format,
            seeds=len(rows), collapsed=sum(r.collapsed for r in rows), kl_blowup=sum(r.kl_blowup for r in rows),
            estimates={k: Estimate(*mean_ci([r.value(k) for r in rows])) for k in AGG_KEYS + _drift_keys(rows)
                       + tuple(k for k in first.extra if all(k in r.extra for r in rows))}))
    return out


def _drift_keys(rows: list[RunSummary]) -> tuple[str, ...]:
    return tuple(rows[0].drift) if rows else ()


@dataclass(frozen=True)
class PairedDifference:
    """The mean per-seed difference ``a - b`` of ``key`` over ``seeds`` shared seeds, with the half-width ``ci`` of
    its 95 % interval (:func:`paired`)."""

    a: str
    b: str
    key: str
    seeds: int
    diff: float
    ci: float


def paired(summary: list[RunSummary], a: str, b: str, key: str = "success_end") -> PairedDifference | None:
    """Mean per-seed difference ``a - b`` of ``key`` over the seeds both configurations ran, with its 95 %
    interval; None when they share no seed."""
    va = {s.seed: s.value(key) for s in summary if s.config == a}
    vb = {s.seed: s.value(key) for s in summary if s.config == b}
    seeds = sorted(set(va) & set(vb))
    if not seeds:
        return None
    mean, ci = mean_ci([va[s] - vb[s] for s in seeds])
    return PairedDifference(a=a, b=b, key=key, seeds=len(seeds), diff=mean, ci=ci)


#: The smallest difference of the primary outcome worth showing, and the equivalence margin of "holds" claims
#: (exact held-out success); both registered in docs/demo.md.
DELTA = 0.01
#: Normal quantiles of the power calculation: two-sided 95 % (z_0.975), 80 % power (z_0.8), and z_0.9 for the
#: equivalence test's two one-sided halves.
_Z975, _Z80, _Z90 = 1.959964, 0.841621, 1.281552


def seeds_needed(sd: float, delta: float, equivalence: bool = False) -> int:
    """Seeds a paired comparison needs, from the sd of the per-seed difference. Difference (95 % two-sided, 80 %
    power, Guenther's t correction): ``n = ((z_0.975 + z_0.8) sd / delta)^2 + z_0.975^2 / 2``. Equivalence (the
    95 % interval inside ``±delta`` with 80 % power when the true difference is 0):
    ``n = ((z_0.975 + z_0.9) sd / delta)^2 + z_0.975^2 / 2``."""
    if not (sd >= 0 and delta > 0):
        raise ValueError(f"seeds_needed: expected sd >= 0 and delta > 0, got sd={sd}, delta={delta}")
    z = _Z975 + (_Z90 if equivalence else _Z80)
    return max(2, math.ceil((z * sd / delta) ** 2 + _Z975 ** 2 / 2))


@dataclass(frozen=True)
class SeedSpread:
    """One pair of :func:`seed_spread_table`: the paired differences' mean and sd over ``seeds`` seeds, and the
    seeds a paired test needs to detect ``delta`` and to show equivalence within it."""

    a: str
    b: str
    seeds: int
    diff: float
    sd: float
    delta: float
    seeds_needed: int
    seeds_needed_equiv: int


def seed_spread_table(results: list[dict]) -> list[SeedSpread]:
    """Per pair (every configuration against the on-policy control and against GRPO on its fleet): the paired
    differences of the primary outcome over the seeds both ran, their sd, and :func:`seeds_needed` for
    :data:`DELTA`."""
    summary = [summarize(r) for r in results]
    configs = list(dict.fromkeys(s.config for s in summary))
    pairs = [(c, "grpo@onpolicy") for c in configs if c != "grpo@onpolicy"]
    pairs += [(c, c.replace(c.split("@")[0] + "@", "grpo@", 1)) for c in configs
              if not c.startswith("grpo@") and c.replace(c.split("@")[0] + "@", "grpo@", 1) in configs]
    out = []
    for a, b in pairs:
        va = {s.seed: s.success_mean for s in summary if s.config == a}
        vb = {s.seed: s.success_mean for s in summary if s.config == b}
        d = [va[k] - vb[k] for k in sorted(set(va) & set(vb))]
        if len(d) < 2:
            continue
        sd = statistics.stdev(d)
        out.append(SeedSpread(a=a, b=b, seeds=len(d), diff=statistics.fmean(d), sd=sd, delta=DELTA,
                              seeds_needed=seeds_needed(sd, DELTA),
                              seeds_needed_equiv=seeds_needed(sd, DELTA, equivalence=True)))
    return out


@dataclass(frozen=True)
class GroupRow:
    """One sampler group of one mixed-fleet configuration (:func:`group_table`), averaged over its ``runs``."""

    config: str
    group: str
    weights: str
    runs: int
    capacity_share: float
    share_samples: float
    share_extreme: float
    extreme_frac: float
    kl_full: float
    tv: float
    share_extreme_loss: float
    kl_k3_loss: float

    def columns(self) -> dict:
        return _columns(self)


_GROUP_KEYS = ("capacity_share", "share_samples", "share_extreme", "extreme_frac", "kl_full", "tv",
               "share_extreme_loss", "kl_k3_loss")


def group_table(results: list[dict]) -> list[GroupRow]:
    """The study's per-group table for every run on the mixed fleet, averaged over seeds per configuration."""
    by: dict[tuple[str, str], list[dict]] = {}
    for r in results:
        if r["config"]["fleet"] != "mixed":
            continue
        for g in r["groups"]:
            by.setdefault((config_key(r["config"]), g["group"]), []).append(g)
    return [GroupRow(config=cfg, group=group, weights=gs[0]["weights"], runs=len(gs),
                     **{k: _mean([g[k] for g in gs]) for k in _GROUP_KEYS}) for (cfg, group), gs in by.items()]


def _fmt(x, ci=None, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if math.isnan(x):
            return "-"
        s = f"{x:.{digits}g}" if (abs(x) < 1e-3 and x != 0) or abs(x) >= 1e4 else f"{x:.{digits}f}"
        if ci is not None and not math.isnan(ci):
            s += f" ± {ci:.{digits}g}" if abs(ci) < 1e-3 and ci != 0 else f" ± {ci:.{digits}f}"
        return s
    return str(x)


def markdown_table(rows: list[dict], cols: list[tuple[str, str]], ci: bool = False) -> str:
    """A markdown table of ``rows`` (named columns: a row's ``columns()``, or a record of a JSON file) with
    ``(key, header)`` columns; ``ci``: append ``± <key>_ci`` when present."""
    lines = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(k), r.get(f"{k}_ci") if ci else None) for k, _ in cols) + " |")
    return "\n".join(lines)


def tables_text(results: list[dict]) -> str:
    """The outcome table (95 % intervals over seeds), the mismatch table, the drift table and the paired
    differences against uncorrected GRPO on the same fleet and format."""
    summary = [summarize(r) for r in results]
    agg = aggregate(summary)
    table = [a.columns() for a in agg]
    key = "success_end" if is_earlier_regime(results) else "success_mean"
    # Newer histories (grid C and its quick demo) also hold the success under the trainer's nucleus (Y_p, the
    # outcome of arms trained with top-p) and, with experts, the route-flip share: a column each where present.
    nucleus = [("success_topp_mean", "nucleus, after start (Y_p)")] if any(
        "success_topp_mean" in a.estimates for a in agg) else []
    flips = [("route_flip", "route flips")] if any("route_flip" in a.estimates for a in agg) else []
    clipped = [("clipped", "share of steps clipped")] if any("clipped" in a.estimates for a in agg) else []
    parts = ["Outcome (exact held-out success by teacher forcing; mean ± 95 % interval over seeds):",
             markdown_table(table, [("config", "configuration"), ("seeds", "seeds"), ("success_start", "start"),
                                  ("success_end", "end"), ("success_change", "change"),
                                  ("success_mean", "mean after start (primary)"), *nucleus,
                                  ("pass1_end", "sampled pass@1"), ("collapsed", "collapsed"),
                                  ("kl_blowup", "KL x3")], ci=True),
             "", "Mismatch on full distributions (every arm alike) and the loss's own view (top-p: support):",
             markdown_table(table, [("config", "configuration"), ("kl_full", "KL(q||p)"),
                                  ("extreme_full", "ratio outside [0.2, 5]"), ("kl_growth", "KL last/first"),
                                  ("kl_k3_loss", "loss KL k3"), ("extreme_loss", "loss extreme"),
                                  ("step_kl", "step KL"), *flips], ci=True),
             "", "Gradient norm (before clipping) and entropy:",
             markdown_table(table, [("config", "configuration"), ("peak_grad_norm", "peak grad norm"),
                                  ("grad_growth", "peak / first tenth"), *clipped,
                                  ("entropy_start", "entropy, first tenth"),
                                  ("final_entropy", "last tenth")], ci=True),
             "", "Drift probe (mean over evaluations; _pos: correct prefixes, a = +1; _neg: wrong prefixes, a = -1; "
                 "a = -1 only in the earlier regime): <u, q - p>, mass moved onto masked ids, onto the tail:",
             markdown_table(table, [("config", "configuration")]
                            + [(k, k.removeprefix("drift_")) for k in _drift_keys(summary) if k != "drift_kl_qp"],
                            ci=True)]
    pairs = []
    # Where the histories score the nucleus too (grid C), an arm trained with top-p is compared with the on-policy
    # top-p control on Y_p, never with GRPO on the full-distribution Y (grids A and B's H2 confound, issue 45).
    topp_control = "grpo_topp@onpolicy" if nucleus and any(a.config == "grpo_topp@onpolicy" for a in agg) else None
    for row in agg:
        d = None
        if topp_control and ARMS[row.arm].top_p:
            if row.config != topp_control:
                d = paired(summary, row.config, topp_control, "success_topp_mean")
        else:
            base = row.config.replace(f"{row.arm}@", "grpo@", 1)
            if row.arm != "grpo" and any(a.config == base for a in agg):
                d = paired(summary, row.config, base, key)
        if d is not None:
            pairs.append(d)
    if pairs:
        parts += ["", f"Paired differences of {'final' if key == 'success_end' else 'mean'} exact success against "
                      "GRPO on the same fleet (same seeds)"
                  + ("; arms trained with top-p against the on-policy top-p control, on success under the trainer's "
                     "nucleus (Y_p):" if topp_control else ":"),
                  markdown_table([dict(_columns(p), diff_ci=p.ci) for p in pairs],
                                 [("a", "configuration"), ("b", "minus"), ("seeds", "seeds"), ("diff", "difference")]
                                 + ([("key", "outcome")] if topp_control else []), ci=True)]
    return "\n".join(parts) + "\n"


def _pair_text(d: PairedDifference | None) -> str:
    if d is None:
        return "not run"
    if d.seeds < 2:  # one seed has no spread: no interval to print
        return f"{d.diff:+.4f} (n = {d.seeds}, no interval)"
    return f"{d.diff:+.4f} ± {d.ci:.4f} (n = {d.seeds})"


def _interval_sign(d: PairedDifference | None) -> int:
    """+1 / -1 when the paired interval lies entirely above / below 0, 0 when it contains 0 (or is missing)."""
    if d is None or math.isnan(d.ci):
        return 0
    return 1 if d.diff - d.ci > 0 else -1 if d.diff + d.ci < 0 else 0


def _rounded(x, digits: int = 6):
    """``x`` with every float rounded to ``digits`` significant digits (small, still exact enough to re-derive
    every table)."""
    if isinstance(x, float):
        return float(f"{x:.{digits}g}") if math.isfinite(x) else x
    if isinstance(x, dict):
        return {k: _rounded(v, digits) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v, digits) for v in x]
    return x


def _write_csv(path: Path, rows: list[dict]) -> None:
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def reading_note(results: list[dict]) -> str:
    """What a gap to the on-policy control can and cannot be read as, one sentence a line (the figures' titles and
    the command's summary print it): at staleness 0 a gap is the samplers' numerics alone (with a mixture-of-experts
    policy, the share of routes the mixed fleet's samplers flip); with stale samplers it mixes staleness with
    numerics, and without a homogeneous fleet at the same staleness this run cannot separate the two (the former
    quick demo's case); one seed is an illustration, not evidence; top-p arms are compared only with the on-policy
    top-p control, on success under the trainer's nucleus. Empty when none applies."""
    def staleness(r: dict) -> float:
        return float(r["config"].get("staleness", 0.0))

    off = [r for r in results if r["config"]["fleet"] != "onpolicy"]
    stale = sorted({staleness(r) for r in off if staleness(r) > 0})
    fresh = [r for r in off if staleness(r) == 0]
    lines = []
    if fresh:
        text = ("Staleness 0 (every sampler serves the trainer's current weights): a gap to the on-policy control "
                "there is the samplers' numerics alone")
        by_fmt: dict[str, list[float]] = {}
        for r in fresh:
            h = r.get("history") or [{}]
            if r["config"]["fleet"] == "mixed" and not math.isnan(h[0].get("route_flip", math.nan)):
                by_fmt.setdefault(r["config"].get("weight_format", "seed"), []).append(
                    _mean([x["route_flip"] for x in h]))
        if by_fmt:
            text += (", here mixture-of-experts routes flipped by the mixed fleet's quantised samplers ("
                     + ", ".join(f"{'study formats' if f == 'seed' else f.upper()} {100 * _mean(v):.1f} %"
                                 for f, v in by_fmt.items()) + " of routes)")
        lines.append(text + ".")
    if stale:
        lines.append(f"Samplers ran {'/'.join(f'{x:g}' for x in stale)} optimizer steps stale on average"
                     + (" in the runs so marked" if fresh else "")
                     + ": a gap to the on-policy control is staleness plus numerics, not mixed precision alone.")
        if "homogeneous" not in {r["config"]["fleet"] for r in results}:
            lines.append("No homogeneous fleet ran at the same staleness, so this run cannot separate the two; in "
                         "the 30-seed grid A (docs/demo.md) uncorrected GRPO lost as much on a homogeneous fleet "
                         "(-0.097) as on the mixed one (-0.094), and the numerics alone (grid B, staleness 0) cost "
                         "it 0.006.")
    seeds = {r["config"].get("seed") for r in results}
    if len(seeds) == 1 and any(r.get("history") for r in results):
        lines.append("One seed: an illustration, not evidence"
                     + ("; grid C (docs/demo_gridC_registration.md, 30 seeds of 200 steps) decides."
                        if any(r.get("grid") == "C" for r in results) else "."))
    def top_p(r: dict) -> bool:
        arm = ARMS.get(r["config"].get("arm", ""))
        return arm is not None and arm.top_p

    if any(top_p(r) and r["config"]["fleet"] != "onpolicy" for r in results) and any(
            top_p(r) and r["config"]["fleet"] == "onpolicy" for r in results):
        lines.append("Top-p arms are compared only with the on-policy top-p control, on success under the trainer's "
                     "nucleus (Y_p); their training rewards come from the nucleus and are not comparable with the "
                     "other arms'.")
    return "\n".join(lines)


def write_outputs(results: list[dict], out: Path, meta: dict, calibration: dict | None = None,
                  plots: bool = True, predictions: Callable[[list[dict]], str] | None = None) -> dict[str, Path]:
    """Write ``runs.json.gz`` (every run's config, per-step history, evaluations and groups), ``summary.csv``,
    ``configs.csv``, ``groups.csv``, ``tables.md`` and (with matplotlib) the figures into ``out``.
    ``predictions``: the judge of the pre-registered predictions
    (:func:`offpolicy.demo.predictions.predictions_text`, which the command line passes: the claims sit above this
    module), whose text ends ``tables.md``."""
    out.mkdir(parents=True, exist_ok=True)
    # Every table is derived from the rounded runs that the file keeps, so that --report-only on the file gives
    # the same tables to the last digit.
    stored = _rounded({"meta": meta, "calibration": calibration, "runs": results})
    results = stored["runs"]
    summary = [summarize(r) for r in results]
    files = {name: out / name for name in ("runs.json.gz", "summary.csv", "configs.csv", "groups.csv", "tables.md")}
    with gzip.open(files["runs.json.gz"], "wt") as f:
        json.dump(stored, f)
    _write_csv(files["summary.csv"], [s.columns() for s in summary])
    _write_csv(files["configs.csv"], [a.columns() for a in aggregate(summary)])
    _write_csv(files["groups.csv"], [g.columns() for g in group_table(results)])
    registration = ("docs/demo_gridC_registration.md" if any(r.get("grid") == "C" for r in results)
                    else "docs/demo.md")
    judged = ("" if predictions is None
              else f"\nPre-registered predictions ({registration}):\n" + predictions(results))
    # The quick demo's tables say how to read them (its printed summary and figures say the same).
    note = reading_note(results) if any(r.get("quick") for r in results) else ""
    files["tables.md"].write_text(tables_text(results) + judged + (f"\nHow to read this:\n{note}\n" if note else ""))
    if plots:
        files.update(write_plots(results, out, calibration))
    return files


def write_plots(results: list[dict], out: Path, calibration: dict | None = None) -> dict[str, Path]:
    """One figure per question: ``training.png`` (reward, held-out success, KL, pre-clip gradient norm, entropy and
    GRPO's per-group extreme-ratio shares over steps), ``collapse.png`` (exact held-out success over steps), ``mismatch.png``
    (numerics KL by fleet and group from the calibration; KL over training), ``drift.png`` (the probe's
    ``<u, q - p>`` and mass moved onto masked ids), ``groups.png`` (share of samples vs share of extreme-ratio
    tokens per group), and for histories that score the nucleus too ``contrast.png`` (held-out success, each arm on
    its own outcome: ``Y`` beside the on-policy control, top-p arms on ``Y_p`` beside the on-policy top-p control).
    Every title carries :func:`reading_note`. Mean over seeds with a min-max band; one colour per arm. Empty without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    plt.rcParams.update({"font.size": 11})
    by: dict[str, list[dict]] = {}
    for r in results:
        by.setdefault(config_key(r["config"]), []).append(r)
    styles = {"mixed": "-", "homogeneous": "--", "onpolicy": ":"}
    files: dict[str, Path] = {}
    fmt_main = main_format([r["config"] for r in results])

    def is_sweep(k: str) -> bool:
        cfg = by[k][0]["config"]
        return cfg["fleet"] == "mixed" and cfg.get("weight_format", "seed") != fmt_main

    def band(ax, xs, runs, get, cfg, label):
        ys = [[get(r, i) for r in runs] for i in range(len(xs))]
        ax.plot(xs, [_mean(y) for y in ys], styles.get(cfg["fleet"], "-"), color=ARM_COLORS[color_key(cfg)],
                label=label, lw=1.8)
        if len(runs) > 1:
            ax.fill_between(xs, [min(y) for y in ys], [max(y) for y in ys], color=ARM_COLORS[color_key(cfg)],
                            alpha=0.15, lw=0)

    def label_of(runs):
        cfg = runs[0]["config"]
        if cfg["fleet"] == "onpolicy":
            return "on-policy GRPO" + ("" if cfg["arm"] == "grpo" else f", {runs[0]['label']} (the top-p control)")
        fmt = cfg["weight_format"]
        tag = f", {cfg['tag']}: staleness {cfg['staleness']:g}" if cfg.get("tag") else ""
        return (f"{runs[0]['label']} ({cfg['fleet']}{', ' + fmt if fmt != 'seed' and cfg['fleet'] == 'mixed' else ''}"
                f"{tag})")

    # What a person looks at first: reward and held-out success per arm; KL and pre-clip gradient norm; entropy;
    # per-group extreme-ratio shares over steps (10-step moving averages of the per-step records).
    main = [k for k in by if not is_sweep(k)]
    fig, axes = plt.subplots(2, 3, figsize=(19, 10))
    topp_ran = any(ARMS[r["config"]["arm"]].top_p for r in results if r["config"]["arm"] in ARMS)
    per_step = ((axes[0, 0], "reward", "training reward (mean over the batch)"
                 + ("\ntop-p arms: nucleus samples, not comparable" if topp_ran else ""), False),
                (axes[1, 0], "kl_full", "KL(q || p) per token, full distributions", True),
                (axes[1, 1], "grad_norm_preclip", "gradient norm before clipping", True),
                (axes[1, 2], "entropy", "trainer entropy per token", False))
    for ax, key, ylabel, log in per_step:
        for k in main:
            runs = by[k]
            if key == "kl_full" and runs[0]["config"]["fleet"] == "onpolicy":
                continue
            n = min(len(r["history"]) for r in runs)
            smooth = {id(r): _moving(_grad_norms({c: [h[c] for h in r["history"]] for c in r["history"][0]})
                                     if key == "grad_norm_preclip" else [h[key] for h in r["history"]], 10)
                      for r in runs}
            band(ax, list(range(1, n + 1)), runs, lambda r, i: smooth[id(r)][i], runs[0]["config"], label_of(runs))
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    # Where the histories score the nucleus too, the top-p arms' held-out success is in contrast.png (on Y_p, beside
    # the on-policy top-p control), not here beside arms scored on the full distribution.
    nucleus = all("success_exact_topp" in r["evals"][0] for r in results)
    for k in main:
        runs = by[k]
        if nucleus and ARMS[runs[0]["config"]["arm"]].top_p:
            continue
        xs = [e["step"] for e in runs[0]["evals"]]
        band(axes[0, 1], xs, runs, lambda r, i: r["evals"][i]["success_exact"], runs[0]["config"], label_of(runs))
    axes[0, 1].set_xlabel("optimizer step")
    axes[0, 1].set_ylabel("held-out success, exact" + ("\n(arms without top-p; top-p arms: contrast.png)"
                                                      if nucleus and topp_ran else ""))
    axes[0, 1].grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    pick = next((k for k in main if k.startswith("grpo@mixed")), None)
    if pick is not None and "extreme_by_group" in by[pick][0]["history"][0]:
        r0 = by[pick][0]
        for gi, g in enumerate(r0["groups"]):
            ys = _moving([_mean([r["history"][t]["extreme_by_group"][gi] for r in by[pick]])
                          for t in range(len(r0["history"]))], 10)
            axes[0, 2].plot(range(1, len(ys) + 1), ys, lw=1.5, label=f"{g['group']} ({g['weights']})")
        axes[0, 2].set_title(f"share of each group's tokens with ratio outside [0.2, 5],\n{pick}", fontsize=10)
        axes[0, 2].set_xlabel("optimizer step")
        axes[0, 2].grid(alpha=0.3)
        axes[0, 2].legend(fontsize=8)
    note = reading_note(results)
    head = ("One seed is an illustration, not evidence" if max(len(v) for v in by.values()) < 2
            else "Mean over seeds, min-max band")
    title = _title("" if "One seed" in note else head, note)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()  # (it makes room for the suptitle)
    files["training.png"] = out / "training.png"
    fig.savefig(files["training.png"], dpi=100)
    plt.close(fig)

    sweep = [k for k in by if is_sweep(k)]
    panels = [("main configurations", [k for k in by if not is_sweep(k)])] + ([("weight-format sweep", sweep)]
                                                                          if sweep else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), 5), squeeze=False)
    for ax, (title, keys) in zip(axes[0], panels):
        for k in keys:
            runs = by[k]
            xs = [e["step"] for e in runs[0]["evals"]]
            if is_sweep(k):
                cfg = runs[0]["config"]
                fmts = ("bf16", "fp8", "nvfp4", "mxfp4")
                ls = ("-", "--", "-.", ":")[fmts.index(cfg["weight_format"])] if cfg["weight_format"] in fmts else "-"
                ys = [_mean([r["evals"][i]["success_exact"] for r in runs]) for i in range(len(xs))]
                ax.plot(xs, ys, ls, color=ARM_COLORS[color_key(cfg)], lw=1.8, label=label_of(runs))
            else:
                band(ax, xs, runs, lambda r, i: r["evals"][i]["success_exact"], runs[0]["config"], label_of(runs))
        start = _mean([r["evals"][0]["success_exact"] for r in results])
        ax.axhline(COLLAPSE_FRACTION * start, color="grey", lw=1, ls="--", label="collapse threshold")
        ax.set_title(f"Does it collapse? ({title})")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("held-out success, exact (teacher forcing)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    files["collapse.png"] = out / "collapse.png"
    fig.savefig(files["collapse.png"], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(15, 5))
    if calibration is not None:
        rows = [r for r in calibration["numerics"] if r["group"] == "(fleet)" and r["kl"] > 0]
        axes[0].bar(range(len(rows)), [r["kl"] for r in rows], color="#607d8b")
        axes[0].set_xticks(range(len(rows)), [r["config"] for r in rows], rotation=25, ha="right", fontsize=9)
        for sk in calibration.get("step_kl", []):
            axes[0].axhline(sk["step_kl_mean"], ls=":", color="black", lw=1)
            axes[0].text(len(rows) - 0.5, sk["step_kl_mean"], f"step KL, lr {sk['lr']:g}", fontsize=8,
                         ha="right", va="bottom")
        axes[0].set_yscale("log")
        axes[0].set_ylabel("KL(q || p) per token, equal weights")
        axes[0].set_title("Numerics mismatch by fleet, before RL")
    for k in by:
        if is_sweep(k) or by[k][0]["config"]["fleet"] == "onpolicy":
            continue
        runs = by[k]
        n = min(len(r["history"]) for r in runs)
        smooth = {id(r): _moving([h["kl_full"] for h in r["history"]], 10) for r in runs}
        band(axes[1], list(range(1, n + 1)), runs, lambda r, i: smooth[id(r)][i], runs[0]["config"],
             label_of(runs))
    axes[1].set_yscale("log")
    axes[1].set_xlabel("optimizer step")
    axes[1].set_ylabel("KL(q || p) per token, full distributions")
    axes[1].set_title("Mismatch over training (10-step moving average)")
    axes[1].grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    files["mismatch.png"] = out / "mismatch.png"
    fig.savefig(files["mismatch.png"], dpi=110)
    plt.close(fig)

    signs = ("",) if is_earlier_regime(results) else ("_pos", "_neg")
    fig, axes = plt.subplots(len(signs), 2, figsize=(15, 5 * len(signs)), squeeze=False)
    for ax, key, ylabel, title in [
            (axes[i, j], key + sfx, ylabel, f"{title} ({'a = -1' if not sfx else sfx[1:]})")
            for i, sfx in enumerate(signs)
            for j, (key, ylabel, title) in enumerate((
                ("drift_along", "<u, q - p> (> 0: p moves toward q)", "Drift probe: update along q - p"),
                ("drift_masked_mass", "d p(masked ids) per unit step",
                 "Drift probe: probability moved onto masked ids")))]:
        for k in by:
            if is_sweep(k):
                continue
            runs = by[k]
            xs = [e["step"] for e in runs[0]["evals"]]
            band(ax, xs, runs, lambda r, i, key=key: r["evals"][i][key], runs[0]["config"], label_of(runs))
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_yscale("symlog", linthresh=1e-6)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    fig.tight_layout()
    files["drift.png"] = out / "drift.png"
    fig.savefig(files["drift.png"], dpi=110)
    plt.close(fig)

    gt = group_table(results)
    cfgs = list(dict.fromkeys(g.config for g in gt if g.config in by and not is_sweep(g.config)))
    if cfgs:
        pick = next((c for c in cfgs if c.startswith("sc_mis_topp@")), cfgs[0])
        rows = [g for g in gt if g.config == pick]
        fig, ax = plt.subplots(figsize=(9, 5))
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [g.share_samples for g in rows], 0.4, color="#90a4ae",
               label="share of samples")
        ax.bar([i + 0.2 for i in x], [g.share_extreme for g in rows], 0.4, color="#c62828",
               label="share of tokens with ratio outside [0.2, 5]")
        ax.set_xticks(list(x), [g.group for g in rows], rotation=20)
        ax.set_title(f"Per sampler group, {pick} (full distributions)")
        ax.legend()
        fig.tight_layout()
        files["groups.png"] = out / "groups.png"
        fig.savefig(files["groups.png"], dpi=110)
        plt.close(fig)

    # The contrast, each arm on the outcome that matches it (newer histories score both): arms without top-p on
    # exact success under the trainer's full distribution (Y) beside the on-policy control; arms trained with
    # top-p on exact success under the trainer's nucleus (Y_p) beside the on-policy top-p control, never across.
    if all("success_exact_topp" in r["evals"][0] for r in results):
        def topp(k: str) -> bool:
            return ARMS[by[k][0]["config"]["arm"]].top_p

        groups = [("Y: exact success, full distribution (arms without top-p)", "success_exact",
                   [k for k in main if not topp(k)])]
        if any(topp(k) for k in main):
            groups.append(("Y_p: exact success under the trainer's nucleus (top-p arms only)", "success_exact_topp",
                           [k for k in main if topp(k)]))
        head = ("Held-out success after the warm-up, " + ("one seed" if max(len(v) for v in by.values()) < 2
                                                           else "mean over seeds, min-max band"))
        title = _title(head, reading_note(results), width=120)
        height = 5.0 + 0.2 * (title.count("\n") + 1)
        fig, axes = plt.subplots(1, len(groups), figsize=(8 * len(groups), height), squeeze=False)
        for ax, (panel, key, keys) in zip(axes[0], groups):
            for k in keys:
                runs = by[k]
                xs = [e["step"] for e in runs[0]["evals"]]
                band(ax, xs, runs, lambda r, i, key=key: r["evals"][i][key], runs[0]["config"], label_of(runs))
            ax.set_title(panel, fontsize=11)
            ax.set_xlabel("optimizer step")
            ax.set_ylabel("held-out success, exact (teacher forcing)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=9)
        fig.suptitle(title, fontsize=10.5)
        fig.tight_layout()  # (it makes room for the suptitle)
        files["contrast.png"] = out / "contrast.png"
        fig.savefig(files["contrast.png"], dpi=110)
        plt.close(fig)
    return files


def _title(head: str, note: str, width: int = 170) -> str:
    """A figure title: ``head``, then the reading note's sentences, each wrapped at ``width`` characters."""
    import textwrap

    lines = ([head] if head else []) + [w for line in note.splitlines() for w in textwrap.wrap(line, width)]
    return "\n".join(lines)
