"""The pre-registered predictions of docs/demo.md as data: the current registration (:data:`CURRENT`,
"Pre-registration") and the earlier regime's (:data:`EARLIER`, "Earlier regime"), each claim a record of a kind in
:mod:`offpolicy.demo.claims`, which judges them from the histories (:func:`predictions_text`
picks the registration the histories belong to).

Current registration: primary outcome ``Y``, a run's mean exact held-out success over its evaluations after the
start (``success_mean`` of :func:`offpolicy.demo.report.summarize`). Comparisons are paired over seeds (mean
per-seed difference, 95 % Student-t interval). A "below" / "above" claim is a hit when the interval lies entirely
below / above 0; a "holds" claim is a hit when the interval lies entirely inside ``[-MARGIN, +MARGIN]``. The grid is
*void* (every verdict "void") when the on-policy control's ``Y - start`` interval does not lie above 0 or any run
skipped a step for a non-finite gradient. One seed gives no interval: every verdict is then "undecided (one seed)".
"""

from __future__ import annotations

from dataclasses import replace

from offpolicy.demo.claims import (ControlRises, Direction, DoseResponse, DriftRemoved, DriftSigns, EarlierDrift,
                                   Equivalent, FinalDirection, GroupShares, KLRatio, LowestKL, NoCollapse,
                                   Registration, Rises)
from offpolicy.demo.claims import judge
from offpolicy.demo.report import DELTA, is_earlier_regime

#: Equivalence margin of the "holds" claims, in exact held-out success (registered before the grid).
MARGIN = DELTA
#: A corrected arm "removes drift" when its |<u, q - p>| is below this fraction of GRPO's on the same fleet.
DRIFT_FRACTION = 0.05
BELOW, AROUND, ABOVE = -1, 0, 1

CURRENT = Registration(void_rule=True, claims=(
    # Headline.
    Direction("H1 GRPO on the mixed fleet below the on-policy control", "grpo@mixed", "grpo@onpolicy", BELOW),
    Equivalent("H2 SC+MIS+top-p on the mixed fleet holds (equivalent to on-policy)", "sc_mis_topp@mixed", MARGIN),
    Direction("H3 SC+MIS+top-p above GRPO, mixed fleet", "sc_mis_topp@mixed", "grpo@mixed", ABOVE),
    # The study's per-method observations ("Insights").
    Direction("S1 GRPO: pre-clip gradient norm grows more than SC+MIS+top-p's (mixed)", "grpo@mixed",
              "sc_mis_topp@mixed", ABOVE, "grad_growth"),
    Direction("S2a GRPO+MIS: gradient norm grows less than GRPO's (mixed)", "grpo_mis@mixed", "grpo@mixed", BELOW,
              "grad_growth"),
    Direction("S2b GRPO+MIS: KL grows more than SC+MIS's (mixed)", "grpo_mis@mixed", "sc_mis@mixed", ABOVE,
              "kl_growth"),
    DriftRemoved("S3a SC: drift removed (|<u, q-p>| < 5 % of GRPO's at both signs, mixed)", "sc@mixed",
                 "grpo@mixed", DRIFT_FRACTION, ("SC", "GRPO")),
    Direction("S3b SC: KL grows more than SC+MIS's (mixed)", "sc@mixed", "sc_mis@mixed", ABOVE, "kl_growth"),
    Direction("S4a GRPO+top-p (replay): gradient norm grows less than GRPO's (mixed)", "grpo_topp@mixed",
              "grpo@mixed", BELOW, "grad_growth"),
    Direction("S4b GRPO+top-p (replay): KL grows more than SC+MIS+top-p's (mixed)", "grpo_topp@mixed",
              "sc_mis_topp@mixed", ABOVE, "kl_growth"),
    Equivalent("S5a SC+MIS holds (equivalent to on-policy, mixed)", "sc_mis@mixed", MARGIN),
    Direction("S5b SC+MIS: KL grows less than GRPO's (mixed)", "sc_mis@mixed", "grpo@mixed", BELOW, "kl_growth"),
    LowestKL("S6 SC+MIS+top-p has the lowest mean KL of the mixed-fleet arms", "sc_mis_topp@mixed"),
    Direction("S7 GRPO on the homogeneous fleet also below on-policy", "grpo@homogeneous", "grpo@onpolicy", BELOW),
    KLRatio("S8 mixed / homogeneous KL (SC+MIS+top-p) >= 2", "sc_mis_topp@mixed", "sc_mis_topp@homogeneous", 2),
    GroupShares("S9 per group: NVFP4 over, BF16 under their share of samples in extreme-ratio tokens",
                "sc_mis_topp@mixed", not_run_label="S9 per group"),
    DriftSigns("D1 drift probe: GRPO moves p toward q at a > 0 and away at a < 0 (mixed)", "grpo@mixed"),
))

