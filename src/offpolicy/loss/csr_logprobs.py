"""The trainer's log-probabilities at a CSR record's entries (docs/spec.md#record-memory), without padding.

Given the record's ``nnz`` entries ``(r, v)`` and the sampled tokens ``(t, y_t)``, one gather of ``nnz + N``
logits ``x = z / tau`` (:mod:`offpolicy.ops.support_entries`) gives everything:

* ``kind="support"`` (mask replay): ``log P_S(t) = logsumexp_{v in S_t} x_t(v)`` is a per-row reduction over
  the entries, ``log p^S(v) = x(v) - log P_S`` and ``log p^S(y_t) = x(y_t) - log P_S``. No vocabulary pass at
  all: the normaliser reads only the support, as the padded path's does. Without a vocabulary split this is the
  fused support pass (:mod:`offpolicy.ops.support_pass`, ``O(|S_t|)`` per row whatever the width).
* ``kind="head"``: the full-vocabulary normaliser ``logZ`` comes from the sparse log-softmax at the sampled
  tokens (``lp_t = log p(y_t)``, ``lse``); ``log p(v) = x(v) - logZ``. Its gradient needs
  ``d logZ / dx = p``, which is ``d (x(y_t) - lp_t) / dx = e_y - (e_y - p)``: ``logZ`` takes the value ``lse``
  and the gradient of ``x(y_t) - lp_t`` (:class:`_ValueWithGradOf`; an exact identity, not an approximation).
  The primitive and the gather are one autograd node, whose backward adds the entries' gradient into the
  primitive's dense one in place.

Extra memory: ``O(nnz + N)`` in the statistics' dtype, never ``[N, K]`` or ``[N, V]`` (the bound is stated and
measured in docs/spec.md#record-memory).
"""

from __future__ import annotations

import torch
from torch import Tensor

from offpolicy.loss.entry_rows import EntryRows
from offpolicy.ops import SparseLogSoftmax, VocabShard
from offpolicy.ops.backend_registry import Backend
from offpolicy.ops.row_io import row_inputs
from offpolicy.ops.support_pass import SPARSE_DENSITY, linear_support_log_softmax, support_log_softmax
from offpolicy.ops.support_entries import (entry_logits, linear_entry_logits, linear_log_softmax_with_entries,
                                           log_softmax_with_entries)
from offpolicy.records.csr_candidates import CSRCandidates


class _ValueWithGradOf(torch.autograd.Function):
    """``value`` in the forward; the backward sends the whole gradient to ``carrier`` (whose value may be
    infinite where ``value`` is finite: ``x(y) - lp(y)`` on a token the trainer gives probability 0)."""

    @staticmethod
    def forward(ctx, value: Tensor, carrier: Tensor) -> Tensor:
        return value.clone()

    @staticmethod
    def backward(ctx, g: Tensor):
        return None, g


