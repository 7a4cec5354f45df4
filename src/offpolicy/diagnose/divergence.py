"""Sampler-trainer divergence of recorded tokens: Schulman's KL estimators and the extreme-ratio share.

On tokens drawn from ``q`` with ``log r = log p(y) - lq``: ``k1 = -log r`` and ``k3 = r - 1 - log r`` both estimate
``KL(q || p)`` (``k3`` is non-negative per token). The extreme share is the fraction of tokens with ``r`` outside
``[0.2, 5]`` (``docs/spec.md#metrics``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

EXTREME_BAND = (0.2, 5.0)


@dataclass(frozen=True)
class Divergence:
    """Aggregates over ``tokens`` recorded tokens (non-finite ratios counted apart, never averaged in)."""

    tokens: int
    k1: float
    k3: float
    extreme_share: float
    mean_log_ratio: float
    non_finite: int

    def as_dict(self) -> dict[str, float | int]:
        return {"tokens": self.tokens, "k1": self.k1, "k3": self.k3, "extreme_share": self.extreme_share,
                "mean_log_ratio": self.mean_log_ratio, "non_finite": self.non_finite}


def divergence(log_ratio: Tensor) -> Divergence:
    """Aggregate ``log r`` ``[n]`` (float64)."""
    lr = log_ratio.double()
    ok = torch.isfinite(lr)
    fin = lr[ok]
    n = int(fin.numel())
    if n == 0:
        return Divergence(int(lr.numel()), float("nan"), float("nan"), float("nan"), float("nan"), int((~ok).sum()))
    lo, hi = (math.log(b) for b in EXTREME_BAND)
    r = torch.exp(fin.clamp(max=50.0))
    extreme = ((fin < lo) | (fin > hi)).double()  # the band is inclusive, compared in log space
    return Divergence(
        tokens=int(lr.numel()), k1=float((-fin).mean()), k3=float((r - 1 - fin).mean()),
        extreme_share=float(extreme.mean()), mean_log_ratio=float(fin.mean()), non_finite=int((~ok).sum()),
    )


def split(log_ratio: Tensor, keys: Tensor) -> dict[int, Divergence]:
    """:func:`divergence` per distinct value of ``keys`` ``[n]`` (int64)."""
    return {int(k): divergence(log_ratio[keys == k]) for k in torch.unique(keys).tolist()}
