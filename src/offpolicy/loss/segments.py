"""Per-sequence reductions over a flat token batch (``seq_ids`` need not be contiguous or sorted).

Context parallelism: with ``group`` set, each rank holds only some tokens of every sequence, and every
per-sequence statistic (:meth:`Segments.sum`, ``count``, ``mean``, ``max``, ``min``, ``has_active``) is
all-reduced over the group, so all ranks see the whole sequence's value. Those reductions are not
differentiable (they feed detached weights and rejections); the differentiable per-sequence sum of the loss is
:meth:`Segments.partial_sum`, this rank's share, whose sum over the ranks is the whole.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class Segments:
    """Sequence membership of ``N`` tokens.

    Attributes:
        index: ``[N]`` int64 in ``[0, num)``, the dense sequence index of each token.
        num: number of sequences (the same on every rank of ``group``).
        active: ``[N]`` bool, the tokens that count (trained tokens); reductions ignore the rest.
        group: ``torch.distributed`` process group over which sequences are split (context parallelism), or None.
    """

    index: Tensor
    num: int
    active: Tensor
    group: Any = None

    @classmethod
    def from_ids(cls, seq_ids: Tensor, active: Tensor, group: Any = None) -> "Segments":
        """Segments of ``seq_ids [N]``.

        Without a group the ids are made dense with ``unique``. With a group the ids index the sequences directly
        (a rank may hold no token of some sequence, so a local ``unique`` would not agree across ranks): they
        must be ``>= 0`` and name the same sequence on every rank, and ``num`` is one more than the largest id
        on any rank (one all-reduce).
        """
        if group is None:
            uniq, index = torch.unique(seq_ids, return_inverse=True)
            return cls(index.reshape(-1), int(uniq.numel()), active)
        import torch.distributed as dist

        ids = seq_ids.to(torch.int64).reshape(-1)
        # One MAX of (largest id + 1, -smallest id): every rank learns num, and every rank raises on a bad id.
        stats = torch.stack([ids.max() + 1, -ids.min()]) if ids.numel() else ids.new_zeros(2)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
        if int(stats[1]) > 0:
            raise ValueError(
                f"seq_ids: id {-int(stats[1])} is negative (on some rank); under a context-parallel group the ids "
                "index the sequences directly and must be >= 0"
            )
        return cls(ids, int(stats[0]), active, group)

    def local(self) -> "Segments":
        """The same segments without the group: reductions over this rank's tokens only."""
        return replace(self, group=None)

    def _all_reduce(self, x: Tensor, op: str) -> Tensor:
        if self.group is None:
            return x
        import torch.distributed as dist

        dist.all_reduce(x, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=self.group)
        return x

    def partial_sum(self, x: Tensor) -> Tensor:
        """``[num]`` sum of ``x [N]`` over this rank's active tokens of each sequence (differentiable)."""
        out = torch.zeros(self.num, dtype=x.dtype, device=x.device)
        return out.index_add(0, self.index, torch.where(self.active, x, torch.zeros_like(x)))

    def sum(self, x: Tensor) -> Tensor:
        """``[num]`` sum of ``x [N]`` over each sequence's active tokens (on all ranks of the group)."""
        if self.group is not None and x.requires_grad:
            raise RuntimeError(
                "Segments.sum all-reduces over the context-parallel group without autograd; use partial_sum for a "
                "differentiable sum"
            )
        return self._all_reduce(self.partial_sum(x), "sum")

    def count(self) -> Tensor:
        """``[num]`` number of active tokens per sequence (float)."""
        return self.sum(torch.ones_like(self.index, dtype=torch.float32))

    def mean(self, x: Tensor) -> Tensor:
        """``[num]`` mean over active tokens; 0 for a sequence without any."""
        return self.sum(x) / self.count().to(x.dtype).clamp_min(1)

    def max(self, x: Tensor) -> Tensor:
        """``[num]`` max over active tokens; ``-inf`` for a sequence without any."""
        out = torch.full((self.num,), float("-inf"), dtype=x.dtype, device=x.device)
        src = torch.where(self.active, x, torch.full_like(x, float("-inf")))
        return self._all_reduce(out.scatter_reduce_(0, self.index, src, reduce="amax"), "max")

    def min(self, x: Tensor) -> Tensor:
        """``[num]`` min over active tokens; ``+inf`` for a sequence without any."""
        return -self.max(-x)

    def has_active(self) -> Tensor:
        """``[num]`` bool, sequences with at least one active token."""
        return self.count() > 0

    def broadcast(self, per_seq: Tensor) -> Tensor:
        """``[N]`` the per-sequence value at each token."""
        return per_seq[self.index]
