"""Property checkers: run a user's loss function against the spec's invariants, with hypothesis shrinking.

The function is reached through one adapter signature (:data:`LossFn`)::

    fn(logits, tokens, sampler_logprobs, candidates, advantages, temperature) -> token_loss

    logits            [N, V] float (LossConfig.dtype), requires_grad
    tokens            [N] int64, sampled ids
    sampler_logprobs  [N] float, lq of each token (renormalised over the support for support records)
    candidates        offpolicy.Candidates (ids [N, K] int64 with -1 padding, logprobs [N, K] with -inf padding,
                      kind "head" | "support"), or None when LossConfig.record is None
    advantages        [N] float
    temperature       float > 0: the sampling temperature; the trainer's distribution is softmax(logits / tau)
    token_loss        [N] per-token loss, unaggregated (no mean); the kit differentiates its sum; or, with
                      LossConfig(aggregation=...), the aggregated scalar loss []

Optional keywords widen what is checked: ``loss_mask`` ([N] bool, True on trained tokens; the ``masking``
invariant runs when the function takes it), ``seq_ids`` ([N] int64 packed sequence ids; needed for
``LossConfig(level="sequence" | "geometric")``, whose batches the kit packs into random sequences, and for every
other sequence-wise part of a configuration: sequence rejections, ``batch_normalize="sequences"``,
``ppo_ratio="gspo_token"``, sequence aggregations) and ``proximal_logprobs`` ([N] float ``log pi_prox(y_t)``; needed
for decoupled PPO and CISPO). The function receives each keyword only where the check uses it.

and a :class:`~offpolicy.testing.LossConfig` declaring which correction it claims. Each invariant is a property
over a hypothesis strategy from :mod:`offpolicy.testing.strategies`; a violation is shrunk to a small example
and reported with the invariant's name, the configuration and the example.

Invariants (see docs/testing_kit.md for one paragraph each):

``agreement``          loss (per token, or aggregated) and logit gradient equal offpolicy.reference's
                       (docs/spec.md#inv-head-exact, docs/spec.md#inv-autograd)
``zero_drift``         constant advantage: sum_y q(y) grad loss(y) = 0 (docs/spec.md#inv-zero-drift), when centering
                       is claimed
``plain_is_unbiased``  f(r) = r: E_q[grad loss] = E_p[grad of -A log p] (docs/spec.md#inv-plain-is), for tis / mis
``support_replay``     support records: no gradient outside S, no dependence on logits outside S
                       (docs/spec.md#inv-support)
``shift_invariance``   adding a constant to a row's logits changes nothing (docs/spec.md#inv-support)
``sampler_no_grad``    no gradient reaches sampler log-probabilities, candidate log-probabilities or advantages
``hostile_finite``     finite loss and gradient on hostile numerics (docs/spec.md#inv-hostile)
``masking``            untrained tokens contribute nothing, fully masked batches give zeros (docs/spec.md#inv-masking)
"""

from __future__ import annotations

import inspect
import math
import os
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable

import torch
from hypothesis import HealthCheck, Phase, Verbosity, assume, given, settings
from hypothesis import strategies as st
from torch import Tensor

from offpolicy.corrections import registry as reg
from offpolicy.corrections.registry import LEVELS, WEIGHT_MODES
from offpolicy.corrections.trust_region import binary_kl
from offpolicy.loss.aggregation import SEQUENCE_AGGREGATIONS
from offpolicy.records.candidates import Candidates
from offpolicy.reference import (TAIL_EPS, kl, kl_statistic, log_probs, reference_policy_loss, sequence_log_ratio,
                                 support_mask)
from offpolicy.testing.config import LossConfig
from offpolicy.testing.strategies import (
    Position,
    Problem,
    hostile_problems,
    loss_masks,
    positions,
    problems,
    temperatures,
    with_proximal,
    with_sequences,
)

LossFn = Callable[[Tensor, Tensor, Tensor, "Candidates | None", Tensor, float], Tensor]

#: Hypothesis examples per invariant unless told otherwise.
DEFAULT_MAX_EXAMPLES = 40


class InvariantViolation(AssertionError):
    """Raised by :func:`check_all` (and the pytest entries): names the invariant, the configuration, what failed
    and the shrunk example."""


class _Fail(Exception):
    """A property's failure on one example (internal; hypothesis shrinks on it)."""

    def __init__(self, what: str, example: str):
        super().__init__(what)
        self.what = what
        self.example = example


# ----------------------------------------------------------------------------------------------------------------
# Feeding the function and the reference
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class _Fed:
    """The tensors handed to the user's function (and, upcast, to the reference)."""

    logits: Tensor
    tokens: Tensor
    lq: Tensor
    cands: Candidates | None
    adv: Tensor
    tau: float
    loss_mask: Tensor | None = None
    seq_ids: Tensor | None = None
    scalar: bool = False  # the function returns the aggregated scalar, not per-token losses
    prox: Tensor | None = None  # proximal log-probabilities (decoupled PPO, CISPO)

    @property
    def loss_name(self) -> str:
        return "aggregated loss" if self.scalar else "per-token loss"

    def keywords(self) -> dict[str, Tensor]:
        """The optional keywords this call passes (only those set)."""
        kw = {"loss_mask": self.loss_mask, "seq_ids": self.seq_ids, "proximal_logprobs": self.prox}
        return {k: v for k, v in kw.items() if v is not None}

    def trained(self) -> Tensor:
        """``[N]`` bool: the tokens the loss trains."""
        n = self.tokens.shape[0]
        return torch.ones(n, dtype=torch.bool) if self.loss_mask is None else self.loss_mask


def _sampler_dtype(cfg: LossConfig) -> torch.dtype:
    # Sampler-side tensors are float32 in practice; float64 runs keep everything in float64.
    return torch.float64 if cfg.dtype == torch.float64 else torch.float32


def _feed(prob: Problem, cfg: LossConfig, logits: Tensor | None = None, sampler_grad: bool = False,
          loss_mask: Tensor | None = None) -> _Fed:
    sd = _sampler_dtype(cfg)
    z = (prob.logits if logits is None else logits).to(cfg.dtype).detach().requires_grad_()
    lq = prob.sampler_logprobs.to(sd).detach().requires_grad_(sampler_grad)
    adv = prob.advantages.to(sd).detach().requires_grad_(sampler_grad)
    cands = None
    if cfg.record is not None and prob.candidates is not None:
        clp = prob.candidates.logprobs.to(sd).detach().requires_grad_(sampler_grad)
        cands = Candidates(prob.candidates.ids.clone(), clp, prob.candidates.kind)
    seq_ids = prob.seq_ids.clone() if cfg.needs_sequences and prob.seq_ids is not None else None
    mask = None if loss_mask is None else loss_mask.clone()
    prox = None
    if cfg.needs_proximal:
        if prob.proximal_logprobs is None:
            raise ValueError("the configuration needs proximal log-probabilities: draw problems through "
                             "offpolicy.testing.strategies.with_proximal")
        prox = prob.proximal_logprobs.to(sd).detach().requires_grad_(sampler_grad)
    return _Fed(z, prob.tokens.clone(), lq, cands, adv, float(prob.temperature), mask, seq_ids,
                cfg.aggregation is not None, prox)


