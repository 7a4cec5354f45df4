"""Surrogate nodes: the per-token objective ``s_t`` the weight multiplies, ``loss_t = -w_t s_t``
(docs/spec.md#decoupled-ppo, #sapo, #vespo, #gmpo, #trust-region).

:class:`ScoreFunction` is ``A_t log p(y_t)``, which the pipeline forms itself (it adds score centering); every
other surrogate's ``fast(logp_y, prox, adv, seg, max_log_ratio) -> [N]`` takes the differentiable ``[N]``
``log p(y_t)``, the detached ``[N]`` proximal log-probabilities (the sampler's for a surrogate that goes without),
the advantages and the Segments (None without ``seq_ids``). Traits (class attributes): ``centerable`` (of the form
``w log p``, so score centering applies), ``needs_proximal``, ``needs_sequences``, ``proximal_optional``,
``takes_trust_region``; ``jumps()`` gives the values of ``log u = log p - log pi_prox`` where the gradient jumps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Union

import torch
from torch import Tensor

from offpolicy.corrections.node import Keyword, Jump, NodeError, check, finite

#: VESPO's floor on the sequence log-ratio, log(1e-8) (TRL 1.16 ``get_gamma_weights``, from the paper's code).
VESPO_LOG_W_MIN = math.log(1e-8)


def _u(logp_y: Tensor, prox: Tensor, max_log_ratio: float) -> Tensor:
    return torch.exp((logp_y - prox).clamp(-max_log_ratio, max_log_ratio))


@dataclass(frozen=True)
class _Surrogate:
    name: ClassVar[str]
    centerable: ClassVar[bool] = False
    needs_proximal: ClassVar[bool] = True
    needs_sequences: ClassVar[bool] = False
    proximal_optional: ClassVar[bool] = False
    takes_trust_region: ClassVar[bool] = True
    anchor: ClassVar[str] = "docs/spec.md#decoupled-ppo"
    source: ClassVar[str] = ""

    def jumps(self) -> tuple[Jump, ...]:
        return ()


@dataclass(frozen=True)
class ScoreFunction(_Surrogate):
    """REINFORCE: ``A_t log p(y_t)`` (formed by the pipeline, with score centering when asked)."""

    keywords: ClassVar[tuple[Keyword, ...]] = ()
    table_form: ClassVar[str] = '(no surrogate keyword)'
    inputs: ClassVar[tuple[str, ...]] = ()
    table_traits: ClassVar[str] = '`centerable`'

    name: ClassVar[str] = "score_function"
    centerable: ClassVar[bool] = True
    needs_proximal: ClassVar[bool] = False
    anchor: ClassVar[str] = "docs/spec.md#score-centering"
    source: ClassVar[str] = "REINFORCE: A_t log p(y_t)"
    fast: ClassVar[None] = None


@dataclass(frozen=True)
class PPO(_Surrogate):
    """Decoupled PPO: ``min(min(u, delta) A, clip(u, 1 - eps_lo, 1 + eps_hi) A)`` with ``u = p / pi_prox``;
    ``dual_clip=c > 1`` bounds it below by ``c A`` where ``A < 0``; ``ratio="gspo_token"`` clips GSPO's sequence
    ratio ``exp(mean_t log u_t)`` in value with each token's own gradient (needs ``seq_ids``)."""

    keywords: ClassVar[tuple[Keyword, ...]] = (Keyword("ppo_clip", ("eps_lo", "eps_hi"), "pair"),
                                           Keyword("dual_clip", ("dual_clip",), role="modifier"),
                                           Keyword("ppo_delta", ("delta",), role="modifier"),
                                           Keyword("ppo_ratio", ("ratio",), "string", "token", "modifier",
                                                   choices=("token", "gspo_token")))
    inputs: ClassVar[tuple[str, ...]] = ('proximal_logprobs',)
    table_traits: ClassVar[str] = '`needs_proximal`; `needs_sequences` for `gspo_token`'

    eps_lo: float
    eps_hi: float
    dual_clip: float | None = None
    delta: float | None = None
    ratio: str = "token"
    expects: ClassVar[str] = "with eps_lo in [0, 1) and eps_hi >= 0, finite"
    source: ClassVar[str] = ("decoupled PPO: min(u A, clip(u, 1 - eps_lo, 1 + eps_hi) A), u = p / pi_prox; dual clip "
                             "(Ye et al. 2020, verl clip_ratio_c); delta caps u (TRL); GSPO-token (Zheng et al. 2025)")

    def __post_init__(self) -> None:
        check("PPO", "eps_lo", finite(self.eps_lo) and 0.0 <= self.eps_lo < 1.0, "in [0, 1)", self.eps_lo)
        check("PPO", "eps_hi", finite(self.eps_hi) and self.eps_hi >= 0.0, "a finite number >= 0", self.eps_hi)
        for arg in ("dual_clip", "delta"):
            val = getattr(self, arg)
            check("PPO", arg, val is None or (finite(val) and val > 1), "a finite number > 1", val)
        check("PPO", "ratio", self.ratio in ("token", "gspo_token"), "'token' or 'gspo_token'", self.ratio)

    @property
    def name(self) -> str:  # type: ignore[override]
        """``"gspo_token"``, ``"ppo_dual_clip"`` or ``"ppo"``."""
        return "gspo_token" if self.ratio == "gspo_token" else "ppo_dual_clip" if self.dual_clip else "ppo"

    @property
    def needs_sequences(self) -> bool:  # type: ignore[override]
        return self.ratio == "gspo_token"

    def clip(self, ratio: Tensor, adv: Tensor) -> Tensor:
        """``min(min(ratio, delta) A, clip(ratio, 1 - eps_lo, 1 + eps_hi) A)``, bounded below by ``c A`` where
        ``A < 0`` under a dual clip."""
        unclipped = ratio if self.delta is None else ratio.clamp(max=self.delta)
        s = torch.minimum(unclipped * adv, ratio.clamp(1.0 - self.eps_lo, 1.0 + self.eps_hi) * adv)
        if self.dual_clip is not None:
            s = torch.where(adv < 0, torch.maximum(s, self.dual_clip * adv), s)
        return s

    def fast(self, logp_y: Tensor, prox: Tensor, adv: Tensor, seg, max_log_ratio: float) -> Tensor:
        if self.ratio == "token":
            return self.clip(_u(logp_y, prox, max_log_ratio), adv)
        # s_{i,t} = sg(s_i) p_t / sg(p_t): the value of GSPO's sequence ratio s_i = exp(mean_t log(p_t / pi_prox_t)),
        # the gradient of token t's own log-probability. Untrained tokens are zeroed first (they may hold -inf).
        zero = torch.zeros_like(logp_y)
        lp = torch.where(seg.active, logp_y, zero)
        log_s = seg.broadcast(seg.mean(torch.where(seg.active, lp.detach() - prox, zero)))
        return self.clip(torch.exp((log_s + lp - lp.detach()).clamp(-max_log_ratio, max_log_ratio)), adv)

    def jumps(self) -> tuple[Jump, ...]:
        at = [math.log(1 - self.eps_lo), math.log(1 + self.eps_hi)]
        at += [math.log(c) for c in (self.delta, self.dual_clip) if c is not None]
        return (Jump("log_u", tuple(at), "geometric" if self.ratio == "gspo_token" else "token"),)


