"""Online-softmax statistics shared by both primitives (logits and fused-linear) and all their backends.

A row's statistics relative to a reference ``m`` (its max) are ``s = sum exp(x - m)`` and
``t = sum exp(x - m) (x - m)``; then ``lse = m + log s`` and the entropy is ``log s - t / s`` (from
``H = -sum p log p`` with ``p = exp(x - m) / s``). Two partial results fold exactly (:func:`merge`), which is what
the vocabulary tiles of one rank and the vocabulary shards of several ranks need.

The optional fourth statistic ``q = sum exp(2 (x - m))`` gives ``sum_v p(v)^2 = q / s^2`` (the Optimal Token
Baseline's statistic, verl PR #4678): moving the reference from ``m`` to ``M`` scales it by ``exp(2 (m - M))``, the
square of the factor that scales ``s``. Since the max term contributes 1 to both, ``s >= 1`` and ``q >= 1`` on a row
with mass: no underflow where it matters.
"""

from __future__ import annotations

import torch
from torch import Tensor

INF = float("inf")


def finish(m: Tensor, s: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
    """``(lse [N], entropy [N])`` from full-vocabulary statistics ``m, s, t [N]``.

    A row with ``s = 0`` (skipped, or all ``-inf``) has no mass: ``lse = +inf`` and entropy 0. A NaN anywhere in a
    row makes ``s`` NaN and propagates into ``lse`` (NaN is not "no mass"), so callers see it in the log-probs.
    """
    has_mass = s != 0
    safe_s = torch.where(has_mass, s, torch.ones_like(s))
    lse = torch.where(has_mass, m + torch.log(safe_s), torch.full_like(m, INF))
    entropy = torch.where(has_mass, torch.log(safe_s) - t / safe_s, torch.zeros_like(s))
    return lse, entropy


def sum_p2(s: Tensor, q: Tensor) -> Tensor:
    """``sum_v p(v)^2 [N] = q / s^2`` from full-vocabulary statistics; 0 on rows without mass (``s = 0``)."""
    has_mass = s != 0
    safe_s = torch.where(has_mass, s, torch.ones_like(s))
    return torch.where(has_mass, q / (safe_s * safe_s), torch.zeros_like(s))


def merge(m: Tensor, s: Tensor, t: Tensor, m2: Tensor, s2: Tensor, t2: Tensor, q: Tensor | None = None,
          q2: Tensor | None = None) -> tuple[Tensor, ...]:
    """Fold the statistics ``(m2, s2, t2[, q2])`` of more columns into ``(m, s, t[, q])``.

    With ``M = max(m, m2)`` over the parts with mass and ``a = exp(m - M)``: ``s' = a s + a2 s2``,
    ``t' = a (t + s (m - M)) + a2 (t2 + s2 (m2 - M))`` and (given ``q`` and ``q2``) ``q' = a^2 q + a2^2 q2``. A part
    without mass (``s = 0``) counts as ``m = -inf``; ``M = 0`` where neither part has mass. NaN in either ``s``
    propagates into ``s'``. Returns ``(M, s', t')``, or ``(M, s', t', q')`` when ``q`` is given.
    """
    m1e = torch.where(s > 0, m, -INF)
    m2e = torch.where(s2 > 0, m2, -INF)
    big = torch.maximum(m1e, m2e)
    big = torch.where(torch.isfinite(big), big, torch.zeros_like(big))
    a1 = torch.exp(m1e - big)
    a2 = torch.exp(m2e - big)
    d1 = torch.where(s > 0, m - big, torch.zeros_like(m))
    d2 = torch.where(s2 > 0, m2 - big, torch.zeros_like(m2))
    folded = (big, a1 * s + a2 * s2, a1 * (t + s * d1) + a2 * (t2 + s2 * d2))
    return folded if q is None else (*folded, a1 * a1 * q + a2 * a2 * q2)


def support_stats(xc: Tensor) -> tuple[Tensor, Tensor]:
    """``(lse [N], entropy [N])`` over a gathered support ``xc [N, K]`` (padding ``-inf``).

    An empty support (every entry ``-inf``, or ``K = 0``) has ``lse = +inf`` and entropy 0.
    """
    lse = torch.logsumexp(xc, dim=1) if xc.shape[1] else torch.full(xc.shape[:1], -INF, dtype=xc.dtype,
                                                                      device=xc.device)
    lse = torch.where(lse == -INF, torch.full_like(lse, INF), lse)
    logp = xc - lse[:, None]
    p = torch.exp(logp)
    entropy = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(dim=1)
    return lse, entropy


def support_sum_p2(xc: Tensor, lse: Tensor) -> Tensor:
    """``sum_k p^S(k)^2 [N]`` of the support-renormalised distribution ``p^S = exp(xc - lse)`` over a gathered support
    ``xc [N, K]`` (padding ``-inf``, contributing 0); 0 where ``lse = +inf`` (empty support, skipped row)."""
    has_mass = lse != INF  # a NaN lse stays NaN
    p = torch.exp(xc - torch.where(has_mass, lse, torch.zeros_like(lse))[:, None])
    return torch.where(has_mass, (p * p).sum(dim=1), torch.zeros_like(lse))


def support_probs(x_support: Tensor, lse: Tensor, live: Tensor) -> Tensor:
    """``p^S = exp(x - lse)`` over the support ``[N, K]`` on the rows in ``live [N]``, exactly 0 on the others.

    Rows outside ``live`` (skipped, untrained, empty) may hold NaN or inf; they must not leak into the gradient
    through ``0 * NaN``.
    """
    p = torch.exp(x_support - lse[:, None])
    return torch.where(live[:, None], p, torch.zeros_like(p))
