"""The weighting node: which weight function ``f`` (docs/spec.md#weights) acts on which ratio (the level,
docs/spec.md#sequence-level).

``Weighting(mode, level)``: ``mode`` is :class:`NoWeights`, :class:`TIS`, :class:`MIS` or :class:`Reject`, each
holding its own validated bounds; ``level`` is :class:`TokenLevel`, :class:`SequenceLevel` or
:class:`GeometricLevel`. Conventions: fast functions take log-ratios ``log r = log p - lq``; ``f`` clamps them to
``[-max_log_ratio, max_log_ratio]`` before exponentiating and tests the bounds on the *unclamped* log-ratio (so
``+-inf`` fall outside any finite interval).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Union

import torch
from torch import Tensor

from offpolicy.corrections.node import Keyword, Jump, NodeError, check, finite, log_bound

# ---------------------------------------------------------------------------------------------------------------
# Levels: the ratio f acts on
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenLevel:
    """Each token's own ratio ``r_t``."""

    keywords: ClassVar[tuple[Keyword, ...]] = ()
    table_form: ClassVar[str] = '`level="token"`'
    inputs: ClassVar[tuple[str, ...]] = ()
    table_traits: ClassVar[str] = ''

    name: ClassVar[str] = "token"
    per_sequence: ClassVar[bool] = False
    needs_sequences: ClassVar[bool] = False
    needs_segments: ClassVar[bool] = False
    anchor: ClassVar[str] = "docs/spec.md#weights"
    source: ClassVar[str] = "per-token ratio r_t"

    def ratio(self, log_r: Tensor, seg) -> Tensor:
        """``[N]`` the log-ratio ``f`` sees at each token: ``log_r`` itself."""
        return log_r


@dataclass(frozen=True)
class SequenceLevel:
    """The sequence's product ``exp(sum_t log r_t)`` over its trained tokens (needs ``seq_ids``)."""

    keywords: ClassVar[tuple[Keyword, ...]] = ()
    table_form: ClassVar[str] = '`level="sequence"`'
    inputs: ClassVar[tuple[str, ...]] = ('seq_ids',)
    table_traits: ClassVar[str] = '`per_sequence`'

    name: ClassVar[str] = "sequence"
    per_sequence: ClassVar[bool] = True
    needs_sequences: ClassVar[bool] = True
    needs_segments: ClassVar[bool] = False
    anchor: ClassVar[str] = "docs/spec.md#sequence-level"
    source: ClassVar[str] = "Liu & Li, 'When speed kills stability' (sequence-level IS)"

    def reduce(self, log_r: Tensor, seg) -> Tensor:
        """``[num]`` per-sequence log-ratio from ``[N]`` token log-ratios (``seg``: the Segments)."""
        return seg.sum(log_r)

    def ratio(self, log_r: Tensor, seg) -> Tensor:
        """``[N]`` each token's sequence log-ratio."""
        return seg.broadcast(self.reduce(log_r, seg))


@dataclass(frozen=True)
class GeometricLevel(SequenceLevel):
    """The sequence's geometric mean ``exp(mean_t log r_t)`` (needs ``seq_ids``)."""

    keywords: ClassVar[tuple[Keyword, ...]] = ()
    table_form: ClassVar[str] = '`level="geometric"`'
    inputs: ClassVar[tuple[str, ...]] = ('seq_ids',)
    table_traits: ClassVar[str] = '`per_sequence`'

    name: ClassVar[str] = "geometric"
    source: ClassVar[str] = "geometric mean exp(mean_t log r_t) (GSPO-style length-normalised ratio)"

    def reduce(self, log_r: Tensor, seg) -> Tensor:
        return seg.mean(log_r)


@dataclass(frozen=True)
class SegmentLevel(GeometricLevel):
    """Per-turn IS for multi-turn trajectories: each segment's geometric mean ``exp(mean_{t in k} log r_t)`` over
    its trained tokens, a segment being one ``(seq_ids, segment_ids)`` pair (ROLL's ``"segment"`` granularity, a
    masked mean per run of response tokens; needs the ``segment_ids`` input, and ``seg`` is then the segments)."""

    keywords: ClassVar[tuple[Keyword, ...]] = ()
    table_form: ClassVar[str] = '`level="segment"`, with the `segment_ids` input'
    inputs: ClassVar[tuple[str, ...]] = ('segment_ids',)
    table_traits: ClassVar[str] = '`per_sequence` (one ratio per turn), `needs_segments`'

    name: ClassVar[str] = "segment"
    needs_sequences: ClassVar[bool] = False
    needs_segments: ClassVar[bool] = True
    source: ClassVar[str] = ("ROLL (alibaba/ROLL, train-infer correction, weight_type / agg_type 'segment': "
                             "compute_segment_masked_mean of the log-ratio per turn)")