def _call(fn: LossFn, fed: _Fed, example: str) -> Tensor:
    """Run the user's function; a wrong type or shape, or an exception, is a failure of the example."""
    n = fed.tokens.shape[0]
    want, shape = ("a scalar [] tensor (LossConfig.aggregation is set)", ()) if fed.scalar else (
        f"a [N] = [{n}] tensor", (n,))
    try:
        out = fn(fed.logits, fed.tokens, fed.lq, fed.cands, fed.adv, fed.tau, **fed.keywords())
    except Exception as exc:  # the user's code failed on a valid input: report it with the example
        raise _Fail(f"the loss function raised {type(exc).__name__}: {exc}", example) from exc
    if not isinstance(out, Tensor):
        raise _Fail(f"the loss function returned {type(out).__name__}, expected {want}", example)
    if tuple(out.shape) != shape:
        expected = "a scalar (LossConfig.aggregation is set)" if fed.scalar else f"per-token [N] = [{n}]"
        raise _Fail(f"the loss function returned shape {tuple(out.shape)}, expected {expected}", example)
    return out


def _grads(out: Tensor, wrt: Iterable[Tensor], example: str) -> list[Tensor | None]:
    """Gradients of ``out.sum()`` (None where a tensor is unused or nothing is differentiable)."""
    wrt = list(wrt)
    if not out.requires_grad:
        return [None] * len(wrt)
    try:
        return list(torch.autograd.grad(out.sum(), wrt, allow_unused=True))
    except Exception as exc:  # a custom backward of the user's failed
        raise _Fail(f"the backward of the loss raised {type(exc).__name__}: {exc}", example) from exc


def _logit_grad(out: Tensor, fed: _Fed, example: str) -> Tensor:
    (g,) = _grads(out, [fed.logits], example)
    return torch.zeros_like(fed.logits, dtype=torch.float64) if g is None else g.double()


def _reference(fed: _Fed, cfg: LossConfig) -> tuple[Tensor, Tensor]:
    """``(token_loss [N], d sum(token_loss) / d logits [N, V])`` of the float64 oracle, or ``(loss [], d loss /
    d logits)`` for an aggregated configuration."""
    z = fed.logits.detach().double().requires_grad_()
    cands = None if fed.cands is None else Candidates(fed.cands.ids, fed.cands.logprobs.detach().double(),
                                                       fed.cands.kind)
    agg = cfg.aggregation or "constant"
    loss, token_loss, _ = reference_policy_loss(
        z, fed.tokens, fed.lq.detach().double(), fed.adv.detach().double(), cands, fed.loss_mask, fed.tau,
        cfg.correction, fed.seq_ids, aggregation=agg,
        constant_normalizer=cfg.constant_normalizer if cfg.aggregation else (1.0 if agg == "constant" else None),
        proximal_logprobs=None if fed.prox is None else fed.prox.detach().double(),
    )
    (g,) = torch.autograd.grad(loss, z)
    return (loss.detach() if fed.scalar else token_loss), g


def _kl_band(rule) -> tuple[float, float]:
    """A KL rule's kept band: ``(lo, hi)`` two-sided, else ``(-inf, threshold)``."""
    return tuple(rule.threshold) if isinstance(rule.threshold, tuple) else (-math.inf, rule.threshold)


