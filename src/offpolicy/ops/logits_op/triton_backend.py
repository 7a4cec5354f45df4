"""Triton backend for the vocabulary pass: the GPU path (and, under ``TRITON_INTERPRET=1``, the same kernels on CPU).

Both functions follow the logits contract of :mod:`offpolicy.ops.backend_registry` by launching the kernels of
:mod:`offpolicy.kernels.logsoftmax`: the forward reads the logits once, the backward reads them once and writes
the gradient once, every row in its own program of a 1-D grid; all arithmetic is fp32.

The support pass (:mod:`offpolicy.ops.support_pass`: CSR support records, mask replay) has its own kernels,
:mod:`offpolicy.kernels.support_logsoftmax`, behind :func:`support_stats` / :func:`support_grad` (the contract of
:func:`offpolicy.ops.logits_op.torch_backend.support_stats` / ``support_grad``): one program per row walking its
CSR segment, ``O(|S|)`` work per row forward, the zeroing of the gradient row and ``O(|S|)`` backward.

float64 logits (gradient checks, references) are outside the kernels' remit: the backend declares
``float64=False`` and the registry sends them to the torch backend.
"""

from __future__ import annotations

import torch
from torch import Tensor

from offpolicy.kernels import logsoftmax as kernels
from offpolicy.kernels import support_logsoftmax as support_kernels
from offpolicy.ops.logits_op import torch_backend
from offpolicy.ops.row_stats import RowStats

#: The extras (:data:`offpolicy.ops.row_stats.STATISTICS`) the kernels accumulate: ``q = sum exp(2 (x - m))``.
NATIVE_STATS = frozenset({"sum_p2"})


def full_stats(logits: Tensor, inv_temp: Tensor, skip: Tensor | None, *,
               extras: tuple[str, ...] = ()) -> RowStats:
    """Per-row statistics of ``x = logits * inv_temp`` over the whole (local) vocabulary.

    Args:
        logits: ``[N, V]`` bf16/fp16/fp32, unit stride along ``V``.
        inv_temp: ``[N]`` fp32, ``1 / tau``.
        skip: ``[N]`` bool or None; skipped rows are not read and report ``m = s = t = 0``.
        extras: names of :data:`offpolicy.ops.row_stats.STATISTICS`; those in :data:`NATIVE_STATS` come from the
            same kernel pass, any other sends the whole pass to the PyTorch backend.

    Returns:
        :class:`~offpolicy.ops.row_stats.RowStats`, fp32: ``m [N]`` (row max, 0 where the row is all ``-inf`` or
        skipped), ``s [N] = sum exp(x - m)``, ``t [N] = sum exp(x - m) * (x - m)`` and the extras' accumulators.
    """
    if not NATIVE_STATS.issuperset(extras):
        return torch_backend.full_stats(logits, inv_temp, skip, extras=extras)
    m, s, t, *q = kernels.row_stats(logits, inv_temp, skip, sum_p2="sum_p2" in extras)
    return RowStats(m, s, t, dict(zip(extras, q)))


def full_grad(
    logits: Tensor,
    ids: Tensor,
    inv_temp: Tensor,
    lse: Tensor,
    grad: Tensor,
    grad_sum: Tensor,
    out: Tensor,
) -> Tensor:
    """Write ``dz = inv_temp * (scatter(grad at ids) - grad_sum * exp(x - lse))`` into ``out`` and return it.

    Args:
        logits: ``[N, V]``; ``x = logits * inv_temp``.
        ids: ``[N, M]`` int64 local column ids, ``-1`` where the entry is padding or owned by another shard;
            repeated ids add their gradients.
        inv_temp: ``[N]`` fp32.
        lse: ``[N]`` fp32 normaliser of ``x``; ``+inf`` marks a row with no mass (its logits are not read).
        grad: ``[N, M]`` fp32 upstream gradient of the gathered log-probabilities (0 at padding).
        grad_sum: ``[N]`` fp32 ``sum`` of the row's gradient over *all* its entries (all shards).
        out: ``[N, V]`` output in the logits' dtype, unit stride along ``V``; may be ``logits`` itself
            (in-place: the logits are overwritten, outside autograd's version check).
    """
    return kernels.row_grad(logits, ids, inv_temp, lse, grad, grad_sum, out)


