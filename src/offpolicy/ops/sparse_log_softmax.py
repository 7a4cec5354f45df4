"""The one vocabulary-sized primitive: a log-softmax that returns only the ``1 + K`` entries each row needs.

Given logits ``z [N, V]``, per-row ids (the sampled token and ``K`` candidates), a temperature and a
normalisation (the full vocabulary, or the row's candidate support), it returns the gathered log-probabilities
of ``x = z / tau``, the normaliser ``lse`` and the entropy. Its backward is the closed form

    dz = (scatter(g at ids) - G p) / tau,      G = sum of g over the row,  p = exp(x - lse)

(support mode: ``p`` is the support-renormalised distribution and every entry outside the support gets exactly
zero). Only the full-vocabulary statistics and the backward touch ``[N, V]`` data; they run in a backend
(:mod:`offpolicy.ops.backends`). Support-mode forward is a gather: ``O(N K)``.

Vocabulary parallelism: with ``shard=VocabShard(group, start)`` each rank holds the columns
``[start, start + V_local)``; the forward all-reduces one MAX and one packed SUM of ``O(N (3 + 1 + K))`` per-row
statistics, and the backward needs no communication (each rank differentiates the same replicated loss).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from offpolicy.ops import backends, library, torch_backend

_INF = float("inf")


class SparseLogSoftmax(NamedTuple):
    """Outputs of :func:`sparse_log_softmax` (fp32; float64 for float64 logits).

    Attributes:
        target: ``[N]`` log-probability of the sampled token.
        candidates: ``[N, K]`` log-probabilities of the candidates, ``-inf`` at padding.
        lse: ``[N]`` normaliser of ``z / tau`` (full vocabulary, or the support); ``+inf`` on skipped rows.
        entropy: ``[N]`` entropy of the (full or support) distribution; 0 on skipped rows. Not differentiable.
    """

    target: Tensor
    candidates: Tensor
    lse: Tensor
    entropy: Tensor


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice ``[start, start + V_local)`` of a vocabulary split over ``group``."""

    group: Any
    start: int


def _localise(ids: Tensor, shard: VocabShard | None, v_local: int) -> Tensor:
    """Global ids -> local column ids, ``-1`` for padding and for ids owned by another shard."""
    if shard is None:
        return ids
    local = ids - shard.start
    return torch.where((ids >= 0) & (local >= 0) & (local < v_local), local, torch.full_like(local, -1))


def _gather(logits: Tensor, local: Tensor, inv_temp: Tensor) -> Tensor:
    """``[N, M]`` fp32 ``x`` at the local ids, 0 where not owned (so a SUM over shards assembles the row)."""
    if logits.shape[1] == 0:  # a shard holding only vocabulary padding owns nothing
        return torch.zeros(local.shape, dtype=inv_temp.dtype, device=local.device)
    x = logits.gather(1, local.clamp_min(0)).to(inv_temp.dtype) * inv_temp[:, None]
    return torch.where(local >= 0, x, torch.zeros_like(x))


def _combine_shards(shard: VocabShard, m: Tensor, s: Tensor, t: Tensor, x: Tensor) -> tuple[Tensor, ...]:
    """All-reduce per-row online-softmax statistics over the vocabulary shards.

    With ``M = max_r m_r`` and ``a_r = exp(m_r - M)``: ``s = sum_r a_r s_r`` and
    ``t = sum_r a_r (t_r + s_r (m_r - M))`` (``t`` is taken relative to the row max). One MAX, one SUM.
    """
    import torch.distributed as dist

    m_loc = torch.where(s > 0, m, torch.full_like(m, -_INF))
    big = m_loc.clone()
    dist.all_reduce(big, op=dist.ReduceOp.MAX, group=shard.group)
    big = torch.where(torch.isfinite(big), big, torch.zeros_like(big))
    m_safe = torch.where(s > 0, m, big)
    a = torch.exp(m_loc - big)
    packed = torch.cat([(a * s)[:, None], (a * (t + s * (m_safe - big)))[:, None], x], dim=1)
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=shard.group)
    return big, packed[:, 0], packed[:, 1], packed[:, 2:]


