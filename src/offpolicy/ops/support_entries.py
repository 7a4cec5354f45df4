"""Gathered logits at ``M`` (row, id) entries, differentiable, without an ``[N, V]`` or ``[M, D]`` temporary.

The CSR record path of the loss (docs/spec.md#record-memory) needs the trainer's logit at each recorded entry
(and at each sampled token): ``z[r, v]`` from logits, or ``h[r] . W[v] (+ b[v])`` from hidden states. Outputs
are ``[M]`` in the statistics' dtype (fp32; float64 for float64 inputs).

* :func:`entry_logits` / :func:`linear_entry_logits`: the gather alone; the backward returns dense gradients
  (for a caller whose only gradient of the input they are: mask replay reads nothing but the support).
* :func:`log_softmax_with_entries` / :func:`linear_log_softmax_with_entries`: the full-vocabulary sparse
  log-softmax at the sampled tokens *and* the gather, as one autograd node. Two nodes would each return an input
  gradient and autograd would add them out of place (the CPU gradient buffer is a kept workspace it cannot
  reuse): a second ``[N, V]`` (or ``[V, D]``). Here the backward takes the primitive's gradient and adds the
  ``M`` entry gradients into it in place, duplicates summed in the statistics' dtype and rounded once.

Under a vocabulary split (``shard``: this rank holds ids ``[start, start + V_local)``) each rank gathers the
entries it owns (0 elsewhere) and one SUM all-reduce of the ``M`` values assembles them on every rank; the
backward needs no communication (each rank differentiates the same replicated loss and keeps the gradient of its
own entries), as in :mod:`offpolicy.ops.vocab_parallel`.

The fused-linear gathers recompute ``h[rows]`` and ``W[cols]`` :data:`CHUNK_BYTES` at a time, forward and
backward (nothing ``[M, D]`` is saved): ``dh[r] += g W[v]`` and ``dW[v] += g h[r]`` by ``index_add_``, ``dW``
over the distinct ids only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from offpolicy.ops.backend_registry import Backend
from offpolicy.ops.linear_op import linear_torch_backend
from offpolicy.ops.linear_op.linear_log_softmax import linear_sparse_log_softmax_unchecked
from offpolicy.ops.logits_op.sparse_log_softmax import sparse_log_softmax_unchecked
from offpolicy.ops.vocab_parallel import VocabShard, sum_shards

__all__ = ["entry_logits", "linear_entry_logits", "linear_log_softmax_with_entries", "log_softmax_with_entries"]

#: Bytes of fp32 gathered rows per chunk of the fused-linear gather (two ``[chunk, D]`` blocks live at once).
CHUNK_BYTES = 8 << 20


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunks(m: int, d: int):
    step = max(1, CHUNK_BYTES // max(1, 4 * d))
    return ((s, min(m, s + step)) for s in range(0, m, step))


def _add_entries(out: Tensor, index: Tensor, values: Tensor, width: int | None = None) -> None:
    """``out[index] += values`` in place (``out [L, ...]``, ``values [M, ...]``), or with ``width`` the entries
    ``out[index // width, index % width] += values`` of a 2-D ``out`` (any strides); duplicates in ``index [M]``
    are summed in ``values``' dtype and each touched entry is rounded once to ``out``'s dtype."""
    uniq, inv = torch.unique(index, return_inverse=True)
    summed = torch.zeros((uniq.shape[0], *values.shape[1:]), dtype=values.dtype, device=values.device)
    summed.index_add_(0, inv, values)
    if width is not None and out.is_contiguous():
        out, width = out.view(-1), None
    at = (uniq,) if width is None else (uniq // width, uniq % width)
    out[at] = (out[at].to(values.dtype) + summed).to(out.dtype)


def _localise(cols: Tensor, shard: VocabShard | None, v_local: int) -> tuple[Tensor, Tensor | None]:
    """``(local column of each entry (0 where not owned), owned [M] bool or None without a shard)``."""
    if shard is None:
        return cols, None
    local = cols - shard.start
    owned = (local >= 0) & (local < v_local)
    return torch.where(owned, local, torch.zeros_like(local)), owned


def _assemble(x: Tensor, owned: Tensor | None, shard: VocabShard | None) -> Tensor:
    """The owned entries of every shard, summed over the shards (``x`` itself without a shard)."""
    if shard is None:
        return x
    return sum_shards(shard, torch.where(owned, x, torch.zeros_like(x)))


def _own(g: Tensor, owned: Tensor | None) -> Tensor:
    """The gradient of this shard's entries (0 at the others)."""
    return g if owned is None else torch.where(owned, g, torch.zeros_like(g))


def _gather(logits: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    acc = _acc(logits.dtype)
    if logits.shape[1] == 0:  # a shard holding only vocabulary padding owns nothing
        return torch.zeros(rows.shape, dtype=acc, device=rows.device)
    return logits[rows, cols].to(acc)


def _gather_linear(hidden: Tensor, weight: Tensor, bias: Tensor | None, rows: Tensor, cols: Tensor) -> Tensor:
    acc = _acc(hidden.dtype)
    out = torch.empty(rows.shape[0], dtype=acc, device=hidden.device)
    if weight.shape[0] == 0:
        return out.zero_()
    for s, e in _chunks(rows.shape[0], hidden.shape[1]):
        out[s:e] = (hidden[rows[s:e]].to(acc) * weight[cols[s:e]].to(acc)).sum(dim=1)
    if bias is not None:
        out += bias[cols].to(acc)
    return out


def _linear_entry_grads(g: Tensor, hidden: Tensor, weight: Tensor, rows: Tensor, cols: Tensor, need_h: bool,
                        need_w: bool) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(dh [N, D], uniq [U], dW_u [U, D])`` in ``g``'s dtype for the gathered ``h[rows] . W[cols]``."""
    uniq, inv = torch.unique(cols, return_inverse=True)
    dh = torch.zeros(hidden.shape, dtype=g.dtype, device=hidden.device) if need_h else None
    dwu = torch.zeros(uniq.shape[0], weight.shape[1], dtype=g.dtype, device=weight.device) if need_w else None
    for s, e in _chunks(rows.shape[0], hidden.shape[1]):
        gs = g[s:e, None]
        if need_h:
            dh.index_add_(0, rows[s:e], gs * weight[cols[s:e]].to(g.dtype))
        if need_w:
            dwu.index_add_(0, inv[s:e], gs * hidden[rows[s:e]].to(g.dtype))
    return dh, uniq, dwu


class _EntryLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, rows: Tensor, cols: Tensor, shard: VocabShard | None) -> Tensor:
        local, owned = _localise(cols, shard, logits.shape[1])
        ctx.save_for_backward(rows, local, owned)
        ctx.meta = (tuple(logits.shape), logits.dtype)
        return _assemble(_gather(logits, rows, local), owned, shard)

    @staticmethod
    def backward(ctx, g: Tensor):
        rows, local, owned = ctx.saved_tensors
        shape, dtype = ctx.meta
        dz = torch.zeros(shape, dtype=dtype, device=g.device)
        if shape[1]:
            _add_entries(dz, rows * shape[1] + local, _own(g, owned), shape[1])
        return dz, None, None, None


def entry_logits(logits: Tensor, rows: Tensor, cols: Tensor, shard: VocabShard | None = None) -> Tensor:
    """``[M]`` ``logits[rows, cols]`` in fp32 (float64 for float64 logits); dense gradient.

    Args:
        logits: ``[N, V]`` float (``V`` this shard's width under ``shard``).
        rows, cols: ``[M]`` int64 indices (global ids), in range (unchecked: the caller validates its record).
        shard: the vocabulary split, or None.
    """
    return _EntryLogits.apply(logits, rows, cols, shard)


class _LinearEntryLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, rows: Tensor, cols: Tensor,
                shard: VocabShard | None) -> Tensor:
        local, owned = _localise(cols, shard, weight.shape[0])
        ctx.save_for_backward(hidden, weight, rows, local, owned)
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return _assemble(_gather_linear(hidden, weight, bias, rows, local), owned, shard)

    @staticmethod
    def backward(ctx, g: Tensor):
        hidden, weight, rows, cols, owned = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        g = _own(g, owned)
        if weight.shape[0] == 0:  # nothing owned: every gradient is empty or zero
            need_w = need_b = False
        dh, uniq, dwu = _linear_entry_grads(g, hidden, weight, rows, cols, need_h, need_w)
        dw = db = None
        if need_w:
            dw = torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device)
            dw[uniq] = dwu.to(weight.dtype)
        if ctx.bias_dtype is not None and need_b:
            db = torch.zeros(weight.shape[0], dtype=ctx.bias_dtype, device=g.device)
            _add_entries(db, cols, g)
        return (dh.to(hidden.dtype) if need_h else None), dw, db, None, None, None


