"""The log-softmax over a sparse support per row, in Triton: rows given as CSR segments of column ids, any width.

Row ``r`` owns the entries ``offsets[r] .. offsets[r + 1]`` of ``ids`` (its support ``S_r``: 0 to ``V`` distinct
column ids of ``z [N, V]``, in any order). With ``x = z * inv_temp`` (``inv_temp > 0``), the support's
distribution and its normaliser are

    p^S_r(v) = exp(x_v - lse_r) [v in S_r],   lse_r = log sum_{v in S_r} exp(x_v)

Two kernels, each a 1-D grid with one program per row, ``O(|S_r|)`` work per row (plus the zeroing of the gradient
row in the backward); no per-row host work, no ``[N, K_max]`` padding, each id read once per pass:

* :func:`support_stats`: one sweep over the row's segment in blocks of ids gathers ``z`` at the ids (the only
  gather), writes the gathered values (fp32) into the caller's ``[nnz]`` output as scratch, and keeps the online
  statistics about the running max ``m`` of the raw ``z`` (``inv_temp > 0``, so the max of ``z`` is the max of
  ``x``), in base 2: ``y = (z - m) inv_temp log2(e)``, ``s = sum 2^y``, ``t2 = sum 2^y y``; when a block raises
  the max from ``m`` to ``m'`` the sums rescale exactly as the terms do, ``y' = y + d``, ``d = (m - m')
  inv_temp log2(e) <= 0``, so ``s' = 2^d s`` and ``t2' = 2^d (t2 + d s)``. Then ``lse = m inv_temp + ln s`` and
  the entropy of ``p^S`` is ``-sum p^S ln p^S = ln s - ln(2) t2 / s``; a second sweep over the contiguous scratch
  (no second gather) rewrites it as the log-probabilities ``lp_e = (z_e - m) inv_temp - ln s``. The max is taken
  on the raw logits and ``x - m`` formed as ``(z - m) inv_temp``, as the library's other support paths form it.
* :func:`support_grad`: the gradient of ``L(lp, lp_target)`` with respect to ``z`` given ``g_e = dL / d lp_e``
  (optional) and ``g_t = dL / d lp_target`` (``lp_target = x_y - lse`` for a target id ``y`` per row, inside or
  outside the support). With ``d lp_u / d x_v = [u = v] - p^S(v) [v in S]`` and ``dx / dz = inv_temp``:

      dz_v = inv_temp (g_e [v = ids_e] + g_t [v = y] - G p^S(v) [v in S]),   G = g_t + sum_e g_e

  so every element outside ``S`` and ``y`` is exactly 0. The program zeroes its whole gradient row (the caller's
  buffer needs no zero fill: every element is written), a barrier orders those stores before the entries', then
  one sweep over the segment writes each support entry once, ``(g_e - G exp(lp_e) + g_t [ids_e = y]) inv_temp``
  (the target's term folded into its entry, so each element is rounded once to the output dtype), and the target's
  column is written alone when ``y`` is not in ``S``. With ``g_e`` given, a first sweep sums it for ``G``. ``G = 0``
  drops the probability term, so a row without gradient never reads its log-probabilities.

Conventions (those of the library's other support paths): a row without mass (skipped, empty support, all
``-inf``) has ``lse = +inf``, entropy 0, ``lp = -inf``; a NaN or ``+inf`` logit in the support, an id outside
``[0, V)`` (never read) or ``z / tau`` overflowing makes the row's ``lse``, entropy and ``lp`` NaN. Ids must be
distinct within a row (the record contract, which ``CSRCandidates.validate`` checks): with a repeated id the
statistics count it twice and the backward writes one of its entries' values. Offsets are clamped to ``[0, nnz]``
inside the kernels (no read or write outside the buffers whatever they hold), without a host check.

All arithmetic is fp32 whatever the storage dtype (bf16/fp16/fp32); FMA contraction on (set explicitly). Row
offsets into ``z`` and the gradient are 64-bit when ``N * row_stride`` reaches ``2**31``; entry offsets are 64-bit
(the CSR offsets are int64). The only extra memory is the outputs. These kernels know nothing about what the rows
mean.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from offpolicy.kernels.logsoftmax import _check_rows, _needs_int64, _vector, is_interpreted, launch_device

_FP32_LOWEST: tl.constexpr = tl.constexpr(-3.4028234663852886e38)
_LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
_LN2: tl.constexpr = tl.constexpr(0.6931471805599453)
#: Ids per step of a segment sweep and warps per program (GPU): 8 ids per thread, the ids' 64 bytes as four
#: 16-byte loads; a narrow row (tens of ids) wastes lanes of one step, a wide one streams its ids.
_GPU_K_BLOCK, _GPU_WARPS = 1024, 4
#: Gradient elements zeroed per step of the backward's row sweep (GPU).
_GPU_V_BLOCK = 4096
#: The interpreter's (CPU) tiles: each loop iteration costs milliseconds there.
_INTERPRETER_K_BLOCK, _INTERPRETER_V_BLOCK = 4096, 16384
_FP_FUSION = True


@triton.jit
def _segment(offsets_ptr, row, nnz):
    """``(e0, w)``: the row's first entry (int64) and its width (int32), the offsets clamped to ``[0, nnz]``."""
    e0 = tl.minimum(tl.maximum(tl.load(offsets_ptr + row), 0), nnz)
    e1 = tl.minimum(tl.maximum(tl.load(offsets_ptr + row + 1), e0), nnz)
    return e0, (e1 - e0).to(tl.int32)


