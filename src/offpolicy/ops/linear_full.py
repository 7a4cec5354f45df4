"""Autograd function of the fused linear log-softmax over the full (local) vocabulary: head mode, no record.

Forward: one pass over vocabulary tiles x token chunks of ``z = h W^T + b`` (never stored) yields the per-row
online-softmax statistics ``(m, s, t)`` and the logits at the ``1 + K`` ids; ``lse = m + log s`` and the entropy
``log s - t / s`` follow exactly as in :func:`offpolicy.ops.sparse_log_softmax`.

Backward by recompute. With ``g`` the upstream gradient of the gathered log-probabilities and ``G = sum_j g_j``,

    dz[n, v] = inv_temp[n] (sum_j [ids[n, j] = v] g[n, j]  -  G[n] p[n, v]),   p = exp(x - lse)

so ``dz`` is a sparse part at the ids plus a dense part ``coef[n] p[n, v]`` with ``coef = -G inv_temp``. The
backend recomputes ``p`` tile by tile and accumulates ``dh = dz W``, ``dW = dz^T h``, ``db = sum_n dz`` in fp32.

Vocabulary parallelism: the statistics are combined across shards like the logits path; each rank's ``dh`` is
its shard's partial sum (what autograd through ``h @ W_local^T`` gives; the tensor-parallel layer that
replicated ``h`` sums it over ranks).
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import Tensor

from offpolicy.ops.sparse_log_softmax import VocabShard, _combine_shards

_INF = float("inf")


def _stats_on_rows(be: ModuleType, hidden, weight, bias, local, inv_temp, skip, chunk_bytes):
    """Backend statistics for the rows not in ``skip``; skipped rows get ``m = s = t = 0`` and ``x = 0``."""
    if skip is None:
        return be.full_stats(hidden, weight, bias, local, inv_temp, chunk_bytes)
    n = hidden.shape[0]
    rows = (~skip).nonzero().squeeze(1)
    m_a, s_a, t_a, x_a = be.full_stats(hidden.index_select(0, rows), weight, bias, local.index_select(0, rows),
                                       inv_temp.index_select(0, rows), chunk_bytes)
    m = torch.zeros(n, dtype=inv_temp.dtype, device=hidden.device)
    s, t = torch.zeros_like(m), torch.zeros_like(m)
    x = torch.zeros(local.shape, dtype=inv_temp.dtype, device=hidden.device)
    for full, part in ((m, m_a), (s, s_a), (t, t_a), (x, x_a)):
        full.index_copy_(0, rows, part)
    return m, s, t, x


class LinearFullLogSoftmax(torch.autograd.Function):
    """``(logp [N, M], lse [N], entropy [N])`` of ``softmax((h W^T + b) inv_temp)`` at ids ``[N, M]``."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, ids: Tensor, local: Tensor,
                inv_temp: Tensor, skip: Tensor | None, shard: VocabShard | None, be: ModuleType,
                chunk_bytes: int, grad_filter: float | None):
        m, s, t, x = _stats_on_rows(be, hidden, weight, bias, local, inv_temp, skip, chunk_bytes)
        if shard is not None:
            m, s, t, x = _combine_shards(shard, m, s, t, x)
        x = x.masked_fill(ids < 0, -_INF)
        has_mass = s > 0
        safe_s = torch.where(has_mass, s, torch.ones_like(s))
        lse = torch.where(has_mass, m + torch.log(safe_s), torch.full_like(m, _INF))
        entropy = torch.where(has_mass, torch.log(safe_s) - t / safe_s, torch.zeros_like(s))
        ctx.save_for_backward(hidden, weight, bias, local, inv_temp, lse)
        ctx.be, ctx.chunk_bytes, ctx.grad_filter = be, chunk_bytes, grad_filter
        ctx.mark_non_differentiable(lse, entropy)
        return x - lse[:, None], lse, entropy

    @staticmethod
    def backward(ctx, g: Tensor, _g_lse: Tensor, _g_entropy: Tensor):
        hidden, weight, bias, local, inv_temp, lse = ctx.saved_tensors
        valid = torch.isfinite(lse)[:, None] & (g != 0)
        g = torch.where(valid, g.to(inv_temp.dtype), torch.zeros_like(g, dtype=inv_temp.dtype))
        coef = -g.sum(dim=1) * inv_temp
        dz_ids = torch.where(local >= 0, g * inv_temp[:, None], torch.zeros_like(g))
        dh, dw, db, _ = ctx.be.backward(hidden, weight, bias, local, dz_ids, inv_temp, lse, coef,
                                        chunk_bytes=ctx.chunk_bytes, grad_filter=ctx.grad_filter,
                                        needs=tuple(ctx.needs_input_grad[:3]))
        dh = None if dh is None else dh.to(hidden.dtype)
        return dh, dw, db, None, None, None, None, None, None, None, None
