"""Gathered logits at ``M`` (row, id) entries, differentiable, without an ``[N, V]`` or ``[M, D]`` temporary.

The CSR record path of the loss (docs/spec.md#record-memory) needs the trainer's logit at each recorded entry
(and at each sampled token): ``z[r, v]`` from logits, or ``h[r] . W[v] (+ b[v])`` from hidden states. Both are
autograd Functions whose outputs are ``[M]`` in the statistics' dtype (fp32; float64 for float64 inputs) and
whose backward writes ``M`` gradient entries:

* ``sparse_grad=True``: the gradient of ``logits`` (or ``weight``, ``bias``) is a sparse COO tensor of the
  ``M`` entries (duplicates summed in fp32 before the one rounding to the input dtype), which autograd adds in
  place into the dense gradient another op produces (the full-vocabulary log-softmax's): no second ``[N, V]``.
* ``sparse_grad=False``: the gradient is returned dense (the caller's only gradient of that input).

The fused-linear twin recomputes the gathered rows chunk by chunk in the backward (nothing ``[M, D]`` is saved):
``dh[r] += g W[v]`` and ``dW[v] += g h[r]`` by ``index_add_``, ``dW`` over the distinct ids only.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["entry_logits", "linear_entry_logits"]

#: Bytes of fp32 gathered rows per chunk of the fused-linear gather (two ``[chunk, D]`` blocks live at once).
CHUNK_BYTES = 8 << 20


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _entry_grad(index: Tensor, values: Tensor, shape: tuple[int, ...], dtype: torch.dtype, sparse: bool) -> Tensor:
    """The gradient holding ``values`` at ``index [d, M]`` of a ``shape`` tensor, duplicates summed in ``values``'
    dtype, then rounded once to ``dtype``: sparse COO, or dense."""
    grad = torch.sparse_coo_tensor(index, values, shape, check_invariants=False).coalesce().to(dtype)
    return grad if sparse else grad.to_dense()


class _EntryLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, rows: Tensor, cols: Tensor, sparse_grad: bool) -> Tensor:
        ctx.save_for_backward(rows, cols)
        ctx.meta = (tuple(logits.shape), logits.dtype, sparse_grad)
        return logits[rows, cols].to(_acc(logits.dtype))

    @staticmethod
    def backward(ctx, g: Tensor):
        rows, cols = ctx.saved_tensors
        shape, dtype, sparse = ctx.meta
        return _entry_grad(torch.stack([rows, cols]), g, shape, dtype, sparse), None, None, None


def entry_logits(logits: Tensor, rows: Tensor, cols: Tensor, *, sparse_grad: bool) -> Tensor:
    """``[M]`` ``logits[rows, cols]`` in fp32 (float64 for float64 logits).

    Args:
        logits: ``[N, V]`` float.
        rows, cols: ``[M]`` int64 indices, in range (unchecked: the caller validates its record).
        sparse_grad: return the gradient of ``logits`` as a sparse COO tensor (see the module docstring).
    """
    return _EntryLogits.apply(logits, rows, cols, sparse_grad)


def _chunks(m: int, d: int):
    step = max(1, CHUNK_BYTES // max(1, 4 * d))
    return ((s, min(m, s + step)) for s in range(0, m, step))


class _LinearEntryLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, rows: Tensor, cols: Tensor,
                sparse_grad: bool) -> Tensor:
        acc = _acc(hidden.dtype)
        out = torch.empty(rows.shape[0], dtype=acc, device=hidden.device)
        for s, e in _chunks(rows.shape[0], hidden.shape[1]):
            out[s:e] = (hidden[rows[s:e]].to(acc) * weight[cols[s:e]].to(acc)).sum(dim=1)
        if bias is not None:
            out += bias[cols].to(acc)
        ctx.save_for_backward(hidden, weight, rows, cols)
        ctx.has_bias, ctx.sparse = bias is not None, sparse_grad
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        hidden, weight, rows, cols = ctx.saved_tensors
        acc = g.dtype
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        uniq, inv = torch.unique(cols, return_inverse=True)
        dh = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_h else None
        dwu = torch.zeros(uniq.shape[0], weight.shape[1], dtype=acc, device=weight.device) if need_w else None
        for s, e in _chunks(rows.shape[0], hidden.shape[1]):
            gs = g[s:e, None]
            if need_h:
                dh.index_add_(0, rows[s:e], gs * weight[cols[s:e]].to(acc))
            if need_w:
                dwu.index_add_(0, inv[s:e], gs * hidden[rows[s:e]].to(acc))
        dw = db = None
        if need_w:
            dw = _entry_grad(uniq[None], dwu, tuple(weight.shape), weight.dtype, ctx.sparse)
        if ctx.has_bias and need_b:
            db = _entry_grad(cols[None], g, (weight.shape[0],), ctx.bias_dtype, ctx.sparse)
        return (dh.to(hidden.dtype) if need_h else None), dw, db, None, None, None


def linear_entry_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, rows: Tensor, cols: Tensor, *,
                        sparse_grad: bool) -> Tensor:
    """``[M]`` ``hidden[rows] . weight[cols] (+ bias[cols])`` in fp32 (float64 for float64 hidden), gathered
    ``CHUNK_BYTES`` at a time.

    Args:
        hidden: ``[N, D]`` float; weight: ``[V, D]``; bias: ``[V]`` or None.
        rows, cols: ``[M]`` int64 indices, in range (unchecked).
        sparse_grad: return the gradients of ``weight`` and ``bias`` as sparse COO tensors (that of ``hidden``,
            ``[N, D]`` like its input, is dense).
    """
    return _LinearEntryLogits.apply(hidden, weight, bias, rows, cols, sparse_grad)