def _near_discontinuity(fed: _Fed, cfg: LossConfig) -> bool:
    """Whether a statistic the loss jumps on (in value or gradient) lies within the margin of the jump, where
    rounding alone may put it on either side:

    * the weight function's bounds (MIS / rejection) on the ratio it sees (``p / q``, or ``pi_prox / q`` under
      a proximal surrogate; each sequence's reduction at the sequence levels), on each candidate under centering
      and on the head's tail ratio;
    * token-level rejection rules (ratio bands, KL thresholds) on the same ratios;
    * sequence rules: ratio and KL bands on each sequence's statistic, the veto on its smallest ratio, OPSM on its
      mean ``lq - log p``;
    * the clipped surrogates' kinks: ``u = p / pi_prox`` (GSPO-token: the sequence's geometric ``u``) at
      ``1 - eps_lo``, ``1 + eps_hi``, the delta cap and the dual clip ``c`` (CISPO's clamp is continuous), and
      each surrogate's own ``log_u_kinks`` (GMPO's log-space clip);
    * a trust region's mask edges: the divergence of each token at ``lower`` / ``upper`` and the probability
      difference at 0 (or each sequence's summed / mean difference at ``-lower`` / ``upper``).
    """
    corr = cfg.correction
    n = fed.tokens.shape[0]
    if n == 0:
        return False
    support = fed.cands is not None and fed.cands.kind == "support"
    z = fed.logits.detach().double()
    lp = log_probs(z, fed.tau, support_mask(fed.cands, z.shape[1]) if support else None)
    trained = fed.trained()
    logp_y = lp[torch.arange(n), fed.tokens]
    lq = fed.lq.detach().double()
    prox = None if fed.prox is None else fed.prox.detach().double()
    base = logp_y if prox is None else prox
    token_log_r = torch.where(trained, base - lq, 0.0)
    seqs = []
    if fed.seq_ids is not None:
        for sid in torch.unique(fed.seq_ids).tolist():
            rows = ((fed.seq_ids == sid) & trained).nonzero().reshape(-1)
            if rows.numel():
                seqs.append(rows)
    pairs: list[tuple[Tensor, list[float]]] = []  # (statistics, the values they jump at)

    mode_jumps = ([math.log(b) for b in (corr.lower, corr.upper) if 0 < b < math.inf]
                  if WEIGHT_MODES[corr.weights].masks_outside else [])
    level = LEVELS[cfg.level]

    def token_ratio_pairs(log_r: Tensor, with_mode: bool = True) -> None:
        # The weight function and the token-level rejection rules folded into it, at log-ratios log_r.
        if with_mode:
            pairs.append((log_r, mode_jumps))
        clamped = log_r.clamp(-corr.max_log_ratio, corr.max_log_ratio)
        for rule in corr.token_rejection_rules():
            if rule.kind == "ratio":
                pairs.append((log_r, [math.log(b) for b in (rule.lower, rule.upper) if b > 0]))
            else:
                k = kl(torch.exp(clamped), rule.estimator)
                pairs.append((k, [t for t in _kl_band(rule) if math.isfinite(t)]))

    if level.per_sequence:
        pairs.append((torch.stack([sequence_log_ratio(token_log_r[idx], cfg.level) for idx in seqs]) if seqs
                      else torch.zeros(0, dtype=torch.float64), mode_jumps))
        token_ratio_pairs(token_log_r[trained], with_mode=False)
    else:
        token_ratio_pairs(token_log_r[trained])
    for _, rule in corr.rejection_rules:
        if not reg.REJECTION_KINDS[rule.kind].per_sequence(rule) or not seqs:
            continue
        if rule.kind == "ratio":
            stats = torch.stack([sequence_log_ratio(token_log_r[idx], rule.level) for idx in seqs])
            pairs.append((stats, [math.log(b) for b in (rule.lower, rule.upper) if b > 0]))
        else:
            stats = torch.stack([kl_statistic(
                kl(torch.exp(token_log_r[idx].clamp(-corr.max_log_ratio, corr.max_log_ratio)), rule.estimator),
                rule.level) for idx in seqs])
            pairs.append((stats, [t for t in _kl_band(rule) if math.isfinite(t)]))
    if corr.veto is not None and seqs:
        pairs.append((torch.stack([token_log_r[idx].min() for idx in seqs]), [math.log(corr.veto)]))
    if corr.opsm_delta is not None and seqs:
        current = torch.where(trained, logp_y - lq, 0.0)
        pairs.append((torch.stack([(-current[idx]).mean() for idx in seqs]), [corr.opsm_delta]))
    if cfg.score_centering and fed.cands is not None:
        valid = fed.cands.ids >= 0
        lpc = lp.gather(1, fed.cands.ids.clamp_min(0))
        lqc = fed.cands.logprobs.detach().double()
        token_ratio_pairs((lpc - lqc)[valid & torch.isfinite(lqc) & torch.isfinite(lpc)])
        if not support:
            p_h = torch.where(valid, lpc.exp(), torch.zeros_like(lpc)).sum(1)
            q_h = torch.where(valid, lqc.exp(), torch.zeros_like(lqc)).sum(1)
            rho = (1 - q_h).clamp_min(TAIL_EPS) / (1 - p_h).clamp_min(TAIL_EPS)
            token_ratio_pairs(-torch.log(rho))
    if corr.ppo_clip is not None and prox is not None:
        log_u = torch.where(trained, logp_y - prox, 0.0)
        if corr.ppo_ratio == "gspo_token":
            log_u = torch.stack([log_u[idx].mean() for idx in seqs]) if seqs else log_u[:0]
        else:
            log_u = log_u[trained]
        lo, hi = corr.ppo_clip
        kinks = [math.log(1 - lo), math.log(1 + hi)] if lo < 1 else [math.log(1 + hi)]
        kinks += [math.log(c) for c in (corr.ppo_delta, corr.dual_clip) if c is not None]
        pairs.append((log_u, kinks))
    if corr.trust_region is not None:
        pairs.extend(_trust_region_pairs(corr.trust_region, logp_y, lq, prox, trained, seqs))
    kinks_of = corr.surrogate.log_u_kinks
    if kinks_of is not None and prox is not None:
        pairs.append((torch.where(trained, logp_y - prox, 0.0)[trained], kinks_of(corr)))
    for stats, jumps in pairs:
        vals = stats.reshape(-1)
        vals = vals[torch.isfinite(vals)]
        if any(bool(((vals - j).abs() < cfg.margin).any()) for j in jumps):
            return True
    return False


def _trust_region_pairs(tr, logp_y: Tensor, lq: Tensor, prox: Tensor | None, trained: Tensor,
                        seqs: list) -> list[tuple[Tensor, list[float]]]:
    """``(statistic, jumps)`` of a trust region's mask (docs/spec.md#trust-region), in float64."""
    if tr.on == "update":
        num, den = logp_y, (prox if prox is not None else lq)
    else:
        num, den = (prox if prox is not None else logp_y), lq
    d = torch.where(trained, num.exp() - den.exp(), 0.0)
    if tr.per_sequence:
        stats = [d[idx].sum() if tr.level == "sequence" else d[idx].mean() for idx in seqs]
        return [(torch.stack(stats) if stats else d[:0], [-tr.lower, tr.upper])]
    kl_ref = binary_kl(den, num)
    div = {"difference": d.abs(), "binary_kl": kl_ref,
           "binary_kl_max": torch.maximum(kl_ref, binary_kl(num, den))}[tr.divergence]
    return [(div[trained], [tr.lower, tr.upper]), (d[trained], [0.0])]


