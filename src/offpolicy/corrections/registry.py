"""The correction family as data: every weight mode, ratio level, KL estimator, KL rejection level, sequence
rejection rule and surrogate is one entry here, holding its fast torch function, its defaults and the traits the
test kit reads.

The loss pipeline (:mod:`offpolicy.loss.logprobs`) and the test kit (:mod:`offpolicy.testing`) enumerate these
tables. The float64 oracle (:mod:`offpolicy.reference`) does not: it writes every formula, default and trait again
with explicit branches on the names, so that a wrong entry here disagrees with it. Adding a weight mode is one
:class:`WeightMode` entry in :data:`WEIGHT_MODES`, its branch in the reference, and its tests.

Conventions. Fast functions take log-ratios ``log r = log p - lq`` already clamped to ``[-max_log_ratio,
max_log_ratio]`` (``lr``) and, where bounds matter, ``inside = 1[L <= r <= U]`` tested on the *unclamped*
log-ratio (so ``+-inf`` fall outside any finite interval). Definitions: docs/spec.md#weights, docs/spec.md#family.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor


def log_bound(x: float) -> float:
    """``log x`` of a ratio bound, ``-inf`` for 0 (an open lower end)."""
    return math.log(x) if x > 0 else -math.inf


# ---------------------------------------------------------------------------------------------------------------
# Weight modes: w = sg(f(r)), docs/spec.md#weights
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightMode:
    """One weight function ``f``.

    Attributes:
        name: the ``Correction(weights=...)`` value.
        fast: ``(lr, inside, lower, upper) -> f`` on clamped log-ratios (any float dtype, same shape).
        default_bounds: ``(lower, upper)`` when the user gives none; None for a mode without bounds.
        scalar_bound: a single number ``C`` is accepted as ``bounds`` and means ``(0, C)``.
        masks_outside: ``f`` is discontinuous at the bounds (a bound on ``r`` that masks): rounding near a bound
            may flip the weight, so the test kit keeps examples off them.
        ratio_inside: ``f(r) = r`` somewhere inside the bounds (the weighted score is then unbiased there).
        rejects: a ratio outside the bounds is a rejection (the token leaves the normaliser under
            ``rejected_in_normalizer=False``), not merely a weight of 0.
        source: the published source.
    """

    name: str
    fast: Callable[[Tensor, Tensor, float, float], Tensor]
    default_bounds: tuple[float, float] | None
    scalar_bound: bool = False
    masks_outside: bool = False
    ratio_inside: bool = False
    rejects: bool = False
    source: str = ""

    @property
    def bounded(self) -> bool:
        """Whether the mode takes bounds at all."""
        return self.default_bounds is not None


def _tis_fast(lr: Tensor, inside: Tensor, lower: float, upper: float) -> Tensor:
    # clamp(r, c, C) in log space; lr >= -max_log_ratio already, so a zero lower bound needs no special case.
    return torch.exp(lr.clamp(min=log_bound(lower), max=log_bound(upper)))


WEIGHT_MODES: dict[str, WeightMode] = {
    mode.name: mode
    for mode in (
        WeightMode(
            "none",
            fast=lambda lr, inside, lo, hi: torch.ones_like(lr),
            default_bounds=None,
            source="plain REINFORCE / GRPO",
        ),
        WeightMode(
            "tis", fast=_tis_fast, default_bounds=(0.0, 2.0), scalar_bound=True,
            ratio_inside=True, source="Yao et al. 2025 (truncated importance sampling)",
        ),
        WeightMode(
            "mis",
            fast=lambda lr, inside, lo, hi: torch.where(inside, torch.exp(lr), torch.zeros_like(lr)),
            default_bounds=(0.5, 5.0), masks_outside=True, ratio_inside=True,
            source="IcePop arXiv 2510.18855 (masked importance sampling, band [0.5, 5])",
        ),
        WeightMode(
            "reject",
            fast=lambda lr, inside, lo, hi: inside.to(lr.dtype),
            default_bounds=(0.5, 5.0), masks_outside=True, rejects=True,
            source="rejection sampling on the ratio (kept tokens weigh 1)",
        ),
    )
}


# ---------------------------------------------------------------------------------------------------------------
# Ratio levels: which r the weight function sees, docs/spec.md#sequence-level
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Level:
    """The ratio that ``f`` acts on.

    Attributes:
        name: the ``Correction(level=...)`` value.
        fast: ``(log_r [N], seg) -> [num]`` per-sequence log-ratio (None for the token level).
        source: the published source.
    """

    name: str
    fast: Callable | None
    source: str = ""

    @property
    def per_sequence(self) -> bool:
        """Whether the ratio is one per sequence (needs ``seq_ids``; breaks per-prefix score centering)."""
        return self.fast is not None


LEVELS: dict[str, Level] = {
    lv.name: lv
    for lv in (
        Level("token", None, "per-token ratio r_t"),
        Level("sequence", lambda lr, seg: seg.sum(lr), "Liu & Li, 'When speed kills stability' (sequence-level IS)"),
        Level("geometric", lambda lr, seg: seg.mean(lr),
              "geometric mean exp(mean_t log r_t) (GSPO-style length-normalised ratio)"),
    )
}


# ---------------------------------------------------------------------------------------------------------------
# KL estimators and the levels a KL rejection acts at, docs/spec.md#kl-rejection
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Estimator:
    """A per-token estimator of KL(q || p) on tokens drawn from ``q``.

    Attributes:
        fast: ``lr -> k`` on clamped log-ratios.
        signed: the estimate can be negative (a negative threshold is then meaningful).
    """

    name: str
    fast: Callable[[Tensor], Tensor]
    signed: bool = False


ESTIMATORS: dict[str, Estimator] = {
    e.name: e
    for e in (
        Estimator("k1", lambda lr: -lr, signed=True),
        Estimator("k2", lambda lr: 0.5 * lr.square()),
        # k3 = r - 1 - log r = expm1(log r) - log r (accurate near log r = 0).
        Estimator("k3", lambda lr: torch.expm1(lr) - lr),
    )
}


@dataclass(frozen=True)
class KLLevel:
    """Where a KL rejection's statistic lives.

    Attributes:
        fast: ``(k [N], seg) -> [num]`` per-sequence statistic; None at the token level (then the rejection is a
            bound on ``r`` folded into ``f``, which score centering sees exactly).
    """

    name: str
    fast: Callable | None

    @property
    def per_sequence(self) -> bool:
        return self.fast is not None


KL_LEVELS: dict[str, KLLevel] = {
    lv.name: lv
    for lv in (
        KLLevel("token", None),
        KLLevel("seq_sum", lambda k, seg: seg.sum(k)),
        KLLevel("seq_mean", lambda k, seg: seg.mean(k)),
        KLLevel("seq_max", lambda k, seg: seg.max(k)),
    )
}


# ---------------------------------------------------------------------------------------------------------------
# Sequence rejection rules: drop a whole sequence, docs/spec.md#veto, #kl-rejection, #opsm
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SequenceRule:
    """A rule that drops whole sequences.

    Attributes:
        name: the metric suffix and the name in error messages.
        applies: ``corr -> bool``, whether the correction switches the rule on.
        fast: ``(log_r [N], log_p_ratio [N], adv [N], seg, corr) -> [num]`` bool, sequences to drop.
            ``log_r`` is the ratio the weights act on (``pi_prox / q`` under decoupled PPO); ``log_p_ratio`` is
            always the current policy's ``log p - lq``. Both unclamped (``-inf`` is a ratio of 0); a rule that
            exponentiates clamps first.
        source: the published source.
    """

    name: str
    applies: Callable
    fast: Callable
    source: str = ""


SEQUENCE_RULES: dict[str, SequenceRule] = {
    rule.name: rule
    for rule in (
        SequenceRule(
            "veto",
            applies=lambda corr: corr.veto is not None,
            fast=lambda lr, lr_p, adv, seg, corr: seg.min(lr) < math.log(corr.veto),
            source="Liu & Li, 'When speed kills stability' (catastrophic-token veto)",
        ),
        SequenceRule(
            "opsm",
            applies=lambda corr: corr.opsm_delta is not None,
            # Negative advantage and mean k1 of the *current* policy, mean_t (lq - log p) > delta (also under
            # decoupled PPO, where the weights act on pi_prox / q: drift during the PPO epochs must be caught).
            fast=lambda lr, lr_p, adv, seg, corr: (seg.mean(adv) < 0) & (seg.mean(-lr_p) > corr.opsm_delta),
            source="DeepSeek-V3.2 arXiv 2512.02556 (off-policy sequence masking)",
        ),
    )
}


# ---------------------------------------------------------------------------------------------------------------
# Rejection rules with their own band and level: KLRejection and RatioRejection items, docs/spec.md#kl-rejection
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RejectionKind:
    """How one kind of user rejection rule (a ``KLRejection`` or ``RatioRejection`` item) acts.

    A token-level rule is a bound on each token's ratio, folded into ``f`` (score centering sees it exactly); a
    sequence-level rule drops whole sequences. ``band(rule) = (lo, hi)``: the statistic is kept iff it lies in it.

    Attributes:
        per_sequence: ``rule -> bool``.
        token_keep: ``(log_r [N] unclamped, rule, corr) -> [N] bool``.
        sequence_drop: ``(log_r [N] unclamped, seg, rule, corr) -> [num] bool``.
    """

    name: str
    per_sequence: Callable
    token_keep: Callable
    sequence_drop: Callable


def _kl_band(rule) -> tuple[float, float]:
    return tuple(rule.threshold) if isinstance(rule.threshold, tuple) else (-math.inf, rule.threshold)


def _in_band(x, band) -> Tensor:
    return (x >= band[0]) & (x <= band[1])


def _clamped(lr: Tensor, corr) -> Tensor:
    return lr.clamp(-corr.max_log_ratio, corr.max_log_ratio)


REJECTION_KINDS: dict[str, RejectionKind] = {
    k.name: k
    for k in (
        RejectionKind(
            "kl",
            per_sequence=lambda rule: KL_LEVELS[rule.level].per_sequence,
            token_keep=lambda lr, rule, corr: _in_band(ESTIMATORS[rule.estimator].fast(_clamped(lr, corr)),
                                                       _kl_band(rule)),
            sequence_drop=lambda lr, seg, rule, corr: ~_in_band(
                KL_LEVELS[rule.level].fast(ESTIMATORS[rule.estimator].fast(_clamped(lr, corr)), seg), _kl_band(rule)),
        ),
        RejectionKind(
            "ratio",
            per_sequence=lambda rule: LEVELS[rule.level].per_sequence,
            token_keep=lambda lr, rule, corr: _in_band(lr, (log_bound(rule.lower), log_bound(rule.upper))),
            sequence_drop=lambda lr, seg, rule, corr: ~_in_band(LEVELS[rule.level].fast(lr, seg),
                                                                (log_bound(rule.lower), log_bound(rule.upper))),
        ),
    )
}


# ---------------------------------------------------------------------------------------------------------------
# Surrogates: what the weight multiplies, docs/spec.md#decoupled-ppo
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Surrogate:
    """The per-token objective the weight multiplies.

    Attributes:
        applies: ``corr -> bool``.
        fast: ``(logp_y [N] differentiable, prox [N] detached, adv [N], seg, corr) -> [N]`` the surrogate ``s_t``
            whose ``-w_t s_t`` is the token loss (``seg``: the sequences, None without ``seq_ids``). None for the
            score-function term ``A_t log p(y_t)``, which the pipeline forms itself (it adds score centering).
        centerable: score centering may be combined with it (it is of the form ``w log p``).
        needs_proximal: needs ``proximal_logprobs``.
        needs_sequences: needs ``seq_ids``.
        proximal_optional: takes ``proximal_logprobs`` or goes without (then ``prox`` is the sampler's ``lq``).
        log_u_kinks: ``corr -> [float]``, values of each token's ``log u = log p - log pi_prox`` where the
            surrogate's gradient jumps (the test kit keeps examples off them); None for none beyond PPO's clip.
    """

    name: str
    applies: Callable
    fast: Callable | None
    centerable: bool
    needs_proximal: bool
    needs_sequences: bool = False
    source: str = ""
    proximal_optional: bool = False
    log_u_kinks: Callable | None = None


def _clip_fast(ratio: Tensor, adv: Tensor, corr) -> Tensor:
    """``min(min(ratio, delta) A, clip(ratio, 1 - eps_lo, 1 + eps_hi) A)``, and with a dual clip ``c`` the result
    is bounded below by ``c A`` where ``A < 0``."""
    eps_lo, eps_hi = corr.ppo_clip
    unclipped = ratio if corr.ppo_delta is None else ratio.clamp(max=corr.ppo_delta)
    s = torch.minimum(unclipped * adv, ratio.clamp(1.0 - eps_lo, 1.0 + eps_hi) * adv)
    if corr.dual_clip is not None:
        s = torch.where(adv < 0, torch.maximum(s, corr.dual_clip * adv), s)
    return s


def _ppo_fast(logp_y, prox, adv, seg, corr):
    u = torch.exp((logp_y - prox).clamp(-corr.max_log_ratio, corr.max_log_ratio))
    return _clip_fast(u, adv, corr)


def _gspo_token_fast(logp_y, prox, adv, seg, corr):
    # s_{i,t} = sg(s_i) p_t / sg(p_t): the value of GSPO's sequence ratio s_i = exp(mean_t log(p_t / pi_prox_t)),
    # the gradient of token t's own log-probability. Untrained tokens are zeroed first (they may hold -inf).
    zero = torch.zeros_like(logp_y)
    lp = torch.where(seg.active, logp_y, zero)
    log_s = seg.broadcast(seg.mean(torch.where(seg.active, lp.detach() - prox, zero)))
    ratio = torch.exp((log_s + lp - lp.detach()).clamp(-corr.max_log_ratio, corr.max_log_ratio))
    return _clip_fast(ratio, adv, corr)


def _cispo_fast(logp_y, prox, adv, seg, corr):
    # sg(clamp(u, lo, hi)) A log p(y): the clipped ratio is a stop-gradient coefficient on REINFORCE.
    lo, hi = corr.cispo
    coef = torch.exp((logp_y.detach() - prox).clamp(-corr.max_log_ratio, corr.max_log_ratio)).clamp(lo, hi)
    return torch.where(coef != 0, coef * adv * logp_y, torch.zeros_like(logp_y))


def _sapo_fast(logp_y, prox, adv, seg, corr):
    # 4/tau sigmoid(tau (u - 1)) A, tau by the sign of A: the gate's slope at u = 1 is 1, so the gradient there is
    # A grad log p (REINFORCE); away from u = 1 it decays smoothly instead of PPO's hard cut.
    tau_pos, tau_neg = corr.sapo
    u = torch.exp((logp_y - prox).clamp(-corr.max_log_ratio, corr.max_log_ratio))
    tau = torch.where(adv > 0, torch.full_like(u, tau_pos), torch.full_like(u, tau_neg))
    return torch.sigmoid(tau * (u - 1)) * (4.0 / tau) * adv


#: VESPO's floor on the sequence log-ratio, log(1e-8) (TRL 1.16 ``get_gamma_weights``, from the paper's code).
VESPO_LOG_W_MIN = math.log(1e-8)


def _vespo_fast(logp_y, prox, adv, seg, corr):
    # sg(phi(W_i)) A log p, phi(W) = exp(lam + k log W - lam W) (= 1 at W = 1), W_i = prod_t u_t of the sequence,
    # k and lam by the sign of A (A >= 0: the positive pair).
    k_pos, lam_pos, k_neg, lam_neg = corr.vespo
    zero = torch.zeros_like(logp_y)
    lu = torch.where(seg.active, (logp_y.detach() - prox).clamp(-corr.max_log_ratio, corr.max_log_ratio), zero)
    log_w = seg.broadcast(seg.sum(lu)).clamp(VESPO_LOG_W_MIN, corr.max_log_ratio)
    pos = adv >= 0
    k = torch.where(pos, torch.full_like(lu, k_pos), torch.full_like(lu, k_neg))
    lam = torch.where(pos, torch.full_like(lu, lam_pos), torch.full_like(lu, lam_neg))
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return torch.where(phi != 0, phi * adv * torch.where(seg.active, logp_y, zero), zero)


def _gmpo_fast(logp_y, prox, adv, seg, corr):
    # A_t exp(mean_{t' in i} l_t'), l = sgn(A) min(sgn(A) log u, sgn(A) clip(log u, -eps_lo, eps_hi)): PPO's
    # pessimistic clip in log space, inside the sequence's geometric mean (differentiable through every token).
    if seg.group is not None:
        raise ValueError("Correction.gmpo under cp_group is not supported: its geometric mean is differentiated "
                         "through every token of the sequence, which the context-parallel reductions are not")
    eps_lo, eps_hi = corr.gmpo
    zero = torch.zeros_like(logp_y)
    lu = (torch.where(seg.active, logp_y, zero) - prox).clamp(-corr.max_log_ratio, corr.max_log_ratio)
    sgn = torch.sign(adv)
    lmin = sgn * torch.minimum(sgn * lu, sgn * lu.clamp(-eps_lo, eps_hi))
    count = seg.partial_sum(torch.ones_like(lu)).clamp_min(1)
    return adv * torch.exp(seg.broadcast(seg.partial_sum(lmin) / count))


#: The Correction fields that each select a surrogate other than the score function (at most one may be set).
SURROGATE_FIELDS = ("ppo_clip", "cispo", "sapo", "vespo", "gmpo")


def _clipped_ratio(corr) -> bool:
    return corr.ppo_clip is not None


def _trust_region_surrogate(corr) -> bool:
    tr = corr.trust_region
    return tr is not None and tr.on == "update" and all(getattr(corr, f) is None for f in SURROGATE_FIELDS)


def _ratio_fast(logp_y, prox, adv, seg, corr):
    # u A with u = p / p_ref (the proximal policy, or the sampler); the trust region's mask zeroes w elsewhere.
    return torch.exp((logp_y - prox).clamp(-corr.max_log_ratio, corr.max_log_ratio)) * adv



SURROGATES: dict[str, Surrogate] = {
    s.name: s
    for s in (
        Surrogate("score_function", applies=lambda corr: all(getattr(corr, f) is None for f in SURROGATE_FIELDS)
                  and not _trust_region_surrogate(corr), fast=None,
                  centerable=True, needs_proximal=False, source="REINFORCE: A_t log p(y_t)"),
        Surrogate("ppo", applies=lambda corr: _clipped_ratio(corr) and corr.dual_clip is None
                  and corr.ppo_ratio == "token",
                  fast=_ppo_fast, centerable=False, needs_proximal=True,
                  source="decoupled PPO: min(u A, clip(u, 1 - eps_lo, 1 + eps_hi) A), u = p / pi_prox; ppo_delta "
                         "caps u in the unclipped branch (TRL's two-sided clipping)"),
        Surrogate("ppo_dual_clip", applies=lambda corr: _clipped_ratio(corr) and corr.dual_clip is not None
                  and corr.ppo_ratio == "token",
                  fast=_ppo_fast, centerable=False, needs_proximal=True,
                  source="dual-clip PPO (Ye et al. 2020, verl clip_ratio_c, slime eps_clip_c): A < 0 bounds the "
                         "surrogate below by c A"),
        Surrogate("gspo_token", applies=lambda corr: _clipped_ratio(corr) and corr.ppo_ratio == "gspo_token",
                  fast=_gspo_token_fast, centerable=False, needs_proximal=True,
                  needs_sequences=True,
                  source="GSPO-token (Zheng et al. 2025): sequence ratio exp(mean_t log(p / pi_prox)) in value, "
                         "token-level gradient, clipped like PPO"),
        Surrogate("cispo", applies=lambda corr: corr.cispo is not None, fast=_cispo_fast,
                  centerable=False, needs_proximal=True,
                  source="CISPO (MiniMax-M1 arXiv 2506.13585; TRL loss_type='cispo', slime): "
                         "sg(clamp(u, lo, hi)) A log p"),
        Surrogate("trust_region", applies=_trust_region_surrogate, fast=_ratio_fast,
                  centerable=False, needs_proximal=False, proximal_optional=True,
                  source="DPPO (arXiv 2602.04879): the ratio u A, u = p / pi_prox (p / q without a proximal), "
                         "under a trust-region mask instead of PPO's clip"),
        Surrogate("sapo", applies=lambda corr: corr.sapo is not None, fast=_sapo_fast,
                  centerable=False, needs_proximal=True,
                  source="SAPO (Soft Adaptive Policy Optimization, arXiv 2511.20347; TRL loss_type='sapo'): "
                         "4/tau sigmoid(tau (u - 1)) A"),
        Surrogate("vespo", applies=lambda corr: corr.vespo is not None, fast=_vespo_fast,
                  centerable=False, needs_proximal=True, needs_sequences=True,
                  source="VESPO (arXiv 2602.10693; TRL loss_type='vespo', get_gamma_weights): "
                         "sg(phi(prod_t u_t)) A log p, phi(W) = exp(lam + k log W - lam W)"),
        Surrogate("gmpo", applies=lambda corr: corr.gmpo is not None, fast=_gmpo_fast,
                  centerable=False, needs_proximal=True, needs_sequences=True,
                  log_u_kinks=lambda corr: [-corr.gmpo[0], corr.gmpo[1]],
                  source="GMPO (Zhao et al. 2025, arXiv 2507.20673; verl policy_loss 'geo_mean'): A exp(mean_t "
                         "clip-min of log u in [-eps_lo, eps_hi])"),
    )
}


def surrogate_of(corr) -> Surrogate:
    """The one surrogate the correction selects (the last entry that applies wins: the default applies always)."""
    chosen = [s for s in SURROGATES.values() if s.applies(corr)]
    if len(chosen) != 1:
        raise ValueError(f"the correction selects {len(chosen)} surrogates ({[s.name for s in chosen]}); expected one")
    return chosen[0]


# ---------------------------------------------------------------------------------------------------------------
# Normalisations: a batch constant applied to the weights, docs/spec.md#batch-normalization
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Normalisation:
    """Divides the kept weights by their batch mean (and the centering coefficients alike, so drift stays zero).

    Attributes:
        applies: ``corr -> bool``.
        fast: ``(w [N], sel [N] bool, seg) -> (numerator, denominator)`` scalars whose ratio is the mean to divide
            by; the pipeline all-reduces both over the context-parallel group.
        needs_sequences: needs ``seq_ids``.
    """

    name: str
    applies: Callable
    fast: Callable
    needs_sequences: bool = False
    source: str = ""


def _sequence_mean_fast(w: Tensor, sel: Tensor, seg) -> tuple[Tensor, Tensor]:
    # Per-sequence mean of the kept weights, then (sum over sequences with a kept token, their count). Under a
    # context-parallel group the per-sequence sums are already global; the pipeline's extra sum over the group
    # scales numerator and denominator alike.
    kept_w = seg.sum(torch.where(sel, w, torch.zeros_like(w)))
    count = seg.sum(sel.to(w.dtype))
    has = count > 0
    means = torch.where(has, kept_w / count.clamp_min(1), torch.zeros_like(kept_w))
    return means.sum(), has.sum().to(w.dtype)


NORMALISATIONS: dict[str, Normalisation] = {
    n.name: n
    for n in (
        Normalisation(
            "tokens",
            applies=lambda corr: corr.batch_normalize in (True, "tokens"),
            fast=lambda w, sel, seg: (torch.where(sel, w, torch.zeros_like(w)).sum(), sel.sum().to(w.dtype)),
            source="the mean weight over the batch's kept trained tokens",
        ),
        Normalisation(
            "sequences",
            applies=lambda corr: corr.batch_normalize == "sequences",
            fast=_sequence_mean_fast,
            needs_sequences=True,
            source="the mean over sequences of each sequence's mean kept weight (verl's sequence-level batch "
                   "normalisation; one weight per sequence at the sequence levels)",
        ),
    )
}


def normalisation_of(corr) -> Normalisation | None:
    """The normalisation the correction selects, or None."""
    chosen = [n for n in NORMALISATIONS.values() if n.applies(corr)]
    return chosen[0] if chosen else None