Level = Union[TokenLevel, SequenceLevel, GeometricLevel, SegmentLevel]
LEVEL_CLASSES: tuple[type, ...] = (TokenLevel, SequenceLevel, GeometricLevel, SegmentLevel)

# ---------------------------------------------------------------------------------------------------------------
# Weight modes: w = sg(f(r))
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Mode:
    """What every weight mode has: its traits (class attributes) and ``f``."""

    name: ClassVar[str]
    bounded: ClassVar[bool] = False
    scalar_bound: ClassVar[bool] = False
    masks_outside: ClassVar[bool] = False
    ratio_inside: ClassVar[bool] = False
    rejects: ClassVar[bool] = False
    anchor: ClassVar[str] = "docs/spec.md#weights"
    source: ClassVar[str] = ""
    lower: ClassVar[float] = 0.0
    upper: ClassVar[float] = math.inf

    def inside(self, log_r: Tensor) -> Tensor:
        """``[N]`` bool ``1[L <= r <= U]`` on the unclamped log-ratio."""
        return (log_r >= log_bound(self.lower)) & (log_r <= log_bound(self.upper))

    def fast(self, lr: Tensor, inside: Tensor) -> Tensor:
        """``f`` on clamped log-ratios ``lr`` (``inside``: :meth:`inside` of the unclamped ones); same dtype."""
        return torch.ones_like(lr)

    def weight(self, log_r: Tensor, max_log_ratio: float) -> Tensor:
        """``f(exp(log_r))`` from unclamped log-ratios (``+-inf`` allowed); finite, same dtype."""
        return self.fast(log_r.clamp(-max_log_ratio, max_log_ratio), self.inside(log_r))

    def jumps(self) -> tuple[Jump, ...]:
        """Where ``f`` jumps, in ``log r``: the finite bounds of a mode that masks outside them."""
        if not self.masks_outside:
            return ()
        return (Jump("log_r", tuple(math.log(b) for b in (self.lower, self.upper) if 0 < b < math.inf)),)


@dataclass(frozen=True)
class NoWeights(_Mode):
    """``f = 1``: plain REINFORCE / GRPO on the sampler's tokens."""

    keywords: ClassVar[tuple[Keyword, ...]] = ()
    table_form: ClassVar[str] = '`weights="none"`'
    inputs: ClassVar[tuple[str, ...]] = ()
    table_traits: ClassVar[str] = 'unbounded'

    name: ClassVar[str] = "none"
    source: ClassVar[str] = "plain REINFORCE / GRPO"


@dataclass(frozen=True)
class _Bounded(_Mode):
    lower: float = 0.0
    upper: float = math.inf
    bounded: ClassVar[bool] = True
    expects: ClassVar[str] = "with 0 <= lower <= upper < inf"

    def __post_init__(self) -> None:
        me = type(self).__name__
        for arg in ("lower", "upper"):
            check(me, arg, finite(getattr(self, arg)), "a finite number", getattr(self, arg))
        if not (0.0 <= self.lower <= self.upper and self.upper > 0):
            raise NodeError(me, "lower", f"and upper must satisfy 0 <= lower <= upper < inf with upper > 0, got "
                                         f"({self.lower!r}, {self.upper!r})")
        object.__setattr__(self, "lower", float(self.lower))
        object.__setattr__(self, "upper", float(self.upper))


