"""Triton backend for the vocabulary pass: the GPU path (and, under ``TRITON_INTERPRET=1``, the same kernels on CPU).

Both functions follow the logits contract of :mod:`offpolicy.ops.backend_registry` by launching the kernels of
:mod:`offpolicy.kernels.logsoftmax`: the forward reads the logits once, the backward reads them once and writes
the gradient once, every row in its own program of a 1-D grid; all arithmetic is fp32.

float64 logits (gradient checks, references) are outside the kernels' remit: the backend declares
``float64=False`` and the registry sends them to the torch backend.
"""

from __future__ import annotations

from torch import Tensor

from offpolicy.kernels import logsoftmax as kernels
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