@dataclass(frozen=True)
class CISPO(_Surrogate):
    """``sg(clamp(u, lo, hi)) A log p``: the clipped ratio as a stop-gradient coefficient on REINFORCE (TRL:
    ``(0, epsilon_high)``; slime: ``(1 - eps_clip, 1 + eps_clip_high)``)."""

    keywords: ClassVar[tuple[Keyword, ...]] = (Keyword("cispo", ("lo", "hi"), "pair"),)
    inputs: ClassVar[tuple[str, ...]] = ('proximal_logprobs',)
    table_traits: ClassVar[str] = '`needs_proximal`'

    lo: float
    hi: float
    expects: ClassVar[str] = "with 0 <= lo < hi < inf"
    name: ClassVar[str] = "cispo"
    source: ClassVar[str] = "CISPO (MiniMax-M1 arXiv 2506.13585; TRL loss_type='cispo', slime): sg(clamp(u, lo, hi)) A log p"

    def __post_init__(self) -> None:
        if not (finite(self.lo) and finite(self.hi) and 0.0 <= self.lo < self.hi):
            raise NodeError("CISPO", "lo", f"and hi must satisfy 0 <= lo < hi < inf, got ({self.lo!r}, {self.hi!r})")

    def fast(self, logp_y: Tensor, prox: Tensor, adv: Tensor, seg, max_log_ratio: float) -> Tensor:
        coef = _u(logp_y.detach(), prox, max_log_ratio).clamp(self.lo, self.hi)
        return torch.where(coef != 0, coef * adv * logp_y, torch.zeros_like(logp_y))