def _rounding_floor(fed: _Fed, cfg: LossConfig) -> float:
    """An absolute error any correct implementation may show from rounding alone (in ``cfg.dtype``).

    Two sources, per token, summed into one bound over the batch (``u`` = unit roundoff):

    * the log-softmax of ``x = z / tau`` is good to about one ulp of ``max |x|`` per entry (``x - lse`` drops
      the bits below it, which is all of ``1 - p`` when ``p`` is within an ulp of 1); the loss and gradient
      multiply it by ``|A| (w + sum_v |c(v)|) max(1, 1 / tau)``, with ``w`` and ``m(v)`` at most the weight cap
      and ``alpha = rho f(1 / rho)`` (up to ``1 / eps`` when the tail masses hit the eps floor);
    * head records: ``1 - Q_H`` and ``1 - P_H`` are differences of sums of ``K`` terms near 1, good to ``K u``
      absolute, so ``rho`` carries a relative error of ``K u (1 / (1 - Q_H) + 1 / (1 - P_H))``, which reaches
      ``alpha p(v) log p(v)`` for every candidate.
    """
    n = fed.tokens.shape[0]
    if n == 0:
        return 0.0
    corr = cfg.correction
    z = fed.logits.detach().double()
    finite = z[torch.isfinite(z)]
    x_max = max(1.0, float(finite.abs().max()) / fed.tau if finite.numel() else 0.0)
    unit = torch.finfo(cfg.dtype).eps / 2
    ratio_inside = WEIGHT_MODES[cfg.weights].ratio_inside
    cap = max(1.0, corr.upper if (ratio_inside and math.isfinite(corr.upper)) else 1.0)
    coef = torch.full((n,), cap, dtype=torch.float64)
    tail = torch.zeros(n, dtype=torch.float64)
    if cfg.score_centering and fed.cands is not None:
        from offpolicy.reference import f as weight_f

        alpha = weight_f(torch.ones(1, dtype=torch.float64), corr).expand(n)
        if fed.cands.kind == "head":
            valid = fed.cands.ids >= 0
            lp = log_probs(z, fed.tau)
            zero = torch.zeros((), dtype=torch.float64)
            p_h = torch.where(valid, lp.gather(1, fed.cands.ids.clamp_min(0)).exp(), zero).sum(1)
            q_h = torch.where(valid, fed.cands.logprobs.detach().double().exp(), zero).sum(1)
            rest_q, rest_p = (1 - q_h).clamp_min(TAIL_EPS), (1 - p_h).clamp_min(TAIL_EPS)
            rho = rest_q / rest_p
            alpha = rho * weight_f(1 / rho, corr)
            k = valid.sum(1).double() + 1
            rel_rho = (4 * k * unit * (1 / rest_q + 1 / rest_p)).clamp(max=1.0)
            tail = alpha * rel_rho * (1 + 2 * x_max)
        coef = coef + 2 * cap + alpha
    per_token = fed.adv.detach().double().abs() * (16 * unit * x_max * coef + tail)
    if fed.seq_ids is not None and LEVELS[cfg.level].per_sequence:
        # A sequence weight exp(sum_s log r_s) carries the log-probability errors of all L tokens of its sequence
        # (relative error L * 16 u x_max), and the loss multiplies it by |log p(y_t)|.
        lp = log_probs(z, fed.tau)
        logp_y = lp[torch.arange(n), fed.tokens].abs().nan_to_num(posinf=0.0)
        seq_len = (fed.seq_ids[:, None] == fed.seq_ids[None, :]).sum(1).double()
        per_token = per_token + fed.adv.detach().double().abs() * cap * 16 * unit * x_max * seq_len * logp_y
    per_token = torch.where(fed.trained(), per_token, 0.0)
    return float(per_token.max()) * max(1.0, 1.0 / fed.tau) * _aggregation_factor(fed, cfg)


def _aggregation_factor(fed: _Fed, cfg: LossConfig) -> float:
    """A bound on how much the aggregation scales the largest per-token error: means keep it, a sequence's token
    sum multiplies it by the sequence length, the constant normaliser by ``N / C``."""
    n = fed.tokens.shape[0]
    if cfg.aggregation == "seq_mean_token_sum" and fed.seq_ids is not None and n:
        return float((fed.seq_ids[:, None] == fed.seq_ids[None, :]).sum(1).max())
    if cfg.aggregation == "constant":
        return max(1.0, n / cfg.constant_normalizer)
    return 1.0


def _row_scale(cfg: LossConfig, rows: int) -> float:
    """For a batch of ``rows`` single-token sequences with no mask, the factor the aggregation divides each row's
    loss by (1 for per-token output): ``rows`` for the means, ``C`` for the constant."""
    if cfg.aggregation is None:
        return 1.0
    return cfg.constant_normalizer if cfg.aggregation == "constant" else float(rows)


def _compare(name: str, yours: Tensor, ref: Tensor, cfg: LossConfig, scale: float | None = None,
             floor: float = 0.0, expected: str = "reference") -> str | None:
    """A failure sentence when ``yours`` and ``ref`` differ by more than
    ``atol + floor + rtol * scale`` (``scale`` defaults to ``max |ref|``), else None."""
    rtol, atol = cfg.tolerances
    yours = yours.detach().double()
    if yours.numel() == 0:
        return None
    bad = ~torch.isfinite(yours) & torch.isfinite(ref)
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        return f"{name} is {yours[idx].item()} at index {list(idx)} where the {expected} is {ref[idx].item():.6g}"
    diff = torch.where(torch.isfinite(ref), (yours - ref).abs(), torch.zeros_like(ref))
    fin = ref[torch.isfinite(ref)]
    s = (float(fin.abs().max()) if fin.numel() else 0.0) if scale is None else scale
    tol = atol + floor + rtol * s
    worst = float(diff.max())
    if worst <= tol:
        return None
    idx = tuple(int(i) for i in (diff == diff.max()).nonzero()[0])
    return (f"{name} differs: max |yours - {expected}| = {worst:.3g} at index {list(idx)} (yours "
            f"{yours[idx].item():.9g}, {expected} {ref[idx].item():.9g}); tolerance {tol:.3g} = atol {atol:g} + "
            f"rounding floor {floor:.3g} + rtol {rtol:g} x {s:.3g}")


# ----------------------------------------------------------------------------------------------------------------
# The properties
# ----------------------------------------------------------------------------------------------------------------


def _generic_temperatures(cfg: LossConfig) -> st.SearchStrategy[float]:
    # Below float64, temperatures under 0.25 multiply the logits' rounding error beyond the float32 tolerance;
    # the extremes stay covered by hostile_finite.
    return temperatures() if cfg.dtype == torch.float64 else temperatures(0.25, 10.0)


def _batches(cfg: LossConfig, record: str | None | bool = False) -> st.SearchStrategy[Problem]:
    """Generic batches for ``cfg`` (``record`` overrides ``cfg.record``), packed into sequences for
    sequence-level configurations."""
    batches = problems(cfg.record if record is False else record, temperature=_generic_temperatures(cfg))
    return _dressed(batches, cfg)


def _dressed(batches: st.SearchStrategy[Problem], cfg: LossConfig) -> st.SearchStrategy[Problem]:
    """``batches`` with what ``cfg`` needs besides: packed sequences, proximal log-probabilities."""
    if cfg.needs_sequences:
        batches = with_sequences(batches)
    return with_proximal(batches) if cfg.needs_proximal else batches


def _prop_agreement(fn: LossFn, cfg: LossConfig, prob: Problem) -> None:
    fed = _feed(prob, cfg)
    assume(not _near_discontinuity(fed, cfg))
    ex = prob.describe()
    ref_loss, ref_grad = _reference(fed, cfg)
    out = _call(fn, fed, ex)
    floor = _rounding_floor(fed, cfg)
    msg = _compare(fed.loss_name, out, ref_loss, cfg, floor=floor)
    if msg:
        raise _Fail(msg, ex)
    if not out.requires_grad and bool((ref_grad != 0).any()):
        raise _Fail("the returned loss is not differentiable with respect to the logits (requires_grad is False)", ex)
    msg = _compare("d sum(loss) / d logits", _logit_grad(out, fed, ex), ref_grad, cfg, floor=floor)
    if msg:
        raise _Fail(msg, ex)


