"""What both ops share at their boundary: the per-row inputs they build for their autograd functions and the
result they return (:class:`SparseLogSoftmax`)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class SparseLogSoftmax(NamedTuple):
    """Outputs of :func:`~offpolicy.ops.sparse_log_softmax` and :func:`~offpolicy.ops.linear_sparse_log_softmax`
    (fp32; float64 for float64 inputs).

    Attributes:
        target: ``[N]`` log-probability of the sampled token.
        candidates: ``[N, K]`` log-probabilities of the candidates, ``-inf`` at padding.
        lse: ``[N]`` normaliser of ``z / tau`` (full vocabulary, or the support); ``+inf`` on skipped rows.
        entropy: ``[N]`` entropy of the (full or support) distribution; 0 on skipped rows. Not differentiable.
        stats: the extra statistics the call asked for (``stats=(...)``), by name: each ``[N]`` of the same
            distribution (``p`` of ``z / tau``; under ``support`` the support-renormalised ``p^S``), 0 on skipped
            rows, detached (no gradient flows through them); None when none was asked. The names and what each
            means: :data:`offpolicy.ops.row_stats.STATISTICS`.
    """

    target: Tensor
    candidates: Tensor
    lse: Tensor
    entropy: Tensor
    stats: dict[str, Tensor] | None = None

    @property
    def sum_p2(self) -> Tensor | None:
        """``[N]`` ``sum_v p(v)^2`` (``stats["sum_p2"]``), None unless asked (``sum_p2=True``): a baseline statistic
        (the Optimal Token Baseline's, :func:`offpolicy.advantages.optimal_token_baseline`)."""
        return None if self.stats is None else self.stats.get("sum_p2")


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


def result(outputs: tuple[Tensor, ...], names: tuple[str, ...]) -> SparseLogSoftmax:
    """An autograd function's ``(logp [N, 1 + K], lse, entropy, *values)`` as a :class:`SparseLogSoftmax`,
    ``values`` those of the statistics ``names``, in order."""
    logp, lse, entropy, *values = outputs
    return SparseLogSoftmax(logp[:, 0], logp[:, 1:], lse, entropy, dict(zip(names, values)) if names else None)
