"""The recorded token sequences, stored back to back (CSR): a file with one 100k-token context among short ones
costs what it holds, not ``B x 100k``; the model is fed a few sequences at a time, padded only to the longest of
those."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Contexts:
    """``B`` sequences: sequence ``b`` is ``ids[offsets[b]:offsets[b + 1]]``.

    Attributes:
        ids: ``[S]`` int64 token ids of every sequence, one after another.
        offsets: ``[B + 1]`` int64, from 0 to ``S``, non-decreasing (checked by ``schema.check_columns``).
    """

    ids: Tensor
    offsets: Tensor

    @classmethod
    def from_lists(cls, seqs: Sequence[Sequence[int]]) -> "Contexts":
        offsets = torch.zeros(len(seqs) + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor([len(s) for s in seqs], dtype=torch.int64).cumsum(0)
        ids = torch.tensor([t for s in seqs for t in s], dtype=torch.int64)
        return cls(ids, offsets)

    @classmethod
    def from_padded(cls, sequences: Tensor) -> "Contexts":
        """Every row of ``sequences [B, L]`` kept whole (the caller already holds ``B x L``)."""
        if not isinstance(sequences, Tensor) or sequences.dim() != 2:
            raise ValueError(f"sequences must be an int [B, L] tensor, got "
                             f"{list(sequences.shape) if isinstance(sequences, Tensor) else type(sequences).__name__}")
        b, length = sequences.shape
        return cls(sequences.reshape(-1).to(torch.int64), torch.arange(b + 1, dtype=torch.int64) * length)

    def __len__(self) -> int:
        return int(self.offsets.numel()) - 1

    @property
    def lengths(self) -> Tensor:
        """``[B]`` int64 the length of each sequence."""
        return self.offsets[1:] - self.offsets[:-1]

    def padded(self, start: int = 0, stop: int | None = None) -> Tensor:
        """``[b, L]`` int64 sequences ``start .. stop - 1`` right-padded with 0 to the longest of them (``O(b L)``:
        for a chunk of sequences, or a small record's tests)."""
        stop = len(self) if stop is None else min(stop, len(self))
        lengths = self.lengths[start:stop]
        width = int(lengths.max()) if lengths.numel() else 0
        out = torch.zeros(max(stop - start, 0), width, dtype=torch.int64)
        if out.numel():
            row = torch.repeat_interleave(torch.arange(stop - start), lengths)
            first = self.offsets[start:stop]
            pos = torch.arange(int(lengths.sum())) - (first - first[0]).repeat_interleave(lengths)
            out[row, pos] = self.ids[int(first[0]): int(first[0]) + int(lengths.sum())]
        return out
