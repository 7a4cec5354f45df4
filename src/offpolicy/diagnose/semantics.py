"""Checks of what the recorded log-probs *mean*, against the trainer: each finding names the likely mistake and
its evidence, or says that the gap is sampler-trainer mismatch.

The mistakes users of sampler records report most (docs/diagnose.md lists the issue threads): raw (pre-temperature)
log-probs recorded for a tempered sampler; temperature applied twice; sampler log-probs not renormalised over the
top-p / top-k support; log-probs in base 2; a support truncated and labelled complete; log-probs shifted by one
position. The record-only checks are in :mod:`offpolicy.diagnose.record_checks`.

Mistake or mismatch is decided by how the error behaves: a mistaken reading (a temperature, a missing
normaliser, a log base, a shift) *explains* the gap, so once it is applied the record matches the trainer to
within a third of the declared reading's error; stale weights or other numerics leave an error that no reading
removes, which is reported as mismatch (measured in the divergence tables), never as a record bug. Each check runs
per slice (group, weight version, declared temperature; :mod:`offpolicy.diagnose.slices`), so stale tokens are
judged apart from fresh ones.

Evidence comes in three strengths. From trainer log-probs of the candidates (a tensor file's
``candidate_logprobs`` or a model): the *effective temperature*: within a row, ``l_i - l_j = (z_i - z_j) / T``, so
regressing the row-centred record on the row-centred trainer values (taken at the declared ``T``) gives slope
``T / T_eff``, free of per-row constants such as the support mass. From a model: each reading of the record
(declared, raw, temperature twice, not renormalised, base 2, and a grid of temperatures) is recomputed and the one
closest to the record (median absolute error over tokens) is named; the trainer's own support size shows a
truncated one. From trainer log-probs alone: the sign of filtered-token ratios and a position shift.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from offpolicy.diagnose.entries import entry_rows, row_logsumexp, row_sum
from offpolicy.diagnose.findings import Finding
from offpolicy.diagnose.record_checks import neighbours
from offpolicy.diagnose.recorded import RecordedRollouts
from offpolicy.diagnose.scoring import TEMPERATURE_GRID, TrainerScores

#: relative tolerance on the effective temperature (numerics differences move it by well under 1%)
TEMPERATURE_RTOL = 0.05
#: a reading must beat the declared one by this factor of error (and the declared one be off by ``MIN_ERROR``)
#: before it is named
ERROR_RATIO = 3.0
MIN_ERROR = 0.02
#: share of support rows the trainer's declared filter keeps wider than the record's widest row, above which
#: the support is named truncated
TRUNCATED_SHARE = 0.2
LN2 = math.log(2.0)


def declared_temperature(rollouts: RecordedRollouts) -> float:
    """The slice's declared temperature (fp32 storage: 0.7 reads 0.69999999, so rounded)."""
    return round(float(rollouts.temperature.double().median()), 6)


def _centred_fit(record: Tensor, trainer: Tensor, row: Tensor, n: int
                 ) -> tuple[float, int, float, float, Tensor]:
    """Regress the row-centred ``record`` on the row-centred ``trainer`` (entries ``[nnz]`` of rows ``row [nnz]``,
    ``n`` rows) over rows with >= 2 finite entries: (slope, rows used, sum of squares at slope 1, at the fitted
    slope, ``[nnz]`` mask of the entries used)."""
    ok = torch.isfinite(record) & torch.isfinite(trainer)
    cnt = row_sum(ok.double(), row, n)
    rows = cnt >= 2
    m = ok & rows[row]
    if not bool(rows.any()):
        return float("nan"), 0, 0.0, 0.0, m
    md = m.double()
    a0 = torch.where(m, record, 0.0)
    b0 = torch.where(m, trainer, 0.0)
    safe = cnt.clamp(min=1)
    a = (a0 - (row_sum(a0, row, n) / safe)[row]) * md
    b = (b0 - (row_sum(b0, row, n) / safe)[row]) * md
    den = float((b * b).sum())
    if den <= 0:
        return float("nan"), int(rows.sum()), 0.0, 0.0, m
    s = float((a * b).sum()) / den
    return s, int(rows.sum()), float(((a - b) ** 2).sum()), float(((a - s * b) ** 2).sum()), m