@triton.jit
def _support_stats_kernel(
    z_ptr,
    stride_row,
    offsets_ptr,
    ids_ptr,
    inv_temp_ptr,
    skip_ptr,
    lp_ptr,
    lse_ptr,
    ent_ptr,
    V,
    nnz,
    HAS_SKIP: tl.constexpr,
    BLOCK: tl.constexpr,
    INT64: tl.constexpr,
):
    neg_inf = float("-inf")
    row = tl.program_id(0)
    if INT64:
        row = row.to(tl.int64)
    e0, w = _segment(offsets_ptr, row, nnz)
    it = tl.load(inv_temp_ptr + row)
    a = it * _LOG2E
    w_read = w
    if HAS_SKIP:
        w_read = tl.where(tl.load(skip_ptr + row) != 0, 0, w)  # a skipped row reads nothing
    z_row = z_ptr + row * stride_row
    ids_row = ids_ptr + e0
    lp_row = lp_ptr + e0
    k0 = tl.arange(0, BLOCK)
    m = tl.full([], neg_inf, tl.float32)
    s_acc = tl.zeros([BLOCK], tl.float32)
    t_acc = tl.zeros([BLOCK], tl.float32)
    odd = tl.zeros([BLOCK], tl.int32)  # NaN, +inf or an id outside [0, V)
    # 1. The gather (once), the scratch copy, the online statistics.
    for k in range(0, w_read, BLOCK):
        kk = k + k0
        in_k = kk < w_read
        idk = tl.load(ids_row + kk, mask=in_k, other=0)
        ok = (idk >= 0) & (idk < V)
        zk = tl.load(z_row + idk, mask=in_k & ok, other=neg_inf).to(tl.float32)
        zk = tl.where(ok, zk, float("nan"))
        tl.store(lp_row + kk, zk, mask=in_k)
        odd |= (in_k & ((zk != zk) | (zk == float("inf")))).to(tl.int32)
        bmax = tl.max(tl.where(in_k, zk, neg_inf), 0)
        if bmax > m:  # the running max moves (a NaN block max never does: the row is flagged above)
            d = tl.where(m == neg_inf, 0.0, (m - bmax) * a)
            f = tl.where(m == neg_inf, 0.0, tl.exp2(d))  # nothing accumulated while m = -inf
            t_acc = f * (t_acc + s_acc * d)
            s_acc = f * s_acc
            m = bmax
        m_ref = tl.where(m == neg_inf, 0.0, m)  # all -inf so far: y = -inf, no NaN from -inf - -inf
        y = tl.maximum((zk - m_ref) * a, _FP32_LOWEST, propagate_nan=tl.PropagateNan.ALL)  # e y = 0 at -inf
        e = tl.where(in_k, tl.exp2(y), 0.0)
        s_acc += e
        t_acc += e * y
    s = tl.sum(s_acc, 0)
    t2 = tl.sum(t_acc, 0)
    bad = tl.max(odd, 0) != 0
    mz = tl.where((m == neg_inf) | bad, 0.0, m)
    has = (s > 0.0) & ~bad
    ls = tl.log(tl.where(has, s, 1.0))
    lse = mz * it + ls
    nan_row = bad | (has & ((lse == float("inf")) | (lse == neg_inf)))  # z / tau overflowed
    live = has & ~nan_row
    tl.store(lse_ptr + row, tl.where(nan_row, float("nan"), tl.where(live, lse, float("inf"))))
    tl.store(ent_ptr + row, tl.where(nan_row, float("nan"),
                                     tl.where(live, ls - t2 * _LN2 / tl.where(live, s, 1.0), 0.0)))
    fill = tl.where(nan_row, float("nan"), neg_inf)
    tl.debug_barrier()  # the scratch stores above land before any thread reads them back
    # 2. The log-probabilities from the contiguous scratch (in L1/L2), in place; -inf or NaN without mass.
    w_live = tl.where(live, w, 0)
    for k in range(0, w, BLOCK):
        kk = k + k0
        zk = tl.load(lp_row + kk, mask=kk < w_live, other=0.0)
        tl.store(lp_row + kk, tl.where(kk < w_live, (zk - mz) * it - ls, fill), mask=kk < w)


