"""Vocabulary parallelism shared by both primitives: each rank holds the columns ``[start, start + V_local)``.

The forward gathers the logits at the ids this rank owns (0 elsewhere, so a SUM over ranks assembles each row)
and combines the per-row online-softmax statistics with one MAX and one packed SUM all-reduce of
``O(N (3 + M))`` numbers (one more per row for ``sum p^2``); the backward needs no communication (each rank differentiates the same replicated loss).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from offpolicy.ops.online_softmax import INF


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


def combine_shards(shard: VocabShard, m: Tensor, s: Tensor, t: Tensor, x: Tensor,
                   q: Tensor | None = None) -> tuple[Tensor, ...]:
    """All-reduce per-row statistics ``m, s, t [N]`` (and ``q [N]``) and the gathered ``x [N, M]`` over the shards.

    With ``M = max_r m_r`` and ``a_r = exp(m_r - M)``: ``s = sum_r a_r s_r``,
    ``t = sum_r a_r (t_r + s_r (m_r - M))`` (``t`` is taken relative to the row max) and
    ``q = sum_r a_r^2 q_r`` (``q_r = sum exp(2 (x - m_r))``). One MAX, one SUM (``q`` is one more column of it).
    Returns ``(M, s, t, x)``, then ``q`` when given.
    """
    import torch.distributed as dist

    m_loc = torch.where(s > 0, m, torch.full_like(m, -INF))
    big = m_loc.clone()
    dist.all_reduce(big, op=dist.ReduceOp.MAX, group=shard.group)
    big = torch.where(torch.isfinite(big), big, torch.zeros_like(big))
    m_safe = torch.where(s > 0, m, big)
    a = torch.exp(m_loc - big)
    cols = [(a * s)[:, None], (a * (t + s * (m_safe - big)))[:, None]]
    if q is not None:
        cols.append((a * a * q)[:, None])
    packed = torch.cat([*cols, x], dim=1)
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=shard.group)
    k = len(cols)
    combined = (big, packed[:, 0], packed[:, 1], packed[:, k:])
    return combined if q is None else (*combined, packed[:, 2])


def sum_shards(shard: VocabShard, x: Tensor) -> Tensor:
    """A SUM all-reduce of ``x`` over the shards (a copy; ``x`` is left as it is)."""
    import torch.distributed as dist

    x = x.clone()
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=shard.group)
    return x