def linear_entry_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, rows: Tensor, cols: Tensor,
                        shard: VocabShard | None = None) -> Tensor:
    """``[M]`` ``hidden[rows] . weight[cols] (+ bias[cols])`` in fp32 (float64 for float64 hidden); dense
    gradients (under ``shard`` the gradient of ``hidden`` is this shard's part).

    Args:
        hidden: ``[N, D]`` float; weight: ``[V, D]`` (this shard's rows); bias: ``[V]`` or None.
        rows, cols: ``[M]`` int64 indices (global ids), in range (unchecked).
        shard: the vocabulary split, or None.
    """
    return _LinearEntryLogits.apply(hidden, weight, bias, rows, cols, shard)


class _LogSoftmaxWithEntries(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, tokens: Tensor, rows: Tensor, cols: Tensor, temperature, skip: Tensor,
                shard: VocabShard | None, backend: Backend, inplace_grad: bool, eager: bool):
        # The primitive runs on a detached alias with its own graph; the backward asks that graph for its dense
        # gradient and adds the entries' into it.
        with torch.enable_grad():
            z = logits.detach().requires_grad_(logits.requires_grad)
            lp = sparse_log_softmax_unchecked(z, tokens, None, temperature, backend=backend, support=False,
                                              skip=skip, shard=shard, inplace_grad=inplace_grad, stats=(),
                                              eager=eager)
        ctx.inner = (z, lp.target)
        local, owned = _localise(cols, shard, logits.shape[1])
        ctx.save_for_backward(rows, local, owned)
        x = _assemble(_gather(logits, rows, local), owned, shard)
        ctx.mark_non_differentiable(lp.lse, lp.entropy)
        return lp.target.detach(), lp.lse, lp.entropy, x

    @staticmethod
    def backward(ctx, g_target: Tensor, _g_lse, _g_entropy, g_x: Tensor):
        z, target = ctx.inner
        rows, local, owned = ctx.saved_tensors
        (dz,) = torch.autograd.grad(target, z, g_target)
        if z.shape[1]:
            _add_entries(dz, rows * z.shape[1] + local, _own(g_x, owned), z.shape[1])
        return dz, None, None, None, None, None, None, None, None, None


