"""What correction to apply: the configuration object of :func:`offpolicy.policy_loss`.

``Correction()`` with no arguments is plain REINFORCE/GRPO on the sampler's tokens. The fields compose:

* ``weights`` picks ``f`` in ``w = sg(f(r))`` (docs/spec.md#weights): ``none`` (1), ``tis`` (``min(r, C)``, or
  ``clamp(r, c, C)`` two-sided), ``mis`` (``r * 1[L <= r <= U]``), or ``reject`` (``1[L <= r <= U]``, pure
  rejection sampling: the kept tokens get weight 1).
* ``level`` picks ``r``: the token ratio, the sequence product ``exp(sum_t log r_t)``, the geometric mean
  ``exp(mean_t log r_t)`` or, ``level="segment"``, each turn's geometric mean (the ``segment_ids`` input names the
  turns; docs/spec.md#sequence-level). ``level="geometric", weights="reject"`` keeps a
  sequence iff its geometric ratio lies in ``[L, U]``.
* ``score_centering`` subtracts the sampler-expected weighted score at each position
  (docs/spec.md#score-centering). It is defined for token-level weights only.
* Rejections zero whole tokens or sequences: ``veto``, ``kl_rejection``, ``opsm_delta``. A token-level KL
  rejection is a bound on ``r`` and is folded into ``f`` (so score centering sees it exactly, like MIS masking; at
  the sequence levels it zeros the rejected tokens' weights); sequence-level rejections drop the sequence's whole
  contribution.
* ``batch_normalize`` divides weights (and the centering coefficients, so drift stays zero) by their batch mean.
* ``ppo_clip=(eps_lo, eps_hi)``: decoupled PPO; the weight becomes ``f(pi_prox / q)`` and multiplies the clipped
  surrogate of ``u = p / pi_prox`` (needs ``proximal_logprobs``). ``dual_clip=c`` bounds it below by ``c A``
  where ``A < 0``; ``ppo_delta`` caps ``u`` in the unclipped branch (TRL's ``delta``); ``ppo_ratio="gspo_token"``
  clips GSPO's sequence ratio with a token-level gradient. ``cispo=(lo, hi)`` instead multiplies ``A log p`` by
  the stop-gradient ``clamp(u, lo, hi)``.
* ``sapo=(tau_pos, tau_neg)``: SAPO's soft gate ``4/tau sigmoid(tau (u - 1)) A`` instead of the hard clip;
  ``vespo=(k_pos, lam_pos, k_neg, lam_neg)``: ``sg(phi(W)) A log p`` with VESPO's gamma weight of the sequence's
  ``W = prod_t u_t``; ``gmpo=(eps_lo, eps_hi)``: GMPO's ``A exp(mean_t l_t)`` with PPO's clip in log space on each
  ``l_t = log u_t`` (both need ``seq_ids``). Each needs ``proximal_logprobs``; at most one surrogate field is set.
* ``kl_penalty``: a :class:`KLPenalty` adds ``coef * KL_est(p || p_ref)`` per trained token (needs the
  ``reference_logprobs`` input), optionally importance-weighted by the differentiable ratio (DeepSeek-V3.2).
* ``rejected_in_normalizer=False`` removes rejected tokens (sequence rules, token-level KL rejection, and for a
  weight mode that rejects, such as ``reject``, ratios outside its band) from the aggregation's normaliser (verl's
  convention); by default they stay in it like masked weights.

The keywords are a thin constructor of a :class:`~offpolicy.corrections.tree.CorrectionTree` (``corr.tree``),
whose typed nodes (weight mode, level, rules, surrogate, normalisation, centering) hold the fast functions, the
traits, the jump points and the validation; the loss pipeline reads only the tree. ``Correction.from_tree(tree)``
goes the other way. This class checks the keywords' types and which keywords go together, and names the keyword
in every error.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Callable

from offpolicy.corrections import registry as reg
from offpolicy.corrections.kl_penalty import KLPenalty
from offpolicy.corrections.node import NodeError, real
from offpolicy.corrections.normalisation import SequenceMean, TokenMean
from offpolicy.corrections.rules import RULE_CLASSES, KLRejection, RatioRejection
from offpolicy.corrections.surrogates import RatioSurrogate, ScoreFunction
from offpolicy.corrections.tree import MAX_LOG_RATIO_LIMIT, CorrectionTree, ScoreCentering
from offpolicy.corrections.trust_region import TrustRegion
from offpolicy.corrections.weighting import Weighting

__all__ = ["MAX_LOG_RATIO_LIMIT", "Correction", "KLPenalty", "KLRejection", "RatioRejection"]

#: The keywords that each select a surrogate other than the score function (at most one may be set), from the
#: surrogate nodes' declarations.
SURROGATE_FIELDS = tuple(reg.SURROGATE_KEYWORDS)

#: The rule classes ``rejections=`` chains (those that declare ``chainable``).
CHAINABLE = tuple(c for c in RULE_CLASSES if getattr(c, "chainable", False))

_ANNOTATION = {"pair": "tuple[float, float] | None", "four": "tuple[float, float, float, float] | None",
               "number": "float | None", "int": "int | None", "string": "str"}


def _with_node_keywords(cls: type) -> type:
    """Add a dataclass field for every keyword a node class declares (:data:`~offpolicy.corrections.registry.
    KEYWORDS`) that the class body does not spell, after the written ones (positional order is kept)."""
    ann = cls.__dict__["__annotations__"]
    tree = ann.pop("_tree")
    for name, (_, kw) in reg.KEYWORDS.items():
        if name not in ann:
            ann[name] = _ANNOTATION[kw.kind]
            setattr(cls, name, kw.default)
    ann["_tree"] = tree
    return cls


@dataclass(frozen=True)
@_with_node_keywords
class Correction:
    """The off-policy correction (see the module docstring for how the fields compose).

    Attributes:
        weights: ``"none" | "tis" | "mis" | "reject"``.
        bounds: ``(lower, upper)`` on the ratio. ``tis``: a float ``C`` or ``(c, C)`` for a two-sided clamp
            (default ``(0, 2)``); ``mis`` / ``reject``: ``(L, U)``, inclusive (default ``(0.5, 5)``).
        level: ``"token" | "sequence" | "geometric" | "segment"``.
        score_centering: subtract the sampler-expected weighted score (token level only).
        veto: drop a sequence if any of its trained tokens has ``r < veto`` (e.g. ``1e-4``).
        kl_rejection: a :class:`KLRejection`, or None.
        opsm_delta: off-policy sequence masking: drop sequence ``i`` iff ``A_i < 0`` and
            ``mean_t (lq - log p) > opsm_delta``, with the current policy ``p`` (also under ``ppo_clip``).
        batch_normalize: ``True`` or a name of :data:`~offpolicy.corrections.registry.NORMALISATIONS`
            (``"tokens"``: the same as ``True``): divide the weights by that batch mean.
        ppo_clip: ``(eps_lo, eps_hi)`` for decoupled PPO, or None.
        dual_clip: ``c > 1``: with ``A < 0`` the clipped surrogate is bounded below by ``c A`` (needs ``ppo_clip``).
        ppo_delta: ``delta > 1``: the unclipped branch uses ``min(u, delta)`` (needs ``ppo_clip``).
        ppo_ratio: ``"token"`` (``u = p / pi_prox``) or ``"gspo_token"`` (needs ``ppo_clip`` and ``seq_ids``).
        cispo: ``(lo, hi)`` absolute bounds of CISPO's stop-gradient coefficient ``clamp(u, lo, hi)`` (TRL:
            ``(0, epsilon_high)``; slime: ``(1 - eps_clip, 1 + eps_clip_high)``); excludes ``ppo_clip``.
        rejected_in_normalizer: keep rejected tokens in the aggregation's normaliser (default) or remove them.
        rejections: more rejection rules, each a :class:`KLRejection` or :class:`RatioRejection` with its own
            threshold and level, chained (a token or sequence is dropped if any rule drops it).
        trust_region: a :class:`~offpolicy.corrections.trust_region.TrustRegion` (a mask on probability
            differences: DPPO, prime-rl, ROLL, KPop), or None.
        sapo: ``(tau_pos, tau_neg) > 0``: SAPO's temperatures for ``A > 0`` / ``A <= 0`` (TRL: ``(1.0, 1.05)``).
        vespo: ``(k_pos, lam_pos, k_neg, lam_neg)``, ``k >= 0``, ``lam > 0``: VESPO's gamma weight for ``A >= 0`` /
            ``A < 0`` (TRL: ``(2, 3, 3, 2)``).
        gmpo: ``(eps_lo, eps_hi) >= 0``: GMPO's clip range in log space (the paper: ``(0.4, 0.4)``).
        kl_penalty: a :class:`KLPenalty` (needs ``reference_logprobs``), or None.
        max_log_ratio: log-ratios are clamped to ``[-max, max]`` before any exponentiation; at most
            :data:`MAX_LOG_RATIO_LIMIT` (40) so that fp32 stays finite.
    """

    weights: str = "none"
    bounds: tuple[float, float] | float | None = None
    level: str = "token"
    score_centering: bool = False
    veto: float | None = None
    kl_rejection: KLRejection | None = None
    opsm_delta: float | None = None
    batch_normalize: bool | str = False
    ppo_clip: tuple[float, float] | None = None
    max_log_ratio: float = 20.0
    dual_clip: float | None = None
    ppo_delta: float | None = None
    ppo_ratio: str = "token"
    cispo: tuple[float, float] | None = None
    rejected_in_normalizer: bool = True
    rejections: tuple[KLRejection | RatioRejection, ...] = ()
    trust_region: TrustRegion | None = None
    sapo: tuple[float, float] | None = None
    vespo: tuple[float, float, float, float] | None = None
    gmpo: tuple[float, float] | None = None
    kl_penalty: KLPenalty | None = None
    _tree: CorrectionTree = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._check_types()
        if self.weights not in reg.WEIGHT_MODES:
            raise ValueError(f"Correction.weights must be one of {tuple(reg.WEIGHT_MODES)}, got {self.weights!r}")
        if self.level not in reg.LEVELS:
            raise ValueError(f"Correction.level must be one of {tuple(reg.LEVELS)}, got {self.level!r}")
        if not (self.batch_normalize is False or self.batch_normalize is True
                or (isinstance(self.batch_normalize, str) and self.batch_normalize in reg.NORMALISATIONS)):
            raise ValueError(f"Correction.batch_normalize must be a bool or one of {tuple(reg.NORMALISATIONS)}, "
                             f"got {self.batch_normalize!r}")
        weighting = Weighting(self._mode(), reg.LEVELS[self.level]())
        surrogate = self._surrogate()
        names, rules = self._rules()
        norm = None if self.batch_normalize is False else (
            TokenMean() if self.batch_normalize in (True, "tokens") else SequenceMean())
        tree = self._node(lambda: CorrectionTree(
            weighting=weighting, rejections=rules, rule_names=names, surrogate=surrogate, normalisation=norm,
            centering=ScoreCentering() if self.score_centering else None, trust_region=self.trust_region,
            kl_penalty=self.kl_penalty, max_log_ratio=self.max_log_ratio,
            rejected_in_normalizer=self.rejected_in_normalizer), max_log_ratio="max_log_ratio")
        object.__setattr__(self, "_tree", tree)

    def _node(self, build: Callable[[], Any], expects: str = "", **keywords: str) -> Any:
        """``build()``, re-raising a node's :class:`~offpolicy.corrections.node.NodeError` with the keyword its
        argument came from (``keywords``: node argument -> keyword): ``"Correction.{keyword} {reason}"`` when the
        keyword feeds that argument alone, else ``"Correction.{keyword} must be (args) {expects}, got ..."``."""
        try:
            return build()
        except NodeError as err:
            keyword = keywords.get(err.arg)
            if keyword is None:
                raise
            args = [a for a, k in keywords.items() if k == keyword]
            if len(args) == 1:
                raise ValueError(f"Correction.{keyword} {err.reason}") from None
            raise ValueError(f"Correction.{keyword} must be ({', '.join(args)}) {expects}, got "
                             f"{getattr(self, keyword)!r} ({err})") from None

    def _check_types(self) -> None:
        """Each field has its type (a string ``"no"`` is truthy, ``True`` is the number 1: neither may pass as a
        flag or a number)."""
        kinds = {name: kw.kind for name, (_, kw) in reg.KEYWORDS.items()}
        for name in ("weights", "level", *(n for n, k in kinds.items() if k == "string")):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"Correction.{name} must be a string, got {getattr(self, name)!r}")
        for name in ("score_centering", "rejected_in_normalizer"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Correction.{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("max_log_ratio", *(n for n, k in kinds.items() if k == "number")):
            val = getattr(self, name)
            if not (val is None and name != "max_log_ratio") and not real(val):
                raise TypeError(f"Correction.{name} must be a number, got {val!r}")
        for name in (n for n, k in kinds.items() if k == "int"):
            val = getattr(self, name)
            if val is not None and not (isinstance(val, numbers.Integral) and not isinstance(val, bool)):
                raise TypeError(f"Correction.{name} must be an integer, got {val!r}")
        for name in ("bounds", *(n for n, k in kinds.items() if k in ("pair", "four"))):
            val, size = getattr(self, name), 4 if kinds.get(name) == "four" else 2
            if val is None or (name == "bounds" and real(val)):
                continue
            alt = reg.KEYWORDS[name][1].alt_args if name in reg.KEYWORDS else ()
            if not (isinstance(val, (tuple, list)) and len(val) in (size, len(alt) or size)
                    and all(real(x) for x in val)):
                alt_form = " or (" + ", ".join(alt) + ")" if alt else ""
                raise TypeError(f"Correction.{name} must be {'a pair' if size == 2 else 'four'} of numbers"
                                f"{' or a number' * (name == 'bounds')}{alt_form}, got {val!r}")
            if isinstance(val, list):
                object.__setattr__(self, name, tuple(val))
        self._spread_alt_forms()

    def _spread_alt_forms(self) -> None:
        """A keyword given in its second spelling (:attr:`~offpolicy.corrections.node.Keyword.alt_args`, verl's
        ``clip_cov=(ratio, lb, ub)``) is rewritten as its first (``clip_cov=(lb, ub)``) with the other arguments
        moved to the node's keywords that own them (``clip_cov_ratio``); one of those set to another value is
        refused."""
        for name, (cls, kw) in reg.KEYWORDS.items():
            val = getattr(self, name)
            if not kw.alt_args or val is None or len(val) != len(kw.alt_args) or len(val) == len(kw.args):
                continue
            given = dict(zip(kw.alt_args, val))
            for arg in kw.alt_args:
                if arg in kw.args:
                    continue
                owner = next(k for k in reg.declared(cls, "keywords", ()) if k.args == (arg,))
                if getattr(self, owner.name) != owner.default and getattr(self, owner.name) != given[arg]:
                    raise ValueError(f"Correction.{name}=({', '.join(kw.alt_args)}) sets {arg} and "
                                     f"Correction.{owner.name}={getattr(self, owner.name)!r} sets it too: give "
                                     "one of them")
                object.__setattr__(self, owner.name, given[arg])
            object.__setattr__(self, name, tuple(given[a] for a in kw.args))
        if self.kl_penalty is not None and not isinstance(self.kl_penalty, KLPenalty):
            raise TypeError(f"Correction.kl_penalty must be a KLPenalty, got {self.kl_penalty!r}")
        if self.kl_rejection is not None and not isinstance(self.kl_rejection, KLRejection):
            raise TypeError("Correction.kl_rejection must be a KLRejection")
        if isinstance(self.rejections, list):
            object.__setattr__(self, "rejections", tuple(self.rejections))
        if not (isinstance(self.rejections, tuple) and all(isinstance(r, CHAINABLE) for r in self.rejections)):
            raise TypeError(f"Correction.rejections must be a tuple of {' / '.join(c.__name__ for c in CHAINABLE)} "
                            f"items, got {self.rejections!r}")
        if self.trust_region is not None and not isinstance(self.trust_region, TrustRegion):
            raise TypeError(f"Correction.trust_region must be a TrustRegion, got {self.trust_region!r}")

    def _mode(self):
        """The weight mode node from ``weights`` and ``bounds`` (a scalar ``C`` means ``(0, C)`` where the mode
        takes one; no bounds: the node's own defaults)."""
        cls = reg.WEIGHT_MODES[self.weights]
        if not cls.bounded:
            if self.bounds is not None:
                raise ValueError(f"Correction.bounds is meaningless with weights={self.weights!r}")
            return cls()
        if self.bounds is None:
            return cls()
        bounds = self.bounds
        if real(bounds):
            if not cls.scalar_bound:
                raise ValueError(f"Correction.bounds for weights={self.weights!r} must be a pair (L, U)")
            bounds = (0.0, bounds)
        return self._node(lambda: cls(*bounds), cls.expects, lower="bounds", upper="bounds")

    def _build(self, cls: type) -> Any:
        """The node of ``cls`` from the keywords it declares (a pair or four spread over its arguments, a number or
        string filling one), a node error re-raised naming the keyword."""
        args, names = {}, {}
        for kw in reg.declared(cls, "keywords", ()):
            val = getattr(self, kw.name)
            if kw.kind in ("pair", "four"):
                args.update(zip(kw.args, val))
            else:
                args[kw.args[0]] = val
            names.update({a: kw.name for a in kw.args})
        return self._node(lambda: cls(**args), getattr(cls, "expects", ""), **names)

    def _surrogate(self):
        """The surrogate node the keywords select (the score function when none is set)."""
        for name, (cls, kw) in reg.KEYWORDS.items():
            val = getattr(self, name)
            if kw.choices and val not in kw.choices:
                raise ValueError(f"Correction.{name} must be {' or '.join(map(repr, kw.choices))}, got {val!r}")
            select = reg.selector(cls)
            if kw.role == "modifier" and val != kw.default and getattr(self, select.name) is None:
                shown = name if kw.default is None else f"{name}={val!r}"
                raise ValueError(f"Correction.{shown} needs {select.name} (it modifies the {cls.__name__} node)")
        chosen = [name for name in SURROGATE_FIELDS if getattr(self, name) is not None]
        if len(chosen) > 1:
            raise ValueError(f"Correction.{' and '.join(chosen)} exclude each other (each selects a surrogate)")
        if chosen:
            return self._build(reg.SURROGATE_KEYWORDS[chosen[0]])
        tr = self.trust_region
        return RatioSurrogate() if tr is not None and tr.on == "update" else ScoreFunction()

    def _rules(self) -> tuple[tuple[str, ...], tuple]:
        """``(names, rules)``: the rules the rule keywords select (``veto``, ``opsm_delta``, ... in node order, each
        named by its class), then :attr:`rejection_rules`."""
        named = [(cls.name, self._build(cls)) for name, cls in reg.RULE_KEYWORDS.items()
                 if getattr(self, name) is not None]
        named += list(self.rejection_rules)
        return tuple(n for n, _ in named), tuple(r for _, r in named)

    @classmethod
    def from_tree(cls, tree: CorrectionTree) -> "Correction":
        """The keyword form of ``tree`` (``Correction.from_tree(corr.tree) == corr``). Rule names other than the
        keyword constructor's (``veto``, ``opsm``, ``kl``, ``rule{i}``) are not kept."""
        if not isinstance(tree, CorrectionTree):
            raise TypeError(f"Correction.from_tree needs a CorrectionTree, got {tree!r}")
        mode, sur, kw = tree.weighting.mode, tree.surrogate, {}
        if mode.bounded and mode != type(mode)():
            kw["bounds"] = (mode.lower, mode.upper)
        rules = []
        for name, rule in tree.named_rules:
            select = reg.selector(type(rule))
            own = not getattr(rule, "chainable", False) or name == rule.name
            if select is not None and own and select.name not in kw:
                kw.update(cls._read_back(rule))
            elif name == "kl" and isinstance(rule, KLRejection) and "kl_rejection" not in kw:
                kw["kl_rejection"] = rule
            else:
                rules.append(rule)
        if reg.selector(type(sur)) is not None:
            kw.update(cls._read_back(sur))
        norm = tree.normalisation
        return cls(weights=mode.name, level=tree.weighting.level.name, score_centering=tree.centering is not None,
                   batch_normalize=False if norm is None else norm.name, rejections=tuple(rules),
                   max_log_ratio=tree.max_log_ratio, rejected_in_normalizer=tree.rejected_in_normalizer,
                   trust_region=tree.trust_region, kl_penalty=tree.kl_penalty, **kw)

    @staticmethod
    def _read_back(node: Any) -> dict[str, Any]:
        """The keywords that build ``node`` (the inverse of :meth:`_build`)."""
        return {kw.name: tuple(getattr(node, a) for a in kw.args) if kw.kind in ("pair", "four")
                else getattr(node, kw.args[0]) for kw in reg.declared(type(node), "keywords", ())}

    @property
    def tree(self) -> CorrectionTree:
        """The typed nodes this correction builds (what the loss pipeline reads)."""
        return self._tree

    @property
    def lower(self) -> float:
        """Lower ratio bound (0 when one-sided)."""
        return self.tree.weighting.mode.lower

    @property
    def upper(self) -> float:
        """Upper ratio bound (inf for weights='none')."""
        return self.tree.weighting.mode.upper

    @property
    def sequence_level(self) -> bool:
        """Whether the weight acts on a per-sequence ratio."""
        return self.tree.weighting.level.per_sequence

    @property
    def rejection_rules(self) -> tuple[tuple[str, KLRejection | RatioRejection], ...]:
        """``(name, rule)`` of every KL / ratio rejection: ``"kl"`` for ``kl_rejection``, ``"rule{i}"`` for
        ``rejections[i]``."""
        head = (("kl", self.kl_rejection),) if self.kl_rejection is not None else ()
        return head + tuple((f"rule{i}", r) for i, r in enumerate(self.rejections))

    @property
    def sequence_rules(self) -> tuple[str, ...]:
        """Names of the rules that drop whole sequences (veto, OPSM, then the sequence-level KL / ratio
        rejections)."""
        return tuple(name for name, _ in self.tree.sequence_rules)

    @property
    def surrogate(self):
        """The surrogate node this correction selects (``.name``: ``"score_function"``, ``"ppo"``, ...)."""
        return self.tree.surrogate

    @property
    def needs_sequences(self) -> bool:
        """Whether ``seq_ids`` are required."""
        return self.tree.needs_sequences