def _expected_grad(fn: LossFn, cfg: LossConfig, pos: Position, adv: Tensor | float) -> tuple[Tensor, Tensor, _Fed, str]:
    """Exact ``E_{y ~ q}[grad loss(y)]`` over the position's outcomes (one row each): ``(mean [V], scale [V])``
    with ``scale = E_q |grad loss(y)|`` entrywise."""
    prob = pos.expand(adv)
    if cfg.needs_sequences:  # each outcome row is its own sequence
        prob = replace(prob, seq_ids=torch.arange(prob.num_tokens))
    fed = _feed(prob, cfg)
    assume(not _near_discontinuity(fed, cfg))
    ex = pos.describe() + f"\nadvantages per outcome y={prob.tokens.tolist()}: {prob.advantages.tolist()}"
    out = _call(fn, fed, ex)
    # An aggregated loss divides every row's term by the same factor: undo it to get grad loss(y) per row.
    g = _logit_grad(out, fed, ex) * _row_scale(cfg, prob.num_tokens)
    if not bool(torch.isfinite(g).all()):
        raise _Fail("the logit gradient is not finite", ex)
    q = fed.lq.detach().double().exp()[:, None]
    return (q * g).sum(0), (q * g.abs()).sum(0), fed, ex


def _prop_zero_drift(fn: LossFn, cfg: LossConfig, case: tuple[Position, float]) -> None:
    pos, a = case
    drift, scale, fed, ex = _expected_grad(fn, cfg, pos, a)
    msg = _compare("sum_y q(y) d loss(y) / d logits (the drift)", drift, torch.zeros_like(drift), cfg,
                   scale=float(scale.max()), floor=_rounding_floor(fed, cfg), expected="zero")
    if msg:
        raise _Fail(msg + f"; constant advantage {a:g}", ex)


def _prop_plain_is(fn: LossFn, cfg: LossConfig, case: tuple[Position, list[float]]) -> None:
    pos, adv_list = case
    m = pos.outcomes.shape[0]
    adv = torch.tensor(adv_list[:m], dtype=torch.float64)
    mean, scale, fed, ex = _expected_grad(fn, cfg, pos, adv)
    # Target: E_{y~p}[grad of -A(y) log p(y)] = -(1/tau) sum_y p(y) A(y) (e_y - p), p over the support if any.
    z = fed.logits.detach().double()[0]
    x = z / fed.tau
    if pos.kind == "support":
        x = x.masked_fill(~torch.isfinite(pos.sampler_logq), -math.inf)
    p = torch.softmax(x, dim=0)
    ys = fed.tokens
    a = fed.adv.detach().double()
    target = torch.zeros_like(p)
    target.index_add_(0, ys, -(p[ys] * a) / fed.tau)
    target += p * (p[ys] * a).sum() / fed.tau
    msg = _compare("E_q[d loss / d logits]", mean, target, cfg,
                   scale=max(float(scale.max()), float(target.abs().max())), floor=_rounding_floor(fed, cfg),
                   expected="E_p[d(-A log p) / d logits]")
    if msg:
        raise _Fail(msg, ex)


@st.composite
def _replay_cases(draw: st.DrawFn, cfg: LossConfig) -> tuple[Problem, Tensor]:
    prob = draw(_batches(cfg, "support"))
    inside = support_mask(prob.candidates, prob.vocab)
    z2 = prob.logits.clone()
    if draw(st.booleans()):
        z2 = torch.where(inside, z2, z2.max(dim=1, keepdim=True).values + 40.0)
    else:
        k = int((~inside).sum())
        vals = draw(st.lists(st.floats(-60.0, 60.0, allow_nan=False), min_size=k, max_size=k))
        z2[~inside] = torch.tensor(vals, dtype=torch.float64)
    return prob, z2


def _prop_support_replay(fn: LossFn, cfg: LossConfig, case: tuple[Problem, Tensor]) -> None:
    prob, z2 = case
    ex = prob.describe() + f"\nlogits outside the support changed to: {_rows(z2)}"
    fed = _feed(prob, cfg)
    out = _call(fn, fed, ex)
    g = _logit_grad(out, fed, ex)
    inside = support_mask(fed.cands, prob.vocab)
    rtol, atol = cfg.tolerances
    floor = _rounding_floor(fed, cfg)
    tol = atol + floor + rtol * float(g.abs().max()) if g.numel() else atol
    outside = torch.where(inside, torch.zeros_like(g), g.abs().nan_to_num(math.inf))
    if outside.numel() and float(outside.max()) > tol:
        idx = [int(i) for i in (outside == outside.max()).nonzero()[0]]
        raise _Fail(f"gradient outside the replayed support: |d loss / d logits| = {float(outside.max()):.3g} at "
                    f"{idx} (outside S), tolerance {tol:.3g}", ex)
    fed2 = _feed(prob, cfg, logits=z2)
    out2 = _call(fn, fed2, ex)
    floor = max(floor, _rounding_floor(fed2, cfg))
    msg = _compare(f"{fed.loss_name} after changing logits outside the support", out2, out.detach().double(), cfg,
                   floor=floor, expected="unchanged value")
    msg = msg or _compare("d loss / d logits after changing logits outside the support", _logit_grad(out2, fed2, ex),
                          g, cfg, floor=floor, expected="unchanged value")
    if msg:
        raise _Fail(msg, ex)


def _rows(x: Tensor) -> str:
    from offpolicy.testing.strategies import _fmt

    return _fmt(x)


@st.composite
def _shift_cases(draw: st.DrawFn, cfg: LossConfig) -> tuple[Problem, list[float]]:
    prob = draw(_batches(cfg))
    big = 100.0 if cfg.dtype == torch.float64 else 2.0
    shifts = draw(st.lists(st.one_of(st.sampled_from([big, -big]), st.floats(-big, big, allow_nan=False)),
                           min_size=prob.num_tokens, max_size=prob.num_tokens))
    return prob, shifts


def _prop_shift(fn: LossFn, cfg: LossConfig, case: tuple[Problem, list[float]]) -> None:
    prob, shifts = case
    c = torch.tensor(shifts, dtype=torch.float64).reshape(-1, 1)
    ex = prob.describe() + f"\nper-row constant added to the logits: {_rows(c.reshape(-1))}"
    fed = _feed(prob, cfg)
    assume(not _near_discontinuity(fed, cfg))
    out = _call(fn, fed, ex)
    g = _logit_grad(out, fed, ex)
    fed2 = _feed(prob, cfg, logits=prob.logits + c)
    out2 = _call(fn, fed2, ex)
    floor = max(_rounding_floor(fed, cfg), _rounding_floor(fed2, cfg))
    msg = _compare(f"{fed.loss_name} after a constant logit shift", out2, out.detach().double(), cfg, floor=floor,
                   expected="unshifted value")
    msg = msg or _compare("d loss / d logits after a constant logit shift", _logit_grad(out2, fed2, ex), g, cfg,
                          floor=floor, expected="unshifted value")
    if msg:
        raise _Fail(msg, ex)


