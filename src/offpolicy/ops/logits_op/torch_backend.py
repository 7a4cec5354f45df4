"""Chunked PyTorch backend for the vocabulary pass: the CPU path, and the fallback wherever Triton is absent.

Rows are processed in chunks whose fp32 working set stays near ``CHUNK_BYTES`` (cache-sized), so the only
``[N, V]`` allocation is the gradient itself; bf16/fp16 logits are upcast one chunk at a time. The chunks are shared
out to worker threads with one intra-op thread each (:mod:`offpolicy.ops.row_threads`).

Both functions follow the logits contract of :mod:`offpolicy.ops.backend_registry`.

Exponentials are taken base 2: ``exp(x - m) = exp2((x - m) log2(e))``. PyTorch's CPU ``exp`` (Sleef's 1-ulp ``expf``)
costs three times its ``exp2`` (0.84 against 0.28 ns per fp32 element on one core of the 2-core AVX-512 VM,
``benchmarks/results/cpu_breakdown_vm_2026-12-01_quiet.json``), and the exponential is most of the arithmetic of
both passes. The one extra rounding, of ``(x - m) log2(e)``, moves ``exp(x - m)`` by a relative ``|x - m| 2**-24``:
a few ulps where the mass is (``|x - m|`` small) and nothing that shows in a sum or a 16-bit gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from offpolicy.ops import row_stats, row_threads
from offpolicy.ops.row_stats import RowStats

#: Bytes of one chunk's working buffer (fp32, or float64 for float64 logits); two live at once in the forward.
CHUNK_BYTES = 8 << 20
LOG2E = 1.4426950408889634
INF_ = float("inf")
LN2 = 0.6931471805599453


def full_stats(
    logits: Tensor, inv_temp: Tensor, skip: Tensor | None, probs: Tensor | None = None, *,
    extras: tuple[str, ...] = (),
) -> RowStats:
    """Per-row online-softmax statistics of ``x = logits * inv_temp`` over the whole (local) vocabulary.

    Args:
        logits: ``[N, V]`` bf16/fp16/fp32/fp64, unit stride along ``V``.
        inv_temp: ``[N]`` fp32 (float64 for float64 logits), ``1 / tau``.
        skip: ``[N]`` bool or None; skipped rows are not read and report ``s = 0``.
        probs: optional ``[N, V]`` buffer in ``inv_temp``'s dtype that receives ``exp(x - m)`` of every row read
            (skipped rows are left as they are), for :func:`grad_from_probs`.
        extras: names of :data:`offpolicy.ops.row_stats.STATISTICS` to accumulate too, from the same
            exponentials (one more reduction per chunk each).

    Returns:
        :class:`~offpolicy.ops.row_stats.RowStats` in ``inv_temp``'s dtype: ``m [N]`` (row max, 0 where the row is
        all ``-inf`` or skipped), ``s [N] = sum exp(x - m)``, ``t [N] = sum exp(x - m) * (x - m)`` (so that
        entropy ``= log s - t / s``) and each extra's accumulator (0 on skipped rows).
    """
    n, v = logits.shape
    acc = inv_temp.dtype
    stats = row_stats.zeros(n, extras, acc, logits.device)
    m, s, t = stats.m, stats.s, stats.t
    blocks = [(stats.extras[k], row_stats.STATISTICS[k]) for k in extras]
    all_rows = skip is None or not bool(skip.any())
    rows = torch.arange(n) if all_rows else (~skip).nonzero().view(-1).cpu()
    if rows.numel() == 0 or v == 0:
        return stats
    step = _chunk_rows(v, acc)
    cached = probs is not None and all_rows  # exp(x - m) goes straight into probs

    def make_scratch() -> tuple[Tensor, Tensor | None]:  # per worker: x, and exp(x - m) unless cached
        x_w = torch.empty(step, v, dtype=acc, device=logits.device)
        return x_w, None if cached else torch.empty_like(x_w)

    scratch = row_threads.per_worker(make_scratch)

    def body(lo: int, hi: int) -> None:
        x_buf, e_buf = scratch()
        idx = rows[lo:hi]
        sl = slice(int(idx[0]), int(idx[-1]) + 1)
        z = logits[sl] if all_rows else logits[idx]
        x = x_buf[: idx.numel()]
        e = probs[sl] if e_buf is None else e_buf[: idx.numel()]
        it = inv_temp[idx]
        # The max is taken on the raw logits (tau > 0), and x - m = (z - max z) / tau is formed by one subtraction
        # of nearby values and one rounding: more accurate than z / tau - max(z / tau) when |z / tau| is large.
        # 16-bit logits: a vectorised upcast first (a 16-bit max, or a mixed-dtype subtraction, is far slower on CPU).
        src = z if z.dtype == acc else x.copy_(z)
        mz = src.amax(dim=1)
        mz = torch.where(torch.isfinite(mz), mz, torch.zeros_like(mz))
        torch.sub(src, mz[:, None], out=x)
        x.mul_(it[:, None] * LOG2E)  # y = (x - m) log2(e)
        torch.exp2(x, out=e)
        s_c = e.sum(dim=1)
        for acc_k, st in blocks:  # before x is overwritten below; x - m = y ln 2
            acc_k[idx] = st.block(e, x * LN2 if st.uses_shift else x)
        t_c = x.mul_(e).sum(dim=1).mul_(LN2)  # sum e (x - m) = ln 2 sum e y, in cache; y is not needed afterwards
        bad = torch.isnan(t_c)
        if bool(bad.any()):  # rows holding -inf logits: exp gave 0 but 0 * -inf is NaN; drop those terms
            xb = (z[bad].to(acc) - mz[bad, None]) * it[bad, None]
            t_c[bad] = torch.where(e[bad] > 0, e[bad] * xb, torch.zeros_like(xb)).sum(dim=1)
        if probs is not None and e_buf is not None:
            probs[idx] = e
        m[idx], s[idx], t[idx] = mz * it, s_c, t_c

    row_threads.for_chunks(rows.numel(), step, body)
    return stats


def _chunk_rows(v: int, dtype: torch.dtype) -> int:
    return max(1, CHUNK_BYTES // max(1, torch.finfo(dtype).bits // 8 * v))


def full_grad(
    logits: Tensor,
    ids: Tensor,
    inv_temp: Tensor,
    lse: Tensor,
    grad: Tensor,
    grad_sum: Tensor,
    out: Tensor,
) -> Tensor:
    """Write ``dz = inv_temp * (scatter(grad at ids) - grad_sum * exp(x - lse))`` into ``out``.

    Args:
        logits: ``[N, V]``; ``x = logits * inv_temp``.
        ids: ``[N, M]`` int64 local column ids, ``-1`` where the entry is padding or owned by another shard.
        inv_temp: ``[N]`` fp32 (float64 for float64 logits).
        lse: ``[N]`` normaliser of ``x``; ``+inf`` marks a row with no mass (its ``p`` is 0).
        grad: ``[N, M]`` upstream gradient of the gathered log-probabilities (0 at padding).
        grad_sum: ``[N]`` ``sum`` of the row's gradient over *all* its entries (all shards).
        out: ``[N, V]`` output in the logits' dtype; may be ``logits`` itself (in-place gradient).

    Rows whose dense part vanishes (``lse = +inf`` or ``grad_sum = 0``) are not read: they get the scatter only.
    fp32 outputs are computed in place in ``out``; 16-bit outputs go through one fp32 chunk buffer so that each
    element is rounded once.
    """
    n, v = logits.shape
    if n == 0 or v == 0:
        return out
    acc = inv_temp.dtype
    coef, g_scaled, cols, live = scatter_terms(ids, inv_temp, lse, grad, grad_sum)
    all_live = bool(live.all())
    if not all_live:
        scatter_only(out, ~live, cols, g_scaled)
    rows = torch.arange(n) if all_live else live.nonzero().view(-1).cpu()
    if rows.numel() == 0:
        return out
    # x / tau - lse = (z - tau lse) / tau: one subtraction, then one scale by log2(e) / tau.
    shift = lse / inv_temp
    step = _chunk_rows(v, acc)
    direct = out.dtype == acc and all_live
    # per worker: one fp32 chunk, so that each element of a 16-bit output is rounded once
    scratch = row_threads.per_worker(lambda: torch.empty(step, v, dtype=acc, device=logits.device))

    def body(lo: int, hi: int) -> None:
        idx = rows[lo:hi]
        sl = slice(int(idx[0]), int(idx[-1]) + 1)
        z = logits[sl] if all_live else logits[idx]
        if direct:
            x = out[sl]
        else:
            x = scratch()[: idx.numel()]
        if z.dtype == acc:
            torch.sub(z, shift[idx, None], out=x)
        else:
            x.copy_(z).sub_(shift[idx, None])
        x.mul_(inv_temp[idx, None] * LOG2E)
        x.exp2_()  # p = exp2((x / tau - lse) log2(e))
        x.mul_(coef[idx, None])  # -G p / tau
        x.scatter_add_(1, cols[idx], g_scaled[idx])
        if direct:
            return
        if all_live:
            out[sl].copy_(x)
        else:
            out[idx] = x.to(out.dtype)

    row_threads.for_chunks(rows.numel(), step, body)
    return out


def scatter_terms(ids: Tensor, inv_temp: Tensor, lse: Tensor, grad: Tensor, grad_sum: Tensor
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The ``O(N M)`` parts of ``dz = coef p + scatter(g_scaled at cols)`` (arguments as in :func:`full_grad`).

    Returns ``coef [N] = -grad_sum inv_temp``, ``g_scaled [N, M] = grad inv_temp`` (0 at padding), ``cols [N, M]``
    (ids with padding sent to column 0) and ``live [N]``: rows with a dense part (finite ``lse``, ``coef != 0``).
    """
    coef = -(grad_sum * inv_temp)
    g_scaled = torch.where(ids >= 0, grad * inv_temp[:, None], torch.zeros_like(grad))
    return coef, g_scaled, ids.clamp_min(0), torch.isfinite(lse) & (coef != 0)