@dataclass(frozen=True)
class SAPO(_Surrogate):
    """SAPO's soft gate ``4/tau sigmoid(tau (u - 1)) A``, ``tau`` by the sign of ``A`` (TRL: ``(1.0, 1.05)``).
    ``level="sequence"`` (TRL's and AReaL's ``importance_sampling_level="sequence"``) gates the sequence's
    geometric-mean ratio ``s_i = exp(mean_t log u_t)`` over its trained tokens instead of ``u_t``, differentiated
    through every token of the sequence (needs ``seq_ids``; refused under ``cp_group``)."""

    keywords: ClassVar[tuple[Keyword, ...]] = (Keyword("sapo", ("tau_pos", "tau_neg"), "pair"),
                                           Keyword("sapo_level", ("level",), "string", "token", "modifier",
                                                   choices=("token", "sequence")))
    inputs: ClassVar[tuple[str, ...]] = ('proximal_logprobs',)
    table_traits: ClassVar[str] = ('`needs_proximal`, not `takes_trust_region`; `needs_sequences` for '
                                   '`sapo_level="sequence"`')

    tau_pos: float
    tau_neg: float
    level: str = "token"
    expects: ClassVar[str] = "with finite temperatures > 0"
    name: ClassVar[str] = "sapo"
    takes_trust_region: ClassVar[bool] = False
    anchor: ClassVar[str] = "docs/spec.md#sapo"
    source: ClassVar[str] = ("SAPO (Soft Adaptive Policy Optimization, arXiv 2511.20347; TRL loss_type='sapo', with "
                             "importance_sampling_level='sequence' the gate of exp(mean_t log u_t)): "
                             "4/tau sigmoid(tau (u - 1)) A")

    def __post_init__(self) -> None:
        for arg in ("tau_pos", "tau_neg"):
            check("SAPO", arg, finite(getattr(self, arg)) and getattr(self, arg) > 0, "a finite number > 0",
                  getattr(self, arg))
        check("SAPO", "level", self.level in ("token", "sequence"), "'token' or 'sequence'", self.level)

    @property
    def needs_sequences(self) -> bool:  # type: ignore[override]
        return self.level == "sequence"

    def fast(self, logp_y: Tensor, prox: Tensor, adv: Tensor, seg, max_log_ratio: float) -> Tensor:
        # The gate's slope at u = 1 is 1: the gradient there is A grad log p; away from it it decays smoothly.
        if self.level == "token":
            u = _u(logp_y, prox, max_log_ratio)
        else:
            if seg.group is not None:
                raise ValueError("Correction.sapo_level='sequence' under cp_group is not supported: its geometric "
                                 "mean is differentiated through every token of the sequence, which the "
                                 "context-parallel reductions are not")
            lu = (torch.where(seg.active, logp_y, torch.zeros_like(logp_y)) - prox).clamp(-max_log_ratio,
                                                                                          max_log_ratio)
            count = seg.partial_sum(torch.ones_like(lu)).clamp_min(1)
            u = torch.exp(seg.broadcast(seg.partial_sum(lu) / count))
        tau = torch.where(adv > 0, torch.full_like(u, self.tau_pos), torch.full_like(u, self.tau_neg))
        return torch.sigmoid(tau * (u - 1)) * (4.0 / tau) * adv


