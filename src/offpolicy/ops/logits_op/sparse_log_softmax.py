"""The logits primitive: a log-softmax that returns only the ``1 + K`` entries each row needs.

Given logits ``z [N, V]``, per-row ids (the sampled token and ``K`` candidates), a temperature and a
normalisation (the full vocabulary, or the row's candidate support), it returns the gathered log-probabilities
of ``x = z / tau``, the normaliser ``lse``, the entropy and, on request, ``sum_v p(v)^2``
(:class:`SparseLogSoftmax`). Only the full-vocabulary
statistics and the backward touch ``[N, V]`` data; they run in a backend (:mod:`offpolicy.ops.backend_registry`). The
autograd function is :mod:`offpolicy.ops.logits_op.logits_function`; its fused-linear twin is
:func:`offpolicy.ops.linear_sparse_log_softmax`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from offpolicy.ops import backend_registry, input_checks
from offpolicy.ops.logits_op.logits_function import LogitsPlan, SparseLogSoftmaxFunction
from offpolicy.ops.vocab_parallel import VocabShard

__all__ = ["SparseLogSoftmax", "VocabShard", "sparse_log_softmax"]


class SparseLogSoftmax(NamedTuple):
    """Outputs of :func:`sparse_log_softmax` and :func:`~offpolicy.ops.linear_sparse_log_softmax` (fp32; float64
    for float64 inputs).

    Attributes:
        target: ``[N]`` log-probability of the sampled token.
        candidates: ``[N, K]`` log-probabilities of the candidates, ``-inf`` at padding.
        lse: ``[N]`` normaliser of ``z / tau`` (full vocabulary, or the support); ``+inf`` on skipped rows.
        entropy: ``[N]`` entropy of the (full or support) distribution; 0 on skipped rows. Not differentiable.
        sum_p2: ``[N]`` ``sum_v p(v)^2`` of the same distribution (``p`` of ``z / tau``; under ``support`` the sum
            over the support of the renormalised ``p^S(v)^2``), 0 on skipped rows; None unless ``sum_p2=True`` was
            asked. A baseline statistic (the Optimal Token Baseline's,
            :func:`offpolicy.advantages.optimal_token_baseline`): detached, no gradient flows through it.
    """

    target: Tensor
    candidates: Tensor
    lse: Tensor
    entropy: Tensor
    sum_p2: Tensor | None = None


def row_inputs(targets: Tensor, candidate_ids: Tensor | None, temperature: float | Tensor, n: int,
               acc: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    """``ids [N, 1 + K]`` int64 (target first, then the candidates) and ``inv_temp [N]`` in ``acc``."""
    ids = targets.to(device=device, dtype=torch.int64)[:, None]
    if candidate_ids is not None:
        ids = torch.cat([ids, candidate_ids.to(device=device, dtype=torch.int64)], dim=1)
    if isinstance(temperature, Tensor):
        inv_temp = (1.0 / temperature.to(device=device, dtype=acc)).reshape(-1).expand(n).contiguous()
    else:
        inv_temp = torch.full((n,), 1.0 / float(temperature), dtype=acc, device=device)
    return ids, inv_temp


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
        sum_p2: also return ``sum_v p(v)^2`` per row (one more accumulator in the same vocabulary pass; detached).

    Returns:
        :class:`SparseLogSoftmax`; ``target`` and ``candidates`` are differentiable with respect to ``logits``.

    Raises:
        ValueError: naming the argument, for a bad shape, dtype, option or (with ``validate``) value.
    """
    input_checks.check_logits(logits)
    n, v = logits.shape
    # fp32 statistics for 16/32-bit logits; float64 logits keep float64 throughout (gradcheck, references).
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    input_checks.check_rows(n, logits.device, targets, candidate_ids, temperature, support, skip, shard, acc)
    input_checks.check_inplace_grad(logits, inplace_grad)
    check_sum_p2(sum_p2)
    if validate:
        input_checks.check_values(v, targets, candidate_ids, temperature, shard, support, acc)
    ids, inv_temp = row_inputs(targets, candidate_ids, temperature, n, acc, logits.device)
    plan = LogitsPlan(support, shard, inplace_grad, backend_registry.choose(backend, logits.device, logits.dtype),
                      sum_p2)
    logp, lse, entropy, p2 = SparseLogSoftmaxFunction.apply(logits, ids, inv_temp, skip, plan)
    return SparseLogSoftmax(logp[:, 0], logp[:, 1:], lse, entropy, p2 if sum_p2 else None)


def check_sum_p2(sum_p2: object) -> None:
    """``sum_p2`` must be a bool (a tensor or a number would be a different question)."""
    if not isinstance(sum_p2, bool):
        raise ValueError(f"sum_p2: expected True or False, got {sum_p2!r}")
