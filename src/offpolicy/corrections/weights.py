"""Importance weights and rejections (SPEC sections 2 and 5), computed from log-ratios.

Every function takes log-ratios ``log r = log p - lq`` and clamps them to ``[-max_log_ratio, max_log_ratio]``
before exponentiating; bounds are tested on the unclamped log-ratio, so ``-inf`` / ``+inf`` fall outside any
finite interval.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from offpolicy.corrections.correction import Correction
from offpolicy.loss.segments import Segments


def log_bound(x: float) -> float:
    """``log x`` of a ratio bound, ``-inf`` for 0 (an open lower end)."""
    return math.log(x) if x > 0 else -math.inf


def kl_estimate(log_r: Tensor, estimator: str) -> Tensor:
    """Schulman's per-token estimators of KL(q || p) from ``log r = log p - lq`` on tokens drawn from ``q``.

    k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r (= expm1(log r) - log r, accurate near 0).
    """
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r.square()
    return torch.expm1(log_r) - log_r


def inside_bounds(log_r: Tensor, corr: Correction) -> Tensor:
    """``1[L <= r <= U]`` (inclusive), evaluated in log space."""
    return (log_r >= log_bound(corr.lower)) & (log_r <= log_bound(corr.upper))


def weight_function(log_r: Tensor, corr: Correction) -> Tensor:
    """``f(r)`` of the correction's weight mode at ``r = exp(log_r)``, with token-level KL rejection folded in.

    ``log_r`` may hold ``+-inf`` (a ratio of 0 or infinity); the result is finite. Same dtype as ``log_r``.
    """
    lr = log_r.clamp(-corr.max_log_ratio, corr.max_log_ratio)
    mode = corr.weights
    if mode == "none":
        f = torch.ones_like(lr)
    elif mode == "tis":
        f = torch.exp(lr.clamp(min=max(log_bound(corr.lower), -corr.max_log_ratio), max=log_bound(corr.upper)))
    elif mode == "mis":
        f = torch.where(inside_bounds(log_r, corr), torch.exp(lr), torch.zeros_like(lr))
    else:
        f = inside_bounds(log_r, corr).to(lr.dtype)
    rej = corr.kl_rejection
    if rej is not None and rej.level == "token":
        f = torch.where(kl_estimate(lr, rej.estimator) <= rej.threshold, f, torch.zeros_like(f))
    return f


def sequence_weight(log_r: Tensor, seg: Segments, corr: Correction) -> Tensor:
    """``[N]`` the sequence-level weight ``f(rho)`` of each token's sequence.

    ``log rho = sum_t log r_t`` (``level="sequence"``) or ``mean_t log r_t`` (``"geometric"``) over the
    sequence's trained tokens.
    """
    per_seq = seg.sum(log_r) if corr.level == "sequence" else seg.mean(log_r)
    return seg.broadcast(weight_function(per_seq, _without_token_rejection(corr)))


def _without_token_rejection(corr: Correction) -> Correction:
    if corr.kl_rejection is None or corr.kl_rejection.level != "token":
        return corr
    from dataclasses import replace

    return replace(corr, kl_rejection=None)


def sequence_keep(
    log_r: Tensor, advantages: Tensor, seg: Segments | None, corr: Correction
) -> Tensor | None:
    """``[N]`` bool: False on tokens of sequences dropped by veto, sequence KL rejection or OPSM.

    Returns None when the correction has no sequence-level rejection.
    """
    rej = corr.kl_rejection
    seq_kl = rej is not None and rej.level != "token"
    if corr.veto is None and not seq_kl and corr.opsm_delta is None:
        return None
    assert seg is not None
    drop = torch.zeros(seg.num, dtype=torch.bool, device=log_r.device)
    if corr.veto is not None:
        drop |= seg.min(log_r) < math.log(corr.veto)
    if seq_kl:
        k = kl_estimate(log_r.clamp(-corr.max_log_ratio, corr.max_log_ratio), rej.estimator)
        stat = {"seq_sum": seg.sum, "seq_mean": seg.mean, "seq_max": seg.max}[rej.level](k)
        drop |= stat > rej.threshold
    if corr.opsm_delta is not None:
        # DeepSeek-V3.2's off-policy sequence masking: negative advantage and mean k1 = mean(lq - log p) > delta.
        drop |= (seg.mean(advantages) < 0) & (seg.mean(-log_r) > corr.opsm_delta)
    return ~seg.broadcast(drop)
