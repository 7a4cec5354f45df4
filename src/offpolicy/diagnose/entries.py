"""Per-row reductions over a CSR candidate record (``ids [nnz]``, ``offsets [N + 1]``, ``logprobs [nnz]``), so
diagnose never pads the record to ``[N, K]``: every function here is ``O(N + nnz)``."""

from __future__ import annotations

import torch
from torch import Tensor

from offpolicy.records.csr_candidates import CSRCandidates


def entry_rows(c: CSRCandidates) -> Tensor:
    """``[nnz]`` int64 the row (token) of each entry: the record's own memory-safe ``row_index``."""
    return c.row_index()


def row_sum(values: Tensor, row: Tensor, n: int) -> Tensor:
    """``[n]`` float64 sum of ``values [nnz]`` per row."""
    return torch.zeros(n, dtype=torch.float64).index_add_(0, row, values.double())


def row_logsumexp(values: Tensor, row: Tensor, n: int) -> Tensor:
    """``[n]`` float64 ``logsumexp`` of ``values [nnz]`` per row (``-inf`` for a row without a finite entry)."""
    v = values.double()
    top = torch.full((n,), float("-inf"), dtype=torch.float64).scatter_reduce(0, row, v, "amax")
    safe = torch.where(torch.isfinite(top), top, 0.0)
    s = row_sum(torch.exp(v - safe[row]), row, n)
    return torch.log(s) + safe


def entry_of(c: CSRCandidates, token: Tensor, row: Tensor | None = None) -> Tensor:
    """``[N]`` float64: each row's log-prob for ``token [N]`` (NaN where the row does not hold it; ids are unique
    within a row)."""
    row = entry_rows(c) if row is None else row
    n = c.num_rows
    hit = c.ids.long() == token.long()[row]
    val = torch.zeros(n, dtype=torch.float64).index_put_((row[hit],), c.logprobs.double()[hit])
    has = torch.zeros(n, dtype=torch.bool).index_put_((row[hit],), torch.ones(int(hit.sum()), dtype=torch.bool))
    return torch.where(has, val, float("nan"))


def padded_to_entries(values: Tensor, c: CSRCandidates, what: str) -> Tensor:
    """``[nnz]`` float64 from ``values``: ``[nnz]`` as is, or ``[N, K]`` in the layout of ``c.to_padded()`` (row
    ``t``'s values in its first ``lengths[t]`` columns, ``-inf`` after). Raises ``ValueError`` naming ``what``."""
    if not isinstance(values, Tensor) or not values.is_floating_point():
        raise ValueError(f"{what}: expected a float tensor")
    lengths = c.lengths
    if values.dim() == 1:
        if values.numel() != c.nnz:
            raise ValueError(f"{what}: {values.numel()} values for the record's {c.nnz} candidate entries")
        return values.double()
    if values.dim() != 2 or values.shape[0] != c.num_rows:
        raise ValueError(f"{what}: expected [nnz] = [{c.nnz}] or [N, K] with N = {c.num_rows}, got "
                         f"{list(values.shape)}")
    widest = int(lengths.max()) if c.num_rows else 0
    if values.shape[1] < widest:
        raise ValueError(f"{what}: [N, K] with K = {values.shape[1]} but a candidate row holds {widest} ids")
    inside = torch.arange(values.shape[1])[None, :] < lengths[:, None]
    pad = values[~inside]
    if bool((pad != float("-inf")).any()):
        raise ValueError(f"{what}: [N, K] values must be -inf after each row's own entries (the layout of "
                         "candidates.to_padded()); got a finite value in padding")
    return values[inside].double()
