"""The fused-linear primitive: the sparse log-softmax straight from hidden states, ``z = h W^T + b`` never stored.

:func:`linear_sparse_log_softmax` returns exactly what ``sparse_log_softmax(hidden @ weight.T + bias, ...)``
returns (the same :class:`~offpolicy.ops.row_io.SparseLogSoftmax`, the same padding, skip, temperature and NaN
semantics), differentiable with respect to ``hidden``, ``weight`` and ``bias``, without the ``[N, V]`` logits or
their gradient. This is the op's boundary: arguments checked once (:mod:`offpolicy.ops.input_checks`), the backend
resolved once; then :func:`linear_sparse_log_softmax_unchecked` runs the op, the entry of a caller that is a
boundary itself (:func:`offpolicy.policy_loss`). The fused-linear path keeps the caller's intra-op threads (its
matmuls are large parallel regions), so there is no single-thread context here. The autograd function is :mod:`offpolicy.ops.linear_op.linear_function`; backends come from the
same registry as the logits primitive's (:mod:`offpolicy.ops.backend_registry`): ``torch``
(:mod:`offpolicy.ops.linear_op.linear_torch_backend`, chunked, the CPU default) and ``triton``
(:mod:`offpolicy.ops.linear_op.linear_triton_backend`, the CUDA default).
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import Tensor

from offpolicy.ops import backend_registry, input_checks, library
from offpolicy.ops.backend_registry import Backend
from offpolicy.ops.linear_op import linear_torch_backend
from offpolicy.ops.linear_op.linear_function import LinearPlan, LinearSparseLogSoftmaxFunction
from offpolicy.ops.row_io import SparseLogSoftmax, result, row_inputs
from offpolicy.ops.vocab_parallel import VocabShard


def linear_sparse_log_softmax(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    candidate_ids: Tensor | None = None,
    temperature: float | Tensor = 1.0,
    *,
    bias: Tensor | None = None,
    support: bool = False,
    skip: Tensor | None = None,
    shard: VocabShard | None = None,
    backend: str | None = None,
    chunk_bytes: int | None = None,
    grad_filter: float | None = None,
    validate: bool = True,
    sum_p2: bool = False,
    stats: Collection[str] = (),
) -> SparseLogSoftmax:
    """Log-softmax of ``(hidden @ weight.T + bias) / temperature`` at the sampled token and the candidates.

    Args:
        hidden: ``[N, D]`` fp32/bf16/fp16 hidden states (the input of the output layer); float64 is accepted for
            references and keeps float64 statistics (on the torch backend, whatever ``backend`` says).
        weight: ``[V, D]`` output-layer weight, same dtype and device (``V`` local under ``shard``).
        targets: ``[N]`` int sampled token ids (global ids), in ``[0, V)``.
        candidate_ids: ``[N, K]`` int candidate ids, ``-1`` padding; None means ``K = 0``.
        temperature: float or ``[N]`` tensor, finite and ``> 0``.
        bias: ``[V]`` output bias or None.
        support: normalise over each row's candidates (mask replay); costs ``O(N K D)``, never touches all ``V``.
            Needs ``candidate_ids``.
        skip: ``[N]`` bool rows to leave out (``-inf`` log-probabilities, ``lse = +inf``; in full mode they cost
            no vocabulary work). Rows that are skipped, or get no upstream gradient, contribute exactly zero to
            every gradient whatever their hidden state holds.
        shard: vocabulary-parallel shard (``VocabShard(group, start)``), or None.
        backend: a name in :data:`offpolicy.ops.backend_registry.BACKENDS`; default by device.
        chunk_bytes: working-set budget of the chunked torch backend (default
            :data:`offpolicy.ops.linear_op.linear_torch_backend.CHUNK_BYTES`); peak extra memory is about this plus
            ``O(N (K + D))``.
        grad_filter: full mode only: skip backward blocks whose probabilities are all below this threshold
            (Cut Cross-Entropy's gradient filtering; each dropped gradient entry is below
            ``grad_filter * |sum_j g_j| / tau``). None (default) computes the exact gradient.
        validate: check the ids' range and the temperatures' values (see :func:`offpolicy.ops.sparse_log_softmax`).
        sum_p2: also return ``sum_v p(v)^2`` per row: the shorthand for ``"sum_p2" in stats``.
        stats: names of extra per-row statistics to return, folded in the same vocabulary tiles (see
            :func:`offpolicy.ops.sparse_log_softmax` and :class:`SparseLogSoftmax`).

    Returns:
        :class:`SparseLogSoftmax` (fp32; float64 for float64 inputs): ``target [N]``, ``candidates [N, K]``
        (``-inf`` at padding), ``lse [N]``, ``entropy [N]`` and the asked ``stats`` or None (not
        differentiable). A NaN in a weight row or bias
        entry that a row's normaliser reads makes that row's ``lse`` and log-probabilities NaN, as NaN logits do
        on the logits primitive. Under ``shard`` the gradient of ``hidden`` is this shard's part.

    Raises:
        ValueError: naming the argument, for a bad shape, dtype, option or (with ``validate``) value.
    """
    budget = linear_torch_backend.CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    input_checks.check_layer(hidden, weight, bias, budget, grad_filter)
    names = input_checks.check_stats(stats, sum_p2)
    n, v = hidden.shape[0], weight.shape[0]
    acc = _acc(hidden)
    input_checks.check_rows(n, hidden.device, targets, candidate_ids, support, skip, shard)
    eager = not library.tracing()  # tracing: no host syncs, and the backend behind the custom ops
    input_checks.check_temperature(temperature, n, acc, values=validate and eager)
    if validate and eager:
        input_checks.check_values(v, targets, candidate_ids, shard, support)
    return linear_sparse_log_softmax_unchecked(
        hidden, weight, targets, candidate_ids, temperature, bias=bias,
        backend=backend_registry.choose(backend, hidden.device, hidden.dtype), support=support, skip=skip,
        shard=shard, chunk_bytes=budget, grad_filter=None if grad_filter is None else float(grad_filter),
        stats=names, eager=eager)


def linear_sparse_log_softmax_unchecked(hidden: Tensor, weight: Tensor, targets: Tensor, candidate_ids: Tensor | None,
                                        temperature: float | Tensor, *, bias: Tensor | None, backend: Backend,
                                        support: bool, skip: Tensor | None, shard: VocabShard | None,
                                        chunk_bytes: int, grad_filter: float | None,
                                        stats: tuple[str, ...],
                                        eager: bool) -> SparseLogSoftmax:
    """:func:`linear_sparse_log_softmax` on checked arguments with the backend resolved
    (:func:`offpolicy.ops.backend_registry.choose`): the boundary of the call has done both. ``chunk_bytes`` is
    the budget itself (not None); ``eager`` is False while ``torch.compile`` traces
    (:func:`offpolicy.ops.library.tracing`, asked once by that boundary). Arguments and result as in
    :func:`linear_sparse_log_softmax`."""
    ids, inv_temp = row_inputs(targets, candidate_ids, temperature, hidden.shape[0], _acc(hidden), hidden.device)
    plan = LinearPlan(support, shard, backend, chunk_bytes, grad_filter, stats, eager)
    return result(LinearSparseLogSoftmaxFunction.apply(hidden, weight, bias, ids, inv_temp, skip, plan), stats)


def _acc(hidden: Tensor) -> torch.dtype:
    """The statistics' dtype: fp32 for 16/32-bit inputs; float64 keeps float64 (gradcheck, references)."""
    return torch.float64 if hidden.dtype == torch.float64 else torch.float32
