"""What a user's loss function claims to compute: :class:`LossConfig`.

The checkers compare the function against :func:`offpolicy.reference.reference_policy_loss` under the
:class:`~offpolicy.Correction` this configuration wraps, and decide which invariants apply (zero drift only when
score centering is claimed, support replay only for support records, ...). A ``LossConfig`` is one correction
(its tree of nodes is ``config.correction.tree``) plus how the kit feeds the function: the record kind, the
aggregation, the dtype and the tolerances. The correction's keywords can be given directly
(``LossConfig(weights="mis", veto=0.1, record="head")``) or as a whole (``LossConfig(op.Correction(...))``), and are
read back as attributes (``config.weights``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from offpolicy.corrections.correction import Correction
from offpolicy.corrections.registry import KEYWORDS, NODE_CLASSES, WEIGHT_MODES, declared
from offpolicy.corrections.rules import KLRejection, RatioRejection
from offpolicy.corrections.trust_region import TrustRegion
from offpolicy.loss.aggregation import AGGREGATIONS, SEQUENCE_AGGREGATIONS
from offpolicy.testing.strategies import RECORDS, Record

#: The keywords of :class:`~offpolicy.Correction` a ``LossConfig`` takes and reads through.
CORRECTION_FIELDS = tuple(f.name for f in fields(Correction) if f.init)

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

#: The correction keywords beyond the weights that :meth:`LossConfig.describe` shows when not at their defaults.
_CORRECTION_EXTRAS = ("kl_rejection", "rejections", "batch_normalize", "rejected_in_normalizer", "trust_region",
                      *KEYWORDS)
#: The node keywords by value kind (from the nodes' declarations), for :meth:`LossConfig.parse`.
_KINDS = {name: kw.kind for name, (_, kw) in KEYWORDS.items()}

#: Examples whose ratios fall this close (in log space) to a discontinuity of the weight function (MIS and
#: rejection bounds, the tail ratio's bounds) are skipped: rounding alone may put them on either side.
DISCONTINUITY_MARGIN = {torch.float64: 1e-7, torch.float32: 1e-3, torch.float16: 5e-2, torch.bfloat16: 5e-2}


@dataclass(frozen=True, init=False)
class LossConfig:
    """The correction a loss function claims to implement, and how the kit should feed it.

    ``LossConfig(correction=None, *, record=None, aggregation=None, constant_normalizer=None, dtype=torch.float64,
    rtol=None, atol=None, **keywords)``: ``keywords`` are :class:`~offpolicy.Correction`'s (``weights``,
    ``bounds``, ``level``, ``score_centering``, the rules, the surrogates, ``trust_region``, ``max_log_ratio``...),
    applied on top of ``correction`` (default ``Correction()``), and read back as attributes.

    Attributes:
        correction: the :class:`~offpolicy.Correction` (docs/spec.md#correction-table). Sequence-level weights,
            rules, normalisation and surrogates need a function that takes a ``seq_ids`` keyword: the kit packs
            each batch into random sequences. Decoupled PPO, CISPO, SAPO, VESPO and GMPO need a function that takes
            a ``proximal_logprobs`` keyword (``[N]``, ``log pi_prox`` of each token; the kit draws it near the
            trainer's own log-probability); a trust region compares against it when given, else against the
            sampler. A ``kl_penalty`` and ``level="segment"`` are refused: the kit feeds no reference model and no
            turn ids.
        record: the candidate record the function consumes: ``"head"``, ``"support"`` or None (no record; the
            function then receives ``candidates=None``). Score centering needs one.
        aggregation: None: the function returns the per-token loss ``[N]``. Otherwise the function returns the
            aggregated scalar and this names how it aggregates (``"token_mean"``, ``"seq_mean_token_mean"``,
            ``"seq_mean_token_sum"`` (these two need a ``seq_ids`` keyword) or ``"constant"``, dividing the sum by
            ``constant_normalizer``).
        constant_normalizer: the divisor of ``aggregation="constant"``.
        dtype: the dtype of every float tensor the kit passes (logits, log-probabilities, advantages).
        rtol, atol: comparison tolerances; None takes :data:`DEFAULT_TOLERANCES` for ``dtype``.
    """

    correction: Correction = field(default_factory=Correction)
    record: Record = None
    aggregation: str | None = None
    constant_normalizer: float | None = None
    dtype: torch.dtype = torch.float64
    rtol: float | None = None
    atol: float | None = None

    def __init__(self, correction: Correction | None = None, *, record: Record = None,
                 aggregation: str | None = None, constant_normalizer: float | None = None,
                 dtype: torch.dtype = torch.float64, rtol: float | None = None, atol: float | None = None,
                 **keywords: Any) -> None:
        unknown = sorted(set(keywords) - set(CORRECTION_FIELDS))
        if unknown:
            raise TypeError(f"LossConfig got unexpected keyword arguments {unknown}: it takes correction, record, "
                            f"aggregation, constant_normalizer, dtype, rtol, atol and Correction's {CORRECTION_FIELDS}")
        if correction is not None and not isinstance(correction, Correction):
            raise TypeError(f"LossConfig.correction must be an offpolicy.Correction, got {correction!r}")
        base = Correction() if correction is None else correction
        corr = dataclasses.replace(base, **keywords) if keywords else base
        for name, val in (("correction", corr), ("record", record), ("aggregation", aggregation),
                          ("constant_normalizer", constant_normalizer), ("dtype", dtype), ("rtol", rtol),
                          ("atol", atol)):
            object.__setattr__(self, name, val)
        self.__post_init__()

    def __getattr__(self, name: str) -> Any:
        # Only reached for names that are not attributes: the correction's keywords read through.
        if name in CORRECTION_FIELDS and "correction" in self.__dict__:
            return getattr(self.__dict__["correction"], name)
        raise AttributeError(f"'LossConfig' object has no attribute {name!r}")

    def __post_init__(self) -> None:
        if self.record not in RECORDS:
            raise ValueError(f"LossConfig.record must be 'head', 'support' or None, got {self.record!r}")
        if self.dtype not in DEFAULT_TOLERANCES:
            raise ValueError(f"LossConfig.dtype must be one of {list(DEFAULT_TOLERANCES)}, got {self.dtype}")
        tree = self.correction.tree
        if tree.centering is not None and self.record is None:
            raise ValueError(
                "LossConfig(score_centering=True) needs record='head' or 'support': centering sums over the "
                "sampler's recorded candidates"
            )
        if tree.kl_penalty is not None:
            raise ValueError("LossConfig(kl_penalty=...) is not supported: the kit feeds no reference_logprobs")
        if tree.needs_segments:
            raise ValueError("LossConfig(level='segment') is not supported: the kit feeds no segment_ids")
        if self.aggregation is not None and self.aggregation not in AGGREGATIONS:
            raise ValueError(f"LossConfig.aggregation must be None or one of {AGGREGATIONS}, got {self.aggregation!r}")
        if (self.aggregation == "constant") != (self.constant_normalizer is not None):
            raise ValueError("LossConfig.constant_normalizer goes with aggregation='constant' (and only with it)")
        if self.constant_normalizer is not None and not self.constant_normalizer > 0:
            raise ValueError(f"LossConfig.constant_normalizer must be > 0, got {self.constant_normalizer!r}")
        if not tree.rejected_in_normalizer and self.aggregation is None:
            raise ValueError("LossConfig(rejected_in_normalizer=False) changes only the aggregation's normaliser: "
                             "declare the aggregation the function returns (e.g. aggregation='token_mean')")

    @property
    def needs_sequences(self) -> bool:
        """Whether batches are packed into sequences (``seq_ids``): sequence-level weights, rejections,
        normalisation or surrogate (GSPO-token), or a sequence aggregation."""
        return self.correction.needs_sequences or self.aggregation in SEQUENCE_AGGREGATIONS

    @property
    def needs_versions(self) -> bool:
        """Whether the function receives ``versions`` and ``current_version`` (a staleness rejection)."""
        return "versions" in self.correction.tree.needed_inputs()

    @property
    def needs_route_flips(self) -> bool:
        """Whether the function receives ``route_flips`` (a route-flip rejection)."""
        return "route_flips" in self.correction.tree.needed_inputs()

    @property
    def needs_proximal(self) -> bool:
        """Whether the function receives ``proximal_logprobs`` (decoupled PPO, CISPO)."""
        return self.correction.tree.surrogate.needs_proximal

    @property
    def surrogate(self) -> str:
        """The name of the surrogate node the configuration selects (``"score_function"``, ``"ppo"``,
        ``"ppo_dual_clip"``, ``"gspo_token"``, ``"cispo"``, ...)."""
        return self.correction.tree.surrogate.name

    @property
    def has_sequence_rejections(self) -> bool:
        """Whether a rule drops whole sequences (veto, OPSM, sequence-level KL / ratio rejections)."""
        return bool(self.correction.tree.sequence_rules)

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
        bounded = corr.tree.weighting.mode.bounded
        bounds = f", bounds=({corr.lower:g}, {corr.upper:g})" if bounded else ""
        rtol, atol = self.tolerances
        tol = "" if self.rtol is None and self.atol is None else f", rtol={rtol:g}, atol={atol:g}"
        mlr = "" if self.max_log_ratio == 20.0 else f", max_log_ratio={self.max_log_ratio:g}"
        level = "" if self.level == "token" else f", level={self.level!r}"
        agg = "" if self.aggregation is None else f", aggregation={self.aggregation!r}"
        if self.constant_normalizer is not None:
            agg += f", constant_normalizer={self.constant_normalizer:g}"
        extra = "".join(f", {f.name}={getattr(corr, f.name)!r}" for f in fields(Correction)
                        if f.name in _CORRECTION_EXTRAS and getattr(corr, f.name) != f.default)
        return (f"LossConfig(weights={self.weights!r}{bounds}, score_centering={self.score_centering}, "
                f"record={self.record!r}{level}{agg}{extra}, dtype={str(self.dtype).replace('torch.', '')}{mlr}"
                f"{tol})")

    def short(self) -> str:
        """A compact identifier (``"mis+sc-support"``, ``"none-head+ppo_dual_clip"``) for test ids."""
        out = f"{self.weights}{'+sc' if self.score_centering else ''}-{self.record}"
        if self.level != "token":
            out += f"-{self.level}"
        if self.surrogate != "score_function":
            out += f"+{self.surrogate}" + (f"+delta{self.ppo_delta:g}" if self.ppo_delta is not None else "")
        if self.correction.tree.rejections:
            out += f"+rej{len(self.correction.tree.rejections)}"
            masks = [name for name, _ in self.correction.tree.mask_rules]
            out += f"({'-'.join(masks)})" if masks else ""
        if self.batch_normalize is not False:
            out += f"+bn-{'tokens' if self.batch_normalize is True else self.batch_normalize}"
        if self.trust_region is not None:
            tr = self.trust_region
            out += f"+tr-{tr.divergence}-{tr.sign}-{tr.on}" + (f"-{tr.level}" if tr.level != "token" else "")
        if not self.rejected_in_normalizer:
            out += "+rejected_out"
        if self.aggregation is not None:
            out += f"-{self.aggregation}"
        return out

    @classmethod
    def parse(cls, text: str) -> "LossConfig":
        """Parse ``"weights=mis,bounds=0.5:5,score_centering=1,record=support,level=token,dtype=float32"`` (the
        ``OFFPOLICY_CONFIG`` environment variable). ``sc`` abbreviates ``score_centering``; ``record=none`` is
        None; ``bounds`` is ``C`` or ``L:U``; ``ppo_clip``, ``cispo``, ``sapo``, ``gmpo`` are ``lo:hi`` (``vespo``
        ``a:b:c:d``); ``batch_normalize`` is
        ``0``, ``1``, ``tokens`` or ``sequences``. Rejection rules (``kl_rejection``, ``rejections``) are objects:
        declare them with :func:`~offpolicy.testing.with_config` instead."""
        names = {f.name for f in fields(cls)} - {"correction"} | set(CORRECTION_FIELDS)
        kw: dict = {}
        for item in filter(None, (s.strip() for s in text.split(","))):
            if "=" not in item:
                raise ValueError(f"OFFPOLICY_CONFIG: expected key=value, got {item!r}")
            key, val = (s.strip() for s in item.split("=", 1))
            key = "score_centering" if key == "sc" else key
            if key not in names:
                raise ValueError(f"OFFPOLICY_CONFIG: unknown key {key!r}; expected one of {sorted(names)}")
            if key in ("kl_rejection", "rejections", "trust_region", "kl_penalty"):
                raise ValueError(f"OFFPOLICY_CONFIG: {key} holds rule objects; declare it in Python with "
                                 "offpolicy.testing.with_config(LossConfig(...))")
            if key == "bounds":
                parts = [float(p) for p in val.split(":")]
                kw[key] = parts[0] if len(parts) == 1 else tuple(parts)
            elif _KINDS.get(key) in ("pair", "four"):
                kw[key] = None if val.lower() in ("none", "") else tuple(float(p) for p in val.split(":"))
            elif key in ("score_centering", "rejected_in_normalizer"):
                kw[key] = val.lower() in ("1", "true", "yes", "on")
            elif key == "batch_normalize":
                kw[key] = {"0": False, "false": False, "1": True, "true": True}.get(val.lower(), val)
            elif _KINDS.get(key) in ("number", "int"):
                kw[key] = None if val.lower() in ("none", "") else (int if _KINDS[key] == "int" else float)(val)
            elif key in ("record", "aggregation"):
                kw[key] = None if val.lower() in ("none", "") else val
            elif key == "dtype":
                kw[key] = getattr(torch, val)
            elif key in ("max_log_ratio", "rtol", "atol", "constant_normalizer"):
                kw[key] = float(val)
            else:
                kw[key] = val
        return cls(**kw)


def family_configs(dtype: torch.dtype = torch.float64) -> list[LossConfig]:
    """One configuration per member of the correction family beyond the weight modes: each surrogate (decoupled
    PPO, its dual clip, TRL's delta, GSPO-token, CISPO in TRL's and slime's bounds, SAPO, VESPO, GMPO), chained
    token-level rejections
    (a ratio band and a two-sided ``k1`` band, with score centering), chained sequence-level rejections, veto and
    OPSM, batch normalisation over tokens and over sequences, rejected tokens out of the normaliser, and trust
    regions (DPPO's ratio surrogate with the squared-log-ratio penalty, KPop on the weights, ROLL's geometric
    band)."""
    return [
        LossConfig(weights="tis", record="head", ppo_clip=(0.2, 0.28), dtype=dtype),
        LossConfig(weights="tis", record="support", ppo_clip=(0.2, 0.2), dual_clip=3.0, dtype=dtype),
        LossConfig(weights="none", ppo_clip=(0.2, 0.2), ppo_delta=1.5, dtype=dtype),
        LossConfig(weights="tis", record="head", ppo_clip=(0.2, 0.2), ppo_ratio="gspo_token", dtype=dtype),
        LossConfig(weights="none", record="support", cispo=(0.0, 1.28), dtype=dtype),
        LossConfig(weights="mis", record="head", cispo=(0.8, 1.2), dtype=dtype),
        LossConfig(weights="tis", record="head", sapo=(1.0, 1.05), dtype=dtype),
        LossConfig(weights="none", record="support", vespo=(2.0, 3.0, 3.0, 2.0), dtype=dtype),
        LossConfig(weights="mis", record=None, gmpo=(0.4, 0.4), aggregation="seq_mean_token_mean", dtype=dtype),
        LossConfig(weights="mis", score_centering=True, record="support",
                   rejections=(RatioRejection(0.3, 4.0), KLRejection((-0.4, 0.4), "k1")), dtype=dtype),
        LossConfig(weights="tis", record="head",
                   rejections=(RatioRejection(0.5, 3.0, "geometric"), KLRejection(0.3, "k3", "seq_max")), dtype=dtype),
        LossConfig(weights="tis", record=None, veto=0.2, opsm_delta=0.2, dtype=dtype),
        LossConfig(weights="mis", score_centering=True, record="head", batch_normalize="tokens", dtype=dtype),
        LossConfig(weights="tis", record="support", batch_normalize="sequences", dtype=dtype),
        LossConfig(weights="reject", record="head", kl_rejection=KLRejection(0.5, "k2"), rejected_in_normalizer=False,
                   aggregation="token_mean", dtype=dtype),
        LossConfig(weights="mis", record="support", rejections=(KLRejection((-0.3, 0.3), "k1", "seq_mean"),),
                   rejected_in_normalizer=False, aggregation="seq_mean_token_mean", dtype=dtype),
        LossConfig(weights="none", trust_region=TrustRegion(0.05, 0.08, penalty=0.01), dtype=dtype),
        LossConfig(weights="mis", record="head", ppo_clip=(0.2, 0.2), rejected_in_normalizer=False,
                   aggregation="token_mean", dtype=dtype,
                   trust_region=TrustRegion(0.02, 0.02, "binary_kl_max", sign="none", on="weights")),
        LossConfig(weights="tis", record="support", cispo=(0.0, 3.0), dtype=dtype,
                   trust_region=TrustRegion(0.03, 0.05, "binary_kl", level="token")),
        LossConfig(weights="tis", record=None, dtype=dtype,
                   trust_region=TrustRegion(0.02, 0.03, sign="none", level="geometric", on="weights")),
    ] + node_examples(dtype)


def node_examples(dtype: torch.dtype = torch.float64) -> list[LossConfig]:
    """One configuration per node class that declares an ``example`` (the keywords of a configuration the kit can
    feed): a new correction joins the kit's matrix from its own declaration."""
    return [LossConfig(**declared(cls, "example"), dtype=dtype) for cls in NODE_CLASSES if declared(cls, "example")]


def every_config(dtype: torch.dtype = torch.float64) -> list[LossConfig]:
    """Every weight mode class named in :data:`offpolicy.corrections.registry.WEIGHT_MODES` x score centering x
    record kind (head / support), default bounds, then :func:`family_configs`: the matrix the kit runs the
    project's own loss over."""
    return [
        LossConfig(weights=w, score_centering=sc, record=rec, dtype=dtype)
        for w in WEIGHT_MODES
        for sc in (False, True)
        for rec in ("head", "support")
    ] + family_configs(dtype)