@dataclass(frozen=True)
class TIS(_Bounded):
    """Truncated IS: ``clamp(r, lower, upper)`` (``lower = 0``: ``min(r, C)``); default ``(0, 2)``."""

    keywords: ClassVar[tuple[Keyword, ...]] = ()
    table_form: ClassVar[str] = '`weights="tis"`, `bounds=C` or `(c, C)`'
    inputs: ClassVar[tuple[str, ...]] = ()
    table_traits: ClassVar[str] = 'default `(0, 2)`, `scalar_bound`, `ratio_inside`'

    lower: float = 0.0
    upper: float = 2.0
    name: ClassVar[str] = "tis"
    scalar_bound: ClassVar[bool] = True
    ratio_inside: ClassVar[bool] = True
    source: ClassVar[str] = "Yao et al. 2025 (truncated importance sampling)"

    def fast(self, lr: Tensor, inside: Tensor) -> Tensor:
        # clamp(r, c, C) in log space; lr >= -max_log_ratio already, so a zero lower bound needs no special case.
        return torch.exp(lr.clamp(min=log_bound(self.lower), max=log_bound(self.upper)))


@dataclass(frozen=True)
class MIS(_Bounded):
    """Masked IS: ``r 1[lower <= r <= upper]``; default ``(0.5, 5)``."""

    keywords: ClassVar[tuple[Keyword, ...]] = ()
    table_form: ClassVar[str] = '`weights="mis"`, `bounds=(L, U)`'
    inputs: ClassVar[tuple[str, ...]] = ()
    table_traits: ClassVar[str] = 'default `(0.5, 5)`, `masks_outside`, `ratio_inside`'

    lower: float = 0.5
    upper: float = 5.0
    name: ClassVar[str] = "mis"
    masks_outside: ClassVar[bool] = True
    ratio_inside: ClassVar[bool] = True
    source: ClassVar[str] = "IcePop arXiv 2510.18855 (masked importance sampling, band [0.5, 5])"

    def fast(self, lr: Tensor, inside: Tensor) -> Tensor:
        return torch.where(inside, torch.exp(lr), torch.zeros_like(lr))


@dataclass(frozen=True)
class Reject(_Bounded):
    """Rejection sampling on the ratio: ``1[lower <= r <= upper]`` (kept tokens weigh 1); default ``(0.5, 5)``."""

    keywords: ClassVar[tuple[Keyword, ...]] = ()
    table_form: ClassVar[str] = '`weights="reject"`, `bounds=(L, U)`'
    inputs: ClassVar[tuple[str, ...]] = ()
    table_traits: ClassVar[str] = 'default `(0.5, 5)`, `masks_outside`, `rejects`'

    lower: float = 0.5
    upper: float = 5.0
    name: ClassVar[str] = "reject"
    masks_outside: ClassVar[bool] = True
    rejects: ClassVar[bool] = True
    source: ClassVar[str] = "rejection sampling on the ratio (kept tokens weigh 1)"

    def fast(self, lr: Tensor, inside: Tensor) -> Tensor:
        return inside.to(lr.dtype)


WeightMode = Union[NoWeights, TIS, MIS, Reject]
MODE_CLASSES: tuple[type, ...] = (NoWeights, TIS, MIS, Reject)


@dataclass(frozen=True)
class Weighting:
    """``w = sg(f(r))``: the weight function ``mode`` at the ratio of ``level``.

    A per-sequence level needs a bounded mode (an unbounded product of ratios is refused).
    """

    keywords: ClassVar[tuple[Keyword, ...]] = ()
    table_form: ClassVar[str] = '`weights=`, `level=`'
    inputs: ClassVar[tuple[str, ...]] = ()
    table_traits: ClassVar[str] = 'a per-sequence level needs a bounded mode'

    mode: WeightMode = field(default_factory=NoWeights)
    level: Level = field(default_factory=TokenLevel)
    anchor: ClassVar[str] = "docs/spec.md#weights"

    def __post_init__(self) -> None:
        if not isinstance(self.mode, _Mode):
            raise TypeError(f"Weighting.mode must be one of {[c.__name__ for c in MODE_CLASSES]}, got {self.mode!r}")
        if not isinstance(self.level, LEVEL_CLASSES):
            raise TypeError(f"Weighting.level must be one of {[c.__name__ for c in LEVEL_CLASSES]}, got "
                            f"{self.level!r}")
        if self.level.per_sequence and not self.mode.bounded:
            bounded = " | ".join(repr(c.name) for c in MODE_CLASSES if c.bounded)
            raise ValueError(f"Correction(level={self.level.name!r}) needs weights={bounded} (Weighting.level="
                             f"{type(self.level).__name__}() needs a bounded mode, got {type(self.mode).__name__})")