@dataclass(frozen=True)
class VESPO(_Surrogate):
    """``sg(phi(W)) A log p`` with VESPO's gamma weight ``phi(W) = exp(lam + k log W - lam W)`` of the sequence's
    ``W = prod_t u_t``, ``(k, lam)`` by the sign of ``A`` (TRL: ``(2, 3, 3, 2)``; needs ``seq_ids``)."""

    keywords: ClassVar[tuple[Keyword, ...]] = (Keyword("vespo", ("k_pos", "lam_pos", "k_neg", "lam_neg"), "four"),)
    inputs: ClassVar[tuple[str, ...]] = ('proximal_logprobs', 'seq_ids')
    table_traits: ClassVar[str] = '`needs_proximal`, `needs_sequences`, not `takes_trust_region`'

    k_pos: float
    lam_pos: float
    k_neg: float
    lam_neg: float
    expects: ClassVar[str] = "finite with k >= 0 and lam > 0"
    name: ClassVar[str] = "vespo"
    needs_sequences: ClassVar[bool] = True
    takes_trust_region: ClassVar[bool] = False
    anchor: ClassVar[str] = "docs/spec.md#vespo"
    source: ClassVar[str] = ("VESPO (arXiv 2602.10693; TRL loss_type='vespo', get_gamma_weights): "
                             "sg(phi(prod_t u_t)) A log p, phi(W) = exp(lam + k log W - lam W)")

    def __post_init__(self) -> None:
        for arg in ("k_pos", "k_neg"):
            check("VESPO", arg, finite(getattr(self, arg)) and getattr(self, arg) >= 0, "a finite number >= 0",
                  getattr(self, arg))
        for arg in ("lam_pos", "lam_neg"):
            check("VESPO", arg, finite(getattr(self, arg)) and getattr(self, arg) > 0, "a finite number > 0",
                  getattr(self, arg))

    def fast(self, logp_y: Tensor, prox: Tensor, adv: Tensor, seg, max_log_ratio: float) -> Tensor:
        zero = torch.zeros_like(logp_y)
        lu = torch.where(seg.active, (logp_y.detach() - prox).clamp(-max_log_ratio, max_log_ratio), zero)
        log_w = seg.broadcast(seg.sum(lu)).clamp(VESPO_LOG_W_MIN, max_log_ratio)
        pos = adv >= 0
        k = torch.where(pos, torch.full_like(lu, self.k_pos), torch.full_like(lu, self.k_neg))
        lam = torch.where(pos, torch.full_like(lu, self.lam_pos), torch.full_like(lu, self.lam_neg))
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        return torch.where(phi != 0, phi * adv * torch.where(seg.active, logp_y, zero), zero)