@triton.jit
def _support_grad_kernel(
    out_ptr,
    stride_orow,
    offsets_ptr,
    ids_ptr,
    target_ptr,
    lp_ptr,
    g_ids_ptr,
    g_target_ptr,
    inv_temp_ptr,
    live_ptr,
    V,
    nnz,
    HAS_G_IDS: tl.constexpr,
    BLOCK: tl.constexpr,
    V_BLOCK: tl.constexpr,
    INT64: tl.constexpr,
):
    row = tl.program_id(0)
    if INT64:
        row = row.to(tl.int64)
    e0, w = _segment(offsets_ptr, row, nnz)
    live = tl.load(live_ptr + row) != 0
    it = tl.load(inv_temp_ptr + row)
    gt = tl.where(live, tl.load(g_target_ptr + row), 0.0)
    y = tl.load(target_ptr + row)
    ids_row = ids_ptr + e0
    lp_row = lp_ptr + e0
    g_row = g_ids_ptr + e0
    o_row = out_ptr + row * stride_orow
    dt = out_ptr.dtype.element_ty
    k0 = tl.arange(0, BLOCK)
    w_live = tl.where(live, w, 0)
    big_g = gt
    if HAS_G_IDS:
        g_acc = tl.zeros([BLOCK], tl.float32)
        for k in range(0, w_live, BLOCK):
            kk = k + k0
            g_acc += tl.load(g_row + kk, mask=kk < w_live, other=0.0)
        big_g += tl.sum(g_acc, 0)
        w_write = w_live
    else:
        w_write = tl.where(gt != 0.0, w_live, 0)  # G = g_t = 0: nothing but zeros in the row
    # 1. The whole row zeroed (the caller's buffer is uninitialised).
    cols0 = tl.arange(0, V_BLOCK)
    for start in range(0, V, V_BLOCK):
        cols = start + cols0
        tl.store(o_row + cols, tl.zeros([V_BLOCK], dt), mask=cols < V)
    tl.debug_barrier()  # the entries' stores below land after the zeros of their columns
    # 2. Each support entry written once, the target's term folded into its entry.
    dense = big_g != 0.0
    lse_bound = tl.where(dense, w_write, 0)  # G = 0: the log-probabilities are not read
    hit = tl.zeros([BLOCK], tl.int32)
    for k in range(0, w_write, BLOCK):
        kk = k + k0
        in_k = kk < w_write
        idk = tl.load(ids_row + kk, mask=in_k, other=-1)
        lpk = tl.load(lp_row + kk, mask=kk < lse_bound, other=float("-inf"))
        val = -(big_g * tl.exp(lpk))
        if HAS_G_IDS:
            val += tl.load(g_row + kk, mask=in_k, other=0.0)
        is_y = in_k & (idk == y)
        hit |= is_y.to(tl.int32)
        val = tl.where(is_y, val + gt, val) * it
        tl.store(o_row + idk, val.to(dt), mask=in_k & (idk >= 0) & (idk < V))
    # 3. The target's column alone where it is outside the support (its zero was stored before the barrier).
    alone = (tl.max(hit, 0) == 0) & (gt != 0.0) & (y >= 0) & (y < V)
    tl.store(o_row + y, (gt * it).to(dt), mask=alone)


