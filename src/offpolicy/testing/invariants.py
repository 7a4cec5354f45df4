"""The table of invariants: each property with its spec anchor, summary, applicability and strategy.

Property checkers: run a user's loss function against the spec's invariants, with hypothesis shrinking.

The function is reached through one adapter signature (:data:`LossFn`)::

    fn(logits, tokens, sampler_logprobs, candidates, advantages, temperature) -> token_loss

    logits            [N, V] float (LossConfig.dtype), requires_grad
    tokens            [N] int64, sampled ids
    sampler_logprobs  [N] float, lq of each token (renormalised over the support for support records)
    candidates        offpolicy.Candidates (ids [N, K] int64 with -1 padding, logprobs [N, K] with -inf padding,
                      kind "head" | "support"), or None when LossConfig.record is None
    advantages        [N] float
    temperature       float > 0: the sampling temperature; the trainer's distribution is softmax(logits / tau)
    token_loss        [N] per-token loss, unaggregated (no mean); the kit differentiates its sum; or, with
                      LossConfig(aggregation=...), the aggregated scalar loss []

Optional keywords widen what is checked: ``loss_mask`` ([N] bool, True on trained tokens; the ``masking``
invariant runs when the function takes it), ``seq_ids`` ([N] int64 packed sequence ids; needed for
``LossConfig(level="sequence" | "geometric")``, whose batches the kit packs into random sequences, and for every
other sequence-wise part of a configuration: sequence rejections, ``batch_normalize="sequences"``,
``ppo_ratio="gspo_token"``, sequence aggregations), ``proximal_logprobs`` ([N] float ``log pi_prox(y_t)``; needed
for decoupled PPO and CISPO), ``versions`` and ``current_version`` ([N] int64 and an int; a staleness rejection)
and ``route_flips`` ([N] int64; a route-flip rejection). The function receives each keyword only where the check
uses it.

and a :class:`~offpolicy.testing.LossConfig` declaring which correction it claims. Each invariant is a property
over a hypothesis strategy from :mod:`offpolicy.testing.strategies`; a violation is shrunk to a small example
and reported with the invariant's name, the configuration and the example.

Invariants (see docs/testing_kit.md for one paragraph each):

``agreement``          loss (per token, or aggregated) and logit gradient equal offpolicy.reference's
                       (docs/spec.md#inv-head-exact, docs/spec.md#inv-autograd)
``zero_drift``         constant advantage: sum_y q(y) grad loss(y) = 0 (docs/spec.md#inv-zero-drift), when centering
                       is claimed
``plain_is_unbiased``  f(r) = r: E_q[grad loss] = E_p[grad of -A log p] (docs/spec.md#inv-plain-is), for tis / mis
``support_replay``     support records: no gradient outside S, no dependence on logits outside S
                       (docs/spec.md#inv-support)
``shift_invariance``   adding a constant to a row's logits changes nothing (docs/spec.md#inv-support)
``sampler_no_grad``    no gradient reaches sampler log-probabilities, candidate log-probabilities or advantages
``hostile_finite``     finite loss and gradient on hostile numerics (docs/spec.md#inv-hostile)
``masking``            untrained tokens contribute nothing, fully masked batches give zeros (docs/spec.md#inv-masking)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from hypothesis import strategies as st

from offpolicy.corrections.registry import WEIGHT_MODES
from offpolicy.testing.config import LossConfig
from offpolicy.testing.strategies import Problem, hostile_problems, positions
from offpolicy.testing.harness import LossFn
from offpolicy.testing.properties import (
    _batches,
    _dressed,
    _generic_temperatures,
    _masking_cases,
    _prop_agreement,
    _prop_hostile,
    _prop_masking,
    _prop_plain_is,
    _prop_sampler_no_grad,
    _prop_shift,
    _prop_support_replay,
    _prop_zero_drift,
    _replay_cases,
    _shift_cases,
)


def _always(cfg: LossConfig) -> str | None:
    return None


def _needs_centering(cfg: LossConfig) -> str | None:
    if not cfg.score_centering:
        return "not applicable: the configuration does not claim score centering"
    if cfg.has_sequence_rejections:
        # Centering corrects each position's expected score with f, which holds the token-level rules only; a rule
        # that drops a whole sequence on a sequence statistic is not a function of the position's own ratio.
        return (f"not applicable: sequence rejection rules {list(cfg.correction.sequence_rules)} drop whole "
                "sequences on a sequence statistic, which the per-position centering does not see")
    return None


def _needs_token_level(cfg: LossConfig) -> str | None:
    if cfg.correction.tree.weighting.level.per_sequence:
        return f"not applicable: level={cfg.level!r} (the per-position expectation is a token-level property)"
    return None


def _needs_identity_weight(cfg: LossConfig) -> str | None:
    corr = cfg.correction
    tree = corr.tree
    if tree.weighting.level.per_sequence:
        return _needs_token_level(cfg)
    if not tree.surrogate.centerable:
        return (f"not applicable: the {cfg.surrogate!r} surrogate multiplies f(pi_prox / q) by a clipped function "
                "of u = p / pi_prox, not by log p: it is plain IS only where every u lies inside the clip band")
    if tree.rejections or tree.trust_region is not None:
        return "not applicable: rejection rules zero tokens or sequences where f(r) = r alone would keep them"
    if tree.normalisation is not None:
        return ("not applicable: batch normalisation divides the weights by the batch's mean weight, a "
                "data-dependent constant, so E_q[grad loss] is E_p[grad of -A log p] divided by it")
    if not tree.weighting.mode.ratio_inside:
        modes = [m.name for m in WEIGHT_MODES.values() if m.ratio_inside]
        names = " and ".join([", ".join(modes[:-1]), modes[-1]] if len(modes) > 1 else modes)
        return f"not applicable: weights={cfg.weights!r} is not f(r) = r anywhere (only {names} are)"
    if not corr.lower < 1.0 < corr.upper:
        return f"not applicable: the bounds ({corr.lower:g}, {corr.upper:g}) leave no room around r = 1"
    return None


def _needs_support(cfg: LossConfig) -> str | None:
    return None if cfg.record == "support" else "not applicable: only support records replay a mask"


@dataclass(frozen=True)
class Invariant:
    """One checked property.

    Attributes:
        name: short identifier (``"zero_drift"``).
        spec: where docs/spec.md states it.
        summary: one line, for reports.
        applies: ``config -> None`` when applicable, else the reason it is not.
        strategy: ``config -> SearchStrategy`` of cases.
        prop: ``(fn, config, case) -> None``, raising on a violation.
        needs: optional keywords of the loss function the check passes (it is skipped for a function that takes
            none of that name).
    """

    name: str
    spec: str
    summary: str
    applies: Callable[[LossConfig], str | None]
    strategy: Callable[[LossConfig], st.SearchStrategy]
    prop: Callable[[LossFn, LossConfig, object], None]
    needs: tuple[str, ...] = ()


def _hostile_cases(cfg: LossConfig) -> st.SearchStrategy[Problem]:
    batches = hostile_problems(cfg.record, zero_weight_at_zero_ratio=cfg.weight_at_zero == 0.0)
    return _dressed(batches, cfg)


def _is_bounds(cfg: LossConfig) -> tuple[float, float]:
    corr = cfg.correction
    return (corr.lower, corr.upper)


INVARIANTS: dict[str, Invariant] = {
    inv.name: inv
    for inv in [
        Invariant(
            "agreement", "docs/spec.md#inv-head-exact, docs/spec.md#inv-autograd",
            "loss (per token or aggregated) and logit gradient equal offpolicy.reference for the declared config",
            _always, _batches, _prop_agreement,
        ),
        Invariant(
            "zero_drift", "docs/spec.md#inv-zero-drift, docs/spec.md#inv-head-exact",
            "under a constant advantage the sampler-expected gradient sum_y q(y) grad loss(y) is zero",
            _needs_centering,
            lambda cfg: st.tuples(positions(cfg.record, temperature=_generic_temperatures(cfg)),
                                  st.sampled_from([1.0, -1.0, 2.5])),
            _prop_zero_drift,
        ),
        Invariant(
            "plain_is_unbiased", "docs/spec.md#inv-plain-is",
            "where f(r) = r: E_q[grad loss] = E_p[grad of -A log p]",
            _needs_identity_weight,
            lambda cfg: st.tuples(
                positions(cfg.record, complete=True, ratio_bounds=_is_bounds(cfg),
                          temperature=_generic_temperatures(cfg)),
                st.lists(st.floats(-3.0, 3.0, allow_nan=False), min_size=8, max_size=8),
            ),
            _prop_plain_is,
        ),
        Invariant(
            "support_replay", "docs/spec.md#inv-support",
            "support records: zero gradient outside S and no dependence on logits outside S",
            _needs_support, _replay_cases, _prop_support_replay,
        ),
        Invariant(
            "shift_invariance", "docs/spec.md#inv-support",
            "adding a constant to a row's logits changes neither the loss nor its gradient",
            _always, _shift_cases, _prop_shift,
        ),
        Invariant(
            "sampler_no_grad", "docs/spec.md#weights, docs/spec.md#score-centering (sg)",
            "no gradient reaches sampler log-probabilities, candidate log-probabilities or advantages",
            _always, _batches, _prop_sampler_no_grad,
        ),
        Invariant(
            "hostile_finite", "docs/spec.md#inv-hostile",
            "finite loss and gradient on hostile numerics (-inf logits, +-1e4, underflow, empty rows, N = 0)",
            _always, _hostile_cases, _prop_hostile,
        ),
        Invariant(
            "masking", "docs/spec.md#inv-masking",
            "tokens with loss_mask False carry no loss and no gradient, and do not enter sequence statistics",
            _always, _masking_cases, _prop_masking, needs=("loss_mask",),
        ),
    ]
}