def log_softmax_with_entries(logits: Tensor, tokens: Tensor, rows: Tensor, cols: Tensor, temperature, *,
                             skip: Tensor, shard: VocabShard | None, backend: Backend, inplace_grad: bool,
                             eager: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(log p(y) [N], lse [N], entropy [N], logits[rows, cols] [M])``: the sparse log-softmax at ``tokens``
    over the full vocabulary and the raw logits at the entries (fp32; float64 for float64 logits), one autograd
    node whose backward returns one dense ``[N, V]`` gradient (see the module docstring). The arguments are
    those of :func:`~offpolicy.ops.logits_op.sparse_log_softmax.sparse_log_softmax_unchecked`, already checked
    and resolved by the caller; ``rows``, ``cols``: ``[M]`` int64."""
    return _LogSoftmaxWithEntries.apply(logits, tokens, rows, cols, temperature, skip, shard, backend, inplace_grad,
                                        eager)


class _LinearLogSoftmaxWithEntries(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, tokens: Tensor, rows: Tensor,
                cols: Tensor, temperature, skip: Tensor, shard: VocabShard | None, backend: Backend, eager: bool):
        with torch.enable_grad():
            leaves = tuple(None if t is None else t.detach().requires_grad_(t.requires_grad)
                           for t in (hidden, weight, bias))
            lp = linear_sparse_log_softmax_unchecked(leaves[0], leaves[1], tokens, None, temperature, bias=leaves[2],
                                                     backend=backend, support=False, skip=skip, shard=shard,
                                                     chunk_bytes=linear_torch_backend.CHUNK_BYTES, grad_filter=None,
                                                     stats=(), eager=eager)
        ctx.inner = (leaves, lp.target)
        local, owned = _localise(cols, shard, weight.shape[0])
        ctx.save_for_backward(rows, local, owned)
        x = _assemble(_gather_linear(hidden, weight, bias, rows, local), owned, shard)
        ctx.mark_non_differentiable(lp.lse, lp.entropy)
        return lp.target.detach(), lp.lse, lp.entropy, x

    @staticmethod
    def backward(ctx, g_target: Tensor, _g_lse, _g_entropy, g_x: Tensor):
        leaves, target = ctx.inner
        rows, cols, owned = ctx.saved_tensors
        g_x = _own(g_x, owned)
        want = [i for i, t in enumerate(leaves) if t is not None and t.requires_grad]
        got = torch.autograd.grad(target, [leaves[i] for i in want], g_target, allow_unused=True)
        grads = [None, None, None]
        for i, gr in zip(want, got):
            grads[i] = torch.zeros_like(leaves[i]) if gr is None else gr
        hidden, weight, _ = leaves
        if weight.shape[0] == 0:
            return (*grads, None, None, None, None, None, None, None, None)
        dh, uniq, dwu = _linear_entry_grads(g_x, hidden, weight, rows, cols, grads[0] is not None,
                                            grads[1] is not None)
        if grads[0] is not None:
            grads[0] += dh.to(grads[0].dtype)
        if grads[1] is not None:
            _add_entries(grads[1], uniq, dwu)
        if grads[2] is not None:
            _add_entries(grads[2], cols, g_x)
        return (*grads, None, None, None, None, None, None, None, None)


def linear_log_softmax_with_entries(hidden: Tensor, weight: Tensor, bias: Tensor | None, tokens: Tensor,
                                    rows: Tensor, cols: Tensor, temperature, *, skip: Tensor,
                                    shard: VocabShard | None, backend: Backend,
                                    eager: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The fused-linear twin of :func:`log_softmax_with_entries`: the fused-linear sparse log-softmax
    (:func:`~offpolicy.ops.linear_op.linear_log_softmax.linear_sparse_log_softmax_unchecked`) at ``tokens`` and
    ``hidden[rows] . weight[cols] (+ bias[cols])``, one node returning one gradient per input."""
    return _LinearLogSoftmaxWithEntries.apply(hidden, weight, bias, tokens, rows, cols, temperature, skip, shard,
                                              backend, eager)