def scatter_only(out: Tensor, rows: Tensor, cols: Tensor, g_scaled: Tensor) -> None:
    """Rows ``rows`` ([N] bool) of ``out`` get the scatter of ``g_scaled`` at ``cols`` and zeros elsewhere.

    Repeated ids add up in ``g_scaled``'s dtype, one cache-sized chunk of rows at a time, before the one rounding
    to ``out``'s dtype.
    """
    dead = rows.nonzero().view(-1)
    v = out.shape[1]

    def body(lo: int, hi: int) -> None:
        idx = dead[lo:hi]
        part = torch.zeros(idx.numel(), v, dtype=g_scaled.dtype, device=out.device)
        out[idx] = part.scatter_add_(1, cols[idx], g_scaled[idx]).to(out.dtype)

    row_threads.for_chunks(dead.numel(), _chunk_rows(v, g_scaled.dtype), body)


def grad_from_probs(
    probs: Tensor, ids: Tensor, inv_temp: Tensor, m: Tensor, lse: Tensor, grad: Tensor, grad_sum: Tensor
) -> Tensor:
    """The backward from the forward's cached ``e = exp(x - m)`` (see :func:`full_stats`), in place in ``probs``.

    ``p = e exp(m - lse)``, so ``dz = inv_temp (scatter(g) - G p) = (-G inv_temp exp(m - lse)) e + scatter``: one
    in-place scaling pass instead of re-reading the logits and recomputing the exponential. ``m`` is this shard's
    row max (before any vocabulary-parallel combination) and ``lse`` the global normaliser; rows with no mass
    (skipped, all ``-inf``) get the scatter only.

    Args:
        probs: ``[N, V]`` the cached ``e`` (fp32 or float64); becomes the gradient.
        ids, inv_temp, grad, grad_sum: as in :func:`full_grad`.
        m: ``[N]`` the local row max returned by :func:`full_stats`.
        lse: ``[N]`` the normaliser (``+inf``: no mass).
    """
    n, v = probs.shape
    if n == 0 or v == 0:
        return probs
    live = torch.isfinite(lse)
    row_scale = torch.where(live, -(grad_sum * inv_temp) * torch.exp(m - torch.where(live, lse, m)), 0.0)
    if not bool(live.all()):
        probs[~live] = 0
    g_scaled = torch.where(ids >= 0, grad * inv_temp[:, None], torch.zeros_like(grad))
    cols = ids.clamp_min(0)

    def body(lo: int, hi: int) -> None:
        chunk = probs[lo:hi]
        chunk.mul_(row_scale[lo:hi, None])
        chunk.scatter_add_(1, cols[lo:hi], g_scaled[lo:hi])

    row_threads.for_chunks(n, _chunk_rows(v, probs.dtype), body)
    return probs


