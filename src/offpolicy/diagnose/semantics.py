"""Checks of what the recorded log-probs *mean*: each finding names the likely mistake and its evidence.

The mistakes users of sampler records report most (docs/diagnose.md lists the issue threads): raw (pre-temperature)
log-probs recorded for a tempered sampler; temperature applied twice; sampler log-probs not renormalised over the
top-p / top-k support; candidates that miss the sampled token; supports that do not sum to one; weight versions
going backwards.

Evidence comes in three strengths. From the record alone: support sums, coverage, versions. From trainer log-probs
of the candidates (a tensor file's ``candidate_logprobs`` or a model): the *effective temperature*: within a row,
``l_i - l_j = (z_i - z_j) / T``, so regressing the row-centred record on the row-centred trainer values (taken at
the declared ``T``) gives slope ``T / T_eff``, free of per-row constants such as the support mass. From a model: each
reading of the record (declared, raw, temperature twice, not renormalised, and a grid of temperatures) is
recomputed and the one closest to the record (median absolute error over tokens) is named.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from offpolicy.diagnose.recorded import RecordedRollouts
from offpolicy.diagnose.scoring import TEMPERATURE_GRID, TrainerScores

#: relative tolerance on the effective temperature (numerics differences move it by well under 1%)
TEMPERATURE_RTOL = 0.05
#: a support row sums to one within this (fp32 renormalisation: about 1e-6; bf16 records: about 1e-2)
SUPPORT_SUM_TOL = 2e-2
#: a reading must beat the declared one by this factor of median error (and the declared one be off by
#: ``MIN_ERROR``) before it is named
ERROR_RATIO = 3.0
MIN_ERROR = 0.02


@dataclass(frozen=True)
class Finding:
    """One semantic check. ``ok`` False means a likely mistake; ``mistake`` is its short name."""

    check: str
    ok: bool
    message: str
    mistake: str | None = None
    evidence: dict[str, float | int | str] = field(default_factory=dict)


def _centred_slope(record: Tensor, trainer: Tensor) -> tuple[float, int]:
    """Slope of the row-centred ``record`` on the row-centred ``trainer`` ``[N, K]`` over rows with >= 2 finite
    entries; returns (slope, rows used)."""
    ok = torch.isfinite(record) & torch.isfinite(trainer)
    rows = ok.sum(1) >= 2
    if not bool(rows.any()):
        return float("nan"), 0
    a = torch.where(ok, record, 0.0)[rows]
    b = torch.where(ok, trainer, 0.0)[rows]
    m = ok[rows].double()
    cnt = m.sum(1, keepdim=True)
    a = (a - a.sum(1, keepdim=True) / cnt) * m
    b = (b - b.sum(1, keepdim=True) / cnt) * m
    den = float((b * b).sum())
    return (float((a * b).sum()) / den if den > 0 else float("nan")), int(rows.sum())


def effective_temperature(rollouts: RecordedRollouts, scores: TrainerScores) -> Finding | None:
    """The temperature the record's candidate log-probs were computed at, from their spread vs the trainer's."""
    if rollouts.candidates is None or scores.candidate_logprobs is None:
        return None
    rec = rollouts.candidates.logprobs.double()
    slope, used = _centred_slope(rec, scores.candidate_logprobs)
    if used == 0 or not math.isfinite(slope) or slope <= 0:
        return None
    t = round(float(rollouts.temperature.double().median()), 6)  # fp32 storage: 0.7 reads 0.69999999
    t_eff = t / slope
    ev = {"declared_temperature": t, "effective_temperature": round(t_eff, 4), "rows": used}
    if abs(t_eff - t) <= TEMPERATURE_RTOL * t:
        return Finding("temperature", True, f"candidate log-probs are tempered at T = {t_eff:.3f} (declared {t})",
                       evidence=ev)
    if abs(t_eff - 1.0) <= TEMPERATURE_RTOL and abs(t - 1.0) > TEMPERATURE_RTOL:
        return Finding("temperature", False,
                       f"the record's log-probs are untempered (T_eff = {t_eff:.3f}) but the sampler ran at T = {t}: "
                       "raw log-probs (temperature not applied; vLLM: --logprobs-mode raw_logprobs, SGLang: "
                       "SGLANG_RETURN_ORIGINAL_LOGPROB)", "raw_logprobs", ev)
    if abs(t_eff - t * t) <= TEMPERATURE_RTOL * t * t:
        return Finding("temperature", False,
                       f"the record's log-probs are tempered at T_eff = {t_eff:.3f} = {t}^2: temperature applied "
                       "twice (logits divided by T before a sampler that divides again)", "temperature_twice", ev)
    return Finding("temperature", False,
                   f"the record's log-probs are tempered at T_eff = {t_eff:.3f}, not the declared T = {t}",
                   "temperature_mismatch", ev)


def best_reading(rollouts: RecordedRollouts, scores: TrainerScores) -> list[Finding]:
    """Which recomputed reading of the record explains it best (model scores only)."""
    h = scores.hypotheses
    if h is None:
        return []
    lq = rollouts.sampler_logprobs.double()
    err = {k: float((h[k] - lq).abs().nan_to_num(float("inf")).median()) for k in
           ("declared", "raw", "temperature_twice", "not_renormalised")}
    g = int(h["grid_error"].argmin())
    t_best = float(TEMPERATURE_GRID[g])
    t = round(float(rollouts.temperature.double().median()), 6)  # fp32 storage: 0.7 reads 0.69999999
    filtered = bool(((rollouts.top_p < 1.0) | (rollouts.top_k >= 0)).any())
    ev: dict[str, float | int | str] = {f"median_abs_error_{k}": round(v, 5) for k, v in err.items()}
    ev["best_grid_temperature"] = round(t_best, 3)
    ev["declared_temperature"] = t
    out = []
    candidates = {"raw": ("raw_logprobs", "raw log-probs: the record is the untempered, unfiltered distribution "
                          f"(best-fitting temperature {t_best:.2f}, declared {t})"),
                  "temperature_twice": ("temperature_twice", f"temperature applied twice: the record matches T^2 = "
                                        f"{t * t:.3f} (best-fitting temperature {t_best:.2f}, declared {t})"),
                  "not_renormalised": ("missing_renormalisation", "sampler log-probs are not renormalised over the "
                                       "top-p/top-k support: the record is log p_T(y), the trainer's is "
                                       "log p_T(y) - log P_T(S)")}
    if not filtered:
        candidates.pop("not_renormalised")
    if abs(t - 1.0) <= 1e-6:
        # at T = 1 "twice" is the declared reading, and raw log-probs of a filtered sampler are exactly the
        # unrenormalised ones: the mistake to name is then the missing renormalisation
        candidates.pop("temperature_twice")
        candidates.pop("raw")
    best = min(candidates, key=lambda k: err[k], default=None)
    if best is not None and err["declared"] > MIN_ERROR and err[best] * ERROR_RATIO < err["declared"]:
        mistake, text = candidates[best]
        out.append(Finding("reading", False, text, mistake, ev))
    elif err["declared"] > MIN_ERROR:
        out.append(Finding("reading", False,
                           f"the record is far from the declared distribution (median |lq - log q| = "
                           f"{err['declared']:.3g}; best-fitting temperature {t_best:.2f}, declared {t}): different "
                           "weights, a different model, or another mistake", "unexplained_mismatch", ev))
    else:
        out.append(Finding("reading", True, f"the record matches the declared sampling distribution (median "
                           f"|lq - log q| = {err['declared']:.2g})", evidence=ev))
    return out


def record_checks(rollouts: RecordedRollouts) -> list[Finding]:
    """Checks that need no trainer: coverage, support sums, head sums, versions."""
    out = []
    c = rollouts.candidates
    if c is not None:
        hit = ((c.ids == rollouts.tokens[:, None]) & (c.ids >= 0)).any(1)
        mass = torch.exp(c.logprobs.double()).sum(1)
        if c.kind == "support":
            miss = int((~hit).sum())
            out.append(Finding("coverage", miss == 0,
                               f"{miss} of {len(rollouts)} support rows miss their sampled token" if miss else
                               "every support row holds its sampled token",
                               "candidates_miss_sampled" if miss else None, {"rows_missing": miss}))
            off = (mass - 1.0).abs() > SUPPORT_SUM_TOL
            med = float(mass.median())
            filtered = bool(((rollouts.top_p < 1.0) | (rollouts.top_k >= 0)).any())
            if bool(off.any()):
                hint = (": the support log-probs are full-vocabulary values, not renormalised over the support "
                        "(missing renormalisation)" if med < 1.0 and filtered else "")
                out.append(Finding("support_sum", False, f"{int(off.sum())} support rows do not sum to one "
                                   f"(median sum {med:.4f}){hint}",
                                   "missing_renormalisation" if hint else "support_not_normalised",
                                   {"rows_off": int(off.sum()), "median_sum": round(med, 6)}))
            else:
                out.append(Finding("support_sum", True, f"support rows sum to one (median {med:.6f})",
                                   evidence={"median_sum": round(med, 6)}))
        else:
            over = int((mass > 1.0 + 1e-3).sum())
            out.append(Finding("head_sum", over == 0,
                               f"{over} head rows sum above one: renormalised values recorded as a head" if over
                               else "head rows are sub-probabilities (sum <= 1)",
                               "head_renormalised" if over else None, {"rows_over_one": over}))
    seq_order = torch.argsort(rollouts.seq_ids * (rollouts.cols.max() + 1) + rollouts.cols)
    s, v = rollouts.seq_ids[seq_order], rollouts.versions[seq_order]
    same = s[1:] == s[:-1]
    back = int((same & (v[1:] < v[:-1])).sum())
    out.append(Finding("versions", back == 0,
                       f"weight versions go backwards {back} times within a sequence (a later token sampled by "
                       "older weights: the version stamps or the weight sync are wrong)" if back else
                       "weight versions never go backwards within a sequence",
                       "versions_backwards" if back else None, {"backward_steps": back}))
    return out


def one_sided_ratios(rollouts: RecordedRollouts, log_ratio: Tensor) -> Finding | None:
    """Tensor-only evidence of a missing renormalisation: on filtered tokens, ``log r = -log P(S) >= 0`` always.

    Under a correct record ``E_q[r] = 1``, so ratios fall on both sides of 1; a missing ``log P(S)`` makes nearly
    all of them exceed 1.
    """
    filt = (rollouts.top_p < 1.0) | (rollouts.top_k >= 0)
    lr = log_ratio[filt & torch.isfinite(log_ratio)].double()
    if lr.numel() < 20:
        return None
    share = float((lr > 0).double().mean())
    med = float(lr.median())
    ev = {"share_above_one": round(share, 4), "median_log_ratio": round(med, 5), "tokens": int(lr.numel())}
    if share > 0.95 and med > MIN_ERROR:
        return Finding("ratio_sign", False, f"on filtered tokens {share:.0%} of ratios exceed 1 (median log r = "
                       f"{med:.3f}): the sampler log-probs lack the renormalisation over the top-p/top-k support "
                       "(log r = -log P(S))", "missing_renormalisation", ev)
    return Finding("ratio_sign", True, f"filtered-token ratios fall on both sides of 1 ({share:.0%} above)",
                   evidence=ev)