def _prop_sampler_no_grad(fn: LossFn, cfg: LossConfig, prob: Problem) -> None:
    ex = prob.describe()
    fed = _feed(prob, cfg, sampler_grad=True)
    out = _call(fn, fed, ex)
    named = [("sampler_logprobs", fed.lq), ("advantages", fed.adv)]
    if fed.cands is not None:
        named.append(("candidates.logprobs", fed.cands.logprobs))
    if fed.prox is not None:
        named.append(("proximal_logprobs", fed.prox))
    grads = _grads(out, [t for _, t in named], ex)
    for (name, _), g in zip(named, grads):
        if g is not None and bool((g != 0).any()):
            idx = [int(i) for i in (g != 0).nonzero()[0]]
            raise _Fail(f"gradient flows into {name}: d sum(loss) / d {name} = {_rows(g.detach().double())} "
                        f"(first nonzero at {idx}); sampler-side tensors and advantages must be detached "
                        "(w = sg(f(r)), c = sg(c), pi_prox is data)", ex)


def _prop_hostile(fn: LossFn, cfg: LossConfig, prob: Problem) -> None:
    ex = prob.describe()
    fed = _feed(prob, cfg)
    out = _call(fn, fed, ex)
    if not bool(torch.isfinite(out.detach()).all()):
        if fed.scalar:
            raise _Fail(f"the aggregated loss is {float(out.detach())}", ex)
        bad = [int(i) for i in (~torch.isfinite(out.detach())).nonzero()[:, 0]]
        raise _Fail(f"per-token loss is not finite at tokens {bad}: {_rows(out.detach().double())}", ex)
    g = _logit_grad(out, fed, ex)
    if not bool(torch.isfinite(g).all()):
        idx = [int(i) for i in (~torch.isfinite(g)).nonzero()[0]]
        raise _Fail(f"d loss / d logits is not finite (first at {idx}): {_rows(g)}", ex)


@st.composite
def _masking_cases(draw: st.DrawFn, cfg: LossConfig) -> tuple[Problem, Tensor]:
    prob = draw(_batches(cfg))
    mask = draw(loss_masks(prob.num_tokens))
    if draw(st.booleans()):
        # What padded batches hold at untrained positions: placeholder sampler log-probabilities (0) and
        # advantages; a sequence-level ratio that counts those tokens changes.
        off = ~mask
        prox = None if prob.proximal_logprobs is None else torch.where(off, 0.0, prob.proximal_logprobs)
        prob = replace(prob, sampler_logprobs=torch.where(off, 0.0, prob.sampler_logprobs),
                       advantages=torch.where(off, 1e3, prob.advantages), proximal_logprobs=prox,
                       notes={**prob.notes, "untrained rows": "lq=0, A=1e3" + (", prox=0" if prox is not None
                                                                                  else "")})
    return prob, mask


def _prop_masking(fn: LossFn, cfg: LossConfig, case: tuple[Problem, Tensor]) -> None:
    prob, mask = case
    ex = prob.describe() + f"\nloss_mask        = {_rows(mask)}"
    fed = _feed(prob, cfg, loss_mask=mask)
    assume(not _near_discontinuity(fed, cfg))
    out = _call(fn, fed, ex)
    values = out.detach().double()
    if fed.scalar and not bool(torch.isfinite(values)):
        raise _Fail(f"the aggregated loss is {float(values)}", ex)
    if not fed.scalar and not bool(torch.isfinite(values).all()):
        bad = [int(i) for i in (~torch.isfinite(values)).nonzero()[:, 0]]
        raise _Fail(f"per-token loss is not finite at tokens {bad}: {_rows(values)}", ex)
    g = _logit_grad(out, fed, ex)
    if not bool(torch.isfinite(g).all()):
        idx = [int(i) for i in (~torch.isfinite(g)).nonzero()[0]]
        raise _Fail(f"d loss / d logits is not finite (first at {idx}): {_rows(g)}", ex)
    _, atol = cfg.tolerances
    off = ~mask
    if not fed.scalar and bool(off.any()) and float(values[off].abs().max()) > atol:
        bad = [int(i) for i in (off & (values.abs() > atol)).nonzero()[:, 0]]
        raise _Fail(f"untrained tokens {bad} (loss_mask False) carry loss: {_rows(values)}", ex)
    if bool(off.any()) and float(g[off].abs().max()) > atol:
        bad = [int(i) for i in (off[:, None] & (g.abs() > atol)).any(1).nonzero()[:, 0]]
        raise _Fail(f"gradient reaches the logits of untrained tokens {bad}: {_rows(g)}", ex)
    ref_loss, ref_grad = _reference(fed, cfg)
    floor = _rounding_floor(fed, cfg)
    msg = _compare(f"{fed.loss_name} under the loss mask", out, ref_loss, cfg, floor=floor)
    msg = msg or _compare("d sum(loss) / d logits under the loss mask", g, ref_grad, cfg, floor=floor)
    if msg:
        raise _Fail(msg, ex)


# ----------------------------------------------------------------------------------------------------------------
# The registry
# ----------------------------------------------------------------------------------------------------------------


def _always(cfg: LossConfig) -> str | None:
    return None


def _needs_centering(cfg: LossConfig) -> str | None:
    if not cfg.score_centering:
        return "not applicable: the configuration does not claim score centering"
    if cfg.has_sequence_rejections:
        # Centering corrects each position's expected score with f, which holds the token-level rules only; a rule
        # that drops a whole sequence on a sequence statistic is not a function of the position's own ratio.
        return (f"not applicable: sequence rejection rules {list(cfg.correction.sequence_rules)} drop whole "
                "sequences on a sequence statistic, which the per-position centering does not see")
    return None


def _needs_token_level(cfg: LossConfig) -> str | None:
    if LEVELS[cfg.level].per_sequence:
        return f"not applicable: level={cfg.level!r} (the per-position expectation is a token-level property)"
    return None