# ---- The support pass: CSR rows of any width (mask replay), O(nnz) vectorised, no per-row Python ----


def flat_view(x: Tensor) -> Tensor:
    """A 1-D view of ``x [N, V]`` (unit stride along ``V``) whose element ``r * x.stride(0) + v`` is ``x[r, v]``:
    one ``index_select`` then reads any entries, however wide the rows (no ``[N, K_max]`` index, no copy)."""
    n, v = x.shape
    if n == 0 or v == 0:
        return x.reshape(-1)
    return x.as_strided(((n - 1) * x.stride(0) + v,), (1,))


def csr_rows(offsets: Tensor, nnz: int) -> Tensor:
    """``[nnz]`` int64 row of each entry of a CSR ``offsets [N + 1]``: a running count of the row starts (one
    scatter of ``N`` ones, one cumulative sum; cheaper than ``repeat_interleave``), empty rows included."""
    starts = torch.zeros(nnz + 1, dtype=torch.int64, device=offsets.device)
    starts.index_add_(0, offsets[1:-1], torch.ones_like(offsets[1:-1]))
    return starts[:nnz].cumsum_(0)


def _spread(x: Tensor, row: Tensor) -> Tensor:
    """A per-row ``x [N]`` at each entry, ``[nnz]``."""
    return x.index_select(0, row)


def _segment(x: Tensor, offsets: Tensor, how: str) -> Tensor:
    """``[N]`` sum or max of each row's entries (0 / ``-inf`` on an empty row; NaN propagates)."""
    return torch.segment_reduce(x, how, offsets=offsets)