def full_stats_grad(
    logits: Tensor,
    target: Tensor,
    inv_temp: Tensor,
    skip: Tensor | None,
    coef: Tensor,
    shift: Tensor,
    out: Tensor,
    *,
    band: tuple[float, float] | None,
    exp_clip: tuple[float, float, float] | None,
    head: tuple[Tensor, Tensor] | None = None,
    tail_eps: float = 1e-6,
) -> tuple[Tensor, ...]:
    """The row statistics and the gradient of ``sum_rows g log p(target)``, ``g = coef f(log p(target) - shift)``,
    in one program per row (:func:`offpolicy.kernels.logsoftmax.row_loss_grad`: one read of the logits from
    memory, one re-read from L2, one write of ``out``).

    Args:
        logits: ``[N, V]`` bf16/fp16/fp32, unit stride along ``V``.
        target: ``[N]`` int64 column ids.
        inv_temp: ``[N]`` fp32.
        skip: ``[N]`` bool or None: rows not read, zero gradient.
        coef, shift: ``[N]`` fp32.
        out: ``[N, V]`` in the logits' dtype.
        band, exp_clip: the rule ``f`` (see the kernel's wrapper).
        head, tail_eps: the head term (``(ids [N, K] int64, lq [N, K] fp32)``) and its ``eps``, or None.

    Returns:
        ``(m, s, t, lse, g)``, each ``[N]`` fp32.
    """
    return kernels.row_loss_grad(logits, target, inv_temp, skip, coef, shift, out, band=band, exp_clip=exp_clip,
                                 head=head, tail_eps=tail_eps)


def support_stats(logits: Tensor, offsets: Tensor, ids: Tensor, inv_temp: Tensor, skip: Tensor | None, *,
                  keep_wide: bool = False):
    """The support pass's forward over CSR rows, ``(lp [nnz], lse [N], entropy [N])`` fp32, by
    :func:`offpolicy.kernels.support_logsoftmax.support_stats` (the contract of
    :func:`offpolicy.ops.logits_op.torch_backend.support_stats`).

    Math, per row ``r`` with support ``S_r`` and ``x = logits * inv_temp``: ``lse_r = log sum_{v in S_r} exp(x_v)``
    from one online sweep over the gathered logits (running max ``m`` of the raw logits, ``s = sum exp((z - m)
    inv_temp)`` rescaled by ``exp((m - m') inv_temp)`` when the max moves to ``m'``; ``lse = m inv_temp + log s``),
    ``lp_e = x_{ids_e} - lse_r``, entropy ``log s - sum e (x - m) / s``. Rows without mass (skipped, empty, all
    ``-inf``): ``lse = +inf``, ``lp = -inf``, entropy 0; NaN / ``+inf`` in the support or an overflowing ``z / tau``:
    NaN values (the loss's boundary refuses them).

    Args:
        logits: ``[N, V]`` bf16/fp16/fp32, unit stride along ``V``.
        offsets: ``[N + 1]`` int64; ids: ``[nnz]`` int64 in ``[0, V)``, distinct within a row (validated record).
        inv_temp: ``[N]`` fp32; skip: ``[N]`` bool rows not read, or None.
        keep_wide: accepted for the contract; this backend keeps nothing for wide rows (every width takes the same
            ``O(|S|)`` kernel), so ``wide`` is always None.
    """
    out = support_kernels.support_stats(logits, offsets.to(torch.int64), ids.to(torch.int64),
                                        inv_temp.to(torch.float32), skip)
    return (*out, None) if keep_wide else out


def support_grad(lp: Tensor, offsets: Tensor, ids: Tensor, tokens: Tensor, inv_temp: Tensor, grad_lp: Tensor | None,
                 grad_target: Tensor, live: Tensor, out: Tensor, *, wide=None, logits: Tensor | None = None) -> Tensor:
    """The support pass's backward written into ``out [N, V]`` (every element: the caller's buffer needs no zero
    fill) and returned, by :func:`offpolicy.kernels.support_logsoftmax.support_grad`.

    Math: with ``G_r = grad_target_r + sum_{e in row r} grad_lp_e`` and ``p^S = exp(lp)``,
    ``d lp_u / d x_v = [u = v] - p^S(v) [v in S]`` gives ``out[r, v] = inv_temp_r (grad_lp_e [v = ids_e] +
    grad_target_r [v = tokens_r] - G_r p^S(v) [v in S_r])``: exactly 0 outside the support and the token, and on
    rows not ``live``. Each entry is written once (the token's term folded into its entry).

    Args:
        lp: ``[nnz]`` fp32 from :func:`support_stats`; offsets, ids: the rows; tokens: ``[N]`` int64.
        inv_temp: ``[N]`` fp32; grad_lp: ``[nnz]`` or None; grad_target: ``[N]``; live: ``[N]`` bool.
        out: ``[N, V]`` in the logits' dtype, unit stride along ``V``.
        wide, logits: accepted for the contract (no wide rows here); unused.
    """
    return support_kernels.support_grad(lp.to(torch.float32), offsets.to(torch.int64), ids.to(torch.int64),
                                        tokens.to(torch.int64), inv_temp.to(torch.float32),
                                        None if grad_lp is None else grad_lp.to(torch.float32),
                                        grad_target.to(torch.float32), live.to(torch.bool), out)
