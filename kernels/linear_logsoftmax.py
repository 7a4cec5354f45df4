"""Fused linear + log-softmax statistics and their backward, in Triton: ``z = h W^T + b`` is never stored.

Five kernels (all arithmetic in fp32; ``h`` and ``W`` are read in their storage dtype and multiplied with
``tl.dot``, which accumulates in fp32):

* :func:`linear_row_stats`: for ``x = (h W^T + b) * inv_temp`` over vocabulary tiles, per-row online-softmax
  statistics ``m`` (row max), ``s = sum exp(x - m)``, ``t = sum exp(x - m)(x - m)``. The grid is
  (token blocks) x (vocabulary splits); each split writes partial statistics that :func:`merge_stats` folds.
* :func:`linear_dense_grad`: recomputes a ``[BLOCK_N, BLOCK_V]`` tile of ``x``, forms
  ``dz = coef[n] * exp(x - lse[n])`` and adds ``dz W`` into ``dh`` and ``dz^T h`` into ``dW`` (and column sums into
  ``db``) with fp32 atomics. Optional filtering (Cut Cross-Entropy's gradient filtering): a tile whose
  ``exp(x - lse)`` are all below ``eps`` adds nothing, which skips its two backward matmuls.
* :func:`gathered_dot`: ``z[n, j] = W[ids[n, j]] . h[n] + b[ids[n, j]]`` at given ids only (``-1``: none, 0 out).
* :func:`gathered_grad`: for a gradient ``dz [N, M]`` at those ids, ``dh[n] += sum_j dz[n, j] W[ids[n, j]]``
  (one program per row and ``D`` block, no atomics) and ``dW[ids[n, j]] += dz[n, j] h[n]``, ``db[ids] += dz``
  (fp32 atomics).

fp32 inputs multiply with ``input_precision="tf32x3"`` (tensor cores, about fp32's accuracy), 16-bit ones with
``tl.dot``'s default; the GPU tile is the first of :data:`GPU_TILES` that the device (compute capability, shared
memory) meets.
The atomics are relaxed (no fence: nothing in a kernel reads what they add). Launches go to the tensors' device,
and nothing here waits on the GPU.

FMA contraction is set explicitly on every launch (Triton 3.10 changes the default): on for the gathered kernels;
off for the vocabulary kernels: both vocabulary kernels form ``x = z * inv_temp`` as a rounded fp32 product, so
that the backward's ``exp(x - lse)`` reproduces the forward's statistics exactly: where ``|x|`` is large (1e5
with small temperatures) a fused ``z * it - c`` rounds differently and would leave one-hot rows with
``p = 1 +- 1e-2``.

These kernels know nothing about what the rows mean. The interpreter (``TRITON_INTERPRET=1``) runs them with
fp32/fp16 inputs (its bf16 ``tl.dot`` is wrong); bf16 is for GPUs.
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

_FP32_LOWEST: tl.constexpr = tl.constexpr(-3.4028234663852886e38)

#: GPU tile shapes ``(BLOCK_N, BLOCK_V, BLOCK_D, num_warps, num_stages)`` by operand size in bytes, largest first,
#: each with the least compute capability it is for and the shared memory per block (bytes) that the largest kernel
#: (the backward with dh and dW) needs at that tile: the first that the device meets is used, for every kernel (the
#: forward and the backward recompute the logits alike). tests/ops/test_aot_compile.py compiles the choice for
#: sm_80, sm_90 and sm_100 and checks that nothing spills and the shared memory fits, with Triton 3.9 and 3.7.1:
#: larger tiles spill somewhere (bf16 BLOCK_D = 64 on sm_80, and on sm_100 with Triton 3.7.1; fp32's tf32x3 holds
#: three products' operands). A GPU sweep may find faster tiles (``OFFPOLICY_LINEAR_TILES``).
GPU_TILES = {
    2: (((128, 128, 32, 8, 3), 80, 98_304),),
    4: (((64, 64, 32, 8, 2), 90, 98_304), ((64, 64, 16, 4, 2), 80, 45_056)),
}
INTERPRETER_TILES = (16, 64, 32, 4, 1)
GPU_GROUP_N, INTERPRETER_GROUP_N = 8, 2


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _precision(dtype: torch.dtype) -> str | None:
    """fp32 inputs multiply with ``tf32x3`` (three TF32 products on tensor cores, about fp32's accuracy; ``"ieee"``
    compiles to an FMA loop that spills at these tiles); 16-bit inputs keep ``tl.dot``'s default."""
    return "tf32x3" if dtype == torch.float32 else None


