"""Per-row reductions over a record's entries, for the padded ``[N, K]`` layout and the CSR ``[nnz]`` one alike.

Everything the loss reads from a record is a reduction over each row's entries (``P_H``, ``Q_H``, the centering
sum, ``log P_S``, the support's entropy, metrics). :class:`EntryRows` says where the entries of row ``t`` lie:
along dimension 1 of an ``[N, K]`` tensor (padded), or at the positions ``row == t`` of an ``[nnz]`` one (CSR),
whose reductions are ``index_add_`` over the row index: ``O(nnz)`` work and ``[N]`` outputs, no ``[N, K]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from offpolicy.records.candidates import Candidates
from offpolicy.records.csr_candidates import CSRCandidates

Record = Candidates | CSRCandidates


@dataclass(frozen=True)
class EntryRows:
    """Where each row's entries lie: ``row [nnz]`` int64 for CSR, None for the padded ``[N, K]`` layout.

    Built from a CSR record (:meth:`of`), the ``[nnz]`` row index is formed on first use only (a support record
    under the fused support pass may never need it: the metrics read :meth:`sizes`, ``O(N)``)."""

    row_index: Tensor | None
    n: int
    offsets: Tensor | None = None
    csr: CSRCandidates | None = None
    #: The lazily formed row index (a dict, not ``functools.cached_property``, whose lock ``torch.compile`` cannot
    #: trace on Python 3.11).
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, record: Record) -> "EntryRows":
        if isinstance(record, CSRCandidates):
            return cls(None, record.num_rows, record.offsets.to(torch.int64), record)
        return cls(None, record.num_rows)

    @property
    def row(self) -> Tensor | None:
        """``[nnz]`` int64 row of each entry (CSR), None (padded). Formed by the record's own
        :meth:`~offpolicy.records.csr_candidates.CSRCandidates.row_index` (a binary search, memory-safe on any
        offsets, even ones changed in place after the record was built and checked)."""
        if self.row_index is not None or self.csr is None:
            return self.row_index
        if "row" not in self._cache:
            self._cache["row"] = self.csr.row_index()
        return self._cache["row"]

    def sizes(self, record: Record) -> Tensor:
        """``[N]`` int64 entries per row of ``record`` (this layout's): the CSR offsets' differences (``O(N)``), or
        the padded record's valid entries counted."""
        if self.offsets is not None:
            return self.offsets[1:] - self.offsets[:-1]
        return self.sum(record.valid.to(torch.int64))

    def sum(self, x: Tensor) -> Tensor:
        """``[N]`` sum of each row's entries of ``x`` (``[N, K]`` or ``[nnz]``); differentiable."""
        if self.row is None:
            return x.sum(dim=1)
        return torch.zeros(self.n, dtype=x.dtype, device=x.device).index_add(0, self.row, x)

    def spread(self, r: Tensor) -> Tensor:
        """A per-row ``r [N]`` at every entry: ``[N, 1]`` (broadcasting over ``K``) or ``[nnz]``."""
        return r[:, None] if self.row is None else r[self.row]

    def max(self, x: Tensor) -> Tensor:
        """``[N]`` detached maximum of each row's entries, ``-inf`` on an empty row."""
        x = x.detach()
        if self.row is None:
            return x.amax(dim=1) if x.shape[1] else torch.full((self.n,), -float("inf"), dtype=x.dtype,
                                                                 device=x.device)
        out = torch.full((self.n,), -float("inf"), dtype=x.dtype, device=x.device)
        return out.scatter_reduce(0, self.row, x, reduce="amax")

    def logsumexp(self, x: Tensor) -> Tensor:
        """``[N]`` ``log sum_v exp(x_v)`` over each row's entries, ``-inf`` on a row that is empty or all
        ``-inf`` (NaN if an entry is NaN); differentiable, with zero (not NaN) gradient on empty rows."""
        m = self.max(x)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        s = self.sum(torch.exp(x - self.spread(m)))
        # log(0) would pass 0 / 0 back through the where below: the empty rows take log(1) instead. A NaN sum
        # (a NaN entry) is not empty: it stays NaN.
        empty = s == 0
        return torch.where(empty, torch.full_like(s, -float("inf")), torch.log(torch.where(empty, torch.ones_like(s), s)) + m)