@dataclass(frozen=True)
class GMPO(_Surrogate):
    """GMPO's ``A exp(mean_t l_t)``, ``l = sgn(A) min(sgn(A) log u, sgn(A) clip(log u, -eps_lo, eps_hi))``: PPO's
    pessimistic clip in log space inside the sequence's geometric mean (needs ``seq_ids``; the paper: 0.4, 0.4)."""

    keywords: ClassVar[tuple[Keyword, ...]] = (Keyword("gmpo", ("eps_lo", "eps_hi"), "pair"),)
    inputs: ClassVar[tuple[str, ...]] = ('proximal_logprobs', 'seq_ids')
    table_traits: ClassVar[str] = '`needs_proximal`, `needs_sequences`, not `takes_trust_region`'

    eps_lo: float
    eps_hi: float
    expects: ClassVar[str] = "finite and >= 0"
    name: ClassVar[str] = "gmpo"
    needs_sequences: ClassVar[bool] = True
    takes_trust_region: ClassVar[bool] = False
    anchor: ClassVar[str] = "docs/spec.md#gmpo"
    source: ClassVar[str] = ("GMPO (Zhao et al. 2025, arXiv 2507.20673; verl policy_loss 'geo_mean'): A exp(mean_t "
                             "clip-min of log u in [-eps_lo, eps_hi])")

    def __post_init__(self) -> None:
        for arg in ("eps_lo", "eps_hi"):
            check("GMPO", arg, finite(getattr(self, arg)) and getattr(self, arg) >= 0, "a finite number >= 0",
                  getattr(self, arg))

    def fast(self, logp_y: Tensor, prox: Tensor, adv: Tensor, seg, max_log_ratio: float) -> Tensor:
        if seg.group is not None:
            raise ValueError("Correction.gmpo under cp_group is not supported: its geometric mean is differentiated "
                             "through every token of the sequence, which the context-parallel reductions are not")
        zero = torch.zeros_like(logp_y)
        lu = (torch.where(seg.active, logp_y, zero) - prox).clamp(-max_log_ratio, max_log_ratio)
        sgn = torch.sign(adv)
        lmin = sgn * torch.minimum(sgn * lu, sgn * lu.clamp(-self.eps_lo, self.eps_hi))
        count = seg.partial_sum(torch.ones_like(lu)).clamp_min(1)
        return adv * torch.exp(seg.broadcast(seg.partial_sum(lmin) / count))

    def jumps(self) -> tuple[Jump, ...]:
        return (Jump("log_u", (-self.eps_lo, self.eps_hi)),)


@dataclass(frozen=True)
class RatioSurrogate(_Surrogate):
    """DPPO's ``u A``, ``u = p / pi_prox`` (``p / q`` without a proximal policy), under a trust region's mask
    (``TrustRegion(on="update")``) instead of PPO's clip."""

    keywords: ClassVar[tuple[Keyword, ...]] = ()
    table_form: ClassVar[str] = '`trust_region=TrustRegion(on="update")` without another surrogate'
    inputs: ClassVar[tuple[str, ...]] = ()
    table_traits: ClassVar[str] = '`proximal_optional`'

    name: ClassVar[str] = "trust_region"
    needs_proximal: ClassVar[bool] = False
    proximal_optional: ClassVar[bool] = True
    anchor: ClassVar[str] = "docs/spec.md#trust-region"
    source: ClassVar[str] = ("DPPO (arXiv 2602.04879): the ratio u A, u = p / pi_prox (p / q without a proximal), "
                             "under a trust-region mask instead of PPO's clip")

    def fast(self, logp_y: Tensor, prox: Tensor, adv: Tensor, seg, max_log_ratio: float) -> Tensor:
        return _u(logp_y, prox, max_log_ratio) * adv


@dataclass(frozen=True)
class TOPR(_Surrogate):
    """Tapered off-policy REINFORCE: ``positive A log p`` where ``A >= 0`` (SFT-like, no ratio) and
    ``negative sg(clamp(u, 0, 1)) A log p`` where ``A < 0``, ``u = p / pi_old`` (the proximal policy, the sampler
    without one): the weight depends on the advantage's sign (ROLL ``pg_variant="topr"``)."""

    positive: float = 1.0
    negative: float = 1.0
    expects: ClassVar[str] = "finite and >= 0"
    name: ClassVar[str] = "topr"
    needs_proximal: ClassVar[bool] = False
    proximal_optional: ClassVar[bool] = True
    takes_trust_region: ClassVar[bool] = False
    anchor: ClassVar[str] = "docs/spec.md#topr"
    source: ClassVar[str] = ("TOPR (Le Roux et al. 2025, arXiv 2503.14286; ROLL pg_variant='topr', _compute_topr_loss): "
                             "A log p for A >= 0, sg(clamp(u, 0, 1)) A log p for A < 0")
    keywords: ClassVar[tuple[Keyword, ...]] = (Keyword("topr", ("positive", "negative"), "pair"),)
    example: ClassVar[dict] = {"weights": "tis", "record": "head", "topr": (1.0, 0.8)}
    inputs: ClassVar[tuple[str, ...]] = ()
    table_traits: ClassVar[str] = "`proximal_optional`, not `takes_trust_region`"

    def __post_init__(self) -> None:
        for arg in ("positive", "negative"):
            check("TOPR", arg, finite(getattr(self, arg)) and getattr(self, arg) >= 0, "a finite number >= 0",
                  getattr(self, arg))

    def fast(self, logp_y: Tensor, prox: Tensor, adv: Tensor, seg, max_log_ratio: float) -> Tensor:
        u = _u(logp_y.detach(), prox, max_log_ratio)
        coef = torch.where(adv >= 0, torch.full_like(u, self.positive), self.negative * u.clamp(0.0, 1.0))
        return torch.where(coef != 0, coef * adv * logp_y, torch.zeros_like(logp_y))