def _sum_shards(shard: VocabShard, x: Tensor) -> Tensor:
    import torch.distributed as dist

    x = x.clone()
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=shard.group)
    return x


def _support_stats(xc: Tensor) -> tuple[Tensor, Tensor]:
    """lse and entropy over the valid (finite or ``-inf``-logit) support entries ``xc [N, K]`` (padding -inf)."""
    lse = torch.logsumexp(xc, dim=1) if xc.shape[1] else torch.full(xc.shape[:1], -_INF, device=xc.device)
    lse = torch.where(lse == -_INF, torch.full_like(lse, _INF), lse)
    logp = xc - lse[:, None]
    p = torch.exp(logp)
    entropy = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(dim=1)
    return lse, entropy


class _SparseLogSoftmaxFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, ids, inv_temp, skip, support, shard, inplace_grad, backend_name):
        n, v = logits.shape
        local = _localise(ids, shard, v)
        x = _gather(logits, local, inv_temp)
        pad = ids < 0
        probs = m_local = None
        if support:
            if shard is not None:
                x = _sum_shards(shard, x)
            x = x.masked_fill(pad, -_INF)
            lse, entropy = _support_stats(x[:, 1:])
            if skip is not None:
                lse = lse.masked_fill(skip, _INF)
                entropy = entropy.masked_fill(skip, 0.0)
        else:
            # CPU fast path: with fp32/fp64 logits that need a gradient, the torch backend leaves exp(x - m) in
            # the buffer that becomes the gradient, and the backward only rescales it (no second exp pass, no
            # second read of the logits). The buffer is the gradient itself: no extra [N, V] memory.
            if (backend_name == "torch" and ctx.needs_input_grad[0] and not inplace_grad
                    and logits.dtype == inv_temp.dtype and not torch.compiler.is_compiling()):
                probs = torch.empty_like(logits, memory_format=torch.contiguous_format)
                m, s, t = torch_backend.full_stats(logits, inv_temp, skip, probs)
                m_local = m
            else:
                m, s, t = library.full_stats(logits, inv_temp, skip, backend_name)
            if shard is not None:
                m, s, t, x = _combine_shards(shard, m, s, t, x)
            x = x.masked_fill(pad, -_INF)
            has_mass = s != 0  # NaN (a NaN logit) propagates into lse and the log-probabilities
            safe_s = torch.where(has_mass, s, torch.ones_like(s))
            lse = torch.where(has_mass, m + torch.log(safe_s), torch.full_like(m, _INF))
            entropy = torch.where(has_mass, torch.log(safe_s) - t / safe_s, torch.zeros_like(s))
        logp = x - lse[:, None]
        ctx.save_for_backward(logits, local, inv_temp, lse, pad, x if support else None)
        # The cached exponentials become the gradient in place, so they are kept off the saved-tensor list (whose
        # version check would forbid that) and used by the first backward only; a second backward through a
        # retained graph recomputes from the logits.
        ctx.probs, ctx.m_local = probs, m_local
        ctx.support, ctx.inplace_grad, ctx.backend_name = support, inplace_grad, backend_name
        ctx.mark_non_differentiable(lse, entropy)
        return logp, lse, entropy

    @staticmethod
    def backward(ctx, g, _g_lse, _g_entropy):
        logits, local, inv_temp, lse, pad, x = ctx.saved_tensors
        probs, m_local = ctx.probs, ctx.m_local
        ctx.probs = ctx.m_local = None
        # Padding and rows without mass take no gradient, whatever arrives for them.
        valid = torch.isfinite(lse)[:, None] & ~pad & (g != 0)
        g = torch.where(valid, g.to(inv_temp.dtype), torch.zeros_like(g, dtype=inv_temp.dtype))
        grad_sum = g.sum(dim=1)
        out = logits if ctx.inplace_grad else None
        if ctx.support:
            dz = _support_grad(logits, local, inv_temp, lse, x, g, grad_sum, out)
        elif probs is not None:
            dz = torch_backend.grad_from_probs(probs, local, inv_temp, m_local, lse, g, grad_sum)
        elif out is not None:
            library.full_grad_inplace_(logits, local, inv_temp, lse, g, grad_sum, ctx.backend_name)
            dz = logits
        else:
            dz = library.full_grad(logits, local, inv_temp, lse, g, grad_sum, ctx.backend_name)
        return dz, None, None, None, None, None, None, None


