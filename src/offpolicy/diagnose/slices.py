"""Semantic checks decided per slice of the record: sampler group, weight version and declared sampling
parameters (temperature, top_p, top_k).

A check that pooled every token would let a minority of stale tokens (or of another group's, or unfiltered ones
beside filtered ones) move its median and flip the verdict; per slice, stale tokens are judged on their own, where
their gap shows as mismatch, and filtered tokens are tried under the readings a filter allows. Versions
with fewer than :data:`MIN_SLICE_TOKENS` tokens are pooled with the next newer versions of the same group and
sampling parameters; tokens of unknown version (-1) form their own slice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor

from offpolicy.diagnose.findings import Finding, short_label
from offpolicy.diagnose.recorded import RecordedRollouts
from offpolicy.diagnose.scoring import TrainerScores
from offpolicy.records.csr_candidates import CSRCandidates

MIN_SLICE_TOKENS = 24
#: mistakes that explain the others found with them (a shift, a log base or an lq that disagrees with its own
#: candidate entry makes every reading of lq look wrong)
EXPLAINING = ("position_shift", "log_base_2", "sampled_candidate_mismatch")


def slice_indices(rollouts: RecordedRollouts) -> list[tuple[str, Tensor]]:
    """``[(label, token indices [n] int64)]`` covering every token once, in group, sampling parameters, version
    order."""
    r = rollouts
    out = []
    params = torch.stack([torch.round(r.temperature.double() * 1e6), torch.round(r.top_p.double() * 1e6),
                          r.top_k.double()], 1)
    several = len(torch.unique(params, dim=0)) > 1
    for g in torch.unique(r.group_index).tolist():
        for key in torch.unique(params[r.group_index == g], dim=0):
            here = (r.group_index == g) & (params == key).all(1)
            versions = torch.unique(r.versions[here]).tolist()
            t, p, k = float(key[0]) / 1e6, float(key[1]) / 1e6, int(key[2])
            label = f"group {short_label(r.group_names[g])}" + (f", T {t:g} top_p {p:g} top_k {k}" if several else "")
            if -1 in versions:
                versions.remove(-1)
                out.append((f"{label}, version unknown", (here & (r.versions == -1)).nonzero().flatten()))
            pending: list[int] = []
            for v in versions:
                pending.append(v)
                idx = (here & torch.isin(r.versions, torch.tensor(pending))).nonzero().flatten()
                if idx.numel() >= MIN_SLICE_TOKENS or v == versions[-1]:
                    name = f"v{pending[0]}" if len(pending) == 1 else f"v{pending[0]}-{pending[-1]}"
                    out.append((f"{label}, {name}", idx))
                    pending = []
    return out


def take(rollouts: RecordedRollouts, idx: Tensor) -> RecordedRollouts:
    """The tokens ``idx`` (contexts kept whole: ``rows`` / ``cols`` still index ``contexts``)."""
    c = rollouts.candidates
    per_token = ("tokens", "sampler_logprobs", "group_index", "versions", "seq_ids", "temperature", "top_p",
                 "top_k", "rows", "cols")
    return replace(rollouts, candidates=None if c is None else c.take_rows(idx),
                   **{k: getattr(rollouts, k)[idx] for k in per_token})


def take_scores(scores: TrainerScores, idx: Tensor, candidates: CSRCandidates | None = None) -> TrainerScores:
    """The trainer scores of tokens ``idx`` (hypotheses are ``[N]``, or ``[G, N]`` for the grid; candidate
    log-probs are the ``[nnz]`` entries of ``candidates``' rows, taken like :meth:`CSRCandidates.take_rows`)."""
    hyp = None if scores.hypotheses is None else {k: v[..., idx] for k, v in scores.hypotheses.items()}
    cand = scores.candidate_logprobs
    if cand is not None:
        cand = CSRCandidates(candidates.ids, candidates.offsets, cand, candidates.kind).take_rows(idx).logprobs
    return TrainerScores(scores.logprobs[idx], cand, hyp)


def per_slice(rollouts: RecordedRollouts, scores: TrainerScores, log_ratio: Tensor,
              checks: list[Callable[[RecordedRollouts, TrainerScores, Tensor], Finding | None]],
              explained_by: str | None = None) -> list[Finding]:
    """Run ``checks`` on every slice and merge their findings: one finding per (check, mistake), naming the slices;
    an ok check gives one finding (marked mismatch if any slice saw mismatch). ``explained_by``: a record-level
    mistake from :data:`EXPLAINING` that demotes every slice mistake to its consequence."""
    slices = slice_indices(rollouts)
    found: dict[str, list[tuple[str, Finding]]] = {}
    for label, idx in slices:
        sub, sc = take(rollouts, idx), take_scores(scores, idx, rollouts.candidates)
        results = [f for f in (check(sub, sc, log_ratio[idx]) for check in checks) if f is not None]
        cause = explained_by or next((f.mistake for f in results if not f.ok and f.mistake in EXPLAINING), None)
        for f in results:
            if cause is not None and not f.ok and f.mistake != cause:
                f = replace(f, message=f"{f.message} (explained by {cause})", mistake=cause)
            found.setdefault(f.check, []).append((label, f))
    out = []
    for check, items in found.items():
        bad: dict[str, list[tuple[str, Finding]]] = {}
        for label, f in items:
            if not f.ok:
                bad.setdefault(str(f.mistake), []).append((label, f))
        for hits in bad.values():
            out.append(_labelled(hits, len(slices)))
        if not bad:
            mism = [(label, f) for label, f in items if f.mismatch]
            out.append(_labelled(mism or items, len(slices)))
    return out


def _labelled(hits: list[tuple[str, Finding]], n_slices: int) -> Finding:
    """The first slice's finding, its message prefixed with the slices it holds for (when there are several)."""
    label, f = hits[0]
    if n_slices == 1:
        return f
    where = ", ".join(label for label, _ in hits[:3]) + (f" and {len(hits) - 3} more" if len(hits) > 3 else "")
    return replace(f, message=f"[{where}] {f.message}", evidence={**f.evidence, "slices": len(hits)})