@dataclass(frozen=True)
class KLCov(_Surrogate):
    """KL-Cov (verl ``policy_loss.loss_mode="kl_cov"``): the unclipped ratio ``u A``, ``u = p / pi_prox``, minus
    ``coef |log u|`` on the ``max(1, int(n ratio))`` kept trained tokens with the largest covariance
    ``(A_t - mean A)(log p_t - mean log p)`` over the batch's ``n`` kept trained tokens (those the trainer gives a
    nonzero probability): an entropy-collapse control on the tokens that drive it. One batch: refused under
    ``cp_group``. ``fast`` takes the kept trained tokens as ``active`` (``batch_statistic``)."""

    ratio: float = 0.0002
    coef: float = 1.0
    expects: ClassVar[str] = "with ratio in (0, 1] and coef >= 0, finite"
    name: ClassVar[str] = "kl_cov"
    takes_trust_region: ClassVar[bool] = False
    batch_statistic: ClassVar[bool] = True
    anchor: ClassVar[str] = "docs/spec.md#kl-cov"
    source: ClassVar[str] = ("KL-Cov (Cui et al. 2025, 'The Entropy Mechanism of RL for Reasoning LMs', arXiv "
                             "2505.22617; verl core_algos.py compute_policy_loss_kl_cov)")
    keywords: ClassVar[tuple[Keyword, ...]] = (Keyword("kl_cov", ("ratio", "coef"), "pair"),)
    example: ClassVar[dict] = {"weights": "tis", "record": "support", "kl_cov": (1.0, 1.0)}
    inputs: ClassVar[tuple[str, ...]] = ("proximal_logprobs",)
    table_traits: ClassVar[str] = "`needs_proximal`, `batch_statistic`, not `takes_trust_region`"

    def __post_init__(self) -> None:
        check("KLCov", "ratio", finite(self.ratio) and 0 < self.ratio <= 1, "in (0, 1]", self.ratio)
        check("KLCov", "coef", finite(self.coef) and self.coef >= 0, "a finite number >= 0", self.coef)

    def jumps(self) -> tuple[Jump, ...]:
        return (Jump("log_u", (0.0,)),)  # the kink of |log u|

    def fast(self, logp_y: Tensor, prox: Tensor, adv: Tensor, seg, max_log_ratio: float, *,
             active: Tensor) -> Tensor:
        if seg is not None and seg.group is not None:
            raise ValueError("Correction.kl_cov under cp_group is not supported: its covariance and top-k are over "
                             "the whole batch, and each rank holds only some tokens")
        lu = (logp_y - prox).clamp(-max_log_ratio, max_log_ratio)
        s = torch.exp(lu) * adv
        valid = (active & torch.isfinite(logp_y.detach())).nonzero().squeeze(1)
        if valid.numel() == 0:
            return s
        a, lp = adv[valid], logp_y.detach()[valid]
        cov = (a - a.mean()) * (lp - lp.mean())
        k = max(1, int(valid.numel() * self.ratio))
        top = torch.zeros_like(active)
        top[valid[torch.topk(cov, k).indices]] = True
        return s - torch.where(top, self.coef * lu.abs(), torch.zeros_like(lu))