def _support_grad(logits, local, inv_temp, lse, x, g, grad_sum, out):
    """Support mode: ``dz = inv_temp (scatter(g) - G p^S)`` on the support, exactly 0 elsewhere.

    The target's gradient is folded into its candidate column when it is in the support, so every id is
    written once (``scatter_``, no double rounding in bf16).
    """
    p = torch.exp(x[:, 1:] - lse[:, None])  # 0 at padding and on empty rows
    cand = local[:, 1:]
    same = (cand == local[:, :1]) & (cand >= 0)
    vals = g[:, 1:] - grad_sum[:, None] * p + g[:, :1] * same
    target_val = torch.where(same.any(dim=1), torch.zeros_like(g[:, 0]), g[:, 0])
    vals = torch.cat([target_val[:, None], vals], dim=1) * inv_temp[:, None]
    owned = local >= 0
    dz = logits.zero_() if out is not None else torch.zeros_like(logits, memory_format=torch.contiguous_format)
    rows = torch.arange(local.shape[0], device=local.device)[:, None].expand_as(local)
    dz.index_put_((rows[owned], local[owned]), vals[owned].to(dz.dtype), accumulate=True)
    return dz


def sparse_log_softmax(
    logits: Tensor,
    targets: Tensor,
    candidate_ids: Tensor | None = None,
    temperature: float | Tensor = 1.0,
    *,
    support: bool = False,
    skip: Tensor | None = None,
    shard: VocabShard | None = None,
    inplace_grad: bool = False,
    backend: str | None = None,
) -> SparseLogSoftmax:
    """Log-softmax of ``logits / temperature`` at the sampled token and the candidates of each row.

    Args:
        logits: ``[N, V]`` bf16/fp16/fp32 (``V`` is the local shard width under ``shard``); unit stride in ``V``.
        targets: ``[N]`` int sampled token ids (global ids).
        candidate_ids: ``[N, K]`` int candidate ids, ``-1`` padding; None means ``K = 0``.
        temperature: float or ``[N]`` tensor, ``> 0``.
        support: normalise over each row's candidates (mask replay) instead of the full vocabulary.
        skip: ``[N]`` bool rows to leave out (their outputs are ``-inf`` log-probabilities and they cost no
            vocabulary bandwidth).
        shard: vocabulary-parallel shard description, or None.
        inplace_grad: write the gradient into ``logits`` in the backward. Saves one ``[N, V]`` buffer, but
            overwrites the logits and bypasses autograd's version check: use it only when nothing else needs
            the logits after the backward.
        backend: ``"torch"`` or ``"triton"``; default by device (see :mod:`offpolicy.ops.backends`).

    Returns:
        :class:`SparseLogSoftmax`; ``target`` and ``candidates`` are differentiable with respect to ``logits``.
    """
    n, _ = logits.shape
    ids = targets.to(torch.int64)[:, None]
    if candidate_ids is not None:
        ids = torch.cat([ids, candidate_ids.to(torch.int64)], dim=1)
    # fp32 statistics for 16/32-bit logits; float64 logits keep float64 throughout (gradcheck, references).
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    if isinstance(temperature, Tensor):
        inv_temp = (1.0 / temperature.to(device=logits.device, dtype=acc)).expand(n).contiguous()
    else:
        inv_temp = torch.full((n,), 1.0 / float(temperature), dtype=acc, device=logits.device)
    name = backends.resolve(backend, logits.device)
    logp, lse, entropy = _SparseLogSoftmaxFn.apply(logits, ids, inv_temp, skip, support, shard, inplace_grad, name)
    return SparseLogSoftmax(logp[:, 0], logp[:, 1:], lse, entropy)
