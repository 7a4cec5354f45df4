"""The logits op in float64, written densely and directly: the reference every backend and the op itself are tested
against. It imports nothing from the library (only torch), keeps no running statistics, and reads every logit.

* :func:`sparse_log_softmax`: the op's outputs ``(target [N], candidates [N, K], lse [N], entropy [N])`` from
  ``log_softmax`` of ``x = z / tau`` (over the vocabulary, or over each row's candidate support); differentiable
  through autograd, so its gradient is the op's reference gradient.
* :func:`full_stats`, :func:`full_grad`, :func:`lse_entropy`: the backends' contract functions
  (:mod:`offpolicy.ops.backend_registry`) written out, for the backend tests; :func:`sum_p2`, :func:`varentropy`:
  the extra statistics of :mod:`offpolicy.ops.row_stats`, each from ``p`` directly.

Conventions (as the op defines them): rows without mass (all ``-inf``, an empty support) and skipped rows give
``-inf`` log-probabilities, ``lse = +inf``, entropy 0 and no gradient; padding ids (``-1``) give ``-inf``. In
support mode the target's value is ``x_y - lse_S``, ``-inf`` only where ``x_y`` is.
"""

from __future__ import annotations

import torch
from torch import Tensor

INF = float("inf")


def sparse_log_softmax(z: Tensor, targets: Tensor, candidate_ids: Tensor | None, tau: Tensor, support: bool = False,
                       skip: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """float64 ``(target [N], candidates [N, K], lse [N], entropy [N])`` of ``z [N, V]`` (float64, may require
    grad) at ``targets [N]`` and ``candidate_ids [N, K]`` (``-1`` padding, or None), temperatures ``tau [N]``."""
    n, v = z.shape
    cands = torch.empty(n, 0, dtype=torch.int64) if candidate_ids is None else candidate_ids.long()
    y = targets.long()
    x = z / tau.double()[:, None]
    if support:
        where = torch.where(cands >= 0, cands, v)
        mask = torch.zeros(n, v + 1, dtype=torch.bool).scatter_(1, where, True)[:, :v]
        xs = x.masked_fill(~mask, -INF)
    else:
        xs = x
    dead = (xs == -INF).all(dim=1)
    if skip is not None:
        dead = dead | skip
    xs_live = torch.where(dead[:, None], torch.zeros_like(xs), xs)  # no NaN in the backward of dead rows
    lse_live = torch.logsumexp(xs_live, dim=1)
    target = torch.where(dead, -INF, x.gather(1, y[:, None])[:, 0] - lse_live)
    cand = torch.where((cands >= 0) & ~dead[:, None], x.gather(1, cands.clamp_min(0)) - lse_live[:, None], -INF)
    logp = (xs_live - lse_live[:, None]).detach()
    p = torch.exp(logp)
    ent = torch.where(dead, 0.0, -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(dim=1))
    lse = torch.where(dead, INF, lse_live.detach())
    return target, cand, lse, ent


def lse_entropy(m: Tensor, s: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
    """float64 ``(lse, entropy)`` from a backend's row statistics ``(m, s, t)`` (``lse = +inf``, entropy 0 where
    ``s = 0``: a row without mass), on the CPU."""
    m, s, t = m.cpu().double(), s.cpu().double(), t.cpu().double()
    has = s > 0
    safe = torch.where(has, s, 1.0)
    return torch.where(has, m + torch.log(safe), INF), torch.where(has, torch.log(safe) - t / safe, 0.0)


def full_stats(z: Tensor, inv_temp: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """float64 ``lse [N]`` (``+inf`` for rows without mass), entropy ``[N]`` of ``softmax(z * inv_temp)``, and
    ``x = z * inv_temp [N, V]``."""
    x = z.double() * inv_temp.double()[:, None]
    lse = torch.logsumexp(x, dim=1)
    dead = lse == -INF
    logp = torch.log_softmax(torch.where(dead[:, None], torch.zeros_like(x), x), dim=1)
    p = torch.exp(logp)
    ent = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(dim=1)
    return torch.where(dead, INF, lse), torch.where(dead, 0.0, ent), x


def full_grad(z: Tensor, ids: Tensor, inv_temp: Tensor, lse: Tensor, grad: Tensor, grad_sum: Tensor) -> Tensor:
    """float64 ``inv_temp * (scatter_add(grad at ids) - G exp(x - lse))`` ``[N, V]``; no dense part where
    ``lse = +inf`` or ``G = 0`` (the backends do not read those rows, which may hold NaN)."""
    n, v = z.shape
    x = z.double() * inv_temp.double()[:, None]
    p = torch.exp(x - lse.double()[:, None])
    no_dense = torch.isinf(lse.double()) | (grad_sum == 0)
    p = torch.where(no_dense[:, None], torch.zeros_like(p), p)
    sc = torch.zeros(n, v + 1, dtype=torch.float64)
    sc.scatter_add_(1, torch.where(ids >= 0, ids, v), grad.double())
    return inv_temp.double()[:, None] * (sc[:, :v] - grad_sum.double()[:, None] * p)


def sum_p2(z: Tensor, inv_temp: Tensor) -> Tensor:
    """float64 ``sum_v p(v)^2`` of ``softmax(z * inv_temp)`` per row (0 for rows without mass), on the CPU: ``p``
    from ``exp(x - logsumexp(x))`` squared and summed directly (no running statistics)."""
    x = z.cpu().double() * inv_temp.cpu().double()[:, None]
    lse = torch.logsumexp(x, dim=1)
    dead = lse == -INF
    p = torch.exp(x - torch.where(dead, 0.0, lse)[:, None])
    return torch.where(dead, 0.0, (p**2).sum(dim=1))


def varentropy(z: Tensor, inv_temp: Tensor) -> Tensor:
    """float64 variance of the surprisal ``-log p`` under ``p = softmax(z * inv_temp)`` per row,
    ``sum_v p(v) (log p(v) + H)^2`` with ``H`` the entropy (0 for rows without mass), on the CPU: from
    ``log_softmax`` directly, two passes over the row (no running statistics, no ``E[x^2] - E[x]^2``)."""
    x = z.cpu().double() * inv_temp.cpu().double()[:, None]
    dead = torch.logsumexp(x, dim=1) == -INF
    logp = torch.log_softmax(torch.where(dead[:, None], torch.zeros_like(x), x), dim=1)
    p = torch.exp(logp)
    logp = torch.where(p > 0, logp, torch.zeros_like(logp))
    h = -(p * logp).sum(dim=1)
    return torch.where(dead, 0.0, (p * (logp + h[:, None]).square()).sum(dim=1))