def effective_temperature(rollouts: RecordedRollouts, scores: TrainerScores) -> Finding | None:
    """The temperature the record's candidate log-probs were computed at, from their spread vs the trainer's.

    A temperature (or log base) is named only when rescaling explains the gap: the residual at the fitted slope
    is below ``1 / ERROR_RATIO^2`` of the residual at the declared one. A slope of ``1 / ln 2`` whose *full*
    values (not only their spreads) match ``trainer / ln 2`` (renormalised over the row for support records) is
    base-2 log-probs, not a temperature.
    """
    if rollouts.candidates is None or scores.candidate_logprobs is None:
        return None
    c = rollouts.candidates
    rec = c.logprobs.double()
    tr = scores.candidate_logprobs.double()
    row = entry_rows(c)
    slope, used, sq_declared, sq_fit, ok = _centred_fit(rec, tr, row, len(rollouts))
    if used == 0 or not math.isfinite(slope) or slope <= 0:
        return None
    t = declared_temperature(rollouts)
    t_eff = t / slope
    ev = {"declared_temperature": t, "effective_temperature": round(t_eff, 4), "rows": used,
          "residual_share_after_fit": round(sq_fit / sq_declared, 4) if sq_declared > 0 else 0.0}
    if abs(t_eff - t) <= TEMPERATURE_RTOL * t:
        return Finding("temperature", True, f"candidate log-probs are tempered at T = {t_eff:.3f} (declared {t})",
                       evidence=ev)
    if not sq_fit * ERROR_RATIO ** 2 < sq_declared:
        return Finding("temperature", True,
                       f"candidate spreads differ from the trainer's (best slope gives T_eff = {t_eff:.3f}, declared "
                       f"{t}) but no temperature explains the difference ({ev['residual_share_after_fit']:.0%} of "
                       "it remains): sampler-trainer mismatch (stale weights or other numerics)", evidence=ev,
                       mismatch=True)
    if abs(slope * LN2 - 1.0) <= TEMPERATURE_RTOL:
        if rollouts.candidates.kind == "support":  # support values are renormalised over the row's finite ids
            tr = tr - row_logsumexp(torch.where(ok, tr, float("-inf")), row, len(rollouts))[row]
        full = float((rec[ok] * LN2 - tr[ok]).abs().median())
        spread = math.sqrt(sq_fit / max(int(ok.sum()), 1))
        ev["median_abs_error_base_2"] = round(full, 6)
        if full <= ERROR_RATIO * spread + 1e-3:
            return Finding("temperature", False,
                           f"the record's log-probs are the trainer's divided by ln 2 (slope {slope:.4f} = 1/ln 2, "
                           f"full values within {full:.2g}): log-probs in base 2 (log2), not natural logs",
                           "log_base_2", ev)
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


def _median_error(pred: Tensor, lq: Tensor) -> float:
    return float((pred - lq).abs().nan_to_num(float("inf")).median())


def best_grid_temperature(errors: Tensor) -> float:
    """The temperature of least error over :data:`TEMPERATURE_GRID` (``errors [G]``), refined by the parabola
    through the best point and its neighbours (in log T, moved at most one grid step)."""
    g = int(errors.argmin())
    log_t = torch.log(TEMPERATURE_GRID.double())
    if 0 < g < len(errors) - 1 and bool(torch.isfinite(errors[g - 1: g + 2]).all()):
        lo, mid, hi = (float(e) for e in errors[g - 1: g + 2])
        curve = lo - 2 * mid + hi
        if curve > 0:
            step = float(log_t[1] - log_t[0])
            return math.exp(float(log_t[g]) + max(-step, min(step, 0.5 * step * (lo - hi) / curve)))
    return float(TEMPERATURE_GRID[g])


