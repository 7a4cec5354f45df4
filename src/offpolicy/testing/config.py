"""What a user's loss function claims to compute: :class:`LossConfig`.

The checkers compare the function against :func:`offpolicy.reference.reference_policy_loss` under the
:class:`~offpolicy.Correction` this configuration names, and decide which invariants apply (zero drift only when
score centering is claimed, support replay only for support records, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from offpolicy.loss.aggregation import AGGREGATIONS, SEQUENCE_AGGREGATIONS
from offpolicy.corrections.correction import Correction
from offpolicy.corrections.registry import LEVELS, WEIGHT_MODES
from offpolicy.testing.strategies import RECORDS, Record

#: Default comparison tolerances ``(rtol, atol)`` by the dtype the kit feeds: a difference passes when
#: ``max |yours - reference| <= atol + rtol * max |reference|`` over the compared tensor.
#: float64: the log-softmax of logits up to ~|z / tau| = 600 carries an absolute error of a few 1e-13 and the loss
#: multiplies it by |A| w <= 15; 1e-9 relative leaves three orders of headroom and is still far below any
#: mathematical difference (the kit's mutants differ by 1e-3 or more). float32 (unit roundoff 6e-8): generic
#: examples keep |z / tau| <= 64, so log-probabilities are good to ~1e-5 absolute; 1e-4 relative and 1e-5 absolute
#: hold that. bf16 / fp16 inputs (8 / 11 mantissa bits) are rounded once on the way in and again inside most
#: implementations: 3e-2 relative.
DEFAULT_TOLERANCES = {
    torch.float64: (1e-9, 1e-12),
    torch.float32: (1e-4, 1e-5),
    torch.float16: (3e-2, 1e-3),
    torch.bfloat16: (3e-2, 1e-3),
}

#: Examples whose ratios fall this close (in log space) to a discontinuity of the weight function (MIS and
#: rejection bounds, the tail ratio's bounds) are skipped: rounding alone may put them on either side.
DISCONTINUITY_MARGIN = {torch.float64: 1e-7, torch.float32: 1e-3, torch.float16: 5e-2, torch.bfloat16: 5e-2}


@dataclass(frozen=True)
class LossConfig:
    """The correction a loss function claims to implement, and how the kit should feed it.

    Attributes:
        weights: ``"none" | "tis" | "mis" | "reject"`` (docs/spec.md#weights).
        bounds: the ratio bounds, as in :class:`~offpolicy.Correction` (``tis``: ``C`` or ``(c, C)``; ``mis`` /
            ``reject``: ``(L, U)``); None takes the defaults ((0, 2) for tis, (0.5, 5) otherwise).
        score_centering: the function subtracts the sampler-expected weighted score (docs/spec.md#score-centering).
        record: the candidate record the function consumes: ``"head"``, ``"support"`` or None (no record; the
            function then receives ``candidates=None``).
        level: ``"token"``, or ``"sequence"`` / ``"geometric"`` ratios (docs/spec.md#family). Sequence levels need a
            function that takes a ``seq_ids`` keyword: the kit packs each batch into random sequences.
        aggregation: None: the function returns the per-token loss ``[N]``. Otherwise the function returns the
            aggregated scalar and this names how it aggregates (``"token_mean"``, ``"seq_mean_token_mean"``,
            ``"seq_mean_token_sum"`` (these two need a ``seq_ids`` keyword) or ``"constant"``, dividing the sum by
            ``constant_normalizer``).
        constant_normalizer: the divisor of ``aggregation="constant"``.
        max_log_ratio: log-ratios are clamped to ``[-max, max]`` before exponentiating (docs/spec.md#weights).
        dtype: the dtype of every float tensor the kit passes (logits, log-probabilities, advantages).
        rtol, atol: comparison tolerances; None takes :data:`DEFAULT_TOLERANCES` for ``dtype``.
    """

    weights: str = "none"
    bounds: tuple[float, float] | float | None = None
    score_centering: bool = False
    record: Record = None
    level: str = "token"
    aggregation: str | None = None
    constant_normalizer: float | None = None
    max_log_ratio: float = 20.0
    dtype: torch.dtype = torch.float64
    rtol: float | None = None
    atol: float | None = None

    def __post_init__(self) -> None:
        if self.record not in RECORDS:
            raise ValueError(f"LossConfig.record must be 'head', 'support' or None, got {self.record!r}")
        if self.dtype not in DEFAULT_TOLERANCES:
            raise ValueError(f"LossConfig.dtype must be one of {list(DEFAULT_TOLERANCES)}, got {self.dtype}")
        if self.score_centering and self.record is None:
            raise ValueError(
                "LossConfig(score_centering=True) needs record='head' or 'support': centering sums over the "
                "sampler's recorded candidates"
            )
        if self.aggregation is not None and self.aggregation not in AGGREGATIONS:
            raise ValueError(f"LossConfig.aggregation must be None or one of {AGGREGATIONS}, got {self.aggregation!r}")
        if (self.aggregation == "constant") != (self.constant_normalizer is not None):
            raise ValueError("LossConfig.constant_normalizer goes with aggregation='constant' (and only with it)")
        if self.constant_normalizer is not None and not self.constant_normalizer > 0:
            raise ValueError(f"LossConfig.constant_normalizer must be > 0, got {self.constant_normalizer!r}")
        if isinstance(self.bounds, list):
            object.__setattr__(self, "bounds", tuple(self.bounds))
        self.correction  # validates weights and bounds with Correction's own messages

    @property
    def correction(self) -> Correction:
        """The :class:`~offpolicy.Correction` the reference is run with."""
        return Correction(weights=self.weights, bounds=self.bounds, level=self.level,
                          score_centering=self.score_centering, max_log_ratio=self.max_log_ratio)

    @property
    def needs_sequences(self) -> bool:
        """Whether batches are packed into sequences (``seq_ids``): sequence-level weights or aggregations."""
        return LEVELS[self.level].per_sequence or self.aggregation in SEQUENCE_AGGREGATIONS

    @property
    def tolerances(self) -> tuple[float, float]:
        """``(rtol, atol)``."""
        rtol, atol = DEFAULT_TOLERANCES[self.dtype]
        return (rtol if self.rtol is None else self.rtol, atol if self.atol is None else self.atol)

    @property
    def margin(self) -> float:
        return DISCONTINUITY_MARGIN[self.dtype]

    @property
    def weight_at_zero(self) -> float:
        """``f(0)``: whether a token the trainer finds impossible keeps a weight (then ``-A w log 0`` is
        infinite and hostile inputs must keep such tokens off ``-inf`` logits)."""
        from offpolicy.reference import f

        return float(f(torch.zeros(1, dtype=torch.float64), self.correction)[0])

    def describe(self) -> str:
        corr = self.correction
        bounded = WEIGHT_MODES[self.weights].bounded
        bounds = f", bounds=({corr.lower:g}, {corr.upper:g})" if bounded else ""
        rtol, atol = self.tolerances
        tol = "" if self.rtol is None and self.atol is None else f", rtol={rtol:g}, atol={atol:g}"
        mlr = "" if self.max_log_ratio == 20.0 else f", max_log_ratio={self.max_log_ratio:g}"
        level = "" if self.level == "token" else f", level={self.level!r}"
        agg = "" if self.aggregation is None else f", aggregation={self.aggregation!r}"
        if self.constant_normalizer is not None:
            agg += f", constant_normalizer={self.constant_normalizer:g}"
        return (f"LossConfig(weights={self.weights!r}{bounds}, score_centering={self.score_centering}, "
                f"record={self.record!r}{level}{agg}, dtype={str(self.dtype).replace('torch.', '')}{mlr}{tol})")

    @classmethod
    def parse(cls, text: str) -> "LossConfig":
        """Parse ``"weights=mis,bounds=0.5:5,score_centering=1,record=support,level=token,dtype=float32"`` (the
        ``OFFPOLICY_CONFIG`` environment variable). ``sc`` abbreviates ``score_centering``; ``record=none`` is
        None; ``bounds`` is ``C`` or ``L:U``."""
        names = {f.name for f in fields(cls)}
        kw: dict = {}
        for item in filter(None, (s.strip() for s in text.split(","))):
            if "=" not in item:
                raise ValueError(f"OFFPOLICY_CONFIG: expected key=value, got {item!r}")
            key, val = (s.strip() for s in item.split("=", 1))
            key = "score_centering" if key == "sc" else key
            if key not in names:
                raise ValueError(f"OFFPOLICY_CONFIG: unknown key {key!r}; expected one of {sorted(names)}")
            if key == "bounds":
                parts = [float(p) for p in val.split(":")]
                kw[key] = parts[0] if len(parts) == 1 else tuple(parts)
            elif key == "score_centering":
                kw[key] = val.lower() in ("1", "true", "yes", "on")
            elif key in ("record", "aggregation"):
                kw[key] = None if val.lower() in ("none", "") else val
            elif key == "dtype":
                kw[key] = getattr(torch, val)
            elif key in ("max_log_ratio", "rtol", "atol", "constant_normalizer"):
                kw[key] = float(val)
            else:
                kw[key] = val
        return cls(**kw)


def every_config(dtype: torch.dtype = torch.float64) -> list[LossConfig]:
    """Every registered weight mode (:data:`offpolicy.corrections.registry.WEIGHT_MODES`) x score centering x
    record kind (head / support), default bounds: the matrix the kit runs the project's own loss over."""
    return [
        LossConfig(weights=w, score_centering=sc, record=rec, dtype=dtype)
        for w in WEIGHT_MODES
        for sc in (False, True)
        for rec in ("head", "support")
    ]
