"""How close a correct implementation must come to the float64 oracle, and where it need not.

* :func:`_near_discontinuity`: whether an example lies within ``LossConfig.margin`` of a point where the loss jumps
  (a weight band's edge, a rule's threshold, a surrogate's kink, a trust region's edge); the properties discard it,
  since rounding alone may put it on either side.
* :func:`_rounding_floor`: the absolute error rounding alone may cause in ``LossConfig.dtype``.
* :func:`_compare`: one failure sentence when two tensors differ by more than ``atol + floor + rtol * scale``
  (``LossConfig.tolerances`` per dtype).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from offpolicy.corrections import registry as reg
from offpolicy.corrections.registry import LEVELS, WEIGHT_MODES
from offpolicy.corrections.trust_region import binary_kl
from offpolicy.reference import TAIL_EPS, kl, kl_statistic, log_probs, sequence_log_ratio, support_mask
from offpolicy.testing.config import LossConfig
from offpolicy.testing.harness import _Fed


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