#: A row whose support holds at least ``V / WIDE_DIVISOR`` ids is *wide*: it takes the row-chunked dense path
#: (a membership mask by scatter, a masked log-sum-exp over ``V``, the gradient as one dense expression) instead
#: of the entry path (gather, ``O(K)`` segment passes, scatter); as the ``cpu`` backend's wide rows.
WIDE_DIVISOR = 2
#: Bytes of the ``[rows, V]`` temporaries of one chunk of wide rows (two in ``inv_temp``'s dtype and one bool mask,
#: at most); no ``[N, V]`` temporary is allocated.
WIDE_BYTES = 16 << 20


class WideSupport:
    """What the forward of the support pass keeps for the dense backward of its wide rows (``keep_wide``).

    Attributes:
        rows: ``[n_w]`` int64, the wide rows (ascending; not skipped, no repeated id, no NaN or ``+inf`` logit).
        offsets: ``[n_w + 1]`` int64 and ids: ``[nnz_w]`` int64, their supports as a CSR of their own.
        entries: ``[nnz_w]`` int64 positions of those ids in the record's ``ids``, or None when every row is wide.
        m: ``[n_w]`` the row's support max of the raw logits (0 where not finite); ls: ``[n_w]`` the log of its
            sum, so that ``lse = m inv_temp + ls`` (in ``inv_temp``'s dtype); the backward forms ``p^S`` by the
            forward's own operations.
        mask: ``[n_w, V]`` int8, ``0`` on the row's support and ``-2`` outside it (:func:`_membership`'s values:
            ``V`` bytes per wide row, at most 2 per recorded id), so that the backward needs no scatter.
    """

    __slots__ = ("rows", "offsets", "ids", "entries", "m", "ls", "mask")

    def __init__(self, rows: Tensor, offsets: Tensor, ids: Tensor, entries: Tensor | None, m: Tensor, ls: Tensor,
                 mask: Tensor):
        self.rows, self.offsets, self.ids, self.entries, self.m, self.ls = rows, offsets, ids, entries, m, ls
        self.mask = mask