def _needs_identity_weight(cfg: LossConfig) -> str | None:
    corr = cfg.correction
    if LEVELS[cfg.level].per_sequence:
        return _needs_token_level(cfg)
    if cfg.surrogate != "score_function":
        return (f"not applicable: the {cfg.surrogate!r} surrogate multiplies f(pi_prox / q) by a clipped function "
                "of u = p / pi_prox, not by log p: it is plain IS only where every u lies inside the clip band")
    if corr.rejection_rules or corr.sequence_rules or corr.trust_region is not None:
        return "not applicable: rejection rules zero tokens or sequences where f(r) = r alone would keep them"
    if cfg.batch_normalize is not False:
        return ("not applicable: batch normalisation divides the weights by the batch's mean weight, a "
                "data-dependent constant, so E_q[grad loss] is E_p[grad of -A log p] divided by it")
    if not WEIGHT_MODES[cfg.weights].ratio_inside:
        modes = [m.name for m in WEIGHT_MODES.values() if m.ratio_inside]
        names = " and ".join([", ".join(modes[:-1]), modes[-1]] if len(modes) > 1 else modes)
        return f"not applicable: weights={cfg.weights!r} is not f(r) = r anywhere (only {names} are)"
    if not corr.lower < 1.0 < corr.upper:
        return f"not applicable: the bounds ({corr.lower:g}, {corr.upper:g}) leave no room around r = 1"
    return None


def _needs_support(cfg: LossConfig) -> str | None:
    return None if cfg.record == "support" else "not applicable: only support records replay a mask"


@dataclass(frozen=True)
class Invariant:
    """One checked property.

    Attributes:
        name: short identifier (``"zero_drift"``).
        spec: where docs/spec.md states it.
        summary: one line, for reports.
        applies: ``config -> None`` when applicable, else the reason it is not.
        strategy: ``config -> SearchStrategy`` of cases.
        prop: ``(fn, config, case) -> None``, raising on a violation.
        needs: optional keywords of the loss function the check passes (it is skipped for a function that takes
            none of that name).
    """

    name: str
    spec: str
    summary: str
    applies: Callable[[LossConfig], str | None]
    strategy: Callable[[LossConfig], st.SearchStrategy]
    prop: Callable[[LossFn, LossConfig, object], None]
    needs: tuple[str, ...] = ()


def _hostile_cases(cfg: LossConfig) -> st.SearchStrategy[Problem]:
    batches = hostile_problems(cfg.record, zero_weight_at_zero_ratio=cfg.weight_at_zero == 0.0)
    return _dressed(batches, cfg)


def _is_bounds(cfg: LossConfig) -> tuple[float, float]:
    corr = cfg.correction
    return (corr.lower, corr.upper)


INVARIANTS: dict[str, Invariant] = {
    inv.name: inv
    for inv in [
        Invariant(
            "agreement", "docs/spec.md#inv-head-exact, docs/spec.md#inv-autograd",
            "loss (per token or aggregated) and logit gradient equal offpolicy.reference for the declared config",
            _always, _batches, _prop_agreement,
        ),
        Invariant(
            "zero_drift", "docs/spec.md#inv-zero-drift, docs/spec.md#inv-head-exact",
            "under a constant advantage the sampler-expected gradient sum_y q(y) grad loss(y) is zero",
            _needs_centering,
            lambda cfg: st.tuples(positions(cfg.record, temperature=_generic_temperatures(cfg)),
                                  st.sampled_from([1.0, -1.0, 2.5])),
            _prop_zero_drift,
        ),
        Invariant(
            "plain_is_unbiased", "docs/spec.md#inv-plain-is",
            "where f(r) = r: E_q[grad loss] = E_p[grad of -A log p]",
            _needs_identity_weight,
            lambda cfg: st.tuples(
                positions(cfg.record, complete=True, ratio_bounds=_is_bounds(cfg),
                          temperature=_generic_temperatures(cfg)),
                st.lists(st.floats(-3.0, 3.0, allow_nan=False), min_size=8, max_size=8),
            ),
            _prop_plain_is,
        ),
        Invariant(
            "support_replay", "docs/spec.md#inv-support",
            "support records: zero gradient outside S and no dependence on logits outside S",
            _needs_support, _replay_cases, _prop_support_replay,
        ),
        Invariant(
            "shift_invariance", "docs/spec.md#inv-support",
            "adding a constant to a row's logits changes neither the loss nor its gradient",
            _always, _shift_cases, _prop_shift,
        ),
        Invariant(
            "sampler_no_grad", "docs/spec.md#weights, docs/spec.md#score-centering (sg)",
            "no gradient reaches sampler log-probabilities, candidate log-probabilities or advantages",
            _always, _batches, _prop_sampler_no_grad,
        ),
        Invariant(
            "hostile_finite", "docs/spec.md#inv-hostile",
            "finite loss and gradient on hostile numerics (-inf logits, +-1e4, underflow, empty rows, N = 0)",
            _always, _hostile_cases, _prop_hostile,
        ),
        Invariant(
            "masking", "docs/spec.md#inv-masking",
            "tokens with loss_mask False carry no loss and no gradient, and do not enter sequence statistics",
            _always, _masking_cases, _prop_masking, needs=("loss_mask",),
        ),
    ]
}


# ----------------------------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class CheckResult:
    """The outcome of one invariant: ``status`` is ``"pass"``, ``"fail"`` or ``"skip"`` (not applicable)."""

    invariant: str
    status: str
    detail: str = ""
    examples: int = 0
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.status != "fail"


