"""The candidate record in CSR layout: each row's entries stored back to back, without padding.

``CSRCandidates(ids [nnz], offsets [N + 1], logprobs [nnz], kind)``: row ``t`` owns
``ids[offsets[t]:offsets[t + 1]]`` and the sampler log-probabilities at the same positions. The kinds mean what
they mean for the padded :class:`~offpolicy.records.candidates.Candidates` (docs/spec.md#records); a row may be
empty (``offsets[t] == offsets[t + 1]``). A batch whose realised supports range from 2 to thousands of ids stores
``12`` bytes per recorded id (an int64 id and an fp32 log-probability) plus ``8`` per row, instead of ``12 K`` per
row with ``K`` the widest row (docs/spec.md#record-memory).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from offpolicy.records.candidates import KINDS, SUPPORT_SUM_TOL, Candidates, Kind, has_values


@dataclass(frozen=True)
class CSRCandidates:
    """Candidate ids and sampler log-probabilities per position, stored row after row.

    Attributes:
        ids: ``[nnz]`` int32/int64 token ids (no padding).
        offsets: ``[N + 1]`` int32/int64, non-decreasing, ``offsets[0] == 0``, ``offsets[N] == nnz``.
        logprobs: ``[nnz]`` float sampler log-probabilities of ``ids`` after temperature (renormalised over the
            row for ``kind="support"``).
        kind: ``"head"`` or ``"support"``.

    Shapes, dtypes, devices and the offsets' values (:meth:`check_offsets`: first 0, last ``nnz``,
    non-decreasing; ``O(N)``) are checked on construction; the other values (ids, sums) by :meth:`validate`, which
    the loss calls at its boundary. The offsets check reads the values: no cost on CPU, one host sync for a CUDA
    record (records are built once per batch); it is skipped where there are no values to read, on the meta
    device, on fake tensors and while ``torch.compile`` traces (the compiled loss checks the record in its graph,
    docs/spec.md#records). :meth:`row_index` and :meth:`take_rows` never index memory by unchecked offsets, so
    even a record whose offsets were changed in place after construction cannot make them read or write out of
    bounds.
    """

    ids: Tensor
    offsets: Tensor
    logprobs: Tensor
    kind: Kind = "head"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"CSRCandidates.kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("ids", "offsets", "logprobs"):
            x = getattr(self, name)
            if not isinstance(x, Tensor):
                raise TypeError(f"CSRCandidates.{name} must be a torch.Tensor, got {type(x).__name__}")
            if x.dim() != 1:
                raise ValueError(f"CSRCandidates.{name} must be 1-D, got shape {tuple(x.shape)}")
            if x.device != self.ids.device:
                raise ValueError(f"CSRCandidates.{name} is on {x.device}, expected {self.ids.device} like ids")
        for name in ("ids", "offsets"):
            if getattr(self, name).dtype not in (torch.int32, torch.int64):
                raise TypeError(f"CSRCandidates.{name} must be int32 or int64, got {getattr(self, name).dtype}")
        if not self.logprobs.is_floating_point():
            raise TypeError(f"CSRCandidates.logprobs must be a float tensor, got {self.logprobs.dtype}")
        if self.logprobs.shape != self.ids.shape:
            raise ValueError(f"CSRCandidates.logprobs must have the shape of ids [nnz] = [{self.ids.numel()}], "
                             f"got {tuple(self.logprobs.shape)}")
        if self.offsets.numel() == 0:
            raise ValueError("CSRCandidates.offsets must hold N + 1 >= 1 entries")
        if has_values(self.offsets):
            self.check_offsets()

    @property
    def num_rows(self) -> int:
        return self.offsets.numel() - 1

    @property
    def nnz(self) -> int:
        """The number of recorded entries."""
        return self.ids.numel()

    @property
    def lengths(self) -> Tensor:
        """``[N]`` int64 entries per row."""
        off = self.offsets.to(torch.int64)
        return off[1:] - off[:-1]

    @property
    def valid(self) -> Tensor:
        """``[nnz]`` bool, all True (a CSR record has no padding); the padded record's ``[N, K]`` twin."""
        return torch.ones(self.ids.shape, dtype=torch.bool, device=self.ids.device)

    def row_index(self) -> Tensor:
        """``[nnz]`` int64 row of each entry: entry ``e`` sits in row ``r`` with ``offsets[r] <= e <
        offsets[r + 1]``. ``O(nnz log N)``, no host sync, a static output shape (traceable).

        Memory-safe on any offsets: a binary search of each entry among the rows' ends, clamped to ``[0, N)``,
        never ``repeat_interleave`` with ``output_size`` (whose kernels write each row's repeats before they
        check the lengths, so offsets that go up and down corrupted the heap). Offsets that break the record's
        invariant (changed in place after construction) give wrong rows, which :meth:`validate` refuses, never an
        access out of bounds."""
        n = self.num_rows
        entries = torch.arange(self.nnz, device=self.ids.device, dtype=self.offsets.dtype)
        row = torch.searchsorted(self.offsets[1:], entries, right=True)
        return row.clamp_(max=max(n - 1, 0)).to(torch.int64)

    def to_padded(self, width: int | None = None) -> Candidates:
        """The padded ``[N, K]`` record (``K = width``, default the longest row); see :meth:`Candidates.from_csr`."""
        return Candidates.from_csr(self.ids, self.offsets, self.logprobs, self.kind, width)

    @classmethod
    def from_padded(cls, candidates: Candidates) -> "CSRCandidates":
        """The CSR record of a padded one (its ``-1`` entries dropped, the others kept in column order)."""
        if not isinstance(candidates, Candidates):
            raise TypeError(f"from_padded: candidates must be an offpolicy.Candidates, got "
                            f"{type(candidates).__name__}")
        valid = candidates.ids >= 0
        offsets = torch.zeros(candidates.num_rows + 1, dtype=torch.int64, device=candidates.ids.device)
        offsets[1:] = valid.sum(dim=1).cumsum(0)
        return cls(candidates.ids[valid], offsets, candidates.logprobs[valid], candidates.kind)

    def take_rows(self, index: Tensor) -> "CSRCandidates":
        """The record whose row ``j`` is this record's row ``index[j]`` (``index [M]`` int, in ``[0, N)``; rows
        may repeat or be left out), entries in their order. ``O(N + nnz_out)``, a few host syncs (the checks and
        the output size). Raises ``ValueError`` naming ``index`` for an index out of range and re-checks the
        offsets first (:meth:`check_offsets`), so the copy never reads out of bounds."""
        if not isinstance(index, Tensor) or index.dim() != 1 or index.is_floating_point() or index.is_complex() \
                or index.dtype == torch.bool:
            got = f"{index.dtype} tensor of shape {tuple(index.shape)}" if isinstance(index, Tensor) else \
                type(index).__name__
            raise TypeError(f"take_rows: index must be a 1-D integer tensor [M], got {got}")
        index = index.to(device=self.ids.device, dtype=torch.int64)
        n = self.num_rows
        if index.numel() and not (bool((index >= 0).all()) and bool((index < n).all())):
            bad = int(index.min()) if bool((index < 0).any()) else int(index.max())
            raise ValueError(f"take_rows: index {bad} is out of range for a record of {n} rows (expected [0, {n}))")
        self.check_offsets()
        lengths = self.lengths[index]
        offsets = torch.zeros(index.numel() + 1, dtype=torch.int64, device=self.ids.device)
        offsets[1:] = lengths.cumsum(0)
        nnz = int(offsets[-1])
        # Entry e of output row j sits at starts[j] + (e - offsets[j]) in this record.
        shift = self.offsets.to(torch.int64)[:-1][index] - offsets[:-1]
        pos = torch.repeat_interleave(shift, lengths, output_size=nnz) + torch.arange(nnz, device=self.ids.device)
        return CSRCandidates(self.ids[pos], offsets, self.logprobs[pos], self.kind)

    @classmethod
    def cat(cls, records: "list[CSRCandidates]") -> "CSRCandidates":
        """The records' rows one after another (all of one kind)."""
        if not records:
            raise ValueError("CSRCandidates.cat: records must be non-empty")
        kinds = {r.kind for r in records}
        if len(kinds) != 1:
            raise ValueError(f"CSRCandidates.cat: records of different kinds {sorted(kinds)}")
        lengths = torch.cat([r.lengths for r in records])
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
        offsets[1:] = lengths.cumsum(0)
        return cls(torch.cat([r.ids.to(torch.int64) for r in records]), offsets,
                   torch.cat([r.logprobs for r in records]), kinds.pop())

    def check_offsets(self) -> None:
        """Raise ``ValueError`` unless ``offsets`` start at 0, end at ``nnz`` and never decrease (``O(N)``; one
        host sync on a CUDA record when they are right, a few more to name what is wrong)."""
        off = self.offsets
        down = off[1:] < off[:-1]
        if not bool((off[0] == 0) & (off[-1] == self.nnz) & ~down.any()):
            if int(off[0]) != 0 or int(off[-1]) != self.nnz:
                raise ValueError(f"candidates.offsets must start at 0 and end at nnz = {self.nnz}, got {int(off[0])} "
                                 f"and {int(off[-1])}")
            row = int(down.nonzero()[0])
            raise ValueError(f"candidates.offsets must be non-decreasing; offsets[{row + 1}] < offsets[{row}] "
                             f"({int(off[row + 1])} < {int(off[row])})")

    def validate(self, vocab_size: int | None, num_rows: int, tokens: Tensor | None = None,
                 loss_mask: Tensor | None = None) -> None:
        """The checks of :meth:`Candidates.validate` on the CSR layout (a few host syncs): row count and offsets,
        ids in ``[0, vocab_size)``, no duplicate id within a row, no NaN or ``+inf`` log-probability; on trained
        rows (``loss_mask [N]``, None: all) no log-probability above 0, support rows summing to one within the
        tolerance of :func:`~offpolicy.records.candidates.support_sum_tolerance` and holding the sampled token, head
        rows of mass at most 1.

        Cost ``O(nnz)`` element-wise passes and segment sums, except the duplicate check: where the record is
        dense enough (``N V <= DENSE_CHECK_RATIO nnz``, wide supports) a membership bitmap of the rows, a chunk of
        at most :data:`CHECK_CHUNK_BYTES` at a time (``O(nnz + N V)``, one scatter and one count; it also answers
        whether each row holds its token in ``O(N)``); otherwise one sort of the ``(row, id)`` keys
        (``O(nnz log nnz)``, cheap at those sizes)."""
        if self.num_rows != num_rows:
            raise ValueError(f"candidates: expected {num_rows} rows (one per token), got {self.num_rows} "
                             f"(offsets holds {self.offsets.numel()} entries, N + 1)")
        self.check_offsets()
        if self.nnz == 0:
            return
        ids, lp = self.ids, self.logprobs
        lengths = self.lengths
        trained = (torch.ones(num_rows, dtype=torch.bool, device=ids.device) if loss_mask is None
                   else loss_mask.to(device=ids.device, dtype=torch.bool))
        lo, hi = (int(x) for x in torch.aminmax(ids))  # one pass, one sync
        if lo < 0:
            raise ValueError(f"candidates.ids: id {lo} is negative (a CSR record has no padding)")
        if vocab_size is not None and hi >= vocab_size:
            raise ValueError(f"candidates.ids: id {hi} is out of range for vocabulary size {vocab_size}")
        top = float(lp.max())  # NaN if any is NaN (max propagates it): one reduction for three checks
        if top != top:
            raise ValueError("candidates.logprobs: NaN found")
        if top == float("inf"):
            raise ValueError("candidates.logprobs: +inf found (log-probabilities are <= 0)")
        if top > 1e-4 and bool((lp[torch.repeat_interleave(trained, lengths, output_size=self.nnz)] > 1e-4).any()):
            raise ValueError("candidates.logprobs: a log-probability above 0 found (probabilities are <= 1)")
        width = hi + 1 if vocab_size is None else max(vocab_size, hi + 1)
        inside = None
        # the offsets were checked above: per-row values are spread to the entries by one repeat (no search)
        arange = torch.arange(num_rows, device=ids.device)
        if num_rows * width <= DENSE_CHECK_RATIO * self.nnz:
            dup, inside = _bitmap_check(ids, arange, lengths, width, tokens if self.kind == "support" else None)
            if dup is not None:
                raise ValueError(f"candidates.ids: duplicate id within row {dup}")
        else:
            # One sort of (row, id) keys finds a repeated id within a row.
            key = torch.repeat_interleave(arange * width, lengths, output_size=self.nnz).add_(ids.to(torch.int64))
            srt = torch.sort(key).values
            dup = srt[1:] == srt[:-1]
            if bool(dup.any()):
                bad = int(srt[1:][dup][0])
                raise ValueError(f"candidates.ids: duplicate id within row {bad // width}")
        offsets = self.offsets.to(torch.int64)
        lp64 = lp.double()
        # exp in fp32 for 16/32-bit log-probabilities (1 ulp, 1e-7, against a tolerance of 1e-3), summed in float64
        p = torch.exp(lp64) if lp.dtype == torch.float64 else torch.exp(lp.float()).double()
        mass = torch.segment_reduce(p, "sum", offsets=offsets)
        nonempty = (lengths > 0) & trained
        # support_sum_tolerance's bound, its entropy term summed per row (for head rows too: a bf16 head that holds
        # nearly all the mass rounds above 1 honestly). p lp is NaN only at lp = -inf (p = 0): a zero term.
        spread = torch.segment_reduce(torch.nan_to_num_(p.mul_(lp64).neg_(), nan=0.0), "sum", offsets=offsets)
        tol = SUPPORT_SUM_TOL + torch.finfo(lp.dtype).eps * spread
        if self.kind == "support":
            off = nonempty & ((mass - 1.0).abs() > tol)
            if bool(off.any()):
                r = int(off.nonzero()[0])
                raise ValueError(
                    f"candidates: kind='support' rows must sum to 1 (+-{float(tol[r]):.2g} for {lp.dtype}); row {r} "
                    f"sums to {float(mass[r]):.6f}. Were the sampler log-probabilities renormalised over the support?"
                )
            if tokens is not None:
                if inside is None:
                    tok = torch.repeat_interleave(tokens.to(device=ids.device, dtype=torch.int64), lengths,
                                                  output_size=self.nnz)
                    hit = ids.to(torch.int64) == tok
                    inside = torch.segment_reduce(hit.to(torch.float32), "sum", offsets=offsets) > 0
                outside = nonempty & ~inside
                if bool(outside.any()):
                    r = int(outside.nonzero()[0])
                    raise ValueError(f"candidates: the sampled token of row {r} (id {int(tokens[r])}) is outside its "
                                     "recorded support")
        else:
            over = (mass > 1.0 + tol) & trained
            if bool(over.any()):
                r = int(over.nonzero()[0])
                raise ValueError(
                    f"candidates: kind='head' row {r} has sampler mass {float(mass[r]):.6f} > 1. Head records hold "
                    "full-vocabulary probabilities; a renormalised top-p/top-k record is kind='support'."
                )


#: The duplicate check of :meth:`CSRCandidates.validate` uses a membership bitmap where ``N V <= DENSE_CHECK_RATIO
#: nnz`` (each bitmap byte then costs far less than the sort's ``log nnz`` work per entry), else a sort.
DENSE_CHECK_RATIO = 64
#: The bitmap is built for a chunk of rows of at most this many bytes at a time.
CHECK_CHUNK_BYTES = 16 << 20


def _bitmap_check(ids: Tensor, arange: Tensor, lengths: Tensor, width: int,
                  tokens: Tensor | None) -> tuple[int | None, Tensor | None]:
    """``(first row holding an id twice or None, [N] bool whether each row holds its token or None)`` by a bool
    bitmap ``[rows, width]`` per chunk of rows: the entries' cells set (one scatter), then counted: fewer set cells
    than entries means a repeated id. ``ids`` are in ``[0, width)`` and the offsets valid (checked by the caller);
    ``arange`` is ``[N]`` ``0 .. N - 1``."""
    n = lengths.numel()
    step = max(1, CHECK_CHUNK_BYTES // max(1, width))
    ends = [0, *torch.cumsum(lengths, 0).tolist()]
    seen = torch.empty(min(n, step) * width, dtype=torch.bool, device=ids.device)
    inside = None if tokens is None else torch.empty(n, dtype=torch.bool, device=ids.device)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        e0, e1 = ends[lo], ends[hi]
        cells = seen[:(hi - lo) * width]
        cells.zero_()
        base = torch.repeat_interleave(arange[:hi - lo] * width, lengths[lo:hi], output_size=e1 - e0)
        cells.index_fill_(0, base.add_(ids[e0:e1].to(torch.int64)), True)
        if int(cells.count_nonzero()) != e1 - e0:
            per_row = cells.view(hi - lo, width).sum(dim=1)
            r = int(((per_row != lengths[lo:hi]).nonzero())[0])
            return lo + r, None
        if inside is not None:
            tok = tokens[lo:hi].to(device=ids.device, dtype=torch.int64)
            ok = (tok >= 0) & (tok < width)
            inside[lo:hi] = ok & cells.view(hi - lo, width)[arange[:hi - lo], tok.clamp(0, width - 1)]
    return None, inside