#: The earlier regime's registration (staleness 0.5, drift probe at a = -1 only; primary outcome the final exact
#: success): verdicts rest on each claim's own interval.
EARLIER = Registration(void_rule=False, claims=(
    ControlRises("1 on-policy control does not degrade, rises"),
    NoCollapse("2 no run collapses, no KL blow-up"),
    FinalDirection("3 GRPO mixed below on-policy", "grpo@mixed", "grpo@onpolicy", BELOW),
    FinalDirection("4 SC+MIS mixed above GRPO mixed", "sc_mis@mixed", "grpo@mixed", ABOVE),
    EarlierDrift("5 drift probe", DRIFT_FRACTION),
    DoseResponse("6 dose-response", ("bf16", "fp8", "nvfp4", "mxfp4")),
    FinalDirection("7 GRPO homogeneous within interval of on-policy", "grpo@homogeneous", "grpo@onpolicy", AROUND),
    KLRatio("8 mixed KL >= 5x homogeneous (GRPO)", "grpo@mixed", "grpo@homogeneous", 5, show_means=True),
    GroupShares("9 per group: NVFP4 over, BF16 under their sample share", "sc_mis_topp@mixed",
                not_run_label="9 per group"),
))


#: Grid C's registration (docs/demo_gridC_registration.md), committed before any grid-C history: a mixture-of-experts
#: policy, numerics alone (staleness 0) at the primary format NVFP4, the format sweep, a staleness-4 contrast.
#: Top-p arms are scored under the trainer's nucleus (``success_topp_mean``) against the on-policy top-p control.
_N, _ST4 = "@mixed:nvfp4", "~st4"
GRID_C = Registration(void_rule=True, holm=True, claims=(
    # Headline (C1 is the primary comparison).
    Direction("C1 GRPO (NVFP4) below the on-policy control", "grpo" + _N, "grpo@onpolicy", BELOW),
    Equivalent("C2 SC+MIS+top-p (NVFP4) holds against the on-policy top-p control, both under their nucleus",
               "sc_mis_topp" + _N, MARGIN, "grpo_topp@onpolicy", "success_topp_mean"),
    Direction("C3 SC+MIS (NVFP4) above GRPO (NVFP4)", "sc_mis" + _N, "grpo" + _N, ABOVE),
    # Routing.
    Rises("R1 route-flip share rises BF16 < FP8 < NVFP4 < MXFP4 (GRPO)",
          tuple(f"grpo@mixed:{f}" for f in ("bf16", "fp8", "nvfp4", "mxfp4")), "route_flip"),
    Direction("R2 routing replay + TIS: mean KL(q||p) below GRPO's (NVFP4)", "rr_tis" + _N, "grpo" + _N, BELOW,
              "kl_full"),
    Direction("R3 routing replay + TIS (NVFP4) above GRPO (NVFP4)", "rr_tis" + _N, "grpo" + _N, ABOVE),
    Equivalent("R4 routing replay adds nothing to SC+MIS+top-p (nucleus success, NVFP4)", "sc_mis_topp_rr" + _N,
               MARGIN, "sc_mis_topp" + _N, "success_topp_mean"),
    # The study's per-method observations ("Insights"), at NVFP4.
    Direction("S1 GRPO: pre-clip gradient norm grows more than SC+MIS+top-p's", "grpo" + _N, "sc_mis_topp" + _N,
              ABOVE, "grad_growth"),
    Direction("S2a GRPO+MIS: gradient norm grows less than GRPO's", "grpo_mis" + _N, "grpo" + _N, BELOW,
              "grad_growth"),
    Direction("S2b GRPO+MIS: KL grows more than SC+MIS's", "grpo_mis" + _N, "sc_mis" + _N, ABOVE, "kl_growth"),
    Direction("S3 SC: KL grows more than SC+MIS's", "sc" + _N, "sc_mis" + _N, ABOVE, "kl_growth"),
    Equivalent("S5a SC+MIS holds (equivalent to on-policy)", "sc_mis" + _N, MARGIN),
    Direction("S5b SC+MIS: KL grows less than GRPO's", "sc_mis" + _N, "grpo" + _N, BELOW, "kl_growth"),
    LowestKL("S6 SC+MIS+top-p has the lowest mean KL of the NVFP4 arms", "sc_mis_topp" + _N, "nvfp4"),
    Equivalent("S7 GRPO on the homogeneous fleet holds (equivalent to on-policy)", "grpo@homogeneous", MARGIN),
    KLRatio("S8 NVFP4 / homogeneous KL (GRPO) >= 2", "grpo" + _N, "grpo@homogeneous", 2),
    # Dose-response and the staleness contrast.
    Direction("F1 GRPO: MXFP4 below BF16", "grpo@mixed:mxfp4", "grpo@mixed:bf16", BELOW),
    Rises("F2 GRPO: mean KL(q||p) rises BF16 < FP8 < NVFP4 < MXFP4",
          tuple(f"grpo@mixed:{f}" for f in ("bf16", "fp8", "nvfp4", "mxfp4")), "kl_full"),
    Direction("T1 staleness 4 lowers GRPO (NVFP4) further", "grpo" + _N + _ST4, "grpo" + _N, BELOW),
    Direction("T2 staleness 4 alone: GRPO homogeneous below on-policy", "grpo@homogeneous" + _ST4, "grpo@onpolicy",
              BELOW),
))


