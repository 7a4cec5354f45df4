"""Online-softmax statistics shared by both primitives (logits and fused-linear) and all their backends.

A row's statistics relative to a reference ``m`` (its max) are ``s = sum exp(x - m)`` and
``t = sum exp(x - m) (x - m)``; then ``lse = m + log s`` and the entropy is ``log s - t / s`` (from
``H = -sum p log p`` with ``p = exp(x - m) / s``). Two partial results fold exactly, which is what the vocabulary
tiles of one rank and the vocabulary shards of several ranks need: the record that carries these statistics and
the optional ones (``sum p^2``, ...), and the fold, are in :mod:`offpolicy.ops.row_stats`.
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



def support_probs(x_support: Tensor, lse: Tensor, live: Tensor) -> Tensor:
    """``p^S = exp(x - lse)`` over the support ``[N, K]`` on the rows in ``live [N]``, exactly 0 on the others.

    Rows outside ``live`` (skipped, untrained, empty) may hold NaN or inf; they must not leak into the gradient
    through ``0 * NaN``.
    """
    p = torch.exp(x_support - lse[:, None])
    return torch.where(live[:, None], p, torch.zeros_like(p))