@dataclass(frozen=True)
class Kimi15(_Surrogate):
    """Kimi k1.5's mirror-descent surrogate (ROLL ``pg_variant="kimi15"``): ``A log p - tau/2 (log p - log pi_old)^2``
    with ``pi_old`` the proximal policy (the sampler without one): REINFORCE with a squared penalty on the update's
    log-ratio, differentiable in both terms."""

    tau: float = 0.1
    expects: ClassVar[str] = "a finite number >= 0"
    name: ClassVar[str] = "kimi15"
    needs_proximal: ClassVar[bool] = False
    proximal_optional: ClassVar[bool] = True
    takes_trust_region: ClassVar[bool] = False
    anchor: ClassVar[str] = "docs/spec.md#kimi15"
    source: ClassVar[str] = ("Kimi k1.5 (arXiv 2501.12599, eq. 3; ROLL pg_variant='kimi15', _compute_kimi15_loss): "
                             "A log p - tau/2 (log p - log pi_old)^2")
    keywords: ClassVar[tuple[Keyword, ...]] = (Keyword("kimi15", ("tau",)),)
    example: ClassVar[dict] = {"weights": "mis", "record": "head", "kimi15": 0.1}
    inputs: ClassVar[tuple[str, ...]] = ()
    table_traits: ClassVar[str] = "`proximal_optional`, not `takes_trust_region`"

    def __post_init__(self) -> None:
        check("Kimi15", "tau", finite(self.tau) and self.tau >= 0, "a finite number >= 0", self.tau)

    def fast(self, logp_y: Tensor, prox: Tensor, adv: Tensor, seg, max_log_ratio: float) -> Tensor:
        lu = (logp_y - prox).clamp(-max_log_ratio, max_log_ratio)
        return adv * logp_y - 0.5 * self.tau * lu.square()


