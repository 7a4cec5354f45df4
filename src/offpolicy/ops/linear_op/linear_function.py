"""Autograd function of the fused-linear primitive (:func:`offpolicy.ops.linear_sparse_log_softmax`): the
log-softmax of ``x = (h W^T + b) inv_temp`` at ``ids [N, M]`` without the ``[N, V]`` logits or their gradient.

Full mode (head records, no record): one pass over vocabulary tiles x token chunks of ``z`` (never stored) yields
the per-row online-softmax statistics ``(m, s, t)`` and the logits at the ids; ``lse`` and the entropy follow as in
the logits primitive (:func:`offpolicy.ops.online_softmax.finish`). The backward recomputes ``p`` tile by tile:

    dz[n, v] = inv_temp[n] (sum_j [ids[n, j] = v] g[n, j]  -  G[n] p[n, v]),   p = exp(x - lse)

a sparse part at the ids plus a dense part ``coef[n] p[n, v]`` with ``coef = -G inv_temp``, pushed through the
layer: ``dh = dz W``, ``dW = dz^T h``, ``db = sum_n dz``, accumulated in fp32 (``8 N D V`` FLOPs in all).

Support mode (mask replay): only the ``K`` support rows of ``W`` per token enter, ``O(N K D)``; ``p`` is the
support-renormalised distribution and the dense part is absent.

Rows whose upstream gradient is zero (untrained, skipped) and rows without mass take exactly zero gradient,
whatever their hidden state holds: their ids are dropped from the sparse part and their dense coefficient is 0.

Vocabulary parallelism: the statistics (full) or the gathered logits (support) are combined across shards as in
the logits primitive (:mod:`offpolicy.ops.vocab_parallel`); each rank's ``dh`` is its shard's partial sum (what
autograd through ``h @ W_local^T`` gives; the tensor-parallel layer that replicated ``h`` sums it over ranks).

Eager, the backend (resolved once, at the boundary) is called directly; while ``torch.compile`` traces, through the
custom ops of :mod:`offpolicy.ops.library`. The forward reads that choice from the plan, the backward asks once
(:func:`offpolicy.ops.library.tracing`: it may run under compiled autograd).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from offpolicy.ops import library, online_softmax, row_stats
from offpolicy.ops.backend_registry import Backend
from offpolicy.ops.online_softmax import INF
from offpolicy.ops.row_stats import RowStats
from offpolicy.ops.vocab_parallel import VocabShard, combine_shards, localise, sum_shards


@dataclass(frozen=True)
class LinearPlan:
    """How one call runs: normalisation, vocabulary shard, backend, working-set budget, gradient filter, the extra
    statistics to return (names of :data:`offpolicy.ops.row_stats.STATISTICS`, in its order), and whether the call
    runs eagerly (False while ``torch.compile`` traces)."""

    support: bool
    shard: VocabShard | None
    backend: Backend
    chunk_bytes: int
    grad_filter: float | None
    stats: tuple[str, ...] = ()
    eager: bool = True


class LinearSparseLogSoftmaxFunction(torch.autograd.Function):
    """``(logp [N, M], lse [N], entropy [N], *values)`` of ``softmax((h W^T + b) inv_temp)`` at ``ids [N, M]``,
    ``values`` one ``[N]`` tensor per statistic named in ``plan.stats``, in that order."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, ids: Tensor, inv_temp: Tensor,
                skip: Tensor | None, plan: LinearPlan):
        local = localise(ids, plan.shard, weight.shape[0])
        if plan.support:
            if plan.eager:
                x = plan.backend.linear.gathered_logits(hidden, weight, bias, local, plan.chunk_bytes)
            else:
                x = library.linear_gathered_logits(hidden, weight, bias, local, plan.chunk_bytes, plan.backend.name)
            x = x * inv_temp[:, None]
            if plan.shard is not None:
                x = sum_shards(plan.shard, x)
            x = x.masked_fill(ids < 0, -INF)
            lse, entropy = online_softmax.support_stats(x[:, 1:])
            if skip is not None:
                lse = lse.masked_fill(skip, INF)
                entropy = entropy.masked_fill(skip, 0.0)
            values = row_stats.support(plan.stats, x[:, 1:], lse)
        else:
            stats, x = _stats_on_rows(hidden, weight, bias, local, inv_temp, skip, plan)
            if plan.shard is not None:
                stats, x = combine_shards(plan.shard, stats, x)
            x = x.masked_fill(ids < 0, -INF)
            lse, entropy, values = row_stats.finish(stats)
        ctx.save_for_backward(hidden, weight, bias, local, ids < 0, inv_temp, lse, x if plan.support else None)
        ctx.plan = plan
        ctx.mark_non_differentiable(lse, entropy, *values.values())
        return x - lse[:, None], lse, entropy, *values.values()

    @staticmethod
    def backward(ctx, g: Tensor, _g_lse: Tensor, _g_entropy: Tensor, *_g_values: Tensor):
        hidden, weight, bias, local, pad, inv_temp, lse, x = ctx.saved_tensors
        plan: LinearPlan = ctx.plan
        # Padding and rows without (finite) mass take no gradient, whatever arrives for them.
        finite = torch.isfinite(lse)
        valid = finite[:, None] & ~pad & (g != 0)
        g = torch.where(valid, g.to(inv_temp.dtype), torch.zeros_like(g, dtype=inv_temp.dtype))
        # A NaN lse (NaN or +inf logits on a row that takes no gradient) becomes +inf, "no mass": the backends then
        # neither read the row nor form exp(x - lse) there, so no 0 * NaN reaches the gradient.
        lse = torch.where(finite, lse, torch.full_like(lse, INF))
        grad_sum = g.sum(dim=1)
        if plan.support:
            p = online_softmax.support_probs(x[:, 1:], lse, (g != 0).any(dim=1))
            dx = torch.cat([g[:, :1], g[:, 1:] - grad_sum[:, None] * p], dim=1)
            coef = None
        else:
            dx = g
            coef = -grad_sum * inv_temp
        dz_ids = torch.where(local >= 0, dx * inv_temp[:, None], torch.zeros_like(dx))
        # Entries without gradient are dropped, so no backend reads the hidden state or weight row behind them.
        active = torch.where(dz_ids != 0, local, torch.full_like(local, -1))
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_filter = None if plan.support else plan.grad_filter
        if library.tracing():
            dh, dw, db = library.linear_backward(hidden, weight, bias, active, dz_ids, inv_temp, lse, coef,
                                                 plan.chunk_bytes, grad_filter, need_h, need_w,
                                                 need_b and bias is not None, plan.backend.name)
        else:
            dh, dw, db, _ = plan.backend.linear.backward(hidden, weight, bias, active, dz_ids, inv_temp, lse, coef,
                                                         chunk_bytes=plan.chunk_bytes, grad_filter=grad_filter,
                                                         needs=(need_h, need_w, need_b and bias is not None))
        return (dh.to(hidden.dtype) if need_h else None, dw if need_w else None,
                db if need_b and bias is not None else None, None, None, None, None)