def _tiles(v: int, block: int | None, num_warps: int | None) -> tuple[int, int, int]:
    """``(ids per step, gradient elements per zeroing step, warps)``; in the interpreter the tiles cover a row of
    ``V`` (distinct ids: ``|S| <= V``) in one step, up to the interpreter's caps."""
    if is_interpreted():
        row = triton.next_power_of_2(max(v, 16))
        k_block, v_block = min(_INTERPRETER_K_BLOCK, row), min(_INTERPRETER_V_BLOCK, row)
    else:
        k_block, v_block = _GPU_K_BLOCK, _GPU_V_BLOCK
    k_block = block or k_block
    if k_block < 16 or k_block & (k_block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    return k_block, v_block, num_warps or _GPU_WARPS


def _check_csr(offsets: Tensor, ids: Tensor, n: int, device: torch.device) -> None:
    if offsets.shape != (n + 1,) or offsets.dtype != torch.int64 or offsets.device != device:
        raise ValueError(f"offsets must be [{n + 1}] int64 on {device}, got {tuple(offsets.shape)} {offsets.dtype} "
                         f"on {offsets.device}")
    if ids.dim() != 1 or ids.dtype != torch.int64 or ids.device != device:
        raise ValueError(f"ids must be [nnz] int64 on {device}, got {tuple(ids.shape)} {ids.dtype} on {ids.device}")


def support_stats(
    logits: Tensor,
    offsets: Tensor,
    ids: Tensor,
    inv_temp: Tensor,
    skip: Tensor | None = None,
    *,
    block: int | None = None,
    num_warps: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(lp [nnz], lse [N], entropy [N])`` of the support rows (see the module docstring), fp32.

    Args:
        logits: ``[N, V]`` fp32/fp16/bf16, any row stride, unit column stride.
        offsets: ``[N + 1]`` int64 CSR offsets (nondecreasing from 0 to ``nnz``; clamped, not checked).
        ids: ``[nnz]`` int64 column ids, distinct within a row.
        inv_temp: ``[N]`` fp32, ``> 0``.
        skip: ``[N]`` bool or None; skipped rows are not read (``lse = +inf``, entropy 0, ``lp = -inf``).
        block, num_warps: ids per step (a power of two) and warps per program; defaults suit a GPU.
    """
    _check_rows("logits", logits)
    n, v = logits.shape
    dev = logits.device
    _check_csr(offsets, ids, n, dev)
    inv_temp = _vector("inv_temp", inv_temp, n, torch.float32, dev)
    nnz = ids.shape[0]
    lp = torch.empty(nnz, dtype=torch.float32, device=dev)
    lse = torch.full((n,), float("inf"), dtype=torch.float32, device=dev)
    entropy = torch.zeros(n, dtype=torch.float32, device=dev)
    if n == 0:
        return lp, lse, entropy
    if skip is not None:
        skip = _vector("skip", skip, n, torch.bool, dev).view(torch.uint8)
    k_block, _, num_warps = _tiles(v, block, num_warps)
    with launch_device(dev):
        _support_stats_kernel[(n,)](
            logits, logits.stride(0), offsets.contiguous(), ids.contiguous(), inv_temp,
            skip if skip is not None else inv_temp, lp, lse, entropy, v, nnz, HAS_SKIP=skip is not None,
            BLOCK=k_block, INT64=_needs_int64(n, logits), num_warps=num_warps, enable_fp_fusion=_FP_FUSION,
        )  # fmt: skip
    return lp, lse, entropy


def support_grad(
    lp: Tensor,
    offsets: Tensor,
    ids: Tensor,
    target: Tensor,
    inv_temp: Tensor,
    grad_ids: Tensor | None,
    grad_target: Tensor,
    live: Tensor,
    out: Tensor,
    *,
    block: int | None = None,
    num_warps: int | None = None,
) -> Tensor:
    """Write the gradient of the support rows into ``out`` (every element; see the module docstring), return it.

    Args:
        lp: ``[nnz]`` fp32, :func:`support_stats`'s log-probabilities.
        offsets, ids: the CSR rows (as :func:`support_stats`).
        target: ``[N]`` int64 column id per row (``lp_target = x_target - lse``; inside or outside the support; one
            outside ``[0, V)`` takes no gradient).
        inv_temp: ``[N]`` fp32.
        grad_ids: ``[nnz]`` fp32 upstream gradient of ``lp``, or None (zero).
        grad_target: ``[N]`` fp32 upstream gradient of ``lp_target``.
        live: ``[N]`` bool: rows that take a gradient (finite ``lse``); the others are zeroed.
        out: ``[N, V]`` fp32/fp16/bf16, unit column stride, uninitialised.
        block, num_warps: ids per step (a power of two) and warps per program; defaults suit a GPU.
    """
    _check_rows("out", out)
    n, v = out.shape
    dev = out.device
    _check_csr(offsets, ids, n, dev)
    nnz = ids.shape[0]
    if lp.shape != (nnz,) or lp.dtype != torch.float32 or lp.device != dev:
        raise ValueError(f"lp must be [{nnz}] float32 on {dev}, got {tuple(lp.shape)} {lp.dtype} on {lp.device}")
    if grad_ids is not None and (grad_ids.shape != (nnz,) or grad_ids.dtype != torch.float32 or grad_ids.device != dev):
        raise ValueError(f"grad_ids must be [{nnz}] float32 on {dev}, got {tuple(grad_ids.shape)} {grad_ids.dtype} "
                         f"on {grad_ids.device}")
    target = _vector("target", target, n, torch.int64, dev)
    inv_temp = _vector("inv_temp", inv_temp, n, torch.float32, dev)
    grad_target = _vector("grad_target", grad_target, n, torch.float32, dev)
    live = _vector("live", live, n, torch.bool, dev).view(torch.uint8)
    if n == 0 or v == 0:
        return out
    k_block, v_block, num_warps = _tiles(v, block, num_warps)
    with launch_device(dev):
        _support_grad_kernel[(n,)](
            out, out.stride(0), offsets.contiguous(), ids.contiguous(), target, lp.contiguous(),
            grad_ids.contiguous() if grad_ids is not None else lp, grad_target, inv_temp, live, v, nnz,
            HAS_G_IDS=grad_ids is not None, BLOCK=k_block, V_BLOCK=v_block, INT64=_needs_int64(n, out),
            num_warps=num_warps, enable_fp_fusion=_FP_FUSION,
        )  # fmt: skip
    return out