def quick_heading(results: list[dict]) -> str:
    """The line above the quick demo's verdict table (its runs carry ``quick``): the claims are grid C's that its
    configurations allow, measured on its seed(s) and steps, never a verdict of the grid."""
    seeds = len({r["config"]["seed"] for r in results})
    steps = max(len(r["history"]) for r in results)
    return (f"The quick demo runs part of grid C ({seeds} seed(s) of {steps} steps; the grid: 30 seeds of 200 steps): "
            "the claims below are grid C's, measured on this run, not the grid's verdicts. "
            + ("One seed is an illustration, not evidence (no interval: every verdict undecided). " if seeds == 1
               else "A shorter run on fewer seeds is not the registered test. ")
            + "S6 (it ranks all seven NVFP4 arms) is left out. Grid C (docs/demo_gridC_registration.md) decides.\n")


def predictions_text(results: list[dict]) -> str:
    """The pre-registered predictions judged from the histories: grid C's for its histories (``grid`` "C"; for the
    quick demo's runs, ``quick``, only the claims its configurations allow, under :func:`quick_heading`), the
    earlier regime's for its histories, else the current registration's (grids A and B)."""
    if any(r.get("grid") == "C" for r in results):
        if any(r.get("quick") for r in results):
            # S6 ranks all seven NVFP4 arms: on the quick demo's three it would rank something else.
            part = replace(GRID_C, claims=tuple(c for c in GRID_C.claims if not isinstance(c, LowestKL)))
            return quick_heading(results) + judge(results, part, ran_only=True)
        return judge(results, GRID_C)
    return judge(results, EARLIER if is_earlier_regime(results) else CURRENT)