@dataclass(frozen=True)
class ClipCov(_Surrogate):
    """Clip-Cov (verl ``policy_loss.loss_mode="clip_cov"``): PPO's clipped surrogate
    ``min(u A, clip(u, 1 - eps_lo, 1 + eps_hi) A)``, ``u = p / pi_prox``, set to 0 (no gradient) on
    ``max(1, int(n ratio))`` tokens drawn at random among the kept trained tokens PPO leaves unclipped whose covariance
    ``(A_t - mean A)(log p_t - mean log p)`` lies strictly in ``(lb, ub)`` (means over the batch's ``n`` kept trained
    tokens with a finite ``log p``). The draw is reproducible: the candidates in token order, permuted by
    ``torch.randperm(len, generator=torch.Generator().manual_seed(seed))`` on the CPU, the first ones taken (verl
    draws with the global generator: ``torch.manual_seed(seed)`` before its call gives the same draw). A fixed
    ``seed`` repeats the draw for the same candidate count; pass a new one per step (the step number) for fresh
    draws. One batch: refused under ``cp_group``. ``fast`` takes the kept trained tokens as ``active``
    (``batch_statistic``); all ``[N]`` float tensors, ``active`` ``[N]`` bool."""

    lb: float = 1.0
    ub: float = 5.0
    ratio: float = 0.0002
    eps_lo: float = 0.2
    eps_hi: float = 0.2
    seed: int = 0
    expects: ClassVar[str] = ("with lb < ub finite, ratio in (0, 1], eps_lo in [0, 1), eps_hi >= 0 and "
                              "seed an integer >= 0")
    name: ClassVar[str] = "clip_cov"
    takes_trust_region: ClassVar[bool] = False
    batch_statistic: ClassVar[bool] = True
    anchor: ClassVar[str] = "docs/spec.md#clip-cov"
    source: ClassVar[str] = ("Clip-Cov (Cui et al. 2025, 'The Entropy Mechanism of RL for Reasoning LMs', arXiv "
                             "2505.22617; verl core_algos.py compute_policy_loss_clip_cov), with a seeded draw")
    keywords: ClassVar[tuple[Keyword, ...]] = (
        Keyword("clip_cov", ("lb", "ub"), "pair", doc="`clip_cov=(lb, ub)` or `(ratio, lb, ub)`",
                alt_args=("ratio", "lb", "ub")),
        Keyword("clip_cov_ratio", ("ratio",), "number", 0.0002, "modifier"),
        Keyword("clip_cov_eps", ("eps_lo", "eps_hi"), "pair", (0.2, 0.2), "modifier"),
        Keyword("clip_cov_seed", ("seed",), "int", 0, "modifier"))
    example: ClassVar[dict] = {"weights": "tis", "record": "head", "clip_cov": (-0.5, 5.0), "clip_cov_ratio": 0.2,
                               "clip_cov_seed": 1}
    inputs: ClassVar[tuple[str, ...]] = ("proximal_logprobs",)
    table_traits: ClassVar[str] = "`needs_proximal`, `batch_statistic`, not `takes_trust_region`"

    def __post_init__(self) -> None:
        check("ClipCov", "lb", finite(self.lb), "a finite number", self.lb)
        check("ClipCov", "ub", finite(self.ub) and self.ub > self.lb, "a finite number > lb", self.ub)
        check("ClipCov", "ratio", finite(self.ratio) and 0 < self.ratio <= 1, "in (0, 1]", self.ratio)
        check("ClipCov", "eps_lo", finite(self.eps_lo) and 0 <= self.eps_lo < 1, "in [0, 1)", self.eps_lo)
        check("ClipCov", "eps_hi", finite(self.eps_hi) and self.eps_hi >= 0, "a finite number >= 0", self.eps_hi)
        check("ClipCov", "seed", isinstance(self.seed, int) and not isinstance(self.seed, bool) and self.seed >= 0,
              "an integer >= 0", self.seed)

    def jumps(self) -> tuple[Jump, ...]:
        return (Jump("log_u", (math.log(1 - self.eps_lo), math.log(1 + self.eps_hi))),)

    def fast(self, logp_y: Tensor, prox: Tensor, adv: Tensor, seg, max_log_ratio: float, *,
             active: Tensor) -> Tensor:
        if seg is not None and seg.group is not None:
            raise ValueError("Correction.clip_cov under cp_group is not supported: its covariance and draw are over "
                             "the whole batch, and each rank holds only some tokens")
        u = torch.exp((logp_y - prox).clamp(-max_log_ratio, max_log_ratio))
        s1, s2 = u * adv, u.clamp(1.0 - self.eps_lo, 1.0 + self.eps_hi) * adv
        s = torch.minimum(s1, s2)
        valid = (active & torch.isfinite(logp_y.detach())).nonzero().squeeze(1)
        if valid.numel() == 0:
            return s
        a, lp = adv[valid], logp_y.detach()[valid]
        cov = (a - a.mean()) * (lp - lp.mean())
        unclipped = ~(s2.detach() < s1.detach())[valid]
        cand = valid[unclipped & (cov > self.lb) & (cov < self.ub)]
        k = max(1, int(valid.numel() * self.ratio))
        perm = torch.randperm(cand.numel(), generator=torch.Generator().manual_seed(self.seed))
        drop = torch.zeros_like(active)
        drop[cand[perm[:k].to(cand.device)]] = True
        return torch.where(drop, torch.zeros_like(s), s)


Surrogate = Union[ScoreFunction, PPO, CISPO, SAPO, VESPO, GMPO, RatioSurrogate, TOPR, KLCov, Kimi15, ClipCov]
SURROGATE_CLASSES: tuple[type, ...] = (ScoreFunction, PPO, CISPO, SAPO, VESPO, GMPO, RatioSurrogate, TOPR, KLCov,
                                       Kimi15, ClipCov)
