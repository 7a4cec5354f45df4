"""Which ``op.Correction`` to start from, given the measured divergence and the record kind.

Rules (each stated in the report with the number that triggered it):

* a semantic mistake is found: fix the record first; no correction is recommended (any weight computed from a
  wrong ``lq`` corrects the wrong thing).
* base, a named preset (``offpolicy.presets``, docs/spec.md#presets): ``"icepop"`` (``weights="mis"`` with the
  IcePop band ``(0.5, 5)``, ``docs/spec.md#weights``: it masks the extreme tokens that dominate the variance rather
  than clipping them into the gradient); with candidates ``"sc_mis"``, the same plus ``score_centering=True``
  (``docs/spec.md#score-centering``); support records also replay the mask (passing ``candidates`` does it). The
  rules below add keywords to it; the first reason is the call that builds the result by name,
  ``op.presets.correction(name, **added)``.
* extreme share above 5% of tokens: add a sequence veto (``veto=1e-4``, ``docs/spec.md#veto``), as whole sequences
  then carry tokens the trainer would almost never produce.
* mean k3 above 0.05 and growing with staleness: add ``KLRejection(threshold=0.5, estimator="k3", level="seq_mean")``
  (``docs/spec.md#kl-rejection``) to drop the stalest, most divergent sequences.
"""

from __future__ import annotations

from offpolicy import presets
from offpolicy.corrections.correction import Correction, KLRejection
from offpolicy.diagnose.divergence import Divergence

EXTREME_VETO = 0.05
K3_REJECT = 0.05


def recommend(overall: Divergence, by_staleness: dict[int, Divergence], candidate_kind: str | None,
              mistakes: list[str]) -> tuple[Correction | None, list[str]]:
    """``(correction or None, reasons)``."""
    if mistakes:
        return None, [f"fix the record first ({', '.join(sorted(set(mistakes)))}): importance weights built on a "
                      "mis-specified lq correct the wrong distribution"]
    name = "sc_mis" if candidate_kind is not None else "icepop"
    reasons = ["weights='mis' (band 0.5-5): masks extreme tokens instead of clipping them into the gradient"]
    added: dict[str, object] = {}
    if candidate_kind is not None:
        reasons.append(f"score_centering=True: {candidate_kind} candidates are recorded"
                       + ("; pass them to replay the top-p/top-k mask" if candidate_kind == "support" else ""))
    if overall.extreme_share > EXTREME_VETO:
        added["veto"] = 1e-4
        reasons.append(f"veto=1e-4: {overall.extreme_share:.1%} of tokens have r outside [0.2, 5]")
    stale = sorted(by_staleness)
    if overall.k3 > K3_REJECT and len(stale) > 1 and by_staleness[stale[-1]].k3 > by_staleness[stale[0]].k3:
        added["kl_rejection"] = KLRejection(threshold=0.5, estimator="k3", level="seq_mean")
        reasons.append(f"kl_rejection (k3 mean > 0.5 per sequence): k3 = {overall.k3:.3f} and it grows with "
                       f"staleness ({by_staleness[stale[0]].k3:.3f} at {stale[0]} -> "
                       f"{by_staleness[stale[-1]].k3:.3f} at {stale[-1]})")
    call = ", ".join([repr(name)] + [f"{k}={'op.' if isinstance(v, KLRejection) else ''}{v!r}"
                                     for k, v in added.items()])
    reasons.insert(0, f"by name: op.presets.correction({call}) (the preset {name!r}; its evidence: "
                      f"op.presets.get({name!r}).evidence)")
    return presets.correction(name, **added), reasons