def _compact(offsets: Tensor, ids: Tensor, keep: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """``(rows, offsets, ids, entries)`` of the CSR restricted to the rows ``keep`` ([N] bool): ``O(N + nnz)``,
    ``entries`` None when every row is kept (the record's own ``ids``)."""
    rows = keep.nonzero().view(-1)
    lengths = offsets[1:] - offsets[:-1]
    off = torch.zeros(rows.numel() + 1, dtype=torch.int64, device=offsets.device)
    torch.cumsum(lengths.index_select(0, rows), 0, out=off[1:])
    if rows.numel() == keep.numel():
        return rows, off, ids, None
    # no output_size: with offsets changed in place after their check (validate=False) it would write past the end
    entries = torch.repeat_interleave(keep, lengths).nonzero().view(-1)
    return rows, off, ids.index_select(0, entries), entries


def _wide_step(v: int, dtype: torch.dtype) -> int:
    return max(1, WIDE_BYTES // max(1, v * (2 * (torch.finfo(dtype).bits // 8) + 1)))


def _spans(n: int, step: int):
    return ((a, min(n, a + step)) for a in range(0, n, step))


def _chunk_locs(off: Tensor, ids: Tensor, v: int, step: int, bounds: list[int]) -> Tensor:
    """``[nnz_w]`` int64 ``(row - chunk start) * V + id`` of each entry: its position in its chunk's ``[rows, V]``
    block (one pass over the offsets, then one in-place shift per chunk after the first)."""
    loc = csr_rows(off, ids.numel()).mul_(v).add_(ids)
    for a, _ in _spans(off.numel() - 1, step):
        if a:
            loc[bounds[a]:bounds[min(off.numel() - 1, a + step)]].sub_(a * v)
    return loc


def _membership(buf: Tensor, loc: Tensor, two: Tensor) -> Tensor:
    """``buf [c, V]`` (``inv_temp``'s dtype) as ``-2`` outside the supports and ``0`` on them (``2`` more per
    repeat of an id): all ``-2``, then one ``scatter_add_`` of ``two`` at the chunk's ``loc``.

    ``x + finfo.max * buf`` is then ``x`` on the support (exactly), ``-inf`` outside it (the product overflows),
    ``+inf`` at a repeated id, and NaN outside where ``x`` is NaN or ``+inf``: one vectorised add, where a bool
    ``where`` / ``masked_fill`` over a scattered mask takes 10-40 times as long on CPU. ``two``: ``[K]`` of 2
    (contiguous: a stride-0 source makes the scatter about twice as slow)."""
    buf.fill_(-2.0)
    return buf.view(-1).scatter_add_(0, loc, two).view(buf.shape)


def _masked(logits: Tensor, rows: Tensor, a: int, b: int, all_rows: bool, member: Tensor, big: float,
            out: Tensor) -> Tensor:
    """``out = z + big * member`` for the chunk's rows ``rows[a:b]``, in ``out``'s dtype: the logits on the
    support, ``-inf`` outside (see :func:`_membership`), upcast in the same pass (``member`` in ``out``'s dtype, or
    the saved int8 mask)."""
    z = logits[a:b] if all_rows else logits.index_select(0, rows[a:b])
    if z.dtype != out.dtype and not member.dtype.is_floating_point:  # 16-bit + int8 would compute in 16 bits
        return out.copy_(z).add_(member, alpha=big)
    return torch.add(z, member, alpha=big, out=out)


def _wide_rows(offsets: Tensor, v: int, skip: Tensor | None) -> Tensor:
    wide = (offsets[1:] - offsets[:-1]) * WIDE_DIVISOR >= v
    return wide if skip is None else wide & ~skip


def _wide_stats(logits: Tensor, inv_temp: Tensor, rows: Tensor, off: Tensor, ids: Tensor, keep_mask: bool
                ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """``(lp [nnz_w], lse [n_w], entropy [n_w], m [n_w], log_s [n_w], redo [n_w] bool, mask)`` of
    the wide rows, chunk by chunk of ``step`` rows, over their supports only (see :func:`_membership`; the
    exponentials base 2, as :func:`full_stats`): ``m`` the support max of the raw logits (0 where not finite),
    ``log_s`` the log of ``sum_S exp((z - m) inv_temp)``. ``redo`` marks the rows for the entry path, whose values
    here are meaningless: a repeated id, or NaN / ``+inf`` anywhere in the row (the masked max is NaN or ``+inf``).
    With ``keep_mask``, ``mask`` is the ``[n_w, V]`` int8 membership of :class:`WideSupport` (else None).
    """
    n_w, v = rows.numel(), logits.shape[1]
    acc, dev = inv_temp.dtype, logits.device
    nnz_w = ids.numel()
    lp = torch.empty(nnz_w, dtype=acc, device=dev)
    m, log_s, s, t = (torch.empty(n_w, dtype=acc, device=dev) for _ in range(4))
    redo = torch.empty(n_w, dtype=torch.bool, device=dev)
    step = min(n_w, _wide_step(v, acc))
    bounds = off.tolist()
    loc = _chunk_locs(off, ids, v, step, bounds)
    all_rows = n_w == logits.shape[0]
    big = torch.finfo(acc).max
    scale = inv_temp.index_select(0, rows) * LOG2E
    mask = torch.empty(n_w, v, dtype=torch.int8, device=dev) if keep_mask else None
    buf, x_buf = (torch.empty(step, v, dtype=acc, device=dev) for _ in range(2))
    for a, b in _spans(n_w, step):
        e0, e1 = bounds[a], bounds[b]
        member = _membership(buf[:b - a], loc[e0:e1], lp[e0:e1].fill_(2.0))  # lp's chunk: written below
        if mask is not None:
            mask[a:b] = member
        x = _masked(logits, rows, a, b, all_rows, member, big, x_buf[:b - a])
        mz = x.amax(dim=1)
        redo[a:b] = torch.isnan(mz) | (mz == INF_)
        mz = torch.where(torch.isfinite(mz), mz, torch.zeros_like(mz))
        x.sub_(mz[:, None]).mul_(scale[a:b, None])  # y = (z - m) inv_temp log2(e)
        e = torch.exp2(x, out=buf[:b - a])
        s_c = e.sum(dim=1)
        t[a:b] = e.mul_(x).nansum(dim=1).mul_(LN2)  # 0 * -inf (a -inf logit, or outside): no term
        ls = torch.log(torch.where(s_c == 0, torch.ones_like(s_c), s_c))
        x.sub_((ls * LOG2E)[:, None])  # log2 p^S
        torch.index_select(x.view(-1), 0, loc[e0:e1], out=lp[e0:e1]).mul_(LN2)
        m[a:b], s[a:b], log_s[a:b] = mz, s_c, ls
    # An empty (or all -inf) support has s = 0: no mass (its lp are -inf already).
    empty = s == 0
    it = inv_temp.index_select(0, rows)
    lse = torch.where(empty, torch.full_like(s, INF_), m * it + log_s)
    entropy = torch.where(empty, torch.zeros_like(s), log_s - t / torch.where(empty, torch.ones_like(s), s))
    # z / tau overflowing (finite logits, lse = +inf) is not "no mass": the row's values become NaN
    overflow = ~empty & torch.isinf(lse)
    if bool(overflow.any()):
        lse, entropy = (torch.where(overflow, torch.full_like(x, float("nan")), x) for x in (lse, entropy))
        lp = lp.masked_fill(torch.repeat_interleave(overflow, off[1:] - off[:-1], output_size=nnz_w), float("nan"))
    return lp, lse, entropy, m, log_s, redo, mask


def _gather_stats(logits: Tensor, offsets: Tensor, ids: Tensor, inv_temp: Tensor, skip: Tensor | None,
                  rows: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The entry path of :func:`support_stats`; ``rows`` ([n] int64, or None for ``arange(N)``) maps each CSR row
    to its logits row (``inv_temp`` and ``skip`` are per CSR row)."""
    nnz = ids.numel()
    acc = inv_temp.dtype
    row = csr_rows(offsets, nnz)
    if nnz and logits.shape[1]:
        at = row if rows is None else rows.index_select(0, row)
        z = flat_view(logits).index_select(0, (at * logits.stride(0)).add_(ids)).to(acc)
    else:
        z = torch.zeros(nnz, dtype=acc, device=logits.device)
    if skip is not None and bool(skip.any()):
        z = z.masked_fill(_spread(skip, row), -INF_)
    # the max on the raw logits (tau > 0), then x - m = (z - max z) / tau: one rounding, as full_stats
    mz = _segment(z, offsets, "max")
    mz = torch.where(torch.isfinite(mz), mz, torch.zeros_like(mz))
    d = (z - _spread(mz, row)).mul_(_spread(inv_temp, row))
    e = torch.exp(d)
    s = _segment(e, offsets, "sum")
    t = _segment((e * d).nan_to_num_(nan=0.0, posinf=INF_, neginf=-INF_), offsets, "sum")
    # An empty (or all -inf) row has s = 0: no mass. A NaN in the row makes s NaN, which stays NaN below.
    empty = s == 0
    safe_s = torch.where(empty, torch.ones_like(s), s)
    log_s = torch.log(safe_s)
    lse = torch.where(empty, torch.full_like(s, INF_), mz * inv_temp + log_s)
    entropy = torch.where(empty, torch.zeros_like(s), log_s - t / safe_s)
    lp = d.sub_(_spread(log_s, row))
    # z / tau overflowing (finite logits, lse = +inf) is not "no mass": the row's values become NaN
    overflow = ~empty & torch.isinf(lse)
    if bool(overflow.any()):
        lse, entropy = (torch.where(overflow, torch.full_like(x, float("nan")), x) for x in (lse, entropy))
        lp = lp.masked_fill(_spread(overflow, row), float("nan"))
    return lp, lse, entropy


def support_stats(logits: Tensor, offsets: Tensor, ids: Tensor, inv_temp: Tensor, skip: Tensor | None, *,
                  keep_wide: bool = False):
    """The support pass's forward over CSR rows: ``(lp [nnz], lse [N], entropy [N])``.

    Row ``r``'s support is ``ids[offsets[r]:offsets[r + 1]]`` (any width, empty included); with ``x = logits *
    inv_temp``, ``lse[r] = log sum_{v in S_r} exp(x[r, v])``, ``lp[e] = x[r, ids[e]] - lse[r]`` and the entropy
    of ``p^S = exp(lp)``. A row without mass (skipped, empty, or all ``-inf``) has ``lse = +inf``, ``lp = -inf``
    and entropy 0; a NaN or ``+inf`` logit in the support (or ``z / tau`` overflowing) makes the row's values NaN
    (the caller refuses them). Logits outside a row's support are never combined with it.

    Args:
        logits: ``[N, V]`` float, unit stride along ``V``.
        offsets: ``[N + 1]`` int64; ids: ``[nnz]`` int64 in ``[0, V)`` (unchecked).
        inv_temp: ``[N]`` fp32 (float64 for float64 logits).
        skip: ``[N]`` bool rows not to read, or None.
        keep_wide: also return a :class:`WideSupport` (or None where no row is wide) for :func:`support_grad`.

    Narrow rows (the entry path): one gather of their entries, then about fifteen ``O(nnz)`` element-wise and
    segment passes (no ``[N, K_max]`` tensor, no per-row Python). Wide rows (``K >= V / WIDE_DIVISOR``, not
    skipped; eager calls only, not while ``torch.compile`` traces), chunk by chunk of rows with the ``[rows, V]``
    temporaries within :data:`WIDE_BYTES`: a bool mask by one scatter of the ids, the masked max and sums over
    ``V`` (the dense pass's sweeps), one gather of the ``K`` log-probabilities from the chunk; a row whose ids
    repeat (an unvalidated record) takes the entry path. Results in ``inv_temp``'s dtype.
    """
    n, v = logits.shape
    nnz = ids.numel()
    wide = None
    if nnz and v and not torch.compiler.is_compiling():
        is_wide = _wide_rows(offsets, v, skip)
        if bool(is_wide.any()):
            w_rows, w_off, w_ids, w_ent = _compact(offsets, ids, is_wide)
            w_lp, w_lse, w_ent_h, mz, log_s, redo, mask = _wide_stats(logits, inv_temp, w_rows, w_off, w_ids,
                                                                       keep_wide)
            acc = inv_temp.dtype
            lp = w_lp if w_ent is None else torch.empty(nnz, dtype=acc, device=logits.device).index_copy_(
                0, w_ent, w_lp)
            lse = torch.empty(n, dtype=acc, device=logits.device).index_copy_(0, w_rows, w_lse)
            entropy = torch.empty(n, dtype=acc, device=logits.device).index_copy_(0, w_rows, w_ent_h)
            if bool(redo.any()):  # repeated ids (added up) or NaN / +inf in the row: the entry path
                is_wide = is_wide.index_fill(0, w_rows[redo], False)
                keep = ~redo
                mz, log_s = mz[keep], log_s[keep]
                mask = None if mask is None else mask[keep]
                w_rows, w_off, w_ids, w_ent = _compact(offsets, ids, is_wide)
            if keep_wide and bool(is_wide.any()):
                wide = WideSupport(w_rows, w_off, w_ids, w_ent, mz, log_s, mask)
            if not bool(is_wide.all()):
                n_rows, n_off, n_ids, n_ent = _compact(offsets, ids, ~is_wide)
                n_lp, n_lse, n_ent_h = _gather_stats(logits, n_off, n_ids, inv_temp.index_select(0, n_rows),
                                                     None if skip is None else skip.index_select(0, n_rows), n_rows)
                if n_ent is None:  # every wide row was redone: the entry path's values throughout
                    lp, lse, entropy = n_lp, n_lse, n_ent_h
                else:
                    lp.index_copy_(0, n_ent, n_lp)
                    lse.index_copy_(0, n_rows, n_lse)
                    entropy.index_copy_(0, n_rows, n_ent_h)
            return (lp, lse, entropy, wide) if keep_wide else (lp, lse, entropy)
    out = _gather_stats(logits, offsets, ids, inv_temp, skip)
    return (*out, None) if keep_wide else out


def _entry_grad(lp: Tensor, offsets: Tensor, ids: Tensor, tokens: Tensor, inv_temp: Tensor, grad_lp: Tensor | None,
                grad_target: Tensor, live: Tensor, out: Tensor, rows: Tensor | None = None) -> Tensor:
    """The entry path of :func:`support_grad`; ``rows`` ([n] int64, or None for ``arange(N)``) maps each CSR row
    to its row of ``out`` (only those rows are written; the other arguments are per CSR row)."""
    nnz = ids.numel()
    acc = inv_temp.dtype
    row = csr_rows(offsets, nnz)
    all_live = bool(live.all())
    gt = grad_target.to(acc) if all_live else torch.where(live, grad_target.to(acc), torch.zeros_like(inv_temp))
    gc = None
    if grad_lp is not None:
        gc = grad_lp.to(acc)
        if not all_live:
            gc = torch.where(_spread(live, row), gc, torch.zeros_like(gc))
    g_sum = gt if gc is None else gt + _segment(gc, offsets, "sum")
    dense = g_sum != 0
    g_spread = _spread(torch.where(dense, g_sum, torch.zeros_like(g_sum)), row)
    p = torch.exp(lp if bool(dense.all()) else torch.where(_spread(dense, row), lp, -INF_))
    val = p.mul_(g_spread).neg_() if gc is None else gc - p.mul_(g_spread)
    # The token's own term: folded into its first entry in the row, or a separate entry where it is outside.
    at = (ids == _spread(tokens, row)).nonzero().view(-1)
    hit_rows, first = torch.unique_consecutive(row[at], return_counts=True)
    first = at[torch.cumsum(first, 0) - first]
    val.index_add_(0, first, gt[hit_rows])
    val.mul_(_spread(inv_temp, row))
    outside = gt != 0
    outside[hit_rows] = False
    if rows is None:
        out.zero_()
    else:
        out.index_fill_(0, rows, 0)
    if out.shape[1] == 0:
        return out
    flat = flat_view(out)
    where = ((row if rows is None else rows.index_select(0, row)) * out.stride(0)).add_(ids)
    if flat.device.type == "cpu":  # CPU scatter_add_ is a plain loop, index_put_'s accumulate path 2-3x slower
        flat.scatter_add_(0, where, val.to(out.dtype))
    else:  # elsewhere the accumulating index_put_ (deterministic on CUDA where repeats are summed)
        flat.index_put_((where,), val.to(out.dtype), accumulate=True)
    if bool(outside.any()):
        r = outside.nonzero().view(-1)
        r_out = r if rows is None else rows.index_select(0, r)
        flat.index_put_((r_out * out.stride(0) + tokens[r],), (gt[r] * inv_temp[r]).to(out.dtype), accumulate=True)
    return out


def _wide_grad(logits: Tensor, wide: WideSupport, tokens: Tensor, inv_temp: Tensor, gc: Tensor | None, gt: Tensor,
               live: Tensor, out: Tensor) -> None:
    """Rows ``wide.rows`` of ``out``, chunk by chunk of rows: ``p^S = exp((z - m) inv_temp - ls)`` on the support
    (base 2; exactly 0 outside it, see :func:`_membership`), ``dz = inv_temp (-G p^S + g_t e_y + scatter(g_lp))``
    in ``inv_temp``'s dtype, rounded once to ``out``'s. ``gc`` is the wide entries' ``g_lp`` (or None), ``gt`` and
    ``live`` per wide row. The forward sent every row holding NaN or ``+inf`` to the entry path: these logits are
    finite or ``-inf``."""
    rows, off, ids = wide.rows, wide.offsets, wide.ids
    n_w, v = rows.numel(), out.shape[1]
    acc, dev = inv_temp.dtype, out.device
    it = inv_temp.index_select(0, rows)
    gt = torch.where(live, gt, torch.zeros_like(gt))
    g_sum = gt if gc is None else gt + torch.where(live, _segment(gc, off, "sum"), torch.zeros_like(gt))
    coef = torch.where(live, -g_sum, torch.zeros_like(g_sum))
    all_live = bool(live.all())
    scale = it * LOG2E
    shift = wide.ls * LOG2E  # log2 p^S = (z - m) inv_temp log2(e) - ls log2(e), as the forward
    tok = tokens.index_select(0, rows)[:, None]
    all_rows = n_w == out.shape[0]
    direct = all_rows and out.dtype == acc
    step = min(n_w, _wide_step(v, acc))
    bounds = off.tolist()
    loc = None if gc is None else _chunk_locs(off, ids, v, step, bounds)
    big = torch.finfo(acc).max
    x_buf = None if direct else torch.empty(step, v, dtype=acc, device=dev)
    for a, b in _spans(n_w, step):
        e0, e1 = bounds[a], bounds[b]
        x = _masked(logits, rows, a, b, all_rows, wide.mask[a:b], big, out[a:b] if direct else x_buf[:b - a])
        x.sub_(wide.m[a:b, None]).mul_(scale[a:b, None]).sub_(shift[a:b, None]).exp2_()  # p^S, 0 outside
        x.mul_(coef[a:b, None])
        x.scatter_add_(1, tok[a:b], gt[a:b, None])
        if gc is not None:  # no id repeats in a wide row: one add per element
            x.view(-1).index_add_(0, loc[e0:e1], gc[e0:e1])
        x.mul_(it[a:b, None])
        if not all_live:  # rows without mass take nothing (whatever g_lp their -inf entries got)
            x.index_fill_(0, (~live[a:b]).nonzero().view(-1), 0.0)
        if direct:
            continue
        if all_rows:
            out[a:b].copy_(x)
        else:
            out.index_copy_(0, rows[a:b], x.to(out.dtype))


def support_grad(lp: Tensor, offsets: Tensor, ids: Tensor, tokens: Tensor, inv_temp: Tensor, grad_lp: Tensor | None,
                 grad_target: Tensor, live: Tensor, out: Tensor, *, wide: WideSupport | None = None,
                 logits: Tensor | None = None) -> Tensor:
    """The support pass's backward, written into ``out [N, V]`` and returned.

    With ``G[r] = grad_target[r] + sum_{e in row r} grad_lp[e]`` and ``p^S = exp(lp)``: ``out[r, ids[e]] =
    inv_temp[r] (grad_lp[e] - G[r] p^S[e])`` on the support, ``+ inv_temp[r] grad_target[r]`` at the token
    (``target = x[r, y] - lse``), exactly 0 elsewhere and on rows not ``live`` ([N] bool). ``G = 0`` drops the
    probability term (a row without gradient never reads ``lp``). The token's term is folded into its (first) entry
    when the token is in the support, so each element is rounded once to ``out``'s dtype.

    With ``wide`` (from :func:`support_stats` with ``keep_wide`` on ``logits``, unchanged since), the wide rows'
    gradient is formed densely, chunk by chunk of rows (:data:`WIDE_BYTES`), from the logits and a bool mask built
    by one scatter of the ids (no accumulating scatter of ``K`` entries); the other rows take the entry path.
    """
    if wide is None:
        return _entry_grad(lp, offsets, ids, tokens, inv_temp, grad_lp, grad_target, live, out)
    if logits is None or logits.shape != out.shape:
        raise ValueError("support_grad: wide rows need the forward's logits [N, V]")
    n = out.shape[0]
    acc = inv_temp.dtype
    if wide.rows.numel() < n:
        narrow = torch.ones(n, dtype=torch.bool, device=out.device).index_fill_(0, wide.rows, False)
        n_rows, n_off, n_ids, n_ent = _compact(offsets, ids, narrow)
        _entry_grad(lp.index_select(0, n_ent), n_off, n_ids, tokens.index_select(0, n_rows),
                    inv_temp.index_select(0, n_rows), None if grad_lp is None else grad_lp.index_select(0, n_ent),
                    grad_target.index_select(0, n_rows), live.index_select(0, n_rows), out, n_rows)
    gc = None
    if grad_lp is not None:
        gc = grad_lp.to(acc) if wide.entries is None else grad_lp.to(acc).index_select(0, wide.entries)
    _wide_grad(logits, wide, tokens, inv_temp, gc, grad_target.to(acc).index_select(0, wide.rows),
               live.index_select(0, wide.rows), out)
    return out
