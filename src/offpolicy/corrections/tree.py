"""The correction as a tree of typed nodes: :class:`CorrectionTree`.

``CorrectionTree(weighting=Weighting(MIS(0.5, 5), TokenLevel()), rejections=(Veto(1e-4),), surrogate=PPO(0.2,
0.28), normalisation=TokenMean(), centering=ScoreCentering(), trust_region=..., kl_penalty=...)``. Each node
validates its own arguments; the rules that combine nodes live here and read the nodes' traits:

* score centering needs a token-level weighting, a ``centerable`` surrogate and no trust region (its mask depends
  on the probabilities, not on the ratio ``f`` acts on);
* a trust region goes with a surrogate that ``takes_trust_region``; ``TrustRegion(on="update")`` replaces the
  clip, so it goes with :class:`~offpolicy.corrections.surrogates.RatioSurrogate`, PPO or CISPO, and the ratio
  surrogate needs it.

:class:`~offpolicy.Correction` (the keyword API) builds one of these in ``__post_init__`` (``corr.tree``); the loss
pipeline reads only the tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Iterator

from offpolicy.corrections.kl_penalty import KLPenalty
from offpolicy.corrections.node import Keyword, Jump, NodeError, real
from offpolicy.corrections.normalisation import NORMALISATION_CLASSES, Normalisation
from offpolicy.corrections.rules import RULE_CLASSES, Rule
from offpolicy.corrections.surrogates import SURROGATE_CLASSES, RatioSurrogate, ScoreFunction, Surrogate
from offpolicy.corrections.trust_region import TrustRegion
from offpolicy.corrections.weighting import Weighting

#: Largest accepted ``max_log_ratio``: ``exp(2 * 40) = 5.5e34`` (a squared ratio) is finite in fp32, whose largest
#: value is about ``exp(88.7)``; beyond it fp32 weights, KL estimates and metrics overflow to inf.
MAX_LOG_RATIO_LIMIT = 40.0


@dataclass(frozen=True)
class ScoreCentering:
    """Subtract the sampler-expected weighted score at each position (needs a candidate record)."""

    keywords: ClassVar[tuple[Keyword, ...]] = ()
    table_form: ClassVar[str] = '`score_centering=True`'
    inputs: ClassVar[tuple[str, ...]] = ('candidates',)
    table_traits: ClassVar[str] = 'needs a candidate record'

    anchor: ClassVar[str] = "docs/spec.md#score-centering"
    source: ClassVar[str] = "control variate over the sampler's recorded candidates (this project, docs/spec.md)"


def _kinds(classes: tuple[type, ...]) -> str:
    return " / ".join(c.__name__ for c in classes)


@dataclass(frozen=True)
class CorrectionTree:
    """The off-policy correction as nodes.

    Attributes:
        weighting: the weight function and the ratio it acts on.
        rejections: rules that zero tokens or sequences, chained (dropped if any rule drops it).
        rule_names: one name per rule, for the metrics (``"{name}_rejected_frac"``) and error messages; None: the
            rules' own names, suffixed by their index where two share one.
        surrogate: the per-token objective the weight multiplies.
        normalisation: a batch mean the weights are divided by, or None.
        centering: :class:`ScoreCentering` or None.
        trust_region: a mask on probability differences, or None.
        kl_penalty: a KL-to-reference penalty, or None.
        max_log_ratio: log-ratios are clamped to ``[-max, max]`` before exponentiation; in
            ``(0, MAX_LOG_RATIO_LIMIT]``.
        rejected_in_normalizer: keep rejected tokens in the aggregation's normaliser (default) or remove them.
    """

    keywords: ClassVar[tuple[Keyword, ...]] = ()
    table_form: ClassVar[str] = '`op.Correction(...)`; back with `op.Correction.from_tree`'
    inputs: ClassVar[tuple[str, ...]] = ()
    table_traits: ClassVar[str] = 'the combination rules'

    weighting: Weighting = field(default_factory=Weighting)
    rejections: tuple[Rule, ...] = ()
    rule_names: tuple[str, ...] | None = None
    surrogate: Surrogate = field(default_factory=ScoreFunction)
    normalisation: Normalisation | None = None
    centering: ScoreCentering | None = None
    trust_region: TrustRegion | None = None
    kl_penalty: KLPenalty | None = None
    max_log_ratio: float = 20.0
    rejected_in_normalizer: bool = True

    def __post_init__(self) -> None:
        self._check_types()
        if not (real(self.max_log_ratio) and 0 < self.max_log_ratio <= MAX_LOG_RATIO_LIMIT):
            raise NodeError("CorrectionTree", "max_log_ratio",
                            f"must be in (0, {MAX_LOG_RATIO_LIMIT:g}], got {self.max_log_ratio!r}: the squared ratio "
                            "exp(2 * max_log_ratio) (chi2 metric) must stay finite in fp32 (about exp(88.7))")
        names = self.rule_names
        if names is None:
            own = [r.name for r in self.rejections]
            names = tuple(n if own.count(n) == 1 else f"{n}{i}" for i, n in enumerate(own))
        names = tuple(names)
        if len(names) != len(self.rejections) or len(set(names)) != len(names):
            raise ValueError(f"CorrectionTree.rule_names must name each rule once, got {names!r} for "
                             f"{len(self.rejections)} rules")
        object.__setattr__(self, "rule_names", names)
        if self.centering is not None:
            if self.weighting.level.per_sequence:
                raise ValueError(
                    f"score_centering=True is defined for token-level weights only, got level="
                    f"{self.weighting.level.name!r}: sequence and geometric weights depend on later tokens and break "
                    "the per-prefix centering (docs/spec.md#score-centering)")
            if not self.surrogate.centerable:
                raise ValueError(
                    f"score_centering=True cannot be combined with ppo_clip or cispo, nor sapo / vespo / gmpo (the "
                    f"{self.surrogate.name!r} surrogate): the clipped surrogate is not of the form w * log p that "
                    "centering corrects")
            if self.trust_region is not None:
                raise ValueError("score_centering=True cannot be combined with trust_region: its mask depends on the "
                                 "probabilities, not on the ratio f acts on, so the centering coefficients miss it")
        tr = self.trust_region
        if tr is not None and not self.surrogate.takes_trust_region:
            raise ValueError(f"Correction.trust_region cannot be combined with {self.surrogate.name}: no peer combines "
                             "them and their soft gates are trust regions of their own; use ppo_clip or cispo with it")
        if isinstance(self.surrogate, RatioSurrogate) != (tr is not None and tr.on == "update"
                                                          and not self.surrogate.needs_proximal):
            raise ValueError("CorrectionTree: TrustRegion(on='update') replaces the clip of the surrogate: it goes "
                             "with surrogate=RatioSurrogate() (or PPO / CISPO), and RatioSurrogate needs it")

    def _check_types(self) -> None:
        for name, classes, optional in (("surrogate", SURROGATE_CLASSES, False),
                                        ("normalisation", NORMALISATION_CLASSES, True),
                                        ("centering", (ScoreCentering,), True), ("trust_region", (TrustRegion,), True),
                                        ("kl_penalty", (KLPenalty,), True), ("weighting", (Weighting,), False)):
            val = getattr(self, name)
            if not (isinstance(val, classes) or (optional and val is None)):
                raise TypeError(f"CorrectionTree.{name} must be {'None or ' * optional}a {_kinds(classes)}, got "
                                f"{val!r}")
        if isinstance(self.rejections, list):
            object.__setattr__(self, "rejections", tuple(self.rejections))
        if not (isinstance(self.rejections, tuple) and all(isinstance(r, RULE_CLASSES) for r in self.rejections)):
            raise TypeError(f"CorrectionTree.rejections must be a tuple of {_kinds(RULE_CLASSES)} items, got "
                            f"{self.rejections!r}")
        if not isinstance(self.rejected_in_normalizer, bool):
            raise TypeError(f"CorrectionTree.rejected_in_normalizer must be a bool, got {self.rejected_in_normalizer!r}")

    @property
    def named_rules(self) -> tuple[tuple[str, Rule], ...]:
        """``(name, rule)`` of every rejection rule, in order."""
        return tuple(zip(self.rule_names, self.rejections))

    @property
    def token_rules(self) -> tuple[Rule, ...]:
        """The rules that act on each token's own ratio (folded into ``f``)."""
        return tuple(r for r in self.rejections if not r.per_sequence and not getattr(r, "masks", False))

    @property
    def sequence_rules(self) -> tuple[tuple[str, Rule], ...]:
        """``(name, rule)`` of the ratio rules that drop whole sequences."""
        return tuple((n, r) for n, r in self.named_rules if r.per_sequence and not getattr(r, "masks", False))

    @property
    def mask_rules(self) -> tuple[tuple[str, Rule], ...]:
        """``(name, rule)`` of the mask rules (``masks``: an ``[N]`` mask of dropped tokens from the batch and the
        inputs they declare, :class:`~offpolicy.corrections.rules.RuleInputs`)."""
        return tuple((n, r) for n, r in self.named_rules if getattr(r, "masks", False))

    def needed_inputs(self) -> tuple[str, ...]:
        """The loss inputs the nodes declare they read, each once."""
        return tuple(dict.fromkeys(i for node in self.nodes() for i in getattr(node, "inputs", ())))

    @property
    def needs_sequences(self) -> bool:
        """Whether ``seq_ids`` are required."""
        return (self.weighting.level.needs_sequences or bool(self.sequence_rules) or self.surrogate.needs_sequences
                or any(r.per_sequence for _, r in self.mask_rules)
                or (self.normalisation is not None and self.normalisation.needs_sequences)
                or (self.trust_region is not None and self.trust_region.per_sequence))

    @property
    def needs_segments(self) -> bool:
        """Whether ``segment_ids`` are required (and read: per-turn weights, a per-turn rejection or trust region)."""
        return (self.weighting.level.needs_segments or any(getattr(r, "needs_segments", False) for r in self.rejections)
                or (self.trust_region is not None and self.trust_region.needs_segments))

    def nodes(self) -> Iterator[object]:
        """Every node of the tree (weight mode, level, rules, surrogate, and the optional ones that are set)."""
        yield self.weighting.mode
        yield self.weighting.level
        yield from self.rejections
        yield self.surrogate
        for node in (self.normalisation, self.centering, self.trust_region, self.kl_penalty):
            if node is not None:
                yield node

    def jumps(self) -> tuple[tuple[object, Jump], ...]:
        """``(node, jump)`` for every discontinuity of every node (see :class:`~offpolicy.corrections.node.Jump`).
        The weight mode's jumps are at the weighting's level."""
        out: list[tuple[object, Jump]] = []
        for node in self.nodes():
            for j in getattr(node, "jumps", lambda: ())():
                if node is self.weighting.mode:
                    j = j._replace(level=self.weighting.level.name)
                out.append((node, j))
        return tuple(out)