@triton.jit
def _logits_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, D, stride_h, stride_w,
                 BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    """fp32 ``[BLOCK_N, BLOCK_V]`` tile of ``h[rows] W[cols]^T`` (rows/cols int64; masked entries read 0)."""
    acc = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
    offs_d = tl.arange(0, BLOCK_D)
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + offs_d
        d_ok = dd < D
        a = tl.load(h_ptr + rows[:, None] * stride_h + dd[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        b = tl.load(w_ptr + cols[:, None] * stride_w + dd[None, :], mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _linear_row_stats_kernel(
    h_ptr, w_ptr, b_ptr, inv_temp_ptr, m_ptr, s_ptr, t_ptr, q_ptr,
    N, V, D, stride_h, stride_w, V_PER_SPLIT,
    HAS_BIAS: tl.constexpr, SUM_P2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    it = tl.load(inv_temp_ptr + rows, mask=row_ok, other=1.0)
    neg_inf = float("-inf")
    m = tl.full([BLOCK_N], neg_inf, tl.float32)
    s = tl.zeros([BLOCK_N], tl.float32)
    t = tl.zeros([BLOCK_N], tl.float32)
    q = tl.zeros([BLOCK_N], tl.float32)  # SUM_P2: sum exp(2 (x - m)), rescaled by a^2 when m moves
    v_lo = split * V_PER_SPLIT
    v_hi = tl.minimum(V, v_lo + V_PER_SPLIT)
    for v0 in range(v_lo, v_hi, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
        col_ok = cols < v_hi
        z = _logits_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, D, stride_h, stride_w,
                         BLOCK_N, BLOCK_V, BLOCK_D, PRECISION)
        if HAS_BIAS:
            z += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        x = tl.where(col_ok[None, :], z * it[:, None], neg_inf)
        # Online update (see kernels.logsoftmax): moving the reference from m to m' scales s by a = exp(m - m')
        # and t to a (t + s (m - m')); rows that have seen only -inf keep reference 0 and s = t = 0.
        new_m = tl.maximum(m, tl.max(x, 1))
        ref = tl.where(new_m == neg_inf, 0.0, new_m)
        a = tl.exp(m - ref)
        shift = tl.where(m == neg_inf, 0.0, m - ref)
        # e * d = 0 (not NaN) where x = -inf; a NaN logit (a NaN weight row or bias entry) stays NaN and makes
        # the row's s NaN, as NaN logits do on the logits path.
        d = tl.maximum(x - ref[:, None], _FP32_LOWEST, propagate_nan=tl.PropagateNan.ALL)
        e = tl.exp(d)
        t = a * (t + s * shift) + tl.sum(e * d, 1)
        s = a * s + tl.sum(e, 1)
        if SUM_P2:
            q = a * a * q + tl.sum(e * e, 1)
        m = new_m
    out = split.to(tl.int64) * N + rows
    tl.store(m_ptr + out, tl.where(s > 0, m, 0.0), mask=row_ok)
    tl.store(s_ptr + out, s, mask=row_ok)
    tl.store(t_ptr + out, t, mask=row_ok)
    if SUM_P2:
        tl.store(q_ptr + out, q, mask=row_ok)


@triton.jit
def _linear_dense_grad_kernel(
    h_ptr, w_ptr, b_ptr, rows_ptr, inv_temp_ptr, lse_ptr, coef_ptr, dh_ptr, dw_ptr, db_ptr, skipped_ptr,
    R, V, D, stride_h, stride_w, eps,
    HAS_BIAS: tl.constexpr, NEED_H: tl.constexpr, NEED_W: tl.constexpr, NEED_B: tl.constexpr,
    FILTER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    GROUP_N: tl.constexpr, PRECISION: tl.constexpr,
):
    # Grouped order over a 1-D grid: GROUP_N token blocks sweep each vocabulary block before the next, so the
    # programs running at once share a few weight tiles and hidden blocks in L2 and spread their atomics.
    pid = tl.program_id(0)
    num_n = tl.cdiv(R, BLOCK_N)
    per_group = GROUP_N * tl.cdiv(V, BLOCK_V)
    first_n = (pid // per_group) * GROUP_N
    group_n = tl.minimum(num_n - first_n, GROUP_N)
    pid_n = first_n + (pid % per_group) % group_n
    pid_v = (pid % per_group) // group_n
    slot = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot_ok = slot < R
    rows = tl.load(rows_ptr + slot, mask=slot_ok, other=0)
    coef = tl.load(coef_ptr + rows, mask=slot_ok, other=0.0)
    # A block of rows with coef = 0 adds nothing: the wrapper orders those rows last (no host sync to drop them),
    # so whole blocks of them skip both matmuls here. In a block that mixes them with live rows, a coef = 0 row is
    # masked like a row past the end: its hidden state (untrained rows may hold NaN / inf) is never read, so it adds
    # exactly 0 to dh and dW.
    live = slot_ok & (coef != 0.0)
    if tl.max(tl.abs(coef)) > 0.0:
        cols = pid_v.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
        col_ok = cols < V
        z = _logits_tile(h_ptr, w_ptr, rows, cols, live, col_ok, D, stride_h, stride_w,
                         BLOCK_N, BLOCK_V, BLOCK_D, PRECISION)
        if HAS_BIAS:
            z += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        it = tl.load(inv_temp_ptr + rows, mask=slot_ok, other=1.0)
        lse = tl.load(lse_ptr + rows, mask=slot_ok, other=float("inf"))
        ok = live[:, None] & col_ok[None, :]
        p = tl.where(ok, tl.exp(z * it[:, None] - lse[:, None]), 0.0)
        keep = True
        if FILTER:
            keep = tl.max(p) >= eps  # one reduction: a nested one fails to compile on sm_100 (Triton 3.6, 3.7)
        if keep:
            _dense_grad_tile(h_ptr, w_ptr, dh_ptr, dw_ptr, db_ptr, rows, cols, live, col_ok, coef[:, None] * p, D,
                             stride_h, stride_w, NEED_H, NEED_W, NEED_B, BLOCK_D, PRECISION)
        else:
            tl.atomic_add(skipped_ptr, 1, sem="relaxed")


@triton.jit
def _dense_grad_tile(h_ptr, w_ptr, dh_ptr, dw_ptr, db_ptr, rows, cols, slot_ok, col_ok, dz, D, stride_h, stride_w,
                     NEED_H: tl.constexpr, NEED_W: tl.constexpr, NEED_B: tl.constexpr, BLOCK_D: tl.constexpr,
                     PRECISION: tl.constexpr):
    """Add ``dz W`` into ``dh[rows]``, ``dz^T h`` into ``dW[cols]`` and column sums into ``db[cols]``. The atomics
    are relaxed: nothing in the kernel reads what they write, so no fence is needed around them."""
    if NEED_B:
        tl.atomic_add(db_ptr + cols, tl.sum(dz, 0), mask=col_ok, sem="relaxed")
    dzc = dz.to(h_ptr.dtype.element_ty)
    offs_d = tl.arange(0, BLOCK_D)
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + offs_d
        d_ok = dd < D
        if NEED_H:
            wt = tl.load(w_ptr + cols[:, None] * stride_w + dd[None, :], mask=col_ok[:, None] & d_ok[None, :],
                         other=0.0)
            part = tl.dot(dzc, wt, input_precision=PRECISION)
            tl.atomic_add(dh_ptr + rows[:, None] * D + dd[None, :], part, mask=slot_ok[:, None] & d_ok[None, :],
                          sem="relaxed")
        if NEED_W:
            ht = tl.load(h_ptr + rows[:, None] * stride_h + dd[None, :], mask=slot_ok[:, None] & d_ok[None, :],
                         other=0.0)
            part_w = tl.dot(tl.trans(dzc), ht, input_precision=PRECISION)
            tl.atomic_add(dw_ptr + cols[:, None] * D + dd[None, :], part_w, mask=col_ok[:, None] & d_ok[None, :],
                          sem="relaxed")


@triton.jit
def _gathered_dot_kernel(
    h_ptr, w_ptr, b_ptr, ids_ptr, out_ptr, M, D, stride_h, stride_w,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    ids = tl.load(ids_ptr + n * M + offs_m, mask=m_ok, other=-1)
    valid = ids >= 0
    rows = tl.where(valid, ids, 0).to(tl.int64)
    acc = tl.zeros([BLOCK_M], tl.float32)
    offs_d = tl.arange(0, BLOCK_D)
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + offs_d
        d_ok = dd < D
        hv = tl.load(h_ptr + n * stride_h + dd, mask=d_ok, other=0.0).to(tl.float32)
        wv = tl.load(w_ptr + rows[:, None] * stride_w + dd[None, :], mask=valid[:, None] & d_ok[None, :], other=0.0)
        acc += tl.sum(wv.to(tl.float32) * hv[None, :], 1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + n * M + offs_m, tl.where(valid, acc, 0.0), mask=m_ok)


@triton.jit
def _gathered_grad_h_kernel(
    w_ptr, ids_ptr, dz_ptr, dh_ptr, M, D, stride_w, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    dd = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = dd < D
    acc = tl.zeros([BLOCK_D], tl.float32)
    offs_m = tl.arange(0, BLOCK_M)
    for m0 in range(0, M, BLOCK_M):
        mm = m0 + offs_m
        m_ok = mm < M
        ids = tl.load(ids_ptr + n * M + mm, mask=m_ok, other=-1)
        g = tl.load(dz_ptr + n * M + mm, mask=m_ok, other=0.0)
        valid = (ids >= 0) & (g != 0.0)
        rows = tl.where(valid, ids, 0).to(tl.int64)
        wv = tl.load(w_ptr + rows[:, None] * stride_w + dd[None, :], mask=valid[:, None] & d_ok[None, :], other=0.0)
        acc += tl.sum(wv.to(tl.float32) * g[:, None], 0)
    ptr = dh_ptr + n * D + dd
    tl.store(ptr, tl.load(ptr, mask=d_ok, other=0.0) + acc, mask=d_ok)


@triton.jit
def _gathered_grad_w_kernel(
    h_ptr, ids_ptr, dz_ptr, dw_ptr, db_ptr, M, D, stride_h,
    NEED_W: tl.constexpr, NEED_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    ids = tl.load(ids_ptr + n * M + offs_m, mask=m_ok, other=-1)
    g = tl.load(dz_ptr + n * M + offs_m, mask=m_ok, other=0.0)
    valid = (ids >= 0) & (g != 0.0)
    rows = tl.where(valid, ids, 0).to(tl.int64)
    if NEED_B:
        tl.atomic_add(db_ptr + rows, g, mask=valid, sem="relaxed")
    if NEED_W:
        offs_d = tl.arange(0, BLOCK_D)
        for d0 in range(0, D, BLOCK_D):
            dd = d0 + offs_d
            d_ok = dd < D
            hv = tl.load(h_ptr + n * stride_h + dd, mask=d_ok, other=0.0).to(tl.float32)
            tl.atomic_add(dw_ptr + rows[:, None] * D + dd[None, :], g[:, None] * hv[None, :],
                          mask=valid[:, None] & d_ok[None, :], sem="relaxed")


#: Environment override of the tile shapes, "BLOCK_N,BLOCK_V,BLOCK_D,num_warps,num_stages" (for sweeps on a GPU).
TILES_ENV = "OFFPOLICY_LINEAR_TILES"


def _tiles(tiles, dtype: torch.dtype):
    if tiles is not None:
        return tiles
    env = os.environ.get(TILES_ENV)
    if env:
        parts = tuple(int(x) for x in env.split(","))
        if len(parts) != 5:
            raise ValueError(f"${TILES_ENV}: expected BLOCK_N,BLOCK_V,BLOCK_D,num_warps,num_stages, got {env!r}")
        return parts
    if interpreting():
        return INTERPRETER_TILES
    from triton.runtime import driver

    dev = driver.active.get_current_device()
    shared = driver.active.utils.get_device_properties(dev)["max_shared_mem"]
    return gpu_tiles(dtype.itemsize, driver.active.get_current_target().arch, shared)


def gpu_tiles(itemsize: int, capability: int, max_shared: int) -> tuple[int, int, int, int, int]:
    """The first tile of :data:`GPU_TILES` for operands of ``itemsize`` bytes whose compute capability and shared
    memory (bytes per block) the device meets; the smallest when none fits."""
    options = GPU_TILES[min(itemsize, 4)]
    for tile, least_capability, shared in options:
        if capability >= least_capability and shared <= max_shared:
            return tile
    return options[-1][0]


def _on(device: torch.device) -> contextlib.AbstractContextManager:
    """Makes ``device`` current for the launches (Triton launches on the current CUDA device); a no-op off CUDA."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _check_rows(x: Tensor, name: str) -> None:
    if x.stride(-1) != 1:
        raise ValueError(f"{name}: expected unit stride along D, got strides {x.stride()}")


def linear_row_stats(hidden: Tensor, weight: Tensor, bias: Tensor | None, inv_temp: Tensor, *,
                     splits: int | None = None,
                     tiles: tuple[int, int, int, int, int] | None = None,
                     sum_p2: bool = False) -> tuple[Tensor, ...]:
    """Partial online-softmax statistics of ``x = (h W^T + b) inv_temp``.

    Args:
        hidden: ``[N, D]``, weight: ``[V, D]`` (fp32/bf16/fp16, unit stride in ``D``); bias ``[V]`` or None.
        inv_temp: ``[N]`` fp32.
        splits: vocabulary splits (grid dimension 1); default: enough programs to fill the GPU.
        tiles: ``(BLOCK_N, BLOCK_V, BLOCK_D, num_warps, num_stages)``.
        sum_p2: also return ``q = sum exp(2 (x - m))`` (a constexpr flag: the default kernel is compiled without it).

    Returns:
        ``m, s, t`` (then ``q`` with ``sum_p2``) of shape ``[splits, N]`` fp32 (fold them with
        :func:`merge_stats`).
    """
    _check_rows(hidden, "hidden")
    _check_rows(weight, "weight")
    n, d = hidden.shape
    v = weight.shape[0]
    with _on(hidden.device):  # the tile depends on the device's shared memory
        bn, bv, bd, warps, stages = _tiles(tiles, hidden.dtype)
    n_blocks = triton.cdiv(n, bn)
    v_blocks = triton.cdiv(v, bv)
    if splits is None:
        splits = 1 if interpreting() else max(1, min(v_blocks, triton.cdiv(264, n_blocks)))
    per_split = triton.cdiv(v_blocks, splits) * bv
    splits = triton.cdiv(v, per_split)
    m = torch.empty(splits, n, dtype=torch.float32, device=hidden.device)
    s, t = torch.empty_like(m), torch.empty_like(m)
    q = torch.empty_like(m) if sum_p2 else None
    stats = (m, s, t) if q is None else (m, s, t, q)
    if n == 0:
        return stats
    with _on(hidden.device):
        _linear_row_stats_kernel[(n_blocks, splits)](
            hidden, weight, bias if bias is not None else hidden, inv_temp, m, s, t, t if q is None else q,
            n, v, d, hidden.stride(0), weight.stride(0), per_split,
            HAS_BIAS=bias is not None, SUM_P2=sum_p2, BLOCK_N=bn, BLOCK_V=bv, BLOCK_D=bd,
            PRECISION=_precision(hidden.dtype),
            num_warps=warps, num_stages=stages, enable_fp_fusion=False,
        )
    return stats


def merge_stats(m: Tensor, s: Tensor, t: Tensor, q: Tensor | None = None) -> tuple[Tensor, ...]:
    """Fold ``[splits, N]`` partial statistics into ``[N]`` (``M = max`` over parts with mass, ``a = exp(m - M)``:
    ``s = sum a s``, ``t = sum a (t + s (m - M))``, and given ``q``, ``q = sum a^2 q``); ``m = 0`` where no part has
    mass."""
    m_e = torch.where(s > 0, m, torch.full_like(m, -float("inf")))
    big = m_e.amax(dim=0) if m.shape[0] else torch.zeros(m.shape[1:], device=m.device)
    big = torch.where(torch.isfinite(big), big, torch.zeros_like(big))
    a = torch.exp(m_e - big)
    shift = torch.where(s > 0, m - big, torch.zeros_like(m))
    folded = (big, (a * s).sum(dim=0), (a * (t + s * shift)).sum(dim=0))
    return folded if q is None else (*folded, (a * a * q).sum(dim=0))


def linear_dense_grad(hidden: Tensor, weight: Tensor, bias: Tensor | None, rows: Tensor, inv_temp: Tensor,
                      lse: Tensor, coef: Tensor, dh: Tensor | None, dw: Tensor | None, db: Tensor | None, *,
                      eps: float | None = None, tiles: tuple[int, int, int, int, int] | None = None) -> Tensor:
    """Add the dense gradient ``dz[n, v] = coef[n] exp(x[n, v] - lse[n])`` (for ``n`` in ``rows``) into fp32
    accumulators ``dh [N, D]``, ``dw [V, D]``, ``db [V]`` (each may be None).

    ``rows`` is best ordered with the rows whose ``coef`` is 0 last (:func:`rows_by_coef`): blocks of such rows
    skip their matmuls. Returns the number of tiles skipped by the filter ``eps`` (None: no filtering) as a
    ``[1]`` int32 tensor on the device (no host sync)."""
    r = rows.numel()
    v, d = weight.shape
    skipped = torch.zeros(1, dtype=torch.int32, device=hidden.device)
    if r == 0 or v == 0 or (dh is None and dw is None and db is None):
        return skipped
    dummy = inv_temp
    group_n = INTERPRETER_GROUP_N if interpreting() else GPU_GROUP_N
    with _on(hidden.device):
        bn, bv, bd, warps, stages = _tiles(tiles, hidden.dtype)
        _linear_dense_grad_kernel[(triton.cdiv(r, bn) * triton.cdiv(v, bv),)](
            hidden, weight, bias if bias is not None else hidden, rows, inv_temp, lse, coef,
            dh if dh is not None else dummy, dw if dw is not None else dummy, db if db is not None else dummy,
            skipped, r, v, d, hidden.stride(0), weight.stride(0), float(eps or 0.0),
            HAS_BIAS=bias is not None, NEED_H=dh is not None, NEED_W=dw is not None, NEED_B=db is not None,
            FILTER=bool(eps), BLOCK_N=bn, BLOCK_V=bv, BLOCK_D=bd, GROUP_N=group_n,
            PRECISION=_precision(hidden.dtype), num_warps=warps, num_stages=stages, enable_fp_fusion=False,
        )
    return skipped


def rows_by_coef(coef: Tensor) -> Tensor:
    """All row indices, those with ``coef != 0`` first (in order), as int64: a stable sort, no host sync."""
    return torch.argsort((coef == 0).to(torch.uint8), stable=True)


def _gather_blocks(m: int, d: int) -> tuple[int, int]:
    if interpreting():
        return max(16, triton.next_power_of_2(m)), max(16, min(1024, triton.next_power_of_2(d)))
    return 16, 128


def gathered_dot(hidden: Tensor, weight: Tensor, bias: Tensor | None, ids: Tensor) -> Tensor:
    """``[N, M]`` fp32 ``W[ids] . h + b[ids]`` per row, 0 where ``ids < 0`` (ids int64, contiguous)."""
    _check_rows(hidden, "hidden")
    _check_rows(weight, "weight")
    n, m = ids.shape
    out = torch.zeros(n, m, dtype=torch.float32, device=hidden.device)
    if n == 0 or m == 0:
        return out
    bm, bd = _gather_blocks(m, hidden.shape[1])
    with _on(hidden.device):
        _gathered_dot_kernel[(n, triton.cdiv(m, bm))](
            hidden, weight, bias if bias is not None else hidden, ids.contiguous(), out, m, hidden.shape[1],
            hidden.stride(0), weight.stride(0), HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_D=bd,
            enable_fp_fusion=True,
        )
    return out


def gathered_grad(hidden: Tensor, weight: Tensor, ids: Tensor, dz: Tensor, dh: Tensor | None, dw: Tensor | None,
                  db: Tensor | None) -> None:
    """Add ``dz [N, M]`` (fp32, at ``ids``) into fp32 accumulators: ``dh[n] += sum_j dz W[ids]``,
    ``dw[ids] += dz h[n]``, ``db[ids] += dz`` (each may be None)."""
    n, m = ids.shape
    d = hidden.shape[1]
    if n == 0 or m == 0:
        return
    ids, dz = ids.contiguous(), dz.contiguous()
    bm, bd = _gather_blocks(m, d)
    with _on(hidden.device):
        if dh is not None:
            _gathered_grad_h_kernel[(n, triton.cdiv(d, bd))](weight, ids, dz, dh, m, d, weight.stride(0),
                                                              BLOCK_M=bm, BLOCK_D=bd, enable_fp_fusion=True)
        if dw is not None or db is not None:
            _gathered_grad_w_kernel[(n, triton.cdiv(m, bm))](
                hidden, ids, dz, dw if dw is not None else dz, db if db is not None else dz, m, d,
                hidden.stride(0), NEED_W=dw is not None, NEED_B=db is not None, BLOCK_M=bm, BLOCK_D=bd,
                enable_fp_fusion=True,
            )