def best_reading(rollouts: RecordedRollouts, scores: TrainerScores) -> Finding | None:
    """Which recomputed reading of the record explains it best (model scores only)."""
    h = scores.hypotheses
    if h is None:
        return None
    lq = rollouts.sampler_logprobs.double()
    err = {k: _median_error(h[k], lq) for k in ("declared", "raw", "temperature_twice", "not_renormalised")}
    err["log_base_2"] = _median_error(h["declared"] / LN2, lq)
    t_best = best_grid_temperature(h["grid_abs_error"].double().nan_to_num(float("inf")).median(dim=1).values)
    t = declared_temperature(rollouts)
    filtered = bool(((rollouts.top_p < 1.0) | (rollouts.top_k >= 0)).any())
    ev: dict[str, float | int | str] = {f"median_abs_error_{k}": round(v, 5) for k, v in err.items()}
    ev["best_grid_temperature"] = round(t_best, 3)
    ev["declared_temperature"] = t
    candidates = {"raw": ("raw_logprobs", "raw log-probs: the record is the untempered, unfiltered distribution "
                          f"(best-fitting temperature {t_best:.2f}, declared {t})"),
                  "temperature_twice": ("temperature_twice", f"temperature applied twice: the record matches T^2 = "
                                        f"{t * t:.3f} (best-fitting temperature {t_best:.2f}, declared {t})"),
                  "not_renormalised": ("missing_renormalisation", "sampler log-probs are not renormalised over the "
                                       "top-p/top-k support: the record is log p_T(y), the trainer's is "
                                       "log p_T(y) - log P_T(S)"),
                  "log_base_2": ("log_base_2", "log-probs in base 2: the record is the declared log p(y) / ln 2")}
    if not filtered:
        candidates.pop("not_renormalised")
    if abs(t - 1.0) <= 1e-6:
        # at T = 1 "twice" is the declared reading, and raw log-probs of a filtered sampler are exactly the
        # unrenormalised ones: the mistake to name is then the missing renormalisation
        candidates.pop("temperature_twice")
        candidates.pop("raw")
    best = min(candidates, key=lambda k: err[k])
    if err["declared"] > MIN_ERROR and err[best] * ERROR_RATIO < err["declared"]:
        mistake, text = candidates[best]
        return Finding("reading", False, text, mistake, ev)
    if err["declared"] > MIN_ERROR:
        return Finding("reading", True,
                       f"the record is off the declared distribution (median |lq - log q| = {err['declared']:.3g}; "
                       f"best-fitting temperature {t_best:.2f}, declared {t}) and no mistaken reading explains it: "
                       "sampler-trainer mismatch (stale weights, other numerics, another model)", evidence=ev,
                       mismatch=True)
    return Finding("reading", True, f"the record matches the declared sampling distribution (median "
                   f"|lq - log q| = {err['declared']:.2g})", evidence=ev)


def support_truncation(rollouts: RecordedRollouts, scores: TrainerScores) -> Finding | None:
    """Support rows cut below what the declared filter keeps (model scores only): the trainer's declared filter
    keeps more ids than the record's *widest* row on a large share of rows (stale weights move a support's edge by
    a token or so, on the widest rows only)."""
    c = rollouts.candidates
    if c is None or c.kind != "support" or scores.hypotheses is None:
        return None
    cap = int(c.lengths.max())
    want = scores.hypotheses["declared_support_size"]
    wider = int((want > cap).sum())
    share = wider / max(len(rollouts), 1)
    ev = {"widest_recorded_row": cap, "rows_trainer_wider": wider, "share": round(share, 4),
          "median_trainer_support": float(want.double().median())}
    if wider >= 3 and share >= TRUNCATED_SHARE:
        return Finding("support_width", False,
                       f"on {share:.0%} of rows the declared filter keeps more than the record's widest row ({cap} "
                       "ids): the support was truncated (e.g. to the returned top log-probs) and labelled complete",
                       "support_truncated", ev)
    return Finding("support_width", True, f"recorded supports are as wide as the declared filter's (widest {cap})",
                   evidence=ev)


def shifted_logprobs(rollouts: RecordedRollouts, scores: TrainerScores) -> Finding | None:
    """Records without candidates: does ``lq`` at ``t`` match the trainer's log-prob of the next (or previous)
    token far better than its own?"""
    if rollouts.candidates is not None:
        return None  # record_checks.alignment decides from the candidate rows
    prv, nxt = neighbours(rollouts)
    has = nxt >= 0
    if int(has.sum()) < 3:
        return None
    lq = rollouts.sampler_logprobs.double()
    lp = scores.logprobs.double()
    own = _median_error(lp[has], lq[has])
    nb = {"next": _median_error(lp[nxt[has]], lq[has]), "previous": _median_error(lp[has], lq[nxt[has]])}
    side = min(nb, key=nb.get)
    ev = {"median_abs_error_own": round(own, 5), "median_abs_error_next": round(nb["next"], 5),
          "median_abs_error_previous": round(nb["previous"], 5)}
    if own > MIN_ERROR and nb[side] * ERROR_RATIO < own:
        return Finding("alignment", False, f"lq at each position matches the trainer's log-prob of the {side} "
                       f"token (median error {nb[side]:.3g} against {own:.3g} for its own): the log-probs are "
                       "shifted by one position against the tokens", "position_shift", ev)
    return Finding("alignment", True, "lq matches its own token better than its neighbours'", evidence=ev)


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
