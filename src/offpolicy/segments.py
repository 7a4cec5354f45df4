"""Per-sequence reductions over a flat token batch (``seq_ids`` need not be contiguous or sorted)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Segments:
    """Sequence membership of ``N`` tokens.

    Attributes:
        index: ``[N]`` int64 in ``[0, num)``, the dense sequence index of each token.
        num: number of distinct sequences.
        active: ``[N]`` bool, the tokens that count (trained tokens); reductions ignore the rest.
    """

    index: Tensor
    num: int
    active: Tensor

    @classmethod
    def from_ids(cls, seq_ids: Tensor, active: Tensor) -> "Segments":
        uniq, index = torch.unique(seq_ids, return_inverse=True)
        return cls(index.reshape(-1), int(uniq.numel()), active)

    def sum(self, x: Tensor) -> Tensor:
        """``[num]`` sum of ``x [N]`` over each sequence's active tokens."""
        out = torch.zeros(self.num, dtype=x.dtype, device=x.device)
        return out.index_add_(0, self.index, torch.where(self.active, x, torch.zeros_like(x)))

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
        return out.scatter_reduce_(0, self.index, src, reduce="amax")

    def min(self, x: Tensor) -> Tensor:
        """``[num]`` min over active tokens; ``+inf`` for a sequence without any."""
        return -self.max(-x)

    def has_active(self) -> Tensor:
        """``[num]`` bool, sequences with at least one active token."""
        return self.count() > 0

    def broadcast(self, per_seq: Tensor) -> Tensor:
        """``[N]`` the per-sequence value at each token."""
        return per_seq[self.index]
