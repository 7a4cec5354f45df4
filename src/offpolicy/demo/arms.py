"""The mixed-fleet study's six arms: which correction the trainer applies and how the samplers sample.

Every arm shares everything else (learning rate, seeds, steps, batch, fleet); only these fields differ.

======================  ================================  =========  ======================================
arm                     correction                        top-p      sampler record
======================  ================================  =========  ======================================
``grpo``                none (plain GRPO)                 1          head (top-K, unused by the loss)
``grpo_mis``            MIS [0.5, 5]                      1          head
``sc``                  score centering, no weights       1          head (tail modelled as ``rho * p``)
``grpo_topp_noreplay``  none, no mask replay              ``top_p``  the support, given as a head: the
                                                                     trainer scores the full vocabulary
``grpo_topp``           none, with mask replay            ``top_p``  support
``sc_mis``              SC + MIS [0.5, 5]                 1          head
``sc_mis_topp``         SC + MIS [0.5, 5], mask replay    ``top_p``  support
``sc_mis_topp_rr``      as ``sc_mis_topp``, and routing   ``top_p``  support, and the sampler's MoE routes
                        replay (MoE policy only)
``rr_tis``              routing replay + token TIS        1          head, and the sampler's MoE routes
                        (truncated at 2, verl's default)
======================  ================================  =========  ======================================

Without mask replay the trainer's ``p`` is the full-vocabulary distribution while the sampler drew from its
top-p support: the study's "discrepancies in action spaces". With routing replay (``route_replay``, a
mixture-of-experts policy only: :class:`offpolicy.demo.model.TinyLM` with experts) the trainer's forward uses the
expert ids each token's sampler chose (the practitioners' R3), with the trainer's own router weights over them.
"""

from __future__ import annotations

from dataclasses import dataclass

from offpolicy import Correction
from offpolicy.presets import VERL_IS_THRESHOLD

#: The mixed-fleet study's masking bounds for MIS.
MIS_BOUNDS = (0.5, 5.0)


@dataclass(frozen=True)
class Arm:
    """One arm: a label, the correction, whether samplers filter with top-p, and whether the trainer replays
    their top-p mask (the record is then kind ``"support"``; without replay the same ids go in as a ``"head"``), and
    whether it replays the samplers' MoE routes (``route_replay``)."""

    key: str
    label: str
    correction: Correction
    top_p: bool
    mask_replay: bool = False
    route_replay: bool = False

    @property
    def record_kind(self) -> str:
        return "support" if self.mask_replay else "head"


ARMS: dict[str, Arm] = {
    a.key: a
    for a in (
        Arm("grpo", "GRPO", Correction(), False),
        Arm("grpo_mis", "GRPO+MIS", Correction(weights="mis", bounds=MIS_BOUNDS), False),
        Arm("sc", "SC", Correction(score_centering=True), False),
        Arm("grpo_topp_noreplay", "GRPO+top-p (no replay)", Correction(), True),
        Arm("grpo_topp", "GRPO+top-p", Correction(), True, mask_replay=True),
        Arm("sc_mis", "SC+MIS", Correction(weights="mis", bounds=MIS_BOUNDS, score_centering=True), False),
        Arm("sc_mis_topp", "SC+MIS+top-p",
            Correction(weights="mis", bounds=MIS_BOUNDS, score_centering=True), True, mask_replay=True),
        Arm("sc_mis_topp_rr", "SC+MIS+top-p+R3",
            Correction(weights="mis", bounds=MIS_BOUNDS, score_centering=True), True, mask_replay=True,
            route_replay=True),
        Arm("rr_tis", "R3+TIS", Correction(weights="tis", bounds=VERL_IS_THRESHOLD), False, route_replay=True),
    )
}


def parse_arms(spec: str) -> list[Arm]:
    """``"all"`` (every arm a dense policy can run: all but the routing-replay arms) or a comma-separated list of
    arm keys -> arms, in the given order (duplicates refused)."""
    if spec.strip() == "all":
        return [a for a in ARMS.values() if not a.route_replay]
    keys = [k.strip() for k in spec.split(",") if k.strip()]
    if not keys:
        raise ValueError(f"--arms: expected 'all' or a comma-separated list of {list(ARMS)}, got {spec!r}")
    unknown = [k for k in keys if k not in ARMS]
    if unknown:
        raise ValueError(f"--arms: unknown arm(s) {unknown}; choose from {list(ARMS)} or 'all'")
    if len(set(keys)) != len(keys):
        raise ValueError(f"--arms: duplicate arm in {keys}")
    return [ARMS[k] for k in keys]