def csr_log_probs(model, tokens: Tensor, record: CSRCandidates, temperature, skip: Tensor, *, backend: Backend,
                  inplace_grad: bool = False, shard: VocabShard | None = None, eager: bool = True) -> SparseLogSoftmax:
    """:class:`~offpolicy.ops.SparseLogSoftmax` of the CSR record: ``target [N]``, ``candidates [nnz]`` (trainer
    log-probabilities at the record's entries, support-normalised for ``kind="support"``), ``lse [N]`` and
    ``entropy [N]`` (detached; of the support distribution under replay), with the primitive's conventions on
    skipped rows (``-inf`` log-probabilities, ``lse = +inf``, entropy 0).

    Args:
        model: :class:`~offpolicy.loss.logits.ModelInputs` (``logits [N, V]``, or ``hidden``, ``weight``, ``bias``).
        tokens: ``[N]`` int sampled ids; record: the validated CSR record; temperature: float or ``[N]``.
        skip: ``[N]`` bool untrained rows.
        backend: the resolved backend (:func:`offpolicy.ops.backend_registry.choose`), for head records.
        inplace_grad: as in :func:`offpolicy.policy_loss` (it acts on head records, whose gradient comes from the
            vocabulary pass).
        shard: the vocabulary split, or None: the entries are gathered on their shards and assembled on every
            rank (one SUM all-reduce of ``nnz + N`` values), the head normaliser is the primitive's global one.
        eager: False while ``torch.compile`` traces (:func:`offpolicy.ops.library.tracing`, asked by the caller).
    """
    n = tokens.shape[0]
    device = tokens.device
    src = model.logits if model.logits is not None else model.hidden
    acc = torch.float64 if src.dtype == torch.float64 else torch.float32
    _, inv_temp = row_inputs(tokens, None, temperature, n, acc, device)
    if record.kind == "support" and shard is None:
        fused = _fused_support(model, tokens, record, inv_temp, skip, backend=backend, eager=eager)
        if fused is not None:
            return fused
    layout = EntryRows(record.row_index(), n)
    row, m = layout.row, record.nnz
    active = ~skip
    rows = torch.cat([row, torch.arange(n, device=device)])
    cols = torch.cat([record.ids.to(torch.int64), tokens.to(torch.int64)])
    support = record.kind == "support"
    ninf = torch.full((), -float("inf"), dtype=acc, device=device)
    if support:
        if model.logits is not None:
            x = entry_logits(model.logits, rows, cols, shard)
        else:
            x = linear_entry_logits(model.hidden, model.weight, model.bias, rows, cols, shard)
        x = x * inv_temp[rows]
        x_e, x_y = x[:m], x[m:]
        x_e = torch.where(active[row], x_e, ninf)
        lse = layout.logsumexp(x_e)
        # Only rows without mass (untrained, or all -inf) are set aside: a NaN or +inf logit in the support
        # propagates into the row's values (NaN), which the boundary check refuses, as on the padded path.
        none = lse == -float("inf")
        safe = torch.where(none, torch.zeros_like(lse), lse)
        cand = torch.where(none[row], ninf, x_e - safe[row])
        target = torch.where(none, ninf, x_y - safe)
        c = cand.detach()
        entropy = -layout.sum(torch.where(c == -float("inf"), torch.zeros_like(c), torch.exp(c) * c))
        lse = torch.where(active, lse.detach(), torch.full_like(lse, float("inf")))
        return SparseLogSoftmax(target, cand, lse, entropy)
    if model.logits is not None:
        target, lse, entropy, x = log_softmax_with_entries(model.logits, tokens, rows, cols, temperature, skip=skip,
                                                           shard=shard, backend=backend, inplace_grad=inplace_grad,
                                                           eager=eager)
    else:
        target, lse, entropy, x = linear_log_softmax_with_entries(model.hidden, model.weight, model.bias, tokens,
                                                                  rows, cols, temperature, skip=skip, shard=shard,
                                                                  backend=backend, eager=eager)
    x = x * inv_temp[rows]
    x_e, x_y = x[:m], x[m:]
    ok = active & torch.isfinite(lse)
    log_z = _ValueWithGradOf.apply(torch.where(ok, lse, torch.zeros_like(lse)), x_y - target)
    cand = torch.where(ok[row], x_e - log_z[row], ninf)
    return SparseLogSoftmax(target, cand, lse, entropy)


def _fused_support(model, tokens: Tensor, record: CSRCandidates, inv_temp: Tensor, skip: Tensor, *,
                   backend: Backend, eager: bool) -> SparseLogSoftmax | None:
    """A support record without a vocabulary split, by the fused support pass (:mod:`offpolicy.ops.support_pass`):
    ``O(nnz)`` with logits; with hidden states, the chunked matmul pass unless the record is sparser than
    ``SPARSE_DENSITY`` (then None: the entry gather, ``O(nnz D)``, is cheaper)."""
    offsets, ids, tok = record.offsets.to(torch.int64), record.ids.to(torch.int64), tokens.to(torch.int64)
    if model.logits is not None:
        out = support_log_softmax(model.logits, tok, offsets, ids, inv_temp, skip, backend=backend, eager=eager)
    elif record.nnz >= SPARSE_DENSITY * tokens.shape[0] * model.weight.shape[0]:
        out = linear_support_log_softmax(model.hidden, model.weight, model.bias, tok, offsets, ids, inv_temp, skip,
                                         backend=backend, eager=eager)
    else:
        return None
    return SparseLogSoftmax(*out)
