"""Triton backend of the fused linear log-softmax: the contract of :mod:`offpolicy.ops.linear_op.linear_torch_backend`
on the kernels of :mod:`offpolicy.kernels.linear_logsoftmax` (the CUDA default).

No token chunking is needed: no kernel stores a logits tile, so the only extra memory is the fp32 gradient
accumulators ``dh [N, D]``, ``dW [V, D]`` (when the weight is not fp32) and ``O(N M)`` per-row data.
``chunk_bytes`` is accepted for the contract and unused. On CPU tensors the kernels run under Triton's
interpreter (``TRITON_INTERPRET=1`` must be set before Triton is imported).
"""

from __future__ import annotations

import torch
from torch import Tensor

from offpolicy.kernels import linear_logsoftmax as K
from offpolicy.ops.linear_op import linear_torch_backend
from offpolicy.ops.row_stats import RowStats

#: The extras (:data:`offpolicy.ops.row_stats.STATISTICS`) the kernels accumulate: ``q = sum exp(2 (x - m))``.
NATIVE_STATS = frozenset({"sum_p2"})


def _require_16_32(*tensors: Tensor | None) -> None:
    for x in tensors:
        if x is not None and x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"backend 'triton': expected fp32/bf16/fp16 tensors, got {x.dtype} (use backend='torch')")


def _unit(x: Tensor) -> Tensor:
    """``x`` with unit stride along ``D`` (the kernels' layout); a copy only when it is not."""
    return x if x.stride(-1) == 1 else x.contiguous()


def gathered_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, ids: Tensor, chunk_bytes: int) -> Tensor:
    """``[N, M]`` fp32 logits at the ids, 0 where ``ids < 0`` (see the torch backend)."""
    _require_16_32(hidden, weight, bias)
    return K.gathered_dot(_unit(hidden), _unit(weight), bias, ids)


def full_stats(hidden: Tensor, weight: Tensor, bias: Tensor | None, ids: Tensor, inv_temp: Tensor,
               chunk_bytes: int, *, extras: tuple[str, ...] = ()) -> tuple[RowStats, Tensor]:
    """``(stats, x)``: the :class:`~offpolicy.ops.row_stats.RowStats` over the whole (local) vocabulary and
    ``x [N, M]`` at the ids (see the torch backend). The extras in :data:`NATIVE_STATS` come from the same kernel
    pass; any other sends the call to the torch backend.

    The ids' logits come from the gathered dot products (``O(N M D)``), not from the vocabulary tiles.
    """
    if not NATIVE_STATS.issuperset(extras):
        return linear_torch_backend.full_stats(hidden, weight, bias, ids, inv_temp, chunk_bytes, extras=extras)
    _require_16_32(hidden, weight, bias)
    hidden, weight = _unit(hidden), _unit(weight)
    m, s, t, *q = K.merge_stats(*K.linear_row_stats(hidden, weight, bias, inv_temp, sum_p2="sum_p2" in extras))
    x = K.gathered_dot(hidden, weight, bias, ids) * inv_temp[:, None]
    return RowStats(m, s, t, dict(zip(extras, q))), x


def backward(hidden: Tensor, weight: Tensor, bias: Tensor | None, ids: Tensor, dz_ids: Tensor, inv_temp: Tensor,
             lse: Tensor, coef: Tensor | None, *, chunk_bytes: int, grad_filter: float | None = None,
             needs: tuple[bool, bool, bool] = (True, True, True)):
    """``dh`` (fp32), ``dW`` (weight dtype), ``db`` (bias dtype) and the filtered-tile count (see the torch backend;
    here a ``[1]`` int32 tensor on the device, so that nothing waits on the GPU)."""
    _require_16_32(hidden, weight, bias)
    hidden, weight = _unit(hidden), _unit(weight)
    n, d = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    need_h, need_w, need_b = needs
    need_b = need_b and bias is not None
    dh = torch.zeros(n, d, dtype=torch.float32, device=dev) if need_h else None
    dw = torch.zeros(v, d, dtype=torch.float32, device=dev) if need_w else None
    db = torch.zeros(v, dtype=torch.float32, device=dev) if need_b else None
    K.gathered_grad(hidden, weight, ids, dz_ids.float(), dh, dw, db)
    skipped = torch.zeros(1, dtype=torch.int32, device=dev)
    if coef is not None:
        # every row, those with coef = 0 last (their blocks skip the matmuls): no host sync to select them
        skipped = K.linear_dense_grad(hidden, weight, bias, K.rows_by_coef(coef), inv_temp, lse, coef, dh, dw, db,
                                      eps=grad_filter)
    dw = None if dw is None else dw.to(weight.dtype)
    db = None if db is None else db.to(bias.dtype)
    return dh, dw, db, skipped