@dataclass
class Report:
    """All invariants' outcomes for one function and configuration."""

    target: str
    config: LossConfig
    results: list[CheckResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    @property
    def failed(self) -> list[str]:
        """Names of the violated invariants."""
        return [r.invariant for r in self.results if r.status == "fail"]

    def __getitem__(self, name: str) -> CheckResult:
        for r in self.results:
            if r.invariant == name:
                return r
        raise KeyError(name)

    def __str__(self) -> str:
        head = f"offpolicy.testing report for {self.target}\n  {self.config.describe()}"
        lines = [head]
        for r in self.results:
            inv = INVARIANTS[r.invariant]
            tag = {"pass": "PASS", "fail": "FAIL", "skip": "skip"}[r.status]
            extra = {"pass": f"  ({r.examples} examples, {r.seconds:.1f} s)", "fail": f"  ({r.seconds:.1f} s)",
                     "skip": f"  {r.detail}"}[r.status]
            lines.append(f"  {tag}  {r.invariant:<18} {inv.summary} [{inv.spec}]{extra}")
        for r in self.results:
            if r.status == "fail":
                lines.append("")
                lines.append(r.detail)
        return "\n".join(lines)


def _keywords(fn: Callable) -> set[str]:
    """The optional keywords (``loss_mask``, ``seq_ids``, ``proximal_logprobs``) a loss function takes (all of them
    with ``**kwargs``)."""
    optional = {"loss_mask", "seq_ids", "proximal_logprobs"}
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or extension callable: pass only the six positional arguments
        return set()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return optional
    return optional & {p.name for p in params if p.kind is not inspect.Parameter.POSITIONAL_ONLY}


def _target_name(fn: Callable) -> str:
    mod = getattr(fn, "__module__", None) or "?"
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return f"{mod}.{name}"


def run_invariant(
    fn: LossFn,
    config: LossConfig,
    invariant: str,
    *,
    max_examples: int | None = None,
    derandomize: bool = True,
    shrink: bool = True,
) -> CheckResult:
    """Check one invariant; never raises for a violation (see :class:`CheckResult`).

    Args:
        fn: the loss function (:data:`LossFn`).
        config: what it claims.
        invariant: a key of :data:`INVARIANTS`.
        max_examples: hypothesis examples (default :data:`DEFAULT_MAX_EXAMPLES`, or the
            ``OFFPOLICY_MAX_EXAMPLES`` environment variable).
        derandomize: a fixed example sequence (reproducible CI); False explores new examples on each run.
        shrink: shrink a failing example to a minimal one (False reports the first failing example as found:
            faster, less readable).
    """
    if invariant not in INVARIANTS:
        raise KeyError(f"unknown invariant {invariant!r}; expected one of {list(INVARIANTS)}")
    inv = INVARIANTS[invariant]
    takes = _keywords(fn)
    if config.needs_sequences and "seq_ids" not in takes:
        what = (f"level={config.level!r}" if config.level != "token" else
                f"aggregation={config.aggregation!r}" if config.aggregation in SEQUENCE_AGGREGATIONS else
                "a sequence-wise rule, normalisation or surrogate")
        raise ValueError(f"LossConfig({what}) works on packed sequences: the loss function {_target_name(fn)} must "
                         "take a seq_ids keyword ([N] int64 packed sequence ids)")
    if config.needs_proximal and "proximal_logprobs" not in takes:
        raise ValueError(f"LossConfig(surrogate {config.surrogate!r}) needs the proximal policy's log-probabilities: "
                         f"the loss function {_target_name(fn)} must take a proximal_logprobs keyword ([N] float)")
    reason = inv.applies(config)
    missing = [k for k in inv.needs if k not in takes]
    if reason is None and missing:
        reason = f"not applicable: the function takes no {' / '.join(missing)} keyword"
    if reason is not None:
        return CheckResult(invariant, "skip", reason)
    if max_examples is None:
        max_examples = int(os.environ.get("OFFPOLICY_MAX_EXAMPLES", DEFAULT_MAX_EXAMPLES))
    evaluated = [0]

    def body(case) -> None:
        inv.prop(fn, config, case)
        evaluated[0] += 1

    test = settings(
        max_examples=max_examples, deadline=None, database=None, derandomize=derandomize,
        suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet, report_multiple_bugs=False,
        phases=[Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else []),
    )(given(inv.strategy(config))(body))
    start = time.perf_counter()
    # The examples are tiny: intra-op parallelism only adds thread wake-ups (on a busy 2-core machine a
    # [5, 10] log-softmax took 30 ms with 2 threads and 2 us with 1), so check single-threaded.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        test()
    except _Fail as f:
        return CheckResult(invariant, "fail", _message(fn, config, inv, f), evaluated[0],
                           time.perf_counter() - start)
    except Exception as exc:  # hypothesis itself gave up (flaky function, unsatisfiable strategy, ...)
        return CheckResult(invariant, "fail", _message(fn, config, inv, _Fail(
            f"the check could not complete: {type(exc).__name__}: {exc}", "(no example)")), evaluated[0],
            time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    if evaluated[0] == 0:
        return CheckResult(invariant, "fail", _message(fn, config, inv, _Fail(
            "no example could be evaluated (every generated case was rejected)", "(no example)")), 0,
            time.perf_counter() - start)
    return CheckResult(invariant, "pass", "", evaluated[0], time.perf_counter() - start)


def _message(fn: Callable, cfg: LossConfig, inv: Invariant, f: _Fail) -> str:
    example = "\n".join("    " + line for line in f.example.splitlines())
    return (f"invariant '{inv.name}' violated ({inv.spec}: {inv.summary})\n"
            f"  function:      {_target_name(fn)}\n"
            f"  configuration: {cfg.describe()}\n"
            f"  what failed:   {f.what}\n"
            f"  shrunk example:\n{example}")


def check_all(
    fn: LossFn,
    config: LossConfig,
    invariants: Iterable[str] | None = None,
    *,
    max_examples: int | None = None,
    derandomize: bool = True,
    shrink: bool = True,
    raise_on_failure: bool = True,
) -> Report:
    """Check every applicable invariant (or those named) and return the :class:`Report`.

    With ``raise_on_failure`` (the default, for a one-line test) a violation raises
    :class:`InvariantViolation` whose message is the whole report.
    """
    names = list(INVARIANTS) if invariants is None else list(invariants)
    report = Report(_target_name(fn), config)
    for name in names:
        report.results.append(run_invariant(fn, config, name, max_examples=max_examples, derandomize=derandomize,
                                           shrink=shrink))
    if raise_on_failure and not report.passed:
        raise InvariantViolation(str(report))
    return report


def pytest_suite(fn: LossFn, config: LossConfig, name: str | None = None) -> type:
    """A pytest test class with one test per invariant (skipped where not applicable)::

        TestMyLoss = offpolicy.testing.pytest_suite(my_loss, LossConfig(weights="mis", score_centering=True,
                                                                         record="support"))
    """
    import pytest

    def make(inv_name: str):
        def test(self) -> None:
            result = run_invariant(fn, config, inv_name)
            if result.status == "skip":
                pytest.skip(result.detail)
            if result.status == "fail":
                pytest.fail(result.detail, pytrace=False)

        test.__name__ = f"test_{inv_name}"
        return test

    attrs = {f"test_{n}": make(n) for n in INVARIANTS}
    return type(name or "TestOffpolicyInvariants", (), attrs)


def with_config(config: LossConfig) -> Callable[[LossFn], LossFn]:
    """Decorator attaching the claimed configuration to a loss function (read by the pytest entry when
    ``OFFPOLICY_LOSS`` points at the function and ``OFFPOLICY_CONFIG`` is unset)."""

    def attach(fn: LossFn) -> LossFn:
        fn.offpolicy_config = config
        return fn

    return attach


__all__ = [
    "DEFAULT_MAX_EXAMPLES", "INVARIANTS", "CheckResult", "Invariant", "InvariantViolation", "LossFn", "Report",
    "check_all", "pytest_suite", "run_invariant", "with_config",
]
