"""The logits primitive: a log-softmax that returns only the ``1 + K`` entries each row needs.

Given logits ``z [N, V]``, per-row ids (the sampled token and ``K`` candidates), a temperature and a
normalisation (the full vocabulary, or the row's candidate support), it returns the gathered log-probabilities
of ``x = z / tau``, the normaliser ``lse``, the entropy and, on request, the extra statistics of
:mod:`offpolicy.ops.row_stats` (``sum_v p(v)^2``, ...) by name (:class:`SparseLogSoftmax`). Only the full-vocabulary
statistics and the backward touch ``[N, V]`` data; they run in a backend (:mod:`offpolicy.ops.backend_registry`). This
is the op's boundary: the arguments are checked here once (:mod:`offpolicy.ops.input_checks`), the backend is
resolved here once, and on CPU the single-intra-op-thread context is entered here for the forward; then
:func:`sparse_log_softmax_unchecked` runs the op, the entry of callers that are boundaries themselves and have made
those three steps (:func:`offpolicy.policy_loss`). The autograd function is
:mod:`offpolicy.ops.logits_op.logits_function`; its fused-linear twin is :func:`offpolicy.ops.linear_sparse_log_softmax`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection

import torch
from torch import Tensor

from offpolicy.ops import backend_registry, input_checks, library, row_threads
from offpolicy.ops.backend_registry import Backend
from offpolicy.ops.logits_op.logits_function import LogitsPlan, SparseLogSoftmaxFunction
from offpolicy.ops.row_io import SparseLogSoftmax, result, row_inputs
from offpolicy.ops.vocab_parallel import VocabShard

__all__ = ["SparseLogSoftmax", "VocabShard", "sparse_log_softmax", "sparse_log_softmax_unchecked"]


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
    validate: bool = True,
    sum_p2: bool = False,
    stats: Collection[str] = (),
) -> SparseLogSoftmax:
    """Log-softmax of ``logits / temperature`` at the sampled token and the candidates of each row.

    Args:
        logits: ``[N, V]`` bf16/fp16/fp32/float64 (``V`` is the local shard width under ``shard``); unit stride in
            ``V``. float64 keeps float64 statistics (references, gradcheck).
        targets: ``[N]`` int sampled token ids (global ids), in ``[0, V)``; ids are int8/16/32/64 or uint8.
        candidate_ids: ``[N, K]`` int candidate ids, ``-1`` padding; None means ``K = 0``. With ``support`` an
            id appears at most once per row.
        temperature: float or ``[N]`` tensor, finite and ``> 0``, with ``1 / temperature`` finite in the
            statistics' dtype (``>= 2.9e-39`` for fp32).
        support: normalise over each row's candidates (mask replay) instead of the full vocabulary; needs
            ``candidate_ids``.
        skip: ``[N]`` bool rows to leave out (their outputs are ``-inf`` log-probabilities and they cost no
            vocabulary bandwidth). Rows that are skipped, or get no upstream gradient, get exactly zero gradient
            whatever their logits hold.
        shard: vocabulary-parallel shard description, or None.
        inplace_grad: write the gradient into ``logits`` in the backward. Saves one ``[N, V]`` buffer, but
            overwrites the logits and bypasses autograd's version check: use it only when nothing else needs
            the logits after the backward. Refused on logits whose rows overlap in memory (``expand``,
            ``as_strided``).
        backend: a name in :data:`offpolicy.ops.backend_registry.BACKENDS` (``"torch"``, ``"cpu"``,
            ``"triton"``); default by device.
        validate: check the ids' range and the temperatures' values (a host sync on GPUs; skipped while
            ``torch.compile`` traces). Shapes, dtypes and options are always checked. Pass False only when the
            caller has checked them.
        sum_p2: also return ``sum_v p(v)^2`` per row: the shorthand for ``"sum_p2" in stats``.
        stats: names of extra per-row statistics to return (:data:`offpolicy.ops.row_stats.STATISTICS`), a tuple,
            list or set; each is one more accumulator in the same vocabulary pass (a backend whose kernels lack one
            runs the PyTorch pass for the call), detached, read as ``out.stats[name]``.

    Returns:
        :class:`SparseLogSoftmax`; ``target`` and ``candidates`` are differentiable with respect to ``logits``.

    Raises:
        ValueError: naming the argument, for a bad shape, dtype, option or (with ``validate``) value.
    """
    input_checks.check_logits(logits)
    n, v = logits.shape
    acc = _acc(logits)
    input_checks.check_rows(n, logits.device, targets, candidate_ids, support, skip, shard)
    eager = not library.tracing()  # tracing: no host syncs, and the backend behind the custom ops
    input_checks.check_temperature(temperature, n, acc, values=validate and eager)
    input_checks.check_inplace_grad(logits, inplace_grad)
    names = input_checks.check_stats(stats, sum_p2)
    if validate and eager:
        input_checks.check_values(v, targets, candidate_ids, shard, support)
    chosen = backend_registry.choose(backend, logits.device, logits.dtype)
    with row_threads.single_intra_op() if eager and logits.device.type == "cpu" else contextlib.nullcontext():
        return sparse_log_softmax_unchecked(logits, targets, candidate_ids, temperature, backend=chosen,
                                            support=support, skip=skip, shard=shard, inplace_grad=inplace_grad,
                                            stats=names, eager=eager)


def sparse_log_softmax_unchecked(logits: Tensor, targets: Tensor, candidate_ids: Tensor | None,
                                 temperature: float | Tensor, *, backend: Backend, support: bool,
                                 skip: Tensor | None, shard: VocabShard | None, inplace_grad: bool,
                                 stats: tuple[str, ...],
                                 eager: bool) -> SparseLogSoftmax:
    """:func:`sparse_log_softmax` on checked arguments (shapes, dtypes, options and, unless the caller opted out,
    values), with the backend resolved (:func:`offpolicy.ops.backend_registry.choose`) and, eagerly on CPU, inside
    the single-intra-op-thread context: the boundary of the call has done all three. ``eager`` is False while
    ``torch.compile`` traces (:func:`offpolicy.ops.library.tracing`, asked once by that boundary). Arguments and
    result as in :func:`sparse_log_softmax`."""
    ids, inv_temp = row_inputs(targets, candidate_ids, temperature, logits.shape[0], _acc(logits), logits.device)
    plan = LogitsPlan(support, shard, inplace_grad, backend, stats, eager)
    return result(SparseLogSoftmaxFunction.apply(logits, ids, inv_temp, skip, plan), stats)


def _acc(logits: Tensor) -> torch.dtype:
    """The statistics' dtype: fp32 for 16/32-bit logits; float64 logits keep float64 (gradcheck, references)."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32
