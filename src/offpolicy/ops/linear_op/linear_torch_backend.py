"""Chunked PyTorch backend of the fused linear log-softmax (the CPU path; it also runs on CUDA with cuBLAS).

Logits ``z = h W^T + b`` are never stored: the vocabulary pass walks vocabulary tiles (outer loop) and token
chunks (inner loop), computes one ``[rows, cols]`` block of ``z`` with a matmul, folds it into per-row
online-softmax statistics and drops it. The working set is a few such blocks plus one weight tile, sized from
``chunk_bytes``; nothing ``[N, V]`` is ever allocated.

Functions (the fused-linear contract of :mod:`offpolicy.ops.backend_registry`, used by
:mod:`offpolicy.ops.linear_op.linear_function`; ``ids [N, M]`` are local vocabulary rows, ``-1`` for padding or rows owned
by another shard):

* :func:`gathered_logits`: ``z`` at the ids only, ``O(N M D)``.
* :func:`full_stats`: online-softmax statistics over the whole (local) vocabulary and ``x`` at the ids.
* :func:`backward`: ``dh = dz W``, ``dW = dz^T h``, ``db = sum_n dz`` for a ``dz`` given as a sparse part at the
  ids plus a dense part ``coef[n] p[n, v]``, accumulated in fp32.

Matmul precision: fp32 inputs multiply in fp32; bf16 inputs multiply in bf16 with fp32 accumulation (the
product is rounded to bf16, as materialised bf16 logits would be); fp16 inputs are upcast to fp32 on CPU (its
fp16 matmul is slow and its fp16 output would overflow above 65504) and multiplied in fp16 elsewhere. The
candidate (gathered) products follow the same rule: the logits at the ids are a sampled dense-dense product
(CSR pattern) for fp32 / float64 weights and a gather + ``bmm`` otherwise; their ``dh`` is a weighted
``embedding_bag``; their ``dW`` is a CSR x dense product with an fp32 (float64) copy of ``h`` (``O(N D)``), so
its accumulation is fp32 for every weight dtype.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from offpolicy.ops import row_stats
from offpolicy.ops.row_stats import RowStats

#: Default working-set budget in bytes (blocks of logits, one weight tile, the fp32 dW tile accumulator).
CHUNK_BYTES = 128 << 20
#: Widest vocabulary tile and most token rows per block on CPU: a [256, 4096] fp32 block (4 MiB) keeps the
#: element-wise passes cache-friendly and larger blocks do not speed up the matmul. On GPUs only the budget bounds
#: the block (large blocks keep cuBLAS busy).
MAX_COLS = {"cpu": 4096, "other": 1 << 16}
MAX_ROWS = {"cpu": 512, "other": 1 << 14}


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp32, or float64 for float64 inputs (references, gradcheck)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """Dtype in which the ``[rows, cols]`` matmul blocks run (see the module docstring)."""
    if dtype == torch.float16 and device.type == "cpu":
        return torch.float32
    return dtype


def plan(n: int, v: int, d: int, chunk_bytes: int, device: torch.device | None = None) -> tuple[int, int]:
    """``(rows, cols)`` of one logits block so that the working set stays near ``chunk_bytes``.

    Working set: three ``[rows, cols]`` fp32 blocks (logits, exponentials, the matmul output) and two
    ``[cols, D]`` fp32 weight-side tiles (an upcast weight tile, the dW accumulator).
    """
    kind = "cpu" if device is None or device.type == "cpu" else "other"
    cols = max(1, min(v, MAX_COLS[kind]))
    while cols > 64 and 2 * cols * d * 4 > chunk_bytes // 2:
        cols //= 2
    rows = (chunk_bytes - 2 * cols * d * 4) // (3 * 4 * cols)
    return max(1, min(n, MAX_ROWS[kind], rows)), cols


def _gather_rows(weight: Tensor, flat_ids: Tensor, buf: Tensor) -> Tensor:
    """``weight[flat_ids]`` in ``buf``'s (compute) dtype, written into ``buf`` (``[len(flat_ids), D]``)."""
    if weight.dtype == buf.dtype:
        return torch.index_select(weight, 0, flat_ids, out=buf)
    return buf.copy_(weight.index_select(0, flat_ids))


