"""Checks of a record that need no trainer: alignment, coverage, sampled-vs-candidate consistency, support sums
(and their log base), head sums, support width against a declared ``top_k``, weight versions.

Alignment comes first: a record whose per-position entries (``lq`` and the candidate row) belong to the
neighbouring token explains every coverage miss and every sampled-vs-candidate disagreement, so those are then
reported as the shift, not as separate mistakes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from offpolicy.diagnose.entries import entry_of, entry_rows, row_sum
from offpolicy.diagnose.findings import Finding
from offpolicy.diagnose.recorded import RecordedRollouts

#: a support row sums to one within this (fp32 renormalisation: about 1e-6; bf16 records: about 1e-2)
SUPPORT_SUM_TOL = 2e-2
#: the sampled token's ``lq`` and its own candidate entry agree within this (absolute + relative to ``|lq|``);
#: both are the same number in a correct record, fp32 or bf16
ENTRY_ATOL = 1e-3
ENTRY_RTOL = 1e-3


def neighbours(rollouts: RecordedRollouts) -> tuple[Tensor, Tensor]:
    """``(prev, next) [N]`` int64: the index of the token one position before / after in the same context row
    (``-1`` where there is none)."""
    key = rollouts.rows * (int(rollouts.cols.max()) + 2 if len(rollouts) else 1) + rollouts.cols
    order = torch.argsort(key)
    k = key[order]
    adjacent = k[1:] == k[:-1] + 1
    nxt = torch.full((len(rollouts),), -1, dtype=torch.int64)
    prv = torch.full((len(rollouts),), -1, dtype=torch.int64)
    nxt[order[:-1][adjacent]] = order[1:][adjacent]
    prv[order[1:][adjacent]] = order[:-1][adjacent]
    return prv, nxt


def _agrees(entry: Tensor, lq: Tensor) -> Tensor:
    return (entry - lq).abs() <= ENTRY_ATOL + ENTRY_RTOL * lq.abs()


def alignment(rollouts: RecordedRollouts) -> Finding | None:
    """Do the per-position entries belong to their own token, or to the next / previous one?

    In a correct record the sampled token's entry in its own candidate row equals ``lq``. A record shifted by one
    (``lq`` and the row at ``t`` are the sampler's for position ``t + 1``, or ``t - 1``) matches the neighbour's
    token instead; repeated tokens match both ways, so a shift is named only where neighbour matches outnumber
    own matches twice over (and at least 3 rows).
    """
    c = rollouts.candidates
    if c is None or len(rollouts) < 2:
        return None
    lq = rollouts.sampler_logprobs.double()
    prv, nxt = neighbours(rollouts)
    row = entry_rows(c)
    own = int(_agrees(entry_of(c, rollouts.tokens, row), lq).sum())
    counts = {}
    for name, nb in (("next", nxt), ("previous", prv)):
        has = nb >= 0
        tok = torch.where(has, rollouts.tokens[nb.clamp(min=0)], -2)
        counts[name] = int((_agrees(entry_of(c, tok, row), lq) & has).sum())
    side = max(counts, key=counts.get)
    ev = {"rows_matching_own_token": own, "rows_matching_next_token": counts["next"],
          "rows_matching_previous_token": counts["previous"]}
    if counts[side] >= 3 and counts[side] > 2 * own:
        return Finding("alignment", False,
                       f"the log-probs and candidate rows are shifted by one position against the tokens: "
                       f"{counts[side]} rows hold the {side} token with exactly lq, only {own} their own (an "
                       "off-by-one when the record was cut from the response)", "position_shift", ev)
    return Finding("alignment", True, f"each row's entry for its own sampled token is lq ({own} rows)", evidence=ev)


def record_checks(rollouts: RecordedRollouts) -> list[Finding]:
    """Checks that need no trainer: alignment, coverage, consistency, support/head sums, top_k width, versions."""
    out = []
    c = rollouts.candidates
    filtered = (rollouts.top_p < 1.0) | (rollouts.top_k >= 0)
    if c is not None:
        shift = alignment(rollouts)
        shifted = shift is not None and not shift.ok
        if shift is not None:
            out.append(shift)
        row = entry_rows(c)
        entry = entry_of(c, rollouts.tokens, row)
        lq = rollouts.sampler_logprobs.double()
        if c.kind == "support":
            miss = int(entry.isnan().sum())
            out.append(_consequence("coverage", miss, shifted, "candidates_miss_sampled",
                                    f"{miss} of {len(rollouts)} support rows miss their sampled token",
                                    "every support row holds its sampled token", {"rows_missing": miss}))
        held = ~entry.isnan()
        bad = int((held & ~_agrees(entry, lq)).sum())
        worst = float((entry - lq)[held].abs().max()) if bool(held.any()) else 0.0
        out.append(_consequence("consistency", bad, shifted, "sampled_candidate_mismatch",
                                f"{bad} of {int(held.sum())} rows give the sampled token a log-prob that differs "
                                f"from lq (max |entry - lq| = {worst:.3g}): the sampled log-probs and the "
                                "candidates come from different computations",
                                "the sampled token's own candidate entry equals lq in every row that holds it",
                                {"rows_disagreeing": bad, "max_abs_difference": round(worst, 6)}))
        if c.kind == "support":
            out += _support_sums(rollouts, row, bool(filtered.any()))
            width = _top_k_width(rollouts)
            if width is not None:
                out.append(width)
        else:
            mass = row_sum(torch.exp(c.logprobs.double()), row, len(rollouts))
            over = int((mass > 1.0 + 1e-3).sum())
            out.append(Finding("head_sum", over == 0,
                               f"{over} head rows sum above one: renormalised values recorded as a head" if over
                               else "head rows are sub-probabilities (sum <= 1)",
                               "head_renormalised" if over else None, {"rows_over_one": over}))
    out.append(_versions(rollouts))
    return out


def _consequence(check: str, bad: int, shifted: bool, mistake: str, failed: str, passed: str,
                 ev: dict) -> Finding:
    if bad and shifted:
        return Finding(check, False, f"{failed} (explained by the position shift)", "position_shift", ev)
    return Finding(check, bad == 0, failed if bad else passed, mistake if bad else None, ev)


def _support_sums(rollouts: RecordedRollouts, row: Tensor, filtered: bool) -> list[Finding]:
    """Support rows must sum to one; rows that do in base 2 (``sum 2^l = 1``) are log2 values."""
    lp = rollouts.candidates.logprobs.double()
    n = len(rollouts)
    mass = row_sum(torch.exp(lp), row, n)
    off = (mass - 1.0).abs() > SUPPORT_SUM_TOL
    med = float(mass.median())
    ev = {"rows_off": int(off.sum()), "median_sum": round(med, 6)}
    if not bool(off.any()):
        return [Finding("support_sum", True, f"support rows sum to one (median {med:.6f})", evidence=ev)]
    base2 = row_sum(torch.exp2(lp), row, n)
    if bool(((base2 - 1.0).abs() <= SUPPORT_SUM_TOL).all()):
        ev["median_sum_base_2"] = round(float(base2.median()), 6)
        return [Finding("support_sum", False, f"{int(off.sum())} support rows do not sum to one (median {med:.4f}) "
                        "but every row sums to one as powers of 2: the log-probs are in base 2 (log2), not natural "
                        "logs", "log_base_2", ev)]
    hint = (": the support log-probs are full-vocabulary values, not renormalised over the support (missing "
            "renormalisation)" if med < 1.0 and filtered else "")
    return [Finding("support_sum", False, f"{int(off.sum())} support rows do not sum to one (median sum "
                    f"{med:.4f}){hint}", "missing_renormalisation" if hint else "support_not_normalised", ev)]


def _top_k_width(rollouts: RecordedRollouts) -> Finding | None:
    """With top-k alone (top_p = 1) every support row holds at least ``top_k`` ids (more on ties)."""
    k_only = (rollouts.top_k > 0) & (rollouts.top_p >= 1.0)
    if not bool(k_only.any()):
        return None
    width = rollouts.candidates.lengths
    narrow = k_only & (width < rollouts.top_k)
    n = int(narrow.sum())
    ev = {"rows_narrower_than_top_k": n, "rows_top_k_only": int(k_only.sum())}
    if n:
        k = int(rollouts.top_k[narrow][0])
        w = int(width[narrow].max())
        return Finding("support_width", False, f"{n} support rows of a top_k = {k} sampler (top_p = 1) hold fewer "
                       f"than {k} ids (at most {w}): the support was truncated (e.g. to the returned log-probs) "
                       "and labelled complete", "support_truncated", ev)
    return Finding("support_width", True, "every top-k support row holds at least top_k ids", evidence=ev)


def _versions(rollouts: RecordedRollouts) -> Finding:
    """Versions never go backwards along a sequence; tokens of unknown version (-1) are not compared."""
    known = rollouts.versions >= 0
    seq, col, ver = rollouts.seq_ids[known], rollouts.cols[known], rollouts.versions[known]
    order = torch.argsort(seq * (int(col.max()) + 1 if col.numel() else 1) + col)
    s, v = seq[order], ver[order]
    back = int(((s[1:] == s[:-1]) & (v[1:] < v[:-1])).sum())
    unknown = int((~known).sum())
    return Finding("versions", back == 0,
                   f"weight versions go backwards {back} times within a sequence (a later token sampled by older "
                   "weights: the version stamps or the weight sync are wrong)" if back else
                   "weight versions never go backwards within a sequence"
                   + (f" ({unknown} tokens of unknown version not compared)" if unknown else ""),
                   "versions_backwards" if back else None, {"backward_steps": back, "unknown_version_tokens": unknown})
