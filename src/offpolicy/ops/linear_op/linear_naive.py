"""The fused-linear op in float64, written densely: the logits ``z = h W^T + b`` built in full, then
``log_softmax`` (over the vocabulary, or over each row's candidate support) and a gather. The reference the
backends and the op are tested against; it imports nothing from the library (only torch) and its gradients come
from autograd through it.
"""

from __future__ import annotations

import torch
from torch import Tensor

INF = float("inf")


def _inv_temp(tau: float | Tensor, n: int) -> Tensor:
    return 1.0 / (tau.double() if isinstance(tau, Tensor) else torch.full((n,), float(tau), dtype=torch.float64))


def linear_sparse_log_softmax(h: Tensor, w: Tensor, b: Tensor | None, y: Tensor, c: Tensor | None, tau: float | Tensor,
                              *, support: bool = False, skip: Tensor | None = None):
    """float64 ``(target [N], candidates [N, K], lse [N], entropy [N])`` of ``softmax((h W^T + b) / tau)`` at the
    targets ``y [N]`` and candidates ``c [N, K]`` (``-1`` padding, or None), and the float64 leaves ``(h, w, b)``
    they depend on (copies of the inputs that require grad)."""
    hd = h.detach().double().requires_grad_()
    wd = w.detach().double().requires_grad_()
    bd = None if b is None else b.detach().double().requires_grad_()
    n = hd.shape[0]
    c = torch.empty(n, 0, dtype=torch.int64) if c is None else c.long()
    z = hd @ wd.T
    if bd is not None:
        z = z + bd
    x = z * _inv_temp(tau, n)[:, None]
    ids = torch.cat([y.long()[:, None], c], dim=1)
    xi = x.gather(1, ids.clamp_min(0))
    if support:
        xc = xi[:, 1:].masked_fill(c < 0, -INF)
        has = torch.isfinite(xc).any(dim=1) if xc.shape[1] else torch.zeros(n, dtype=torch.bool)
        lse = torch.full((n,), INF, dtype=torch.float64)
        ent = torch.zeros(n, dtype=torch.float64)
        if bool(has.any()):
            rows = xc[has]
            lse_h = torch.logsumexp(rows, dim=1)
            lse = lse.masked_scatter(has, lse_h)
            lp = rows - lse_h[:, None]
            pr = lp.exp()
            ent = ent.masked_scatter(has, -torch.where(pr > 0, pr * lp, torch.zeros_like(pr)).sum(1).detach())
    else:
        lse = torch.logsumexp(x, dim=1)
        lp = torch.log_softmax(x, dim=1)
        pr = lp.exp()
        ent = -torch.where(pr > 0, pr * lp, torch.zeros_like(pr)).sum(1).detach()
        has = torch.isfinite(lse)
        lse = torch.where(has, lse, torch.full_like(lse, INF))
    if skip is not None:
        lse = lse.masked_fill(skip, INF)
        ent = ent.masked_fill(skip, 0.0)
    logp = torch.where(torch.isfinite(lse)[:, None], xi - torch.where(torch.isfinite(lse), lse, 0.0)[:, None], -INF)
    logp = logp.masked_fill(ids < 0, -INF)
    return (logp[:, 0], logp[:, 1:], lse.detach(), ent), (hd, wd, bd)


def sum_p2(h: Tensor, w: Tensor, b: Tensor | None, y: Tensor, c: Tensor | None, tau: float | Tensor, *,
           support: bool = False, skip: Tensor | None = None) -> Tensor:
    """float64 ``sum_v p(v)^2`` per row of ``softmax((h W^T + b) / tau)`` (full vocabulary), or with ``support``
    of the distribution renormalised over the row's candidates (``-1`` padding left out); 0 on skipped rows and
    rows without mass. Written out directly from the logits, sharing nothing with the statistics under test."""
    n = h.shape[0]
    z = h.detach().double() @ w.detach().double().T
    if b is not None:
        z = z + b.detach().double()
    x = z * _inv_temp(tau, n)[:, None]
    if support:
        c = c.long()
        x = x.gather(1, c.clamp_min(0)).masked_fill(c < 0, -INF)
    out = torch.zeros(n, dtype=torch.float64)
    for i in range(n):
        row = x[i][x[i] > -INF]
        if row.numel() and not (skip is not None and bool(skip[i])):
            p = torch.softmax(row, dim=0)
            out[i] = (p * p).sum()
    return out