def _gather_chunk_rows(n: int, m: int, d: int, chunk_bytes: int) -> int:
    """Token rows per chunk of the gathered ``[rows, M, D]`` fp32 weight rows (two such buffers at most)."""
    return max(1, min(n, chunk_bytes // max(1, 2 * 4 * m * d)))


def _sparse_ok(dense: Tensor) -> bool:
    """Sparse (CSR) products with ``dense`` run natively: fp32 / float64 operands (MKL on CPU, cuSPARSE on CUDA)."""
    return dense.dtype in (torch.float32, torch.float64)


def _csr(rows: Tensor, cols: Tensor, vals: Tensor, shape: tuple[int, int]) -> Tensor:
    """CSR matrix from triples sorted by ``rows`` (columns may repeat within a row: their values add)."""
    counts = torch.bincount(rows, minlength=shape[0])
    crow = torch.zeros(shape[0] + 1, dtype=torch.int64, device=rows.device)
    torch.cumsum(counts, 0, out=crow[1:])
    with warnings.catch_warnings():  # "CSR support is in beta" and "invariant checks disabled" are not ours
        warnings.simplefilter("ignore")
        return torch.sparse_csr_tensor(crow, cols, vals, size=shape)


def _sampled_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, ids: Tensor) -> Tensor:
    """``gathered_logits`` as a sampled dense-dense product (SDDMM): ``(h W^T)`` at the ``[N, M]`` positions only."""
    n, m = ids.shape
    v = weight.shape[0]
    flat = ids.clamp_min(0).reshape(-1)
    # Distinct (row, column) positions in sorted order (a valid CSR pattern); repeated ids read the same entry.
    key, where = torch.unique(torch.arange(n, device=ids.device).repeat_interleave(m) * v + flat, return_inverse=True)
    mask = _csr(key // v, key % v, torch.zeros(key.numel(), dtype=weight.dtype, device=ids.device), (n, v))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        z = torch.sparse.sampled_addmm(mask, hidden.to(weight.dtype), weight.T).values()[where].view(n, m)
    if bias is not None:
        z = z + bias.index_select(0, flat).to(z.dtype).view(n, m)
    return torch.where(ids >= 0, z, torch.zeros_like(z))


def gathered_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, ids: Tensor, chunk_bytes: int) -> Tensor:
    """Logits at the ids only: ``z[n, j] = W[ids[n, j]] . h[n] + b[ids[n, j]]``, 0 where ``ids < 0``.

    Args:
        hidden: ``[N, D]``; weight: ``[V, D]``; bias: ``[V]`` or None (same float dtype family).
        ids: ``[N, M]`` int64 local rows of ``weight``, ``-1`` to skip.
        chunk_bytes: working-set budget; the gathered rows are ``[rows, M, D]`` fp32 per chunk.

    Returns:
        ``[N, M]`` fp32. Work ``O(N M D)``; the vocabulary size does not enter.
    """
    n, m = ids.shape
    d = hidden.shape[1]
    acc = accum_dtype(hidden.dtype)
    out = torch.zeros(n, m, dtype=acc, device=hidden.device)
    if n == 0 or m == 0:
        return out
    if _sparse_ok(weight):
        return _sampled_logits(hidden, weight, bias, ids)
    cdtype = compute_dtype(weight.dtype, weight.device)
    step = _gather_chunk_rows(n, m, d, chunk_bytes)
    buf = torch.empty(step * m, d, dtype=cdtype, device=hidden.device)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        sel = ids[lo:hi]
        flat = sel.clamp_min(0).reshape(-1)
        rows = _gather_rows(weight, flat, buf[: flat.numel()])
        z = torch.bmm(rows.view(hi - lo, m, d), hidden[lo:hi].to(cdtype).unsqueeze(2)).squeeze(2).to(acc)
        if bias is not None:
            z += bias.index_select(0, flat).to(acc).view(hi - lo, m)
        out[lo:hi] = torch.where(sel >= 0, z, torch.zeros_like(z))
    return out


class _Tiles:
    """Matmul blocks ``z = h[rows] W[v0:v1]^T + b[v0:v1]`` in fp32, with reusable buffers."""

    def __init__(self, hidden: Tensor, weight: Tensor, bias: Tensor | None, rows: int, cols: int) -> None:
        self.hidden, self.weight, self.bias = hidden, weight, bias
        self.cdtype = compute_dtype(weight.dtype, weight.device)
        dev = weight.device
        self.acc = accum_dtype(weight.dtype)
        self.zbuf = torch.empty(rows, cols, dtype=self.acc, device=dev)
        self.raw = None if self.cdtype == self.acc else torch.empty(rows, cols, dtype=self.cdtype, device=dev)
        self.w_tile: Tensor | None = None
        self.b_tile: Tensor | None = None

    def set_tile(self, v0: int, v1: int) -> None:
        self.w_tile = self.weight[v0:v1].to(self.cdtype)
        self.b_tile = None if self.bias is None else self.bias[v0:v1].to(self.acc)

    def block(self, h: Tensor) -> Tensor:
        """fp32 ``[len(h), v1 - v0]`` logits of the current tile for hidden rows ``h``."""
        assert self.w_tile is not None
        r, c = h.shape[0], self.w_tile.shape[0]
        z = self.zbuf[:r, :c]
        if self.raw is None:
            torch.mm(h.to(self.cdtype), self.w_tile.T, out=z)
        else:
            z.copy_(torch.mm(h.to(self.cdtype), self.w_tile.T, out=self.raw[:r, :c]))
        if self.b_tile is not None:
            z += self.b_tile
        return z


def full_stats(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    ids: Tensor,
    inv_temp: Tensor,
    chunk_bytes: int,
    *,
    extras: tuple[str, ...] = (),
) -> tuple[RowStats, Tensor]:
    """Online-softmax statistics of ``x = (h W^T + b) inv_temp`` over all (local) vocabulary rows.

    Args:
        hidden: ``[N, D]``; weight: ``[V, D]``; bias: ``[V]`` or None.
        ids: ``[N, M]`` int64 local ids to gather (``-1``: none).
        inv_temp: ``[N]`` fp32.
        chunk_bytes: working-set budget.
        extras: names of :data:`offpolicy.ops.row_stats.STATISTICS` to accumulate too, folded with the others.

    Returns:
        ``(stats, x)``: the :class:`~offpolicy.ops.row_stats.RowStats` (``[N]`` fp32, as
        :func:`offpolicy.ops.logits_op.torch_backend.full_stats`: row max, ``sum exp(x - m)``,
        ``sum exp(x - m)(x - m)``, the extras; all 0 on rows with no mass) and ``x`` at the ids (``[N, M]`` fp32,
        0 where ``ids < 0``), gathered from the same blocks that feed the statistics.
    """
    n, v = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    stats = row_stats.zeros(n, extras, inv_temp.dtype, dev)
    x_ids = torch.zeros(ids.shape, dtype=inv_temp.dtype, device=dev)
    result = (stats, x_ids)
    if n == 0 or v == 0:
        return result
    rows, cols = plan(n, v, hidden.shape[1], chunk_bytes, dev)
    tiles = _Tiles(hidden, weight, bias, rows, cols)
    ebuf = torch.empty(rows, cols, dtype=tiles.acc, device=dev)
    for v0 in range(0, v, cols):
        v1 = min(v, v0 + cols)
        tiles.set_tile(v0, v1)
        for lo in range(0, n, rows):
            hi = min(n, lo + rows)
            # x = z inv_temp is rounded to fp32 once, here and in the backward alike, so that the backward's
            # exp(x - lse) matches the forward's statistics exactly even where |x| is large (a fused
            # z * it - c would round differently and put p = 1 +- 1% on one-hot rows with |x| ~ 1e5).
            x = tiles.block(hidden[lo:hi]).mul_(inv_temp[lo:hi, None])
            sel = ids[lo:hi] - v0
            here = (sel >= 0) & (sel < v1 - v0) & (ids[lo:hi] >= 0)
            if bool(here.any()):
                got = x.gather(1, sel.clamp(0, v1 - v0 - 1))
                x_ids[lo:hi] = torch.where(here, got, x_ids[lo:hi])
            mx = x.amax(dim=1)
            mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
            x.sub_(mx[:, None])  # x - m <= 0, or -inf
            e = torch.exp(x, out=ebuf[: hi - lo, : v1 - v0])
            x.clamp_(min=torch.finfo(x.dtype).min)  # -inf * 0 would be NaN in the entropy dot product
            running = stats.map(lambda r, lo=lo, hi=hi: r[lo:hi])
            folded = row_stats.merge(running, row_stats.of_block(mx, e, x, torch.linalg.vecdot(e, x), extras))
            for old, new in zip(running.tensors(), folded.tensors()):
                old.copy_(new)
    return result


class _Pairs:
    """The sparse part of ``dz``: (token, vocabulary row, value) triples sorted by vocabulary row."""

    def __init__(self, ids: Tensor, dz_ids: Tensor) -> None:
        keep = (ids >= 0) & (dz_ids != 0)
        tok, col = keep.nonzero(as_tuple=True)
        vid = ids[tok, col]
        order = torch.argsort(vid, stable=True)
        self.vid_s, self.tok_s, self.val_s = vid[order], tok[order], dz_ids[tok, col][order]

    def span(self, v0: int, v1: int) -> tuple[int, int]:
        """Range (in row order) of the pairs whose vocabulary row lies in ``[v0, v1)``."""
        bounds = torch.tensor([v0, v1], dtype=self.vid_s.dtype, device=self.vid_s.device)
        lo, hi = torch.searchsorted(self.vid_s, bounds).tolist()
        return lo, hi

    def hidden_rows(self, slots: Tensor, lo: int, hi: int, n_slots: int, h_acc: Tensor) -> Tensor:
        """``out[slots[k]] += val[k] h[tok[k]]`` over the pairs ``lo..hi`` (row order; ``slots`` ascending), as a
        CSR ``[n_slots, N]`` x ``h [N, D]`` product: each output row is written once."""
        a = _csr(slots, self.tok_s[lo:hi], self.val_s[lo:hi].to(h_acc.dtype), (n_slots, h_acc.shape[0]))
        return a @ h_acc

    def bias_rows(self, slots: Tensor, lo: int, hi: int, n_slots: int) -> Tensor:
        out = torch.zeros(n_slots, dtype=self.val_s.dtype, device=self.val_s.device)
        return out.index_add_(0, slots, self.val_s[lo:hi])


def _sparse_dh(dh: Tensor, weight: Tensor, ids: Tensor, dz_ids: Tensor, chunk_bytes: int) -> None:
    """``dh[n] += sum_j dz_ids[n, j] W[ids[n, j]]`` (entries with ``ids < 0`` carry ``dz_ids = 0``): a weighted
    ``embedding_bag`` sum over the ids in the compute dtype (fp32 accumulation inside), token chunk by chunk."""
    n, m = ids.shape
    if n == 0 or m == 0:
        return
    wdt = compute_dtype(weight.dtype, weight.device)
    step = max(1, min(n, chunk_bytes // max(1, 4 * m * weight.shape[1]))) if wdt != weight.dtype else n
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        g = dz_ids[lo:hi].to(wdt)
        sel = ids[lo:hi].clamp_min(0)
        if wdt == weight.dtype:
            bag = torch.nn.functional.embedding_bag(sel, weight, per_sample_weights=g, mode="sum")
        else:  # fp16 on CPU: the fp32 upcast of the rows this chunk uses
            rows, local = torch.unique(sel, return_inverse=True)
            bag = torch.nn.functional.embedding_bag(local, weight.index_select(0, rows).to(wdt),
                                                    per_sample_weights=g, mode="sum")
        dh[lo:hi] += bag.to(dh.dtype)


def backward(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    ids: Tensor,
    dz_ids: Tensor,
    inv_temp: Tensor,
    lse: Tensor,
    coef: Tensor | None,
    *,
    chunk_bytes: int,
    grad_filter: float | None = None,
    needs: tuple[bool, bool, bool] = (True, True, True),
) -> tuple[Tensor | None, Tensor | None, Tensor | None, int]:
    """Gradients for ``dz[n, v] = sum_j [ids[n, j] = v] dz_ids[n, j] + coef[n] exp(x[n, v] - lse[n])``.

    ``x = (h W^T + b) inv_temp`` is recomputed block by block (never stored). With ``coef = None`` the dense
    part is absent (support mode) and the work is ``O(N M D)`` plus writing the rows of ``dW`` that are used.

    Args:
        hidden, weight, bias, ids, inv_temp: as in :func:`full_stats`.
        dz_ids: ``[N, M]`` fp32 gradient with respect to the logits at the ids (0 where ``ids < 0``).
        lse: ``[N]`` fp32 normaliser of ``x``.
        coef: ``[N]`` fp32 dense coefficient, or None.
        chunk_bytes: working-set budget.
        grad_filter: skip a block's dense contribution when every ``p = exp(x - lse)`` in it is below this
            threshold (each dropped entry of ``dz`` is below ``grad_filter |coef[n]|``); None or 0 keeps all.
        needs: which of ``(dh, dW, db)`` to compute.

    Returns:
        ``dh [N, D]`` fp32, ``dW [V, D]`` in the weight's dtype, ``db [V]`` in the bias's dtype (None when not
        needed), and the number of blocks skipped by the filter.
    """
    n, d = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    need_h, need_w, need_b = needs
    need_b = need_b and bias is not None
    acc_dtype = accum_dtype(weight.dtype)
    dh = torch.zeros(n, d, dtype=acc_dtype, device=dev) if need_h else None
    dw = torch.zeros(v, d, dtype=weight.dtype, device=dev) if need_w else None
    db = torch.zeros(v, dtype=acc_dtype, device=dev) if need_b else None
    skipped = 0
    if n == 0 or v == 0:
        return dh, dw, None if db is None else db.to(bias.dtype), skipped
    pairs = _Pairs(ids, dz_ids)
    if dh is not None:
        _sparse_dh(dh, weight, ids, dz_ids, chunk_bytes)
    h_acc = hidden.to(acc_dtype) if need_w else None  # the CSR products multiply fp32 (float64) operands
    if coef is None:
        _support_weight_grad(pairs, h_acc, dw, db, d, chunk_bytes)
        return dh, dw, None if db is None else db.to(bias.dtype), skipped

    # Rows whose dense coefficient is 0 (no gradient, or no mass) cost nothing: compact the rest once (O(N D)).
    dense_rows = (coef != 0).nonzero().squeeze(1)
    compact = dense_rows.numel() < n
    h_d = hidden.index_select(0, dense_rows) if compact else hidden
    it_d, lse_d, coef_d = ((x.index_select(0, dense_rows) if compact else x) for x in (inv_temp, lse, coef))
    dh_d = None if dh is None else (torch.zeros(h_d.shape, dtype=acc_dtype, device=dev) if compact else dh)
    n_d = h_d.shape[0]
    rows, cols = plan(max(1, n_d), v, d, chunk_bytes, dev)
    tiles = _Tiles(h_d, weight, bias, rows, cols)
    acc = torch.empty(cols, d, dtype=acc_dtype, device=dev) if need_w else None
    for v0 in range(0, v, cols):
        v1 = min(v, v0 + cols)
        tiles.set_tile(v0, v1)
        w_tile = tiles.w_tile
        a_tile = None if acc is None else acc[: v1 - v0].zero_()
        b_tile = None if db is None else db[v0:v1]
        for lo in range(0, n_d, rows):
            hi = min(n_d, lo + rows)
            h = h_d[lo:hi]
            p = tiles.block(h)
            p.mul_(it_d[lo:hi, None]).sub_(lse_d[lo:hi, None]).exp_()  # p = exp(x - lse), x rounded as forward
            if grad_filter and float(p.max()) < grad_filter:
                skipped += 1
                continue
            # dz = coef p: the row scale goes on the [rows, D] operands, not on the block.
            c = coef_d[lo:hi, None]
            pc = p if tiles.cdtype == acc_dtype else p.to(tiles.cdtype)
            if dh_d is not None:
                dh_d[lo:hi].addcmul_(torch.mm(pc, w_tile), c)  # a 16-bit product is upcast inside the add
            if a_tile is not None:
                hc = (h.to(acc_dtype) * c).to(tiles.cdtype)
                if tiles.cdtype == acc_dtype:
                    a_tile.addmm_(pc.T, hc)
                else:
                    a_tile += torch.mm(pc.T, hc)
            if b_tile is not None:
                b_tile += torch.mv(p.T, c[:, 0])
        lo, hi = pairs.span(v0, v1)
        if hi > lo:
            slots = pairs.vid_s[lo:hi] - v0
            if a_tile is not None:
                a_tile += pairs.hidden_rows(slots, lo, hi, v1 - v0, h_acc)
            if b_tile is not None:
                b_tile += pairs.bias_rows(slots, lo, hi, v1 - v0)
        if dw is not None:
            dw[v0:v1].copy_(a_tile)
    if compact and dh is not None:
        dh.index_add_(0, dense_rows, dh_d)
    return dh, dw, None if db is None else db.to(bias.dtype), skipped


def _support_weight_grad(pairs: _Pairs, h_acc: Tensor | None, dw: Tensor | None, db: Tensor | None, d: int,
                         chunk_bytes: int) -> None:
    """``dW`` and ``db`` from the sparse pairs alone, touching only the vocabulary rows that occur.

    The distinct rows are processed in blocks whose ``[rows, D]`` fp32 product fits the budget; each used row is
    written once, so the accumulation is fp32 whatever the weight's dtype.
    """
    if pairs.vid_s.numel() == 0:
        return
    uniq, counts = torch.unique_consecutive(pairs.vid_s, return_counts=True)
    slot = torch.repeat_interleave(torch.arange(uniq.numel(), device=uniq.device), counts)
    ends = torch.cumsum(counts, 0).tolist()
    block = max(1, chunk_bytes // (2 * 4 * d))
    for u0 in range(0, uniq.numel(), block):
        u1 = min(uniq.numel(), u0 + block)
        lo = ends[u0 - 1] if u0 > 0 else 0
        hi = ends[u1 - 1]
        if dw is not None:
            dw.index_copy_(0, uniq[u0:u1], pairs.hidden_rows(slot[lo:hi] - u0, lo, hi, u1 - u0, h_acc).to(dw.dtype))
        if db is not None:
            db.index_copy_(0, uniq[u0:u1], pairs.bias_rows(slot[lo:hi] - u0, lo, hi, u1 - u0))
