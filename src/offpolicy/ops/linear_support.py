"""Autograd function of the fused linear log-softmax in support mode (top-p / top-k mask replay).

Only the ``K`` support rows of the output layer enter: ``z_S = W[S] h + b[S]`` per token, ``O(N K D)`` work
and no vocabulary-sized pass. With ``x = z inv_temp`` (``-inf`` at padding), ``lse = logsumexp_S x`` and
``p^S = exp(x - lse)``, the backward is the closed form of :func:`offpolicy.ops.sparse_log_softmax`'s support mode,

    dz[n, S_j] = inv_temp[n] (g[n, j] - G[n] p^S[n, j]),   dz[n, y_n] += inv_temp[n] g[n, 0],   0 elsewhere

pushed through the gathered rows: ``dh[n] = sum_j dz[n, j] W[ids[n, j]]`` and ``dW[ids[n, j]] += dz[n, j] h[n]``
(only the rows used are written), accumulated in fp32.

Vocabulary parallelism: each rank computes the logits of the ids it owns (0 elsewhere) and a SUM all-reduce
assembles ``z_S``; the backward needs no communication.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import Tensor

from offpolicy.ops.sparse_log_softmax import VocabShard, _sum_shards, _support_stats

_INF = float("inf")


class LinearSupportLogSoftmax(torch.autograd.Function):
    """``(logp [N, M], lse [N], entropy [N])`` over each row's support ``ids[:, 1:]``; ``ids[:, 0]`` the target."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, ids: Tensor, local: Tensor,
                inv_temp: Tensor, skip: Tensor | None, shard: VocabShard | None, be: ModuleType,
                chunk_bytes: int):
        x = be.gathered_logits(hidden, weight, bias, local, chunk_bytes) * inv_temp[:, None]
        if shard is not None:
            x = _sum_shards(shard, x)
        x = x.masked_fill(ids < 0, -_INF)
        lse, entropy = _support_stats(x[:, 1:])
        if skip is not None:
            lse = lse.masked_fill(skip, _INF)
            entropy = entropy.masked_fill(skip, 0.0)
        ctx.save_for_backward(hidden, weight, bias, local, inv_temp, lse, x)
        ctx.be, ctx.chunk_bytes = be, chunk_bytes
        ctx.mark_non_differentiable(lse, entropy)
        return x - lse[:, None], lse, entropy

    @staticmethod
    def backward(ctx, g: Tensor, _g_lse: Tensor, _g_entropy: Tensor):
        hidden, weight, bias, local, inv_temp, lse, x = ctx.saved_tensors
        valid = torch.isfinite(lse)[:, None] & (g != 0)
        g = torch.where(valid, g.to(inv_temp.dtype), torch.zeros_like(g, dtype=inv_temp.dtype))
        p = torch.exp(x[:, 1:] - lse[:, None])  # 0 at padding and on rows with an empty support
        dx = torch.cat([g[:, :1], g[:, 1:] - g.sum(dim=1, keepdim=True) * p], dim=1)
        dz_ids = torch.where(local >= 0, dx * inv_temp[:, None], torch.zeros_like(dx))
        dh, dw, db, _ = ctx.be.backward(hidden, weight, bias, local, dz_ids, inv_temp, lse, None,
                                        chunk_bytes=ctx.chunk_bytes, needs=tuple(ctx.needs_input_grad[:3]))
        dh = None if dh is None else dh.to(hidden.dtype)
        return dh, dw, db, None, None, None, None, None, None, None