def _stats_on_rows(hidden: Tensor, weight: Tensor, bias: Tensor | None, local: Tensor, inv_temp: Tensor,
                   skip: Tensor | None, plan: LinearPlan) -> tuple[RowStats, Tensor]:
    """The backend's ``(stats, x)`` with the extras of ``plan.stats``; skipped rows are not read (eager) and report
    zeros throughout.

    Under ``torch.compile`` (no data-dependent shapes) every row is computed and the skipped ones are masked.
    """
    if not plan.eager:
        extras = row_stats.pack(plan.stats)
        m, s, t, x, acc = library.linear_full_stats(hidden, weight, bias, local, inv_temp, plan.chunk_bytes,
                                                    plan.backend.name, extras)
        stats = library.as_record(m, s, t, acc, extras)
        if skip is None:
            return stats, x
        keep = ~skip
        return (stats.map(lambda v: torch.where(keep, v, torch.zeros_like(v))),
                torch.where(keep[:, None], x, torch.zeros_like(x)))
    full_stats = plan.backend.linear.full_stats
    if skip is None:
        return full_stats(hidden, weight, bias, local, inv_temp, plan.chunk_bytes, extras=plan.stats)
    n = hidden.shape[0]
    rows = (~skip).nonzero().squeeze(1)
    part, x_part = full_stats(hidden.index_select(0, rows), weight, bias, local.index_select(0, rows),
                              inv_temp.index_select(0, rows), plan.chunk_bytes, extras=plan.stats)
    stats = row_stats.zeros(n, plan.stats, inv_temp.dtype, hidden.device)
    x = torch.zeros(local.shape, dtype=inv_temp.dtype, device=hidden.device)
    for full, got in zip((*stats.tensors(), x), (*part.tensors(), x_part)):
        full.index_copy_(0, rows, got)
    return stats, x
