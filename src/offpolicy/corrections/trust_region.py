"""Trust regions on probability differences (docs/spec.md#trust-region): DPPO's binary total-variation and
binary-KL masks, prime-rl's symmetric 'IPO' band, ROLL's probability-difference filters and AReaL's KPop.

Per token, with ``p`` the probability of the sampled token under the policy being checked and ``p_ref`` under the
reference it is checked against, ``d = p - p_ref`` and a divergence ``D >= 0`` of the two-event partitions
``{y, not y}``:

* ``"difference"``: ``D = |d|`` (the binary total variation);
* ``"binary_kl"``: ``D = KL(Bern(p_ref) || Bern(p))`` (DPPO's binary KL);
* ``"binary_kl_max"``: ``D = max(KL(Bern(p_ref) || Bern(p)), KL(Bern(p) || Bern(p_ref)))`` (KPop).

A token whose probability rose (``d > 0``) is masked iff ``D > upper``; one whose probability fell (``d < 0``) iff
``D > lower``. With ``sign="advantage"`` only the side the update pushes towards is checked: ``A > 0`` checks a
rise, ``A <= 0`` a fall (DPPO, prime-rl's default loss). The sequence levels (``sign="none"``) mask whole
sequences: ``"sequence" | "geometric"`` band the sum / mean over the sequence's trained tokens of ``d`` (with
``"difference"``: in ``[-lower, upper]``, ROLL) or of ``D`` (the divergences: ``<= upper``, one band, so
``lower == upper``); ``"sequence_max"`` masks a sequence in which the token level masks any trained token, which
for a divergence with ``lower == upper = phi`` is ``max_t D_t > phi`` (AReaL's sequence-level KPop, ``agg="max"``).
``"segment"`` bands the mean over each *turn* instead (one ``(seq_ids, segment_ids)`` pair, the ``segment_ids`` input;
ROLL's difference filter with ``agg_type="segment"``, ``compute_segment_masked_mean`` of ``d``).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from offpolicy.corrections.node import Keyword, Jump

DIVERGENCES = ("difference", "binary_kl", "binary_kl_max")
SIGNS = ("advantage", "none")
LEVELS = ("token", "sequence", "geometric", "sequence_max", "segment")
TARGETS = ("update", "weights")


def _number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class TrustRegion:
    """A mask on probability differences; ``Correction(trust_region=...)``.

    Attributes:
        lower: the band below: a token whose probability fell is masked iff its divergence exceeds ``lower``
            (for ``"difference"``: iff ``d < -lower``). Finite, ``>= 0``.
        upper: the band above (``"difference"``: masked iff ``d > upper``). Finite, ``>= 0``.
        divergence: ``"difference" | "binary_kl" | "binary_kl_max"`` (module docstring).
        sign: ``"advantage"`` (check the side the advantage's sign pushes towards) or ``"none"`` (both sides).
        level: ``"token"``, or a sequence level (needs ``sign="none"`` and ``seq_ids``): ``"sequence"`` /
            ``"geometric"`` band the sum / mean per sequence of ``d`` (``"difference"``) or of ``D`` (a divergence,
            with ``lower == upper``); ``"sequence_max"`` masks a sequence with any token the token level masks;
            ``"segment"`` bands the mean per turn as ``"geometric"`` does per sequence (needs ``sign="none"`` and
            the ``segment_ids`` input; ``seq_ids`` where given keep turn ``k`` of two sequences apart).
        on: ``"update"``: ``p`` is the current policy, ``p_ref`` the proximal policy (the sampler without
            ``proximal_logprobs``); the mask replaces PPO's clip and, without ``ppo_clip`` / ``cispo``, the
            surrogate is the masked ratio ``u A``, ``u = p / p_ref`` (DPPO). ``"weights"``: ``p`` is the
            weights' numerator (the proximal policy, or the current one without it), ``p_ref`` the sampler; the
            mask rejects tokens like a rejection rule and the surrogate is unchanged.
        penalty: ``c >= 0``: adds ``c (log p - log p_ref)^2`` of the update's ratio (current over proximal, or
            over the sampler) on every trained token, masked or not (prime-rl's ``kl_tau``).
    """

    keywords: ClassVar[tuple[Keyword, ...]] = ()
    table_form: ClassVar[str] = '`trust_region=`'
    inputs: ClassVar[tuple[str, ...]] = ()
    table_traits: ClassVar[str] = '`per_sequence` at the sequence levels, `needs_segments` at `level="segment"`'

    lower: float
    upper: float
    divergence: str = "difference"
    sign: str = "advantage"
    level: str = "token"
    on: str = "update"
    penalty: float = 0.0
    anchor: ClassVar[str] = "docs/spec.md#trust-region"
    source: ClassVar[str] = ("DPPO (arXiv 2602.04879, verl #5397), prime-rl's default loss and 'IPO' mask, ROLL's "
                             "probability-difference filters, AReaL's KPop (#1405)")

    def __post_init__(self) -> None:
        for name, options in (("divergence", DIVERGENCES), ("sign", SIGNS), ("level", LEVELS), ("on", TARGETS)):
            if getattr(self, name) not in options:
                raise ValueError(f"TrustRegion.{name} must be one of {options}, got {getattr(self, name)!r}")
        for name in ("lower", "upper", "penalty"):
            val = getattr(self, name)
            if not (_number(val) and val >= 0):
                raise ValueError(f"TrustRegion.{name} must be a finite number >= 0, got {val!r}")
        if self.level != "token" and self.sign != "none":
            raise ValueError(f"TrustRegion(level={self.level!r}) needs sign='none' (a sequence's mask cannot follow "
                             f"each token's advantage sign), got sign={self.sign!r}")
        if self.level in ("sequence", "geometric", "segment") and self.divergence != "difference" \
                and self.lower != self.upper:
            raise ValueError(f"TrustRegion(level={self.level!r}, divergence={self.divergence!r}) bands the sequence's "
                             f"summed or mean divergence, which has no sign to pick lower or upper: pass lower == "
                             f"upper, got lower={self.lower!r}, upper={self.upper!r}")

    @property
    def per_sequence(self) -> bool:
        """Whether the mask is one per sequence (needs ``seq_ids``)."""
        return self.level not in ("token", "segment")

    @property
    def needs_segments(self) -> bool:
        """Whether the mask is one per turn (needs ``segment_ids``)."""
        return self.level == "segment"

    def jumps(self) -> tuple[Jump, ...]:
        """Where the mask jumps: ``"tr_diff"`` is ``d = p - p_ref``, ``"tr_div"`` the divergence ``D`` (``detail``:
        its name), both from the pair of policies ``on`` names, per token or reduced as the level says."""
        if self.level in ("sequence", "geometric", "segment"):
            quantity = "tr_diff" if self.divergence == "difference" else "tr_div"
            at = (-self.lower, self.upper) if quantity == "tr_diff" else (self.upper,)
            return (Jump(quantity, at, self.level, self.divergence),)
        return (Jump("tr_div", (self.lower, self.upper), "token", self.divergence), Jump("tr_diff", (0.0,)))

    def masked(self, log_p: Tensor, log_ref: Tensor, adv: Tensor, seg=None) -> Tensor:
        """``[N]`` bool, the tokens the trust region masks.

        ``log_p``, ``log_ref``: ``[N]`` detached log-probabilities (``-inf`` allowed: probability 0); ``adv``:
        ``[N]``; ``seg``: the :class:`~offpolicy.loss.segments.Segments` of the sequences at the sequence levels, of
        the turns at ``"segment"`` (inactive tokens take no part).
        """
        d = torch.exp(log_p) - torch.exp(log_ref)
        div = d.abs() if self.divergence == "difference" else binary_kl(log_ref, log_p)
        if self.divergence == "binary_kl_max":
            div = torch.maximum(div, binary_kl(log_p, log_ref))
        rise = (d > 0) & (div > self.upper)
        fall = (d < 0) & (div > self.lower)
        if self.level == "token":
            return torch.where(adv > 0, rise, fall) if self.sign == "advantage" else rise | fall
        if self.level == "sequence_max":
            # A sequence goes with any of its trained tokens (max of a 0/1 indicator over its active tokens).
            return seg.broadcast(seg.max((rise | fall).to(d.dtype))) > 0
        signed = self.divergence == "difference"
        x = torch.where(seg.active, d if signed else div, torch.zeros_like(d))
        agg = seg.broadcast(seg.sum(x) if self.level == "sequence" else seg.mean(x))
        return (agg > self.upper) | (agg < -self.lower) if signed else agg > self.upper


def binary_kl(log_a: Tensor, log_b: Tensor) -> Tensor:
    """``KL(Bern(a) || Bern(b)) = a log(a / b) + (1 - a) log((1 - a) / (1 - b))`` from log-probabilities, with
    ``log(1 - x) = log(-expm1(log x))`` (accurate near ``x = 1``) and ``0 log 0 = 0``; ``+inf`` where ``b`` is 0
    or 1 and ``a`` is not."""
    a, na = torch.exp(log_a), -torch.expm1(log_a)
    zero = torch.zeros_like(a)
    head = torch.where(a > 0, a * (log_a - log_b), zero)
    tail = torch.where(na > 0, na * (torch.log(na) - torch.log(-torch.expm1(log_b))), zero)
    return head + tail
