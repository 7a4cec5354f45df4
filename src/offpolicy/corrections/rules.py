"""Rejection rules: nodes that zero whole tokens or sequences (docs/spec.md#veto, #kl-rejection, #opsm).

:class:`Veto` and :class:`OPSM` drop sequences; :class:`KLRejection` and :class:`RatioRejection` act per token
(``level="token"``: a bound on each token's own ratio, folded into ``f`` so that score centering sees it exactly)
or per sequence. Every rule has ``per_sequence``; a token rule has ``token_keep(log_r, max_log_ratio) -> [N] bool``,
a sequence rule ``drop(log_r, log_p_ratio, adv, seg, max_log_ratio) -> [num] bool`` (``log_r``: the unclamped ratio
the weights act on, ``pi_prox / q`` under decoupled PPO; ``log_p_ratio``: the current policy's ``log p - lq``).
The KL estimators of ``KL(q || p)`` on tokens drawn from ``q`` are :data:`ESTIMATORS`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping, NamedTuple, Union

import torch
from torch import Tensor

from offpolicy.corrections.node import Keyword, Jump, NodeError, Reductions, check, finite, log_bound
from offpolicy.corrections.weighting import GeometricLevel, SegmentLevel, SequenceLevel, TokenLevel


class Estimator(NamedTuple):
    """A per-token estimator ``k`` of ``KL(q || p)`` from clamped log-ratios ``lr = log p - lq``.

    Attributes:
        fast: ``lr -> k``, same shape and dtype.
        signed: the estimate can be negative (a negative threshold is then meaningful).
        bound: ``fast`` is ``base``'s estimate clamped to ``[-bound, bound]``; a KL penalty weights ``base``'s
            estimate first and clamps last (slime's order), or None.
        base: the unclamped estimator's name, or None.
    """

    name: str
    fast: Callable[[Tensor], Tensor]
    signed: bool = False
    bound: float | None = None
    base: str | None = None

    def value(self, lr: Tensor) -> Tensor:
        """``k`` (its bound included)."""
        return self.fast(lr)


#: Schulman's estimators by name: ``k1 = -log r``, ``k2 = (log r)^2 / 2``, ``k3 = r - 1 - log r`` (as
#: ``expm1(log r) - log r``, accurate near ``log r = 0``); ``low_var_kl``: ``k3`` clamped to ``[-10, 10]``.
ESTIMATORS: dict[str, Estimator] = {
    e.name: e
    for e in (
        Estimator("k1", lambda lr: -lr, signed=True),
        Estimator("k2", lambda lr: 0.5 * lr.square()),
        Estimator("k3", lambda lr: torch.expm1(lr) - lr),
        # slime's / verl's low_var_kl: k3 clamped to [-10, 10] (slime clamps after its importance weight).
        Estimator("low_var_kl", lambda lr: (torch.expm1(lr) - lr).clamp(-10.0, 10.0), bound=10.0, base="k3"),
    )
}

def estimator_names() -> str:
    """The estimators' names for an error message: Schulman's, then the clamped ones."""
    plain = tuple(n for n, e in ESTIMATORS.items() if e.bound is None)
    clamped = " or ".join(repr(n) for n, e in ESTIMATORS.items() if e.bound is not None)
    return f"{plain}" + (f" or {clamped} (clamped)" if clamped else "")


#: The per-sequence statistics of a KL rejection (``"token"``: none, the rule bounds each token's ratio).
KL_LEVELS: dict[str, Callable | None] = {
    "token": None,
    "seq_sum": lambda k, seg: seg.sum(k),
    "seq_mean": lambda k, seg: seg.mean(k),
    "seq_max": lambda k, seg: seg.max(k),
}

#: The ratio levels of a :class:`RatioRejection`, by name.
RATIO_LEVELS = {c.name: c for c in (TokenLevel, SequenceLevel, GeometricLevel, SegmentLevel)}


def _in_band(x: Tensor, lo: float, hi: float) -> Tensor:
    return (x >= lo) & (x <= hi)


@dataclass(frozen=True)
class Veto:
    """Drop a sequence if any of its trained tokens has ``r < threshold`` (``0 < threshold < 1``), on the
    unclamped log-ratio."""

    keywords: ClassVar[tuple[Keyword, ...]] = (Keyword("veto", ("threshold",)),)
    inputs: ClassVar[tuple[str, ...]] = ('seq_ids',)
    table_traits: ClassVar[str] = '`per_sequence`'

    threshold: float
    name: ClassVar[str] = "veto"
    per_sequence: ClassVar[bool] = True
    anchor: ClassVar[str] = "docs/spec.md#veto"
    source: ClassVar[str] = "Liu & Li, 'When speed kills stability' (catastrophic-token veto)"

    def __post_init__(self) -> None:
        if not (finite(self.threshold) and 0.0 < self.threshold < 1.0):
            raise NodeError("Veto", "threshold", f"must be in (0, 1), got {self.threshold!r}")

    def drop(self, log_r: Tensor, log_p_ratio: Tensor, adv: Tensor, seg, max_log_ratio: float) -> Tensor:
        return seg.min(log_r) < math.log(self.threshold)

    def jumps(self) -> tuple[Jump, ...]:
        return (Jump("log_r", (math.log(self.threshold),), "min"),)


@dataclass(frozen=True)
class VetoHigh:
    """The high side of the veto (SkyRL ``outlier_token_is_threshold_high``): drop a sequence if any of its trained
    tokens has ``r > threshold`` (``threshold > 1``), ``log r`` the log-ratio the weights act on clamped to
    ``max_log_ratio`` (SkyRL's ``safe_exp_delta`` clamps at 20, the default)."""

    threshold: float
    name: ClassVar[str] = "veto_high"
    per_sequence: ClassVar[bool] = True
    anchor: ClassVar[str] = "docs/spec.md#veto"
    source: ClassVar[str] = ("SkyRL off_policy_correction.outlier_token_is_threshold_high "
                             "(compute_outlier_token_mask: a sequence with any token ratio above it is masked)")
    keywords: ClassVar[tuple[Keyword, ...]] = (Keyword("veto_high", ("threshold",)),)
    inputs: ClassVar[tuple[str, ...]] = ("seq_ids",)
    table_traits: ClassVar[str] = "`per_sequence`"

    def __post_init__(self) -> None:
        check("VetoHigh", "threshold", finite(self.threshold) and self.threshold > 1, "a finite number > 1",
              self.threshold)

    def drop(self, log_r: Tensor, log_p_ratio: Tensor, adv: Tensor, seg, max_log_ratio: float) -> Tensor:
        return seg.max(log_r.clamp(-max_log_ratio, max_log_ratio)) > math.log(self.threshold)

    def jumps(self) -> tuple[Jump, ...]:
        return (Jump("log_r", (math.log(self.threshold),), "max"),)


@dataclass(frozen=True)
class OPSM:
    """Off-policy sequence masking: drop sequence ``i`` iff its mean advantage is negative and
    ``mean_t (lq - log p) > delta`` with the *current* policy ``p`` (also under decoupled PPO: drift during the PPO
    epochs must be caught)."""

    keywords: ClassVar[tuple[Keyword, ...]] = (Keyword("opsm_delta", ("delta",)),)
    inputs: ClassVar[tuple[str, ...]] = ('seq_ids',)
    table_traits: ClassVar[str] = '`per_sequence`'

    delta: float
    name: ClassVar[str] = "opsm"
    per_sequence: ClassVar[bool] = True
    anchor: ClassVar[str] = "docs/spec.md#opsm"
    source: ClassVar[str] = "DeepSeek-V3.2 arXiv 2512.02556 (off-policy sequence masking)"

    def __post_init__(self) -> None:
        if not (finite(self.delta) and self.delta >= 0):
            raise NodeError("OPSM", "delta", f"must be a finite number >= 0, got {self.delta!r}")

    def drop(self, log_r: Tensor, log_p_ratio: Tensor, adv: Tensor, seg, max_log_ratio: float) -> Tensor:
        return (seg.mean(adv) < 0) & (seg.mean(-log_p_ratio) > self.delta)

    def jumps(self) -> tuple[Jump, ...]:
        return (Jump("neg_log_p_ratio", (self.delta,), "mean"),)


@dataclass(frozen=True)
class KLRejection:
    """Reject tokens or sequences whose KL estimate exceeds ``threshold`` (or, with ``threshold=(lo, hi)``, lies
    outside ``[lo, hi]``: two-sided, meaningful for the signed ``k1``).

    ``estimator``: ``k1 = -log r``, ``k2 = (log r)^2 / 2``, ``k3 = r - 1 - log r`` (Schulman's estimators of
    KL(q||p) on tokens drawn from q). ``level``: per token, or the sum / mean / max over each sequence's trained
    tokens.
    """

    keywords: ClassVar[tuple[Keyword, ...]] = ()
    table_form: ClassVar[str] = '`kl_rejection=`, `rejections=`'
    inputs: ClassVar[tuple[str, ...]] = ()
    table_traits: ClassVar[str] = '`per_sequence` unless `level="token"`'

    threshold: float | tuple[float, float]
    estimator: str = "k3"
    level: str = "token"
    chainable: ClassVar[bool] = True
    kind: ClassVar[str] = "kl"
    name: ClassVar[str] = "kl"
    anchor: ClassVar[str] = "docs/spec.md#kl-rejection"
    source: ClassVar[str] = "Schulman's KL estimators k1 / k2 / k3 as a rejection (slime, Miles, verl)"

    def __post_init__(self) -> None:
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"KLRejection.estimator must be one of {estimator_names()}, got {self.estimator!r}")
        if self.level not in KL_LEVELS:
            raise ValueError(f"KLRejection.level must be one of {tuple(KL_LEVELS)}, got {self.level!r}")
        if isinstance(self.threshold, list):
            object.__setattr__(self, "threshold", tuple(self.threshold))
        if isinstance(self.threshold, tuple):
            if not (len(self.threshold) == 2 and all(finite(t) for t in self.threshold)
                    and self.threshold[0] <= self.threshold[1]):
                raise ValueError(f"KLRejection.threshold must be a finite number or (lo, hi) with lo <= hi, got "
                                 f"{self.threshold!r}")
            return
        if not finite(self.threshold):
            raise ValueError(f"KLRejection.threshold must be a finite number, got {self.threshold!r}")
        if not ESTIMATORS[self.estimator].signed and self.threshold < 0:
            raise ValueError(f"KLRejection.threshold must be >= 0 for {self.estimator}, got {self.threshold}")

    @property
    def per_sequence(self) -> bool:
        return KL_LEVELS[self.level] is not None

    @property
    def band(self) -> tuple[float, float]:
        """``(lo, hi)``: the statistic is kept iff it lies in it."""
        return tuple(self.threshold) if isinstance(self.threshold, tuple) else (-math.inf, self.threshold)

    def _k(self, log_r: Tensor, max_log_ratio: float) -> Tensor:
        return ESTIMATORS[self.estimator].value(log_r.clamp(-max_log_ratio, max_log_ratio))

    def token_keep(self, log_r: Tensor, max_log_ratio: float) -> Tensor:
        return _in_band(self._k(log_r, max_log_ratio), *self.band)

    def drop(self, log_r: Tensor, log_p_ratio: Tensor, adv: Tensor, seg, max_log_ratio: float) -> Tensor:
        return ~_in_band(KL_LEVELS[self.level](self._k(log_r, max_log_ratio), seg), *self.band)

    def jumps(self) -> tuple[Jump, ...]:
        level = "token" if self.level == "token" else self.level[len("seq_"):]
        return (Jump("kl", tuple(t for t in self.band if math.isfinite(t)), level, self.estimator),)


@dataclass(frozen=True)
class RatioRejection:
    """Reject tokens (``level="token"``), whole sequences (``"sequence"``: ``prod_t r_t``; ``"geometric"``:
    ``exp(mean_t log r_t)``) or whole turns (``"segment"``: each turn's ``exp(mean_t log r_t)``, a turn being one
    ``(seq_ids, segment_ids)`` pair; ROLL's filter ``agg_type="segment"``) whose ratio lies outside
    ``[lower, upper]`` (inclusive), independently of the weight mode's own bounds: importance weights and a
    rejection band at different bounds or levels at once. The segment level is a mask rule (``masks``) that reads
    the ``segment_ids`` input (and ``seq_ids`` where given); it is refused under ``cp_group``."""

    keywords: ClassVar[tuple[Keyword, ...]] = ()
    table_form: ClassVar[str] = '`rejections=`'
    inputs: ClassVar[tuple[str, ...]] = ()
    table_traits: ClassVar[str] = ('`per_sequence` unless `level="token"` / `"segment"`; `masks`, `needs_segments` '
                                   'with `level="segment"`')

    lower: float
    upper: float
    level: str = "token"
    chainable: ClassVar[bool] = True
    kind: ClassVar[str] = "ratio"
    name: ClassVar[str] = "ratio"
    anchor: ClassVar[str] = "docs/spec.md#kl-rejection"
    source: ClassVar[str] = ("a ratio band as a rejection (IcePop's mask at its own level; ROLL's train-infer "
                             "correction filters, agg_type token / geometric / sequence / segment)")

    def __post_init__(self) -> None:
        if self.level not in RATIO_LEVELS:
            raise ValueError(f"RatioRejection.level must be one of {tuple(RATIO_LEVELS)}, got {self.level!r}")
        if not (finite(self.lower) and finite(self.upper) and 0 <= self.lower <= self.upper):
            raise ValueError(f"RatioRejection needs 0 <= lower <= upper < inf, got ({self.lower!r}, {self.upper!r})")

    @property
    def masks(self) -> bool:
        """The segment level drops turns: a mask rule (:meth:`mask_drop`)."""
        return self.level == "segment"

    @property
    def needs_segments(self) -> bool:
        return self.level == "segment"

    @property
    def per_sequence(self) -> bool:
        return self.level != "segment" and RATIO_LEVELS[self.level].per_sequence

    @property
    def log_band(self) -> tuple[float, float]:
        return (log_bound(self.lower), log_bound(self.upper))

    def token_keep(self, log_r: Tensor, max_log_ratio: float) -> Tensor:
        return _in_band(log_r, *self.log_band)

    def drop(self, log_r: Tensor, log_p_ratio: Tensor, adv: Tensor, seg, max_log_ratio: float) -> Tensor:
        return ~_in_band(RATIO_LEVELS[self.level]().reduce(log_r, seg), *self.log_band)

    def mask_drop(self, x: "RuleInputs") -> Tensor:
        """``level="segment"``: the trained tokens of the turns whose mean ``log r`` lies outside the band."""
        if x.group is not None:
            raise ValueError("RatioRejection(level='segment') under cp_group is not supported: a turn's mean is "
                             "taken over this rank's tokens only")
        ids = x.inputs["segment_ids"].to(torch.int64)
        seq = x.inputs.get("seq_ids")
        if ids.numel() == 0:
            return torch.zeros_like(x.active)
        key = ids[:, None] if seq is None else torch.stack([seq.to(torch.int64), ids], 1)
        turn = torch.unique(key, dim=0, return_inverse=True)[1]
        zero = torch.zeros_like(x.log_r)
        num = int(turn.max()) + 1
        sums = torch.zeros(num, dtype=x.log_r.dtype, device=x.log_r.device).index_add(
            0, turn, torch.where(x.active, x.log_r, zero))
        counts = torch.zeros_like(sums).index_add(0, turn, x.active.to(x.log_r.dtype))
        return x.active & ~_in_band((sums / counts.clamp_min(1))[turn], *self.log_band)

    def jumps(self) -> tuple[Jump, ...]:
        return (Jump("log_r", tuple(math.log(b) for b in (self.lower, self.upper) if b > 0), self.level),)


@dataclass(frozen=True)
class SeqLogprobError:
    """NeMo-RL's sequence log-probability error mask: drop sequence ``i`` iff ``mean_t exp(|log r_t|) > threshold``
    over its trained tokens, ``log r`` the clamped log-ratio the weights act on (NeMo-RL's
    ``generation_logprobs - prev_logprobs``, the sampler against the trainer's old policy: ``log pi_prox - lq``
    under a proximal policy, else ``log p - lq``). ``threshold >= 1`` (the statistic is at least 1)."""

    threshold: float
    name: ClassVar[str] = "seq_logprob_error"
    per_sequence: ClassVar[bool] = True
    anchor: ClassVar[str] = "docs/spec.md#seq-logprob-error"
    source: ClassVar[str] = ("NeMo-RL grpo.seq_logprob_error_threshold (compute_and_apply_seq_logprob_error_masking: "
                             "seq_mult_prob_error)")
    keywords: ClassVar[tuple[Keyword, ...]] = (Keyword("seq_logprob_error", ("threshold",)),)
    example: ClassVar[dict] = {"weights": "mis", "record": "head", "seq_logprob_error": 1.5}
    inputs: ClassVar[tuple[str, ...]] = ("seq_ids",)
    table_traits: ClassVar[str] = "`per_sequence`"

    def __post_init__(self) -> None:
        check("SeqLogprobError", "threshold", finite(self.threshold) and self.threshold >= 1,
              "a finite number >= 1", self.threshold)

    def drop(self, log_r: Tensor, log_p_ratio: Tensor, adv: Tensor, seg, max_log_ratio: float) -> Tensor:
        return seg.mean(torch.exp(log_r.clamp(-max_log_ratio, max_log_ratio).abs())) > self.threshold


# ---------------------------------------------------------------------------------------------------------------
# Mask rules: an [N] mask of dropped tokens from the batch and the named inputs they declare
# ---------------------------------------------------------------------------------------------------------------


class RuleInputs(NamedTuple):
    """What a mask rule (``masks = True``) reads: ``mask_drop(RuleInputs) -> [N] bool``, the tokens it drops (a
    dropped token leaves the loss like a token of a dropped sequence).

    Attributes:
        log_r: ``[N]`` the unclamped log-ratio the weights act on (``log pi_prox - lq`` under a proximal policy).
        active: ``[N]`` bool, the trained tokens.
        seg: the sequences (:class:`~offpolicy.corrections.node.Reductions`), or None without ``seq_ids``.
        max_log_ratio: the correction's clamp.
        inputs: the loss inputs by name (``"versions"``, ``"current_version"``, ``"seq_ids"``, ``"segment_ids"``,
            ...): those the rule declares in its ``inputs`` are present (``segment_ids`` where the tree
            ``needs_segments``).
        group: the context-parallel process group, or None.
    """

    log_r: Tensor
    active: Tensor
    seg: Reductions | None
    max_log_ratio: float
    inputs: Mapping[str, Any]
    group: Any = None


@dataclass(frozen=True)
class StalenessRejection:
    """Reject tokens (``level="token"``) or whole sequences (``"sequence"``: any trained token) whose policy version
    lags the trainer's by more than ``max_lag`` updates: ``current_version - versions_t > max_lag`` (Miles'
    ``--max-weight-staleness``, TRL async ``max_staleness``). Needs the ``versions`` input and ``current_version``."""

    max_lag: int
    level: str = "token"
    kind: ClassVar[str] = "staleness"
    name: ClassVar[str] = "staleness"
    masks: ClassVar[bool] = True
    chainable: ClassVar[bool] = True
    anchor: ClassVar[str] = "docs/spec.md#staleness-rejection"
    source: ClassVar[str] = ("Miles --max-weight-staleness / --mask-offpolicy-in-partial-rollout, TRL async "
                             "max_staleness: reject data more than k policy updates old")
    keywords: ClassVar[tuple[Keyword, ...]] = (Keyword("max_staleness", ("max_lag",), "int"),)
    # Its kit configuration is RouteFlipRejection's example (one configuration covers both mask rules).
    inputs: ClassVar[tuple[str, ...]] = ("versions", "current_version")
    table_traits: ClassVar[str] = '`masks`; `per_sequence` with `level="sequence"` (also in `rejections=`)'

    def __post_init__(self) -> None:
        check("StalenessRejection", "max_lag", isinstance(self.max_lag, int) and not isinstance(self.max_lag, bool)
              and self.max_lag >= 0, "an int >= 0", self.max_lag)
        check("StalenessRejection", "level", self.level in ("token", "sequence"), "'token' or 'sequence'", self.level)

    @property
    def per_sequence(self) -> bool:
        return self.level == "sequence"

    def mask_drop(self, x: RuleInputs) -> Tensor:
        lag = (int(x.inputs["current_version"]) - x.inputs["versions"].to(torch.int64)).to(x.log_r.dtype)
        stale = x.active & (lag > self.max_lag)
        if self.level == "token":
            return stale
        return x.active & (x.seg.broadcast(x.seg.max(stale.to(x.log_r.dtype))) > 0)


@dataclass(frozen=True)
class M2PO:
    """M2PO's second-moment mask (AReaL ``actor.m2_threshold``): over the batch's trained tokens, sorted by
    ``m_t = (log r_t)^2`` (``log r``: the clamped log-ratio the weights act on, ``log pi_prox - lq`` under a
    proximal policy, AReaL's ``old_logp - prox_logp``), drop the largest ``k`` where ``k`` is the least count whose
    remaining tokens' mean ``m`` is below ``tau`` (all but one when no count is). Dropped tokens stay in the
    aggregation's normaliser by default (the original token denominator). One batch: refused under ``cp_group``."""

    tau: float = 0.04
    kind: ClassVar[str] = "m2po"
    name: ClassVar[str] = "m2po"
    masks: ClassVar[bool] = True
    per_sequence: ClassVar[bool] = False
    anchor: ClassVar[str] = "docs/spec.md#m2po"
    source: ClassVar[str] = ("M2PO (Zheng et al. 2025, arXiv 2510.01161; AReaL actor.m2_threshold, "
                             "_apply_m2po_masking): second-moment trust region on log r")
    keywords: ClassVar[tuple[Keyword, ...]] = (Keyword("m2po", ("tau",)),)
    example: ClassVar[dict] = {"weights": "tis", "record": "support", "m2po": 0.04}
    inputs: ClassVar[tuple[str, ...]] = ()
    table_traits: ClassVar[str] = "`masks` (one mask per batch)"

    def __post_init__(self) -> None:
        check("M2PO", "tau", finite(self.tau) and self.tau > 0, "a finite number > 0", self.tau)

    def mask_drop(self, x: RuleInputs) -> Tensor:
        if x.group is not None:
            raise ValueError("Correction.m2po under cp_group is not supported: its second moment is over the whole "
                             "batch, and each rank holds only some tokens")
        m2 = x.log_r.clamp(-x.max_log_ratio, x.max_log_ratio).square()
        idx = x.active.nonzero().squeeze(1)
        drop = torch.zeros_like(x.active)
        n = idx.numel()
        if n == 0:
            return drop
        order = torch.sort(m2[idx], descending=True, stable=True)
        suffix_mean = order.values.flip(0).cumsum(0).flip(0) / torch.arange(n, 0, -1, dtype=m2.dtype,
                                                                              device=m2.device)
        below = (suffix_mean < self.tau).nonzero()
        k = int(below[0]) if below.numel() else n - 1
        drop[idx[order.indices[:k]]] = True
        return drop


@dataclass(frozen=True)
class RouteFlipRejection:
    """Reject tokens (``level="token"``) or whole sequences (``"sequence"``: any trained token) whose MoE routing
    flipped in more than ``max_flips`` layers: ``route_flips_t > max_flips``, ``route_flips`` the ``[N]`` int input
    counting the layers where the sampler's top-k expert set differs from the trainer's (the routing record)."""

    max_flips: int
    level: str = "token"
    kind: ClassVar[str] = "route_flips"
    name: ClassVar[str] = "route_flips"
    masks: ClassVar[bool] = True
    chainable: ClassVar[bool] = True
    anchor: ClassVar[str] = "docs/spec.md#route-flip-rejection"
    source: ClassVar[str] = ("MoE routing mismatch between sampler and trainer (routing replay's diagnosis, R3 "
                             "arXiv 2510.11370) as a rejection")
    keywords: ClassVar[tuple[Keyword, ...]] = (Keyword("max_route_flips", ("max_flips",), "int"),)
    #: One kit configuration for both mask rules that read loss inputs (the kit feeds versions and route flips):
    #: this rule at the token level and a staleness rejection at the sequence level (the suite's time budget).
    example: ClassVar[dict] = {"weights": "tis", "record": "head", "max_route_flips": 1,
                               "rejections": (StalenessRejection(1, "sequence"),)}
    inputs: ClassVar[tuple[str, ...]] = ("route_flips",)
    table_traits: ClassVar[str] = '`masks`; `per_sequence` with `level="sequence"` (also in `rejections=`)'

    def __post_init__(self) -> None:
        check("RouteFlipRejection", "max_flips", isinstance(self.max_flips, int)
              and not isinstance(self.max_flips, bool) and self.max_flips >= 0, "an int >= 0", self.max_flips)
        check("RouteFlipRejection", "level", self.level in ("token", "sequence"), "'token' or 'sequence'",
              self.level)

    @property
    def per_sequence(self) -> bool:
        return self.level == "sequence"

    def mask_drop(self, x: RuleInputs) -> Tensor:
        flipped = x.active & (x.inputs["route_flips"].to(torch.int64) > self.max_flips)
        if self.level == "token":
            return flipped
        return x.active & (x.seg.broadcast(x.seg.max(flipped.to(x.log_r.dtype))) > 0)


Rule = Union[Veto, VetoHigh, OPSM, KLRejection, RatioRejection, SeqLogprobError, StalenessRejection, M2PO,
             RouteFlipRejection]
RULE_CLASSES: tuple[type, ...] = (Veto, VetoHigh, OPSM, KLRejection, RatioRejection, SeqLogprobError,
                                  StalenessRejection, M2PO, RouteFlipRejection)
