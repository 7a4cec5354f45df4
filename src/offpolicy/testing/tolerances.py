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

from offpolicy.corrections.node import Jump
from offpolicy.corrections.trust_region import binary_kl
from offpolicy.loss.centering import TAIL_EPS, tail_ratio
from offpolicy.reference import kl, log_probs, support_mask
from offpolicy.testing.config import LossConfig
from offpolicy.testing.harness import _Fed


def _near_discontinuity(fed: _Fed, cfg: LossConfig) -> bool:
    """Whether a statistic the loss jumps on (in value or gradient) lies within the margin of the jump, where
    rounding alone may put it on either side. The jumps are the nodes' own (``CorrectionTree.jumps()``: the weight
    mode's bounds at its level, each rule's band or threshold, each surrogate's kinks in ``log u``, the trust
    region's edges); this function only evaluates the statistic each names, in float64 from the example:

    * ``log_r``: the ratio the weights see (``p / q``, or ``pi_prox / q`` under a proximal surrogate), per token or
      reduced per sequence (sum, mean, min); under score centering also each candidate's ``p / q`` and the head's
      tail ratio, for the weight mode's and the token rules' jumps;
    * ``kl``: a KL estimator of the clamped ratio, per token or per sequence (sum, mean, max);
    * ``neg_log_p_ratio``: the current policy's ``lq - log p`` (OPSM: its sequence mean);
    * ``log_u``: ``log p - log pi_prox`` per token (GSPO-token: the sequence mean), when a proximal is fed;
    * ``tr_diff`` / ``tr_div``: a trust region's probability difference and divergence, per token or per sequence.
    """
    tree = cfg.correction.tree
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
    seqs = []
    if fed.seq_ids is not None:
        for sid in torch.unique(fed.seq_ids).tolist():
            rows = ((fed.seq_ids == sid) & trained).nonzero().reshape(-1)
            if rows.numel():
                seqs.append(rows)
    token_log_r = torch.where(trained, (logp_y if prox is None else prox) - lq, 0.0)

    def quantity(node, jump: Jump) -> Tensor | None:
        """``[N]`` the statistic ``jump`` names at each token (None where the example does not define it)."""
        if jump.quantity == "log_r":
            return token_log_r
        if jump.quantity == "kl":
            return kl(torch.exp(token_log_r.clamp(-tree.max_log_ratio, tree.max_log_ratio)), jump.detail)
        if jump.quantity == "neg_log_p_ratio":
            return torch.where(trained, lq - logp_y, 0.0)
        if jump.quantity == "log_u":
            return None if prox is None else torch.where(trained, logp_y - prox, 0.0)
        num, den = _trust_region_pair(node, logp_y, lq, prox)
        d = torch.where(trained, num.exp() - den.exp(), 0.0)
        if jump.quantity == "tr_diff":
            return d
        kl_ref = binary_kl(den, num)
        div = {"difference": d.abs(), "binary_kl": kl_ref,
               "binary_kl_max": torch.maximum(kl_ref, binary_kl(num, den))}[jump.detail]
        return torch.where(trained, div, 0.0)

    pairs: list[tuple[Tensor, tuple[float, ...]]] = []  # (statistics, the values they jump at)
    for node, jump in tree.jumps():
        x = quantity(node, jump)
        if x is not None:
            pairs.append((_reduce(x, trained, seqs, jump.level), jump.at))
    if tree.centering is not None and fed.cands is not None:
        # The weight function and the token rules folded into it, at each candidate's ratio and the tail ratio.
        valid = fed.cands.ids >= 0
        lpc = lp.gather(1, fed.cands.ids.clamp_min(0))
        lqc = fed.cands.logprobs.detach().double()
        ratios = [(lpc - lqc)[valid & torch.isfinite(lqc) & torch.isfinite(lpc)]]
        if not support:
            p_h = torch.where(valid, lpc.exp(), torch.zeros_like(lpc)).sum(1)
            q_h = torch.where(valid, lqc.exp(), torch.zeros_like(lqc)).sum(1)
            ratios.append(-torch.log(tail_ratio(p_h, q_h)))
        own = [(node, j) for node, j in tree.jumps()
               if node is tree.weighting.mode or any(node is r for r in tree.token_rules)]
        for log_r in ratios:
            for _, jump in own:
                x = log_r if jump.quantity == "log_r" else kl(
                    torch.exp(log_r.clamp(-tree.max_log_ratio, tree.max_log_ratio)), jump.detail)
                pairs.append((x, jump.at))
    for stats, jumps in pairs:
        vals = stats.reshape(-1)
        vals = vals[torch.isfinite(vals)]
        if any(bool(((vals - j).abs() < cfg.margin).any()) for j in jumps):
            return True
    return False


def _reduce(x: Tensor, trained: Tensor, seqs: list[Tensor], level: str) -> Tensor:
    """``x`` on the trained tokens (``level="token"``) or reduced over each sequence's trained tokens."""
    if level == "token":
        return x[trained]
    op = {"sequence": torch.sum, "sum": torch.sum, "geometric": torch.mean, "mean": torch.mean,
          "max": torch.max, "min": torch.min}[level]
    return torch.stack([op(x[idx]) for idx in seqs]) if seqs else x[:0]


def _trust_region_pair(tr, logp_y: Tensor, lq: Tensor, prox: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(log p, log p_ref)`` a trust region compares (docs/spec.md#trust-region), in float64."""
    if tr.on == "update":
        return logp_y, (prox if prox is not None else lq)
    return (prox if prox is not None else logp_y), lq


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
    ratio_inside = corr.tree.weighting.mode.ratio_inside
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
            rho = tail_ratio(p_h, q_h)
            alpha = rho * weight_f(1 / rho, corr)
            k = valid.sum(1).double() + 1
            rel_rho = (4 * k * unit * (1 / rest_q + 1 / rest_p)).clamp(max=1.0)
            tail = alpha * rel_rho * (1 + 2 * x_max)
        coef = coef + 2 * cap + alpha
    per_token = fed.adv.detach().double().abs() * (16 * unit * x_max * coef + tail)
    if fed.seq_ids is not None and corr.tree.weighting.level.per_sequence:
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
