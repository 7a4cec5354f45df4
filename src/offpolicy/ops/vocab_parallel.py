"""Vocabulary parallelism shared by both primitives: each rank holds the columns ``[start, start + V_local)``.

The forward gathers the logits at the ids this rank owns (0 elsewhere, so a SUM over ranks assembles each row)
and combines the per-row online-softmax statistics with one MAX and one packed SUM all-reduce of
``O(N (3 + M))`` numbers (one more per row for each extra statistic of :mod:`offpolicy.ops.row_stats`, merged by
the rule it declares); the backward needs no communication (each rank differentiates the same replicated loss).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from offpolicy.ops import row_stats
from offpolicy.ops.online_softmax import INF
from offpolicy.ops.row_stats import RowStats


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice ``[start, start + V_local)`` of a vocabulary split over ``group``."""

    group: Any
    start: int


def localise(ids: Tensor, shard: VocabShard | None, v_local: int) -> Tensor:
    """Global ids ``[N, M]`` -> local column ids, ``-1`` for padding and for ids owned by another shard."""
    if shard is None:
        return ids
    local = ids - shard.start
    return torch.where((ids >= 0) & (local >= 0) & (local < v_local), local, torch.full_like(local, -1))


def gather_local(logits: Tensor, local: Tensor, inv_temp: Tensor) -> Tensor:
    """``[N, M]`` ``x = logits * inv_temp`` (``inv_temp``'s dtype) at the local ids, 0 where not owned."""
    if logits.shape[1] == 0:  # a shard holding only vocabulary padding owns nothing
        return torch.zeros(local.shape, dtype=inv_temp.dtype, device=local.device)
    x = logits.gather(1, local.clamp_min(0)).to(inv_temp.dtype) * inv_temp[:, None]
    return torch.where(local >= 0, x, torch.zeros_like(x))


def combine_shards(shard: VocabShard, stats: RowStats, x: Tensor) -> tuple[RowStats, Tensor]:
    """All-reduce the per-row statistics (:class:`~offpolicy.ops.row_stats.RowStats`, ``[N]``) and the gathered
    ``x [N, M]`` over the shards.

    With ``M = max_r m_r``, ``a_r = exp(m_r - M)`` and ``d_r = m_r - M``, each shard rescales its record to ``M``
    by the rule each statistic declares (:func:`offpolicy.ops.row_stats.rescale`: ``s = sum_r a_r s_r``,
    ``t = sum_r a_r (t_r + s_r d_r)``, ``sum p^2``'s ``q = sum_r a_r^2 q_r``, ...) and one SUM adds them: one MAX,
    then one SUM of ``2 + E + M`` columns (``E`` extras). Returns the combined record (reference ``M``) and ``x``.
    """
    import torch.distributed as dist

    m_loc = torch.where(stats.s > 0, stats.m, torch.full_like(stats.m, -INF))
    big = m_loc.clone()
    dist.all_reduce(big, op=dist.ReduceOp.MAX, group=shard.group)
    big = torch.where(torch.isfinite(big), big, torch.zeros_like(big))
    m_safe = torch.where(stats.s > 0, stats.m, big)
    cols = row_stats.rescale(stats, torch.exp(m_loc - big), m_safe - big)
    packed = torch.cat([*(c[:, None] for c in cols), x], dim=1)
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=shard.group)
    k = len(cols)
    return RowStats(big, packed[:, 0], packed[:, 1], dict(zip(stats.extras, packed[:, 2:k].unbind(1)))), packed[:, k:]


def sum_shards(shard: VocabShard, x: Tensor) -> Tensor:
    """A SUM all-reduce of ``x`` over the shards (a copy; ``x`` is left as it is)."""
    import torch.distributed as dist

    x = x.clone()
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=shard.group)
    return x
