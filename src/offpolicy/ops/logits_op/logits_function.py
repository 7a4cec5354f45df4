"""Autograd function of the logits primitive (:func:`offpolicy.ops.sparse_log_softmax`).

Forward: the log-softmax of ``x = z inv_temp`` gathered at ``ids [N, M]`` (the target first, then the candidates),
with the normaliser ``lse`` over the full (local) vocabulary or over the row's support. Backward, the closed form

    dz = inv_temp (scatter(g at ids) - G p),      G = sum of g over the row,  p = exp(x - lse)

(support mode: ``p`` is the support-renormalised distribution and every entry outside the support gets exactly
zero). Rows without mass (skipped, empty), padding entries and rows whose upstream gradient is zero take no
gradient whatever their logits hold (NaN and inf included).

Eager, the functions call the plan's backend directly (resolved once, at the boundary); while ``torch.compile``
traces, they go through the custom ops of :mod:`offpolicy.ops.library` (opaque to the tracer, shape-only fakes). The
forward reads that choice from the plan (made at the boundary, in the same trace), the backward asks once itself
(:func:`offpolicy.ops.library.tracing`: it may run under compiled autograd) and, eagerly on CPU, enters the
single-intra-op-thread context of :mod:`offpolicy.ops.row_threads` (the forward runs inside the boundary's).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor

from offpolicy.ops import library, online_softmax, row_stats, row_threads, workspace
from offpolicy.ops.backend_registry import Backend
from offpolicy.ops.online_softmax import INF
from offpolicy.ops.vocab_parallel import VocabShard, combine_shards, gather_local, localise, sum_shards


@dataclass(frozen=True)
class LogitsPlan:
    """How one call runs: normalisation, vocabulary shard, in-place gradient, the backend, the extra statistics to
    return (names of :data:`offpolicy.ops.row_stats.STATISTICS`, in its order), and whether the call runs eagerly
    (False while ``torch.compile`` traces)."""

    support: bool
    shard: VocabShard | None
    inplace_grad: bool
    backend: Backend
    stats: tuple[str, ...] = ()
    eager: bool = True


class SparseLogSoftmaxFunction(torch.autograd.Function):
    """``(logp [N, M], lse [N], entropy [N], *values)`` of ``logits [N, V]`` at ``ids [N, M]`` (``-1`` padding),
    ``values`` one ``[N]`` tensor per statistic named in ``plan.stats``, in that order. Eagerly on CPU the forward
    runs inside the single-thread context of its boundary (:func:`offpolicy.policy_loss` or
    :func:`offpolicy.ops.sparse_log_softmax`)."""

    @staticmethod
    def forward(ctx, logits: Tensor, ids: Tensor, inv_temp: Tensor, skip: Tensor | None, plan: LogitsPlan):
        local = localise(ids, plan.shard, logits.shape[1])
        x = gather_local(logits, local, inv_temp)
        pad = ids < 0
        probs = m_local = None
        if plan.support:
            if plan.shard is not None:
                x = sum_shards(plan.shard, x)
            x = x.masked_fill(pad, -INF)
            lse, entropy = online_softmax.support_stats(x[:, 1:])
            if skip is not None:
                lse = lse.masked_fill(skip, INF)
                entropy = entropy.masked_fill(skip, 0.0)
            values = row_stats.support(plan.stats, x[:, 1:], lse)
        else:
            # A backend that caches exp(x - m) writes it into the buffer that becomes the gradient, and the
            # backward only rescales it (no second exp pass, no second read of the logits). Eager only: the cache
            # lives outside autograd's saved tensors.
            if (plan.eager and plan.backend.caches_probs and ctx.needs_input_grad[0] and not plan.inplace_grad
                    and logits.dtype == inv_temp.dtype):
                probs = workspace.gradient_buffer(logits)
                stats = plan.backend.logits.full_stats(logits, inv_temp, skip, probs, extras=plan.stats)
                m_local = stats.m
            elif plan.eager:
                stats = plan.backend.logits.full_stats(logits, inv_temp, skip, extras=plan.stats)
            else:
                extras = row_stats.pack(plan.stats)
                stats = library.as_record(*library.full_stats(logits, inv_temp, skip, plan.backend.name, extras),
                                          extras)
            if plan.shard is not None:
                stats, x = combine_shards(plan.shard, stats, x)
            x = x.masked_fill(pad, -INF)
            lse, entropy, values = row_stats.finish(stats)
        logp = x - lse[:, None]
        ctx.save_for_backward(logits, local, inv_temp, lse, pad, x if plan.support else None)
        # The cached exponentials become the gradient in place, so they are kept off the saved-tensor list (whose
        # version check would forbid that) and used by the first backward only; a second backward through a
        # retained graph recomputes from the logits.
        ctx.probs, ctx.m_local, ctx.plan = probs, m_local, plan
        ctx.mark_non_differentiable(lse, entropy, *values.values())
        return logp, lse, entropy, *values.values()

    @staticmethod
    def backward(ctx, g: Tensor, _g_lse: Tensor, _g_entropy: Tensor, *_g_values: Tensor):
        """``dz [N, V]`` from ``g [N, M]``: the support form, the cached exponentials, or the backend's
        ``full_grad`` (directly, or through the custom op while tracing)."""
        eager = not library.tracing()
        with row_threads.single_intra_op() if eager and g.device.type == "cpu" else contextlib.nullcontext():
            logits, local, inv_temp, lse, pad, x = ctx.saved_tensors
            plan: LogitsPlan = ctx.plan
            probs, m_local = ctx.probs, ctx.m_local
            ctx.probs = ctx.m_local = None
            # Padding and rows without (finite) mass take no gradient, whatever arrives for them.
            finite = torch.isfinite(lse)
            valid = finite[:, None] & ~pad & (g != 0)
            g = torch.where(valid, g.to(inv_temp.dtype), torch.zeros_like(g, dtype=inv_temp.dtype))
            # A NaN lse (NaN or +inf logits on a row that takes no gradient) becomes +inf, "no mass": the backends
            # then neither read the row nor form exp(x - lse) there, so no 0 * NaN reaches the gradient.
            lse = torch.where(finite, lse, torch.full_like(lse, INF))
            grad_sum = g.sum(dim=1)
            if plan.support:
                dz = _support_grad(logits, local, inv_temp, lse, x, g, grad_sum, plan.inplace_grad, eager)
            elif probs is not None:
                dz = plan.backend.logits.grad_from_probs(probs, local, inv_temp, m_local, lse, g, grad_sum)
            elif eager:  # the backend directly, into the logits or a reused buffer
                out = logits if plan.inplace_grad else workspace.gradient_buffer(logits)
                dz = plan.backend.logits.full_grad(logits, local, inv_temp, lse, g, grad_sum, out)
            elif plan.inplace_grad:
                library.full_grad_inplace_(logits, local, inv_temp, lse, g, grad_sum, plan.backend.name)
                dz = logits
            else:
                dz = library.full_grad(logits, local, inv_temp, lse, g, grad_sum, plan.backend.name)
        return dz, None, None, None, None


def _support_grad(logits: Tensor, local: Tensor, inv_temp: Tensor, lse: Tensor, x: Tensor, g: Tensor,
                  grad_sum: Tensor, inplace: bool, eager: bool) -> Tensor:
    """Support mode: ``dz = inv_temp (scatter(g) - G p^S)`` on the support, exactly 0 elsewhere.

    ``p^S`` is zeroed on rows with no gradient (``G = 0`` and ``g = 0``), so NaN or inf logits on those rows cannot
    leak through ``0 * NaN``. The target's gradient is folded into its candidate column when it is in the support,
    so every id is written once (``scatter_``, no double rounding in bf16). The gradient goes into the logits
    (``inplace``) or a new buffer: eagerly a reused one zeroed by row chunks, while tracing a plain ``zeros``.
    """
    live = (g != 0).any(dim=1)
    p = online_softmax.support_probs(x[:, 1:], lse, live)
    cand = local[:, 1:]
    same = (cand == local[:, :1]) & (cand >= 0)
    vals = g[:, 1:] - grad_sum[:, None] * p + g[:, :1] * same
    target_val = torch.where(same.any(dim=1), torch.zeros_like(g[:, 0]), g[:, 0])
    vals = torch.cat([target_val[:, None], vals], dim=1) * inv_temp[:, None]
    owned = local >= 0
    if eager:
        dz = logits if inplace else workspace.gradient_buffer(logits)
        row_threads.for_chunks(dz.shape[0], max(1, (8 << 20) // max(1, dz.shape[1] * dz.element_size())),
                               lambda lo, hi: dz[lo:hi].zero_())
    else:
        dz = logits.zero_() if inplace else torch.zeros_like(logits, memory_format=torch.contiguous_format)
    rows = torch.arange(local.shape[0], device=local.device)[:, None].expand_as(local)
    dz.index_put_((rows[owned], local[owned]), vals[owned].to(dz.dtype), accumulate=True)
    return dz
