"""What correction to apply: the configuration object of :func:`offpolicy.policy_loss`.

``Correction()`` with no arguments is plain REINFORCE/GRPO on the sampler's tokens. The fields compose:

* ``weights`` picks ``f`` in ``w = sg(f(r))`` (docs/spec.md#weights): ``none`` (1), ``tis`` (``min(r, C)``, or
  ``clamp(r, c, C)`` two-sided), ``mis`` (``r * 1[L <= r <= U]``), or ``reject`` (``1[L <= r <= U]``, pure
  rejection sampling: the kept tokens get weight 1).
* ``level`` picks ``r``: the token ratio, the sequence product ``exp(sum_t log r_t)`` or the geometric mean
  ``exp(mean_t log r_t)`` (docs/spec.md#sequence-level). ``level="geometric", weights="reject"`` keeps a
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

Every mode, level, estimator, rule and surrogate named here is an entry of :mod:`offpolicy.corrections.registry`;
this class only checks that the fields name entries and combine.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from offpolicy.corrections import registry as reg
from offpolicy.corrections.trust_region import TrustRegion


#: Largest accepted ``Correction.max_log_ratio``: ``exp(2 * 40) = 5.5e34`` (a squared ratio) is finite in fp32,
#: whose largest value is about ``exp(88.7)``; beyond it fp32 weights, KL estimates and metrics overflow to inf.
MAX_LOG_RATIO_LIMIT = 40.0


@dataclass(frozen=True)
class KLRejection:
    """Reject tokens or sequences whose KL estimate exceeds ``threshold`` (or, with ``threshold=(lo, hi)``, lies
    outside ``[lo, hi]``: two-sided, meaningful for the signed ``k1``).

    ``estimator``: ``k1 = -log r``, ``k2 = (log r)^2 / 2``, ``k3 = r - 1 - log r`` (Schulman's estimators of
    KL(q||p) on tokens drawn from q). ``level``: per token, or the sum / mean / max over each sequence's trained
    tokens.
    """

    threshold: float | tuple[float, float]
    estimator: str = "k3"
    level: str = "token"
    kind = "kl"

    def __post_init__(self) -> None:
        if self.estimator not in reg.ESTIMATORS:
            raise ValueError(f"KLRejection.estimator must be one of {tuple(reg.ESTIMATORS)}, got {self.estimator!r}")
        if self.level not in reg.KL_LEVELS:
            raise ValueError(f"KLRejection.level must be one of {tuple(reg.KL_LEVELS)}, got {self.level!r}")
        if isinstance(self.threshold, list):
            object.__setattr__(self, "threshold", tuple(self.threshold))
        if isinstance(self.threshold, tuple):
            if not (len(self.threshold) == 2 and all(_finite_number(t) for t in self.threshold)
                    and self.threshold[0] <= self.threshold[1]):
                raise ValueError(f"KLRejection.threshold must be a finite number or (lo, hi) with lo <= hi, got "
                                 f"{self.threshold!r}")
            return
        if not _finite_number(self.threshold):
            raise ValueError(f"KLRejection.threshold must be a finite number, got {self.threshold!r}")
        if not reg.ESTIMATORS[self.estimator].signed and self.threshold < 0:
            raise ValueError(f"KLRejection.threshold must be >= 0 for {self.estimator}, got {self.threshold}")


@dataclass(frozen=True)
class KLPenalty:
    """A KL-to-reference penalty ``coef * k_t`` on every trained token (docs/spec.md#kl-penalty).

    ``k_t`` estimates ``KL(p || p_ref)`` on tokens drawn from ``p`` at ``rho = p_ref / p``: ``k1 = -log rho``,
    ``k2 = (log rho)^2 / 2``, ``k3 = rho - 1 - log rho`` (Schulman). ``importance_weighted=True`` multiplies it by
    the ratio ``p / pi_old`` (``pi_old`` = ``proximal_logprobs`` when given, else the sampler's), differentiable as
    in DeepSeek-V3.2, TRL's ``use_bias_correction_kl`` and slime's ``--use-unbiased-kl``: its gradient is then the
    unbiased gradient of the reverse KL on tokens drawn from ``pi_old``.
    """

    coef: float
    estimator: str = "k3"
    importance_weighted: bool = False

    def __post_init__(self) -> None:
        if not (_finite_number(self.coef) and self.coef >= 0):
            raise ValueError(f"KLPenalty.coef must be a finite number >= 0, got {self.coef!r}")
        if self.estimator not in reg.ESTIMATORS:
            raise ValueError(f"KLPenalty.estimator must be one of {tuple(reg.ESTIMATORS)}, got {self.estimator!r}")
        if not isinstance(self.importance_weighted, bool):
            raise TypeError(f"KLPenalty.importance_weighted must be a bool, got {self.importance_weighted!r}")


def _real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _finite_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class RatioRejection:
    """Reject tokens (``level="token"``) or whole sequences (``"sequence"``: ``prod_t r_t``; ``"geometric"``:
    ``exp(mean_t log r_t)``) whose ratio lies outside ``[lower, upper]`` (inclusive), independently of the weight
    mode's own bounds: importance weights and a rejection band at different bounds or levels at once."""

    lower: float
    upper: float
    level: str = "token"
    kind = "ratio"

    def __post_init__(self) -> None:
        if self.level not in reg.LEVELS:
            raise ValueError(f"RatioRejection.level must be one of {tuple(reg.LEVELS)}, got {self.level!r}")
        if not (_finite_number(self.lower) and _finite_number(self.upper) and 0 <= self.lower <= self.upper):
            raise ValueError(f"RatioRejection needs 0 <= lower <= upper < inf, got ({self.lower!r}, {self.upper!r})")


@dataclass(frozen=True)
class Correction:
    """The off-policy correction (see the module docstring for how the fields compose).

    Attributes:
        weights: ``"none" | "tis" | "mis" | "reject"``.
        bounds: ``(lower, upper)`` on the ratio. ``tis``: a float ``C`` or ``(c, C)`` for a two-sided clamp
            (default ``(0, 2)``); ``mis`` / ``reject``: ``(L, U)``, inclusive (default ``(0.5, 5)``).
        level: ``"token" | "sequence" | "geometric"``.
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
    _bounds: tuple[float, float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._check_types()
        if self.weights not in reg.WEIGHT_MODES:
            raise ValueError(f"Correction.weights must be one of {tuple(reg.WEIGHT_MODES)}, got {self.weights!r}")
        if self.level not in reg.LEVELS:
            raise ValueError(f"Correction.level must be one of {tuple(reg.LEVELS)}, got {self.level!r}")
        object.__setattr__(self, "_bounds", self._resolve_bounds())
        if reg.LEVELS[self.level].per_sequence and not reg.WEIGHT_MODES[self.weights].bounded:
            bounded = tuple(m.name for m in reg.WEIGHT_MODES.values() if m.bounded)
            raise ValueError(f"Correction(level={self.level!r}) needs weights={' | '.join(map(repr, bounded))}")
        if not (self.batch_normalize is False or self.batch_normalize is True
                or (isinstance(self.batch_normalize, str) and self.batch_normalize in reg.NORMALISATIONS)):
            raise ValueError(f"Correction.batch_normalize must be a bool or one of {tuple(reg.NORMALISATIONS)}, "
                             f"got {self.batch_normalize!r}")
        self._check_surrogate_options()
        if not isinstance(self.rejected_in_normalizer, bool):
            raise TypeError(f"Correction.rejected_in_normalizer must be a bool, got {self.rejected_in_normalizer!r}")
        if self.score_centering and reg.LEVELS[self.level].per_sequence:
            raise ValueError(
                f"score_centering=True is defined for token-level weights only, got level={self.level!r}: "
                "sequence and geometric weights depend on later tokens and break the per-prefix centering "
                "(docs/spec.md#score-centering)"
            )
        if self.score_centering and not self.surrogate.centerable:
            raise ValueError(
                f"score_centering=True cannot be combined with ppo_clip or cispo, nor sapo / vespo / gmpo (the "
                f"{self.surrogate.name!r} "
                "surrogate): "
                "the clipped surrogate is not of the form w * log p that centering corrects"
            )
        if self.veto is not None and not (0.0 < self.veto < 1.0):
            raise ValueError(f"Correction.veto must be in (0, 1), got {self.veto!r}")
        if self.kl_rejection is not None and not isinstance(self.kl_rejection, KLRejection):
            raise TypeError("Correction.kl_rejection must be a KLRejection")
        if isinstance(self.rejections, list):
            object.__setattr__(self, "rejections", tuple(self.rejections))
        if not (isinstance(self.rejections, tuple)
                and all(isinstance(r, (KLRejection, RatioRejection)) for r in self.rejections)):
            raise TypeError("Correction.rejections must be a tuple of KLRejection / RatioRejection items, got "
                            f"{self.rejections!r}")
        self._check_trust_region()
        if self.opsm_delta is not None and not (math.isfinite(self.opsm_delta) and self.opsm_delta >= 0):
            raise ValueError(f"Correction.opsm_delta must be a finite number >= 0, got {self.opsm_delta!r}")
        if self.ppo_clip is not None:
            lo, hi = self.ppo_clip
            if not (0.0 <= lo < 1.0 and 0.0 <= hi and math.isfinite(hi)):
                raise ValueError(f"Correction.ppo_clip must be (eps_lo in [0, 1), eps_hi >= 0), got {self.ppo_clip}")
        if not 0 < self.max_log_ratio <= MAX_LOG_RATIO_LIMIT:
            raise ValueError(
                f"Correction.max_log_ratio must be in (0, {MAX_LOG_RATIO_LIMIT:g}], got {self.max_log_ratio}: the "
                "squared ratio exp(2 * max_log_ratio) (chi2 metric) must stay finite in fp32 (about exp(88.7))"
            )

    def _check_types(self) -> None:
        """Each field has its type (a string ``"no"`` is truthy, ``True`` is the number 1: neither may pass as a
        flag or a number)."""
        for name in ("weights", "level", "ppo_ratio"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"Correction.{name} must be a string, got {getattr(self, name)!r}")
        for name in ("score_centering", "rejected_in_normalizer"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Correction.{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("veto", "opsm_delta", "dual_clip", "ppo_delta", "max_log_ratio"):
            val = getattr(self, name)
            if not (val is None and name != "max_log_ratio") and not _real(val):
                raise TypeError(f"Correction.{name} must be a number, got {val!r}")
        for name in ("ppo_clip", "cispo", "bounds", "sapo", "gmpo", "vespo"):
            val, size = getattr(self, name), 4 if name == "vespo" else 2
            if val is None or (name == "bounds" and _real(val)):
                continue
            if not (isinstance(val, (tuple, list)) and len(val) == size and all(_real(x) for x in val)):
                raise TypeError(f"Correction.{name} must be {'a pair' if size == 2 else 'four'} of numbers"
                                f"{' or a number' * (name == 'bounds')}, got {val!r}")
            if isinstance(val, list):
                object.__setattr__(self, name, tuple(val))
        if self.kl_penalty is not None and not isinstance(self.kl_penalty, KLPenalty):
            raise TypeError(f"Correction.kl_penalty must be a KLPenalty, got {self.kl_penalty!r}")

    def _check_surrogate_options(self) -> None:
        if self.ppo_ratio not in ("token", "gspo_token"):
            raise ValueError(f"Correction.ppo_ratio must be 'token' or 'gspo_token', got {self.ppo_ratio!r}")
        needs_clip = {"dual_clip": self.dual_clip, "ppo_delta": self.ppo_delta,
                      "ppo_ratio='gspo_token'": None if self.ppo_ratio == "token" else self.ppo_ratio}
        for name, val in needs_clip.items():
            if val is not None and self.ppo_clip is None:
                raise ValueError(f"Correction.{name} needs ppo_clip (it modifies the clipped PPO surrogate)")
        if self.dual_clip is not None and not (math.isfinite(self.dual_clip) and self.dual_clip > 1):
            raise ValueError(f"Correction.dual_clip must be a finite number > 1, got {self.dual_clip!r}")
        if self.ppo_delta is not None and not (math.isfinite(self.ppo_delta) and self.ppo_delta > 1):
            raise ValueError(f"Correction.ppo_delta must be a finite number > 1, got {self.ppo_delta!r}")
        chosen = [name for name in reg.SURROGATE_FIELDS if getattr(self, name) is not None]
        if len(chosen) > 1:
            raise ValueError(f"Correction.{' and '.join(chosen)} exclude each other (each selects a surrogate)")
        if self.sapo is not None and not all(math.isfinite(t) and t > 0 for t in self.sapo):
            raise ValueError(f"Correction.sapo must be (tau_pos, tau_neg) with finite temperatures > 0, got "
                             f"{self.sapo}")
        if self.vespo is not None and not (all(math.isfinite(x) for x in self.vespo) and self.vespo[0] >= 0
                                           and self.vespo[2] >= 0 and self.vespo[1] > 0 and self.vespo[3] > 0):
            raise ValueError(f"Correction.vespo must be (k_pos, lam_pos, k_neg, lam_neg) finite with k >= 0 and "
                             f"lam > 0, got {self.vespo}")
        if self.gmpo is not None and not all(math.isfinite(e) and e >= 0 for e in self.gmpo):
            raise ValueError(f"Correction.gmpo must be (eps_lo, eps_hi) finite and >= 0, got {self.gmpo}")
        if self.cispo is not None:
            lo, hi = self.cispo
            if not (0.0 <= lo < hi and math.isfinite(hi)):
                raise ValueError(f"Correction.cispo must be (lo, hi) with 0 <= lo < hi < inf, got {self.cispo}")

    def _check_trust_region(self) -> None:
        if self.trust_region is None:
            return
        if not isinstance(self.trust_region, TrustRegion):
            raise TypeError(f"Correction.trust_region must be a TrustRegion, got {self.trust_region!r}")
        if self.score_centering:
            raise ValueError("score_centering=True cannot be combined with trust_region: its mask depends on the "
                             "probabilities, not on the ratio f acts on, so the centering coefficients miss it")
        taken = [name for name in ("sapo", "vespo", "gmpo") if getattr(self, name) is not None]
        if taken:
            raise ValueError(f"Correction.trust_region cannot be combined with {taken[0]}: no peer combines them and "
                             "their soft gates are trust regions of their own; use ppo_clip or cispo with it")

    def _resolve_bounds(self) -> tuple[float, float]:
        mode = reg.WEIGHT_MODES[self.weights]
        if not mode.bounded:
            if self.bounds is not None:
                raise ValueError(f"Correction.bounds is meaningless with weights={self.weights!r}")
            return (0.0, math.inf)
        bounds = mode.default_bounds if self.bounds is None else self.bounds
        if isinstance(bounds, (int, float)):
            if not mode.scalar_bound:
                raise ValueError(f"Correction.bounds for weights={self.weights!r} must be a pair (L, U)")
            bounds = (0.0, float(bounds))
        lo, hi = (float(b) for b in bounds)
        if not (0.0 <= lo <= hi and math.isfinite(hi) and hi > 0):
            raise ValueError(f"Correction.bounds must satisfy 0 <= lower <= upper < inf, got {bounds}")
        return (lo, hi)

    @property
    def lower(self) -> float:
        """Lower ratio bound (0 when one-sided)."""
        return self._bounds[0]

    @property
    def upper(self) -> float:
        """Upper ratio bound (inf for weights='none')."""
        return self._bounds[1]

    @property
    def sequence_level(self) -> bool:
        """Whether the weight acts on a per-sequence ratio."""
        return reg.LEVELS[self.level].per_sequence

    @property
    def rejection_rules(self) -> tuple[tuple[str, KLRejection | RatioRejection], ...]:
        """``(name, rule)`` of every KL / ratio rejection: ``"kl"`` for ``kl_rejection``, ``"rule{i}"`` for
        ``rejections[i]``."""
        head = (("kl", self.kl_rejection),) if self.kl_rejection is not None else ()
        return head + tuple((f"rule{i}", r) for i, r in enumerate(self.rejections))

    def token_rejection_rules(self) -> tuple[KLRejection | RatioRejection, ...]:
        """The rejection rules that act on each token's own ratio (folded into ``f``)."""
        return tuple(r for _, r in self.rejection_rules if not reg.REJECTION_KINDS[r.kind].per_sequence(r))

    @property
    def sequence_rules(self) -> tuple[str, ...]:
        """Names of the sequence rejection rules the correction switches on (registry rules, then the
        sequence-level KL / ratio rejections)."""
        own = tuple(rule.name for rule in reg.SEQUENCE_RULES.values() if rule.applies(self))
        return own + tuple(n for n, r in self.rejection_rules if reg.REJECTION_KINDS[r.kind].per_sequence(r))

    @property
    def surrogate(self) -> reg.Surrogate:
        """The registry's surrogate this correction selects."""
        return reg.surrogate_of(self)

    @property
    def needs_sequences(self) -> bool:
        """Whether ``seq_ids`` are required."""
        norm = reg.normalisation_of(self)
        return (self.sequence_level or bool(self.sequence_rules) or (norm is not None and norm.needs_sequences)
                or self.surrogate.needs_sequences
                or (self.trust_region is not None and self.trust_region.per_sequence))
