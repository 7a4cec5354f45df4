"""Row-wise softmax statistics and the closed-form log-softmax backward over wide rows, in Triton.

Three kernels, each a 1-D grid with one program per row (no 65,535 grid-dimension limit):

* :func:`row_stats` reads ``z [N, V]`` once and returns, for ``x = z * inv_temp``, the row max ``m``,
  ``s = sum_v exp(x_v - m)`` and ``t = sum_v exp(x_v - m) (x_v - m)`` (so ``lse = m + log s`` and the entropy is
  ``log s - t / s``), and on request ``q = sum_v exp(2 (x_v - m))`` (``sum_v p_v^2 = q / s^2``; a constexpr flag,
  so the default kernel is compiled without it). Rows flagged in ``skip`` are not read at all. The loop works in
  base 2 and rescales its sums only when the running max moves (:func:`_row_stats_loop`).
* :func:`row_grad` reads ``z`` once and writes, in ``z``'s dtype,

      dz = inv_temp * (scatter(g at ids) - G * exp(x - lse))

  where ``ids [N, M]`` are column ids (``-1`` = none; ids may repeat, their ``g`` add), ``G [N]`` a per-row
  scalar and ``lse [N]`` a per-row normaliser (``+inf`` = the dense part is zero: the row is not read).
  The output may be ``z`` itself (in-place).

  Repeated ids are summed outside the kernel, in ``O(M log M)`` per row (:func:`unique_ids`).
* :func:`row_loss_grad` does both in one program when the upstream gradient of each row is a closed form of the
  row's log-probability at one id (``g = coef * f(lp - shift)``, ``f`` from a small family given by numbers), and
  optionally of ``K`` head entries whose coefficients are closed forms of their own log-probabilities and of the
  head's masses (``O(K)`` work after the statistics): the statistics (one read), then ``dz`` from a second read
  that finds the row in L2, one write.

All arithmetic is fp32 whatever the storage dtype (bf16/fp16/fp32), but for the head masses of :func:`row_loss_grad`
(float64, ``O(K)`` per row), and each output element is rounded once. FMA
contraction is on (set explicitly: Triton 3.10 changes the default), except in ``x = z * inv_temp``, which is
rounded once as torch rounds it, so that the backward's ``exp(x - lse)`` reproduces the forward's statistics.
Launches go to the tensors' device.
Row offsets are 64-bit when ``N * row_stride`` reaches ``2**31``. The only extra memory is ``O(N M)``.

These kernels know nothing about what the rows mean.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from torch import Tensor

_INT32_LIMIT = 2**31
_FP32_LOWEST: tl.constexpr = tl.constexpr(-3.4028234663852886e38)
_LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
_LN2: tl.constexpr = tl.constexpr(0.6931471805599453)
#: Default tile widths: compiled (GPU) and interpreted (CPU, where each loop iteration costs milliseconds).
_GPU_BLOCK, _GPU_WARPS = 4096, 8
_INTERPRETER_BLOCK = 16384
#: Ids handled per step of the scatter.
_ID_CHUNK = 64
#: FMA contraction, explicit (Triton 3.10 flips its default): on; the product that must stay rounded is pinned
#: by :func:`_scaled`.
_FP_FUSION = True


@triton.jit
def _scaled(z, it):
    """``x = z * it`` rounded to fp32 once, as torch computes it: an explicit ``fma(z, it, 0)`` cannot be contracted
    into what follows (``x - m``), so both kernels and the gathered values see the same ``x`` while the rest of the
    arithmetic keeps FMA contraction (3 fewer instructions per element than turning it off)."""
    return tl.fma(z.to(tl.float32), it, 0.0)


@triton.jit
def _row_stats_loop(row_ptr, it, v_end, V, BLOCK: tl.constexpr, SUM_P2: tl.constexpr):
    """``(m, s, t, q)`` of one row (see :func:`row_stats`), base 2: ``e = exp2(x log2(e) - r)`` with the reference
    ``r = fl(m log2(e))`` rescaled only when a block raises the running max ``m``.

    Per element: one rounded product (``x``), one FMA (``d = x log2(e) - r``, the exponent in base 2, clamped to
    the lowest fp32 so that ``e d = 0`` where ``x = -inf``; NaN propagates), one ``ex2``, one add (``s``) and one
    FMA (``t2 += e d``, ``t`` in base-2 units); the rescale ``a = exp2(r - r')``,
    ``t2' = a (t2 + s (r - r'))``, ``s' = a s`` (since ``e' d' = a e (d + r - r')``) runs only in a block whose max
    exceeds ``m``. At the end the rounding of ``r`` is undone exactly: ``c = fma(m, log2(e), -r)`` is the residual
    of ``r`` against ``m log2(e)`` and ``s = 2^-c sum e``, ``t = ln 2 * 2^-c (t2 - c sum e)``, so ``(m, s, t)`` are
    the statistics about the row max itself. While the row has seen only ``-inf``, ``m = -inf`` and ``r = 0``.
    """
    cols0 = tl.arange(0, BLOCK)
    neg_inf = float("-inf")
    m = tl.full([], neg_inf, tl.float32)
    r = tl.zeros([], tl.float32)
    s_acc = tl.zeros([BLOCK], tl.float32)
    t_acc = tl.zeros([BLOCK], tl.float32)
    q_acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, v_end, BLOCK):
        cols = start + cols0
        x = _scaled(tl.load(row_ptr + cols, mask=cols < V, other=neg_inf), it)
        bmax = tl.max(x, 0)
        if bmax > m:  # the running max moves (a NaN block max never does: NaN reaches s through d below)
            new_r = bmax * _LOG2E
            shift = tl.where(m == neg_inf, 0.0, r - new_r)
            a = tl.where(m == neg_inf, 0.0, tl.exp2(shift))  # nothing accumulated yet while m = -inf
            t_acc = a * (t_acc + s_acc * shift)
            s_acc = a * s_acc
            if SUM_P2:
                q_acc = a * a * q_acc
            m = bmax
            r = new_r
        d = tl.maximum(tl.fma(x, _LOG2E, -r), _FP32_LOWEST, propagate_nan=tl.PropagateNan.ALL)
        e = tl.exp2(d)
        s_acc += e
        t_acc += e * d
        if SUM_P2:
            q_acc += e * e
    s2 = tl.sum(s_acc, 0)
    t2 = tl.sum(t_acc, 0)
    c = tl.where(m == neg_inf, 0.0, tl.fma(m, _LOG2E, -r))  # |c| <= half an ulp of r
    k = tl.exp2(-c)
    s = s2 * k
    t = (t2 - c * s2) * k * _LN2
    q = tl.sum(q_acc, 0) * k * k
    return tl.where(m == neg_inf, 0.0, m), s, t, q


@triton.jit
def _row_stats_kernel(
    logits_ptr,
    stride_row,
    inv_temp_ptr,
    skip_ptr,
    m_ptr,
    s_ptr,
    t_ptr,
    q_ptr,
    V,
    HAS_SKIP: tl.constexpr,
    SUM_P2: tl.constexpr,
    BLOCK: tl.constexpr,
    INT64: tl.constexpr,
):
    row = tl.program_id(0)
    if INT64:
        row = row.to(tl.int64)
    it = tl.load(inv_temp_ptr + row)
    v_end = V
    if HAS_SKIP:
        v_end = tl.where(tl.load(skip_ptr + row) != 0, 0, V)  # a skipped row runs no iteration: no reads
    m, s, t, q = _row_stats_loop(logits_ptr + row * stride_row, it, v_end, V, BLOCK, SUM_P2)
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, s)
    tl.store(t_ptr + row, t)
    if SUM_P2:
        tl.store(q_ptr + row, q)


@triton.jit
def _row_grad_kernel(
    logits_ptr,
    stride_lrow,
    out_ptr,
    stride_orow,
    ids_ptr,
    grad_ptr,
    vals_ptr,
    inv_temp_ptr,
    lse_ptr,
    grad_sum_ptr,
    V,
    M,
    BLOCK: tl.constexpr,
    ID_CHUNK: tl.constexpr,
    INT64: tl.constexpr,
):
    row = tl.program_id(0)
    if INT64:
        row = row.to(tl.int64)
    it = tl.load(inv_temp_ptr + row)
    lse = tl.load(lse_ptr + row)
    big_g = tl.load(grad_sum_ptr + row)
    neg_inf = float("-inf")
    # The dense part -G it p is identically 0 when the row has no mass (lse = +inf) or G = 0: skip the read.
    # (Expressed as a column bound: the interpreter cannot AND a vector mask with a scalar one.)
    v_read = tl.where((lse < float("inf")) & (big_g != 0.0), V, 0)
    l_row = logits_ptr + row * stride_lrow
    o_row = out_ptr + row * stride_orow
    ids_row = ids_ptr + row * M
    g_row = grad_ptr + row * M
    v_row = vals_ptr + row * M
    dt = out_ptr.dtype.element_ty

    # 1. The complete value at every id, it * (g - G p), into the O(N M) scratch row. The ids are unique (the
    #    wrapper summed the g of equal ids), so the final stores in step 3 never race. This reads the logits at
    #    the ids before step 2 can overwrite them (in-place).
    for c0 in range(0, M, ID_CHUNK):
        kc = c0 + tl.arange(0, ID_CHUNK)
        idc = tl.load(ids_row + kc, mask=kc < M, other=-1)
        ok = (idc >= 0) & (idc < V)
        gk = tl.load(g_row + kc, mask=kc < M, other=0.0)
        xk = _scaled(tl.load(l_row + idc, mask=ok & (idc < v_read), other=neg_inf), it)
        tl.store(v_row + kc, it * (gk - big_g * tl.exp(xk - lse)), mask=kc < M)
    tl.debug_barrier()

    # 2. The dense part everywhere: one read, one write, rounded once to the output dtype.
    coef = -(big_g * it)
    cols0 = tl.arange(0, BLOCK)
    for start in range(0, V, BLOCK):
        cols = start + cols0
        x = _scaled(tl.load(l_row + cols, mask=cols < v_read, other=neg_inf), it)
        tl.store(o_row + cols, (coef * tl.exp(x - lse)).to(dt), mask=cols < V)
    tl.debug_barrier()  # orders step 3's stores after step 2's within the program

    # 3. Overwrite the id columns with their complete values.
    for c0 in range(0, M, ID_CHUNK):
        kc = c0 + tl.arange(0, ID_CHUNK)
        idc = tl.load(ids_row + kc, mask=kc < M, other=-1)
        val = tl.load(v_row + kc, mask=kc < M, other=0.0)
        tl.store(o_row + idc, val.to(dt), mask=(idc >= 0) & (idc < V))


@triton.jit
def _rule(lr, lo, hi, clamp, clip_lo, clip_hi, BAND: tl.constexpr, EXP: tl.constexpr):
    """``f(lr)`` of :func:`row_loss_grad`'s rule, elementwise, in ``lr``'s dtype (fp32, or fp64 for the head term's
    ``alpha``): ``1[lo <= lr <= hi]`` (``BAND``) times ``exp(clip(clip(lr, -clamp, clamp), clip_lo, clip_hi))``
    (``EXP``), 1 without either."""
    f = tl.where(lr == lr, 1.0, 1.0).to(lr.dtype)
    if EXP:
        f = tl.exp(tl.minimum(tl.maximum(tl.minimum(tl.maximum(lr, -clamp), clamp), clip_lo), clip_hi))
    if BAND:
        f = tl.where((lr >= lo) & (lr <= hi), f, 0.0)
    return f


@triton.jit
def _head_chunk(l_row, ids_row, lq_row, c0, K, v_end, V, it, lse, K_CHUNK: tl.constexpr):
    """One chunk of a row's head entries: ``(ids, valid, lp, lq, p, q)`` with ``lp = x[id] - lse``,
    ``p = exp(lp)`` and ``q = exp(lq)`` (0 at padding), as the loss forms them from the gathered log-probabilities."""
    kc = c0 + tl.arange(0, K_CHUNK)
    in_k = kc < K
    idc = tl.load(ids_row + kc, mask=in_k, other=-1)
    valid = (idc >= 0) & (idc < V)
    xk = _scaled(tl.load(l_row + idc, mask=valid & (idc < v_end), other=float("-inf")), it)
    lpk = xk - lse
    lqk = tl.load(lq_row + kc, mask=in_k & valid, other=0.0)  # padding: q = 0 below, no -inf - -inf
    pk = tl.where(valid, tl.exp(lpk), 0.0)
    qk = tl.where(valid, tl.exp(lqk), 0.0)
    return idc, valid, lpk, lqk, pk, qk


@triton.jit
def _head_grad(lpk, lqk, pk, qk, valid, alpha, neg_coef, band_lo, band_hi, clamp, clip_lo, clip_hi,
               BAND: tl.constexpr, EXP: tl.constexpr):
    """The upstream gradient of each head entry's log-probability, ``-coef c`` with ``c = m - alpha p``,
    ``m = q f(lp - lq)`` (0 where ``q = 0``), and 0 where ``c = 0`` or ``lp = -inf``. ``alpha p`` is one rounded
    product (``fma(alpha, p, 0)``, not contracted into the subtraction), as torch forms it."""
    f = _rule(lpk - lqk, band_lo, band_hi, clamp, clip_lo, clip_hi, BAND, EXP)
    mk = tl.where(qk > 0.0, qk * f, 0.0)
    ck = tl.where(valid, mk - tl.fma(pk, alpha, 0.0), 0.0)
    return tl.where((ck != 0.0) & (lpk > float("-inf")), neg_coef * ck, 0.0)


@triton.jit
def _row_loss_grad_kernel(
    logits_ptr,
    stride_lrow,
    out_ptr,
    stride_orow,
    target_ptr,
    inv_temp_ptr,
    skip_ptr,
    coef_ptr,
    shift_ptr,
    head_ids_ptr,
    head_lq_ptr,
    rule64_ptr,
    m_ptr,
    s_ptr,
    t_ptr,
    lse_ptr,
    g_ptr,
    band_lo,
    band_hi,
    clamp,
    clip_lo,
    clip_hi,
    V,
    K,
    BAND: tl.constexpr,
    EXP: tl.constexpr,
    HEAD: tl.constexpr,
    HAS_SKIP: tl.constexpr,
    BLOCK: tl.constexpr,
    K_CHUNK: tl.constexpr,
    INT64: tl.constexpr,
):
    """Statistics, then the gradient of the row's first-id log-probability under a closed-form coefficient (and,
    with ``HEAD``, of its head entries' log-probabilities), in one program per row: the second read of the row,
    right after the first, finds it in L2 while the rows in flight (the programs resident at once) fit there (see
    :data:`_TWO_PASS_WARPS`).

    The head term (``HEAD``), and why it fits in this program. The loss of a row is

        L = coef (w lp_y - sum_k c_k lp_k),   w = f(lp_y - shift),   c_k = m_k - alpha p_k   (w, c held constant)
        m_k = q_k f(lp_k - lq_k),   alpha = rho f(-log rho),   rho = max(1 - Q, eps) / max(1 - P, eps)
        P = sum_k p_k,   Q = sum_k q_k,   p_k = exp(lp_k),   q_k = exp(lq_k),   lp_v = x_v - lse

    over the row's K head entries (ids, lq). With ``d lp_u / d x_v = 1[u = v] - p_v`` and ``dx / dz = it``:

        dz_v = it (sum_j g_j 1[v = id_j] - G p_v),   g_y = coef w,   g_k = -coef c_k,   G = g_y + sum_k g_k

    Every quantity on the right is a function of ``lse`` (known when the statistics loop ends) and of the row's
    ``1 + K`` gathered logits, so: (a) one sweep over the K entries (gathered; in L2 after the statistics read)
    gives ``P`` and ``Q`` (in float64: ``1 - P`` and ``1 - Q`` cancel near 1), hence ``rho`` and ``alpha``
    (float64, then fp32, as the loss forms them); (b) a second sweep gives every ``g_k`` and ``G``; the dense part
    ``-it G p_v`` is then written in the one streaming pass over V; (c) after it, a third sweep over the K entries
    recomputes ``g_k`` (the same arithmetic, so the same values) and overwrites each id column with its complete
    value ``it (g_k [+ g_y if id_k = y] - G p_k)``, rounded once; the target's column is written the same way when
    ``y`` is no head id. ``O(K)`` work and ``3 K`` gathered logits per row beside the ``2 V`` of the row: no extra
    pass over V and no scratch. Head ids are unique within a row (the record contract, which ``Candidates.validate``
    checks): with a repeated id one of its entries' values is written. A row takes gradient when ``coef != 0`` and
    its ``lse`` is finite, even when ``w = 0`` (``lp_y = -inf`` or outside the band: the head term stays)."""
    neg_inf = float("-inf")
    dt = out_ptr.dtype.element_ty
    cols0 = tl.arange(0, BLOCK)
    row = tl.program_id(0)
    if INT64:
        row = row.to(tl.int64)
    it = tl.load(inv_temp_ptr + row)
    v_end = V
    if HAS_SKIP:
        v_end = tl.where(tl.load(skip_ptr + row) != 0, 0, V)
    l_row = logits_ptr + row * stride_lrow
    o_row = out_ptr + row * stride_orow
    # 1. Statistics: the only read of the row from memory.
    m, s, t, _q = _row_stats_loop(l_row, it, v_end, V, BLOCK, False)
    lse = tl.where(s != 0.0, m + tl.log(tl.where(s != 0.0, s, 1.0)), float("inf"))  # NaN stays NaN
    # 2. The coefficient g = coef * f(lp - shift) of the first id's log-probability lp = x_y - lse.
    y = tl.load(target_ptr + row)
    y_ok = (y >= 0) & (y < v_end)
    x_y = _scaled(tl.load(l_row + y, mask=y_ok, other=neg_inf), it)
    lp = x_y - lse
    lr = lp - tl.load(shift_ptr + row)
    f = _rule(lr, band_lo, band_hi, clamp, clip_lo, clip_hi, BAND, EXP)
    coef = tl.load(coef_ptr + row)
    mass = (lse < float("inf"))  # also False on a NaN lse
    live = (coef != 0.0) & (lp > neg_inf) & mass  # also False on a NaN lp
    g = tl.where(live, coef * f, 0.0)
    g = tl.where(g == g, g, 0.0)
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, s)
    tl.store(t_ptr + row, t)
    tl.store(lse_ptr + row, lse)
    tl.store(g_ptr + row, g)
    big_g = g
    if HEAD:
        # 2b. The head term (docstring): P, Q -> rho, alpha; then every g_k and G. Rows without gradient run no
        #     iteration (k_end = 0).
        row_live = (coef != 0.0) & mass
        k_end = tl.where(row_live, K, 0)
        ids_row = head_ids_ptr + row * K
        lq_row = head_lq_ptr + row * K
        lse_h = tl.where(row_live, lse, 0.0)
        p_head = tl.zeros([], tl.float64)
        q_head = tl.zeros([], tl.float64)
        for c0 in range(0, k_end, K_CHUNK):
            _i, _v, _lp, _lq, pk, qk = _head_chunk(l_row, ids_row, lq_row, c0, K, v_end, V, it, lse_h, K_CHUNK)
            p_head += tl.sum(pk.to(tl.float64), 0)
            q_head += tl.sum(qk.to(tl.float64), 0)
        eps = tl.load(rule64_ptr + 5)
        rho = tl.maximum(1.0 - q_head, eps) / tl.maximum(1.0 - p_head, eps)
        f64 = _rule(-tl.log(rho), tl.load(rule64_ptr + 0), tl.load(rule64_ptr + 1), tl.load(rule64_ptr + 2),
                    tl.load(rule64_ptr + 3), tl.load(rule64_ptr + 4), BAND, EXP)
        alpha = (rho * f64).to(tl.float32)
        neg_coef = -coef
        y_in = tl.zeros([], tl.int32)
        for c0 in range(0, k_end, K_CHUNK):
            idc, valid, lpk, lqk, pk, qk = _head_chunk(l_row, ids_row, lq_row, c0, K, v_end, V, it, lse_h, K_CHUNK)
            gk = _head_grad(lpk, lqk, pk, qk, valid, alpha, neg_coef, band_lo, band_hi, clamp, clip_lo, clip_hi,
                            BAND, EXP)
            big_g += tl.sum(gk, 0)
            y_in = tl.maximum(y_in, tl.max((valid & (idc == y)).to(tl.int32), 0))
    # 3. dz = it (scatter(g at ids) - G p_v): the dense part from the second read (L2), one write; a row with G = 0
    #    is not read again and gets zeros there.
    v_read = tl.where(big_g != 0.0, V, 0)
    lse_r = tl.where(big_g != 0.0, lse, 0.0)
    dense = -(big_g * it)
    for start in range(0, V, BLOCK):
        cols = start + cols0
        x = _scaled(tl.load(l_row + cols, mask=cols < v_read, other=neg_inf), it)
        tl.store(o_row + cols, (dense * tl.exp(x - lse_r)).to(dt), mask=cols < V)
    tl.debug_barrier()  # the id columns' stores below land after the dense stores of their columns
    if HEAD:
        for c0 in range(0, k_end, K_CHUNK):
            idc, valid, lpk, lqk, pk, qk = _head_chunk(l_row, ids_row, lq_row, c0, K, v_end, V, it, lse_h, K_CHUNK)
            gk = _head_grad(lpk, lqk, pk, qk, valid, alpha, neg_coef, band_lo, band_hi, clamp, clip_lo, clip_hi,
                            BAND, EXP)
            gk = tl.where(idc == y, gk + g, gk)
            tl.store(o_row + idc, (it * (gk - big_g * pk)).to(dt), mask=valid)
        y_alone = y_in == 0
    else:
        y_alone = True
    val = tl.where(g != 0.0, it * (g - big_g * tl.exp(x_y - tl.where(g != 0.0, lse, 0.0))), 0.0)
    tl.store(o_row + y, val.to(dt), mask=(y >= 0) & (y < V) & (g != 0.0) & y_alone)


def is_interpreted() -> bool:
    """True when these kernels were built for Triton's CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_row_stats_kernel, InterpretedFunction)


def _check_rows(name: str, x: Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [N, V], got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"{name} must have unit stride along V, got strides {x.stride()}")
    if x.device.type == "cpu" and not is_interpreted():
        raise RuntimeError(
            f"{name} is on the CPU but the Triton kernels were compiled for a GPU; set TRITON_INTERPRET=1 "
            "before offpolicy.kernels is imported to run them in Triton's interpreter"
        )


def _vector(name: str, x: Tensor, n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    if x.shape != (n,) or x.dtype != dtype or x.device != device:
        raise ValueError(f"{name} must be [{n}] {dtype} on {device}, got {tuple(x.shape)} {x.dtype} on {x.device}")
    return x.contiguous()


def launch_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Makes ``device`` current for a launch (Triton launches on the current CUDA device and stream; a process may
    drive several GPUs). A no-op off CUDA (the interpreter's CPU tensors, meta tensors)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def unique_ids(ids: Tensor, grad: Tensor, v: int) -> tuple[Tensor, Tensor]:
    """Per row, the distinct ids in ``[0, v)`` with the sum of their ``grad``, then ``-1`` / 0 padding.

    ``O(M log M)`` per row (a sort and a segmented sum), so the kernel needs no id-by-id comparison.

    Args:
        ids: ``[N, M]`` int64; ids outside ``[0, v)`` are dropped.
        grad: ``[N, M]`` fp32.

    Returns:
        ``(ids [N, M] int64, grad [N, M] fp32)``, each distinct id once.
    """
    if ids.shape[1] == 0:
        return ids, grad
    ids = torch.where((ids >= 0) & (ids < v), ids, -1)
    sorted_ids, order = ids.sort(dim=1)
    g = torch.where(sorted_ids >= 0, grad.gather(1, order), 0.0)
    first = torch.ones_like(sorted_ids, dtype=torch.bool)
    first[:, 1:] = sorted_ids[:, 1:] != sorted_ids[:, :-1]
    seg = first.cumsum(1) - 1  # the index of each entry's distinct id in its row
    out_g = torch.zeros_like(g).scatter_add_(1, seg, g)
    out_ids = torch.full_like(sorted_ids, -1).scatter_(1, seg, sorted_ids)  # equal values land on each slot
    return out_ids, out_g


def _tile(v: int, block: int | None, num_warps: int | None) -> tuple[int, int]:
    default = _INTERPRETER_BLOCK if is_interpreted() else _GPU_BLOCK
    block = block or min(default, triton.next_power_of_2(max(v, 16)))
    if block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    return block, num_warps or _GPU_WARPS


def _needs_int64(n: int, *tensors: Tensor) -> bool:
    return any(n * max(t.stride(0), t.shape[1]) >= _INT32_LIMIT for t in tensors)


def row_stats(
    logits: Tensor,
    inv_temp: Tensor,
    skip: Tensor | None = None,
    *,
    block: int | None = None,
    num_warps: int | None = None,
    sum_p2: bool = False,
) -> tuple[Tensor, ...]:
    """Per-row ``(m, s, t)`` of ``x = logits * inv_temp`` in one read (see the module docstring).

    Args:
        logits: ``[N, V]`` fp32/fp16/bf16, any row stride, unit column stride.
        inv_temp: ``[N]`` fp32.
        skip: ``[N]`` bool or None; skipped rows are not read and give ``m = s = t = 0``.
        block, num_warps: tile width (a power of two) and warps per program; defaults suit a GPU.
        sum_p2: also return ``q [N] = sum exp(2 (x - m))`` from the same pass.

    Returns:
        ``m [N]`` (0 where the row is all ``-inf`` or skipped), ``s [N]``, ``t [N]``, then ``q [N]`` with
        ``sum_p2`` (0 on skipped rows), fp32.
    """
    _check_rows("logits", logits)
    n, v = logits.shape
    dev = logits.device
    inv_temp = _vector("inv_temp", inv_temp, n, torch.float32, dev)
    m, s, t = (torch.zeros(n, dtype=torch.float32, device=dev) for _ in range(3))
    q = torch.zeros(n, dtype=torch.float32, device=dev) if sum_p2 else None
    stats = (m, s, t) if q is None else (m, s, t, q)
    if n == 0 or v == 0:
        return stats
    if skip is not None:
        skip = _vector("skip", skip, n, torch.bool, dev).view(torch.uint8)
    block, num_warps = _tile(v, block, num_warps)
    with launch_device(dev):
        _row_stats_kernel[(n,)](
            logits, logits.stride(0), inv_temp, skip if skip is not None else inv_temp, m, s, t,
            q if q is not None else t, v, HAS_SKIP=skip is not None, SUM_P2=sum_p2, BLOCK=block,
            INT64=_needs_int64(n, logits), num_warps=num_warps, enable_fp_fusion=_FP_FUSION,
        )  # fmt: skip
    return stats


def row_grad(
    logits: Tensor,
    ids: Tensor,
    inv_temp: Tensor,
    lse: Tensor,
    grad: Tensor,
    grad_sum: Tensor,
    out: Tensor,
    *,
    block: int | None = None,
    num_warps: int | None = None,
) -> Tensor:
    """Write ``dz = inv_temp * (scatter(grad at ids) - grad_sum * exp(logits * inv_temp - lse))`` into ``out``.

    Args:
        logits: ``[N, V]`` fp32/fp16/bf16, any row stride, unit column stride.
        ids: ``[N, M]`` int64 column ids; ``-1`` (or any id outside ``[0, V)``) contributes nothing.
            Repeated ids add their ``grad``.
        inv_temp: ``[N]`` fp32.
        lse: ``[N]`` fp32; ``+inf`` means the dense part of the row is 0 (the row's logits are not read).
        grad: ``[N, M]`` fp32.
        grad_sum: ``[N]`` fp32, the ``G`` of the formula.
        out: ``[N, V]`` of the logits' dtype, unit column stride; may be ``logits`` itself. In-place use
            overwrites the logits and bypasses autograd's version counter, so nothing else may need them.
        block, num_warps: tile width (a power of two) and warps per program; defaults suit a GPU.

    Returns:
        ``out``.
    """
    _check_rows("logits", logits)
    _check_rows("out", out)
    n, v = logits.shape
    dev = logits.device
    if out.shape != logits.shape or out.dtype != logits.dtype or out.device != dev:
        raise ValueError(f"out must match logits ({tuple(logits.shape)} {logits.dtype}), got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")  # fmt: skip
    if ids.dim() != 2 or ids.shape[0] != n or ids.dtype != torch.int64 or ids.device != dev:
        raise ValueError(f"ids must be [{n}, M] int64 on {dev}, got {tuple(ids.shape)} {ids.dtype} on {ids.device}")
    mm = ids.shape[1]
    if grad.shape != ids.shape or grad.dtype != torch.float32 or grad.device != dev:
        raise ValueError(f"grad must be [{n}, {mm}] float32 on {dev}, got {tuple(grad.shape)} {grad.dtype}")
    inv_temp = _vector("inv_temp", inv_temp, n, torch.float32, dev)
    lse = _vector("lse", lse, n, torch.float32, dev)
    grad_sum = _vector("grad_sum", grad_sum, n, torch.float32, dev)
    if n == 0 or v == 0:
        return out
    ids, grad = unique_ids(ids, grad, v)
    vals = torch.empty(n, mm, dtype=torch.float32, device=dev)
    block, num_warps = _tile(v, block, num_warps)
    with launch_device(dev):
        _row_grad_kernel[(n,)](
            logits, logits.stride(0), out, out.stride(0), ids, grad, vals, inv_temp, lse, grad_sum, v, mm,
            BLOCK=block, ID_CHUNK=_ID_CHUNK, INT64=_needs_int64(n, logits, out, ids), num_warps=num_warps,
            enable_fp_fusion=_FP_FUSION,
        )  # fmt: skip
    return out


#: The two-pass kernel's tile: 32 warps (1024 threads, the most a program may have) and 8 elements per thread per
#: step. At more than 32 registers per thread (every compiled variant: docs/performance.md) one program fills an
#: SM's register file, so one row per SM is in flight: 132 x 304 KB = 40 MB at the headline (bf16, V = 151936) on
#: an H100, inside its 50 MB L2, so the gradient pass re-reads the row from L2. (A persistent grid would bound this
#: explicitly, but its row loop carries the cross-warp reductions' predicated shared loads from one row to the
#: next, and ptxas spills them.)
_TWO_PASS_BLOCK, _TWO_PASS_WARPS = 8192, 32
#: Head entries per step of the two-pass kernel's head sweeps (one vector over the program's 1024 threads).
_HEAD_CHUNK = 256


def row_loss_grad(
    logits: Tensor,
    target: Tensor,
    inv_temp: Tensor,
    skip: Tensor | None,
    coef: Tensor,
    shift: Tensor,
    out: Tensor,
    *,
    band: tuple[float, float] | None = None,
    exp_clip: tuple[float, float, float] | None = None,
    head: tuple[Tensor, Tensor] | None = None,
    tail_eps: float = 1e-6,
    block: int | None = None,
    num_warps: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The statistics of each row and the gradient of a closed-form function of its log-probabilities, in one
    program: the row is read once from memory for the statistics, re-read (from L2) and the gradient written once.

    With ``x = logits * inv_temp``, ``lse = m + log s`` and ``lp = x[target] - lse``, each row's coefficient is

        g = coef * f(lp - shift),   f(l) = 1[lo <= l <= hi] (with ``band=(lo, hi)``)
                                        * exp(clip(clip(l, -c, c), a, b)) (with ``exp_clip=(c, a, b)``; else 1)

    and ``out = inv_temp * (g 1[v = target] - g exp(x - lse))``, the gradient of ``sum_rows g lp`` with ``g``
    held constant. ``g = 0`` (and a zero row, not read again) where ``coef = 0``, ``lp = -inf``, the row has no
    mass (skipped, all ``-inf``) or its ``lse`` is NaN.

    With ``head = (ids, lq)`` each row also has ``K`` head entries, and the gradient is that of
    ``sum_rows coef (f(lp - shift) lp - sum_k c_k lp_k)`` with every coefficient held constant:
    ``lp_k = x[ids_k] - lse``, ``p_k = exp(lp_k)``, ``q_k = exp(lq_k)``, ``c_k = q_k f(lp_k - lq_k) - alpha p_k``
    (``q_k f = 0`` where ``q_k = 0``; a term with ``c_k = 0`` or ``lp_k = -inf`` is 0),
    ``alpha = rho f(-log rho)``, ``rho = max(1 - sum q, eps) / max(1 - sum p, eps)`` (``P``, ``Q``, ``rho`` and
    ``alpha`` in float64, ``alpha`` then rounded to fp32): the same program, ``O(K)`` more work per row (the
    derivation is in the kernel's docstring). A row with ``coef != 0`` and mass takes this gradient even where
    ``lp = -inf``.

    Args:
        logits: ``[N, V]`` fp32/fp16/bf16, any row stride, unit column stride.
        target: ``[N]`` int64 column ids (``-1`` or any id outside ``[0, V)``: ``lp = -inf``).
        inv_temp: ``[N]`` fp32.
        skip: ``[N]`` bool or None; skipped rows are not read (``m = s = t = 0``, ``lse = +inf``, zero gradient).
        coef, shift: ``[N]`` fp32.
        out: ``[N, V]`` of the logits' dtype, unit column stride, not overlapping ``logits``.
        band: ``(lo, hi)`` inclusive bounds on ``l`` (``-inf`` / ``inf`` allowed), or None.
        exp_clip: ``(c, a, b)``: ``f`` includes ``exp`` of ``l`` clipped to ``[-c, c]`` then to ``[a, b]``.
        head: ``(ids [N, K] int64, lq [N, K] fp32)``: ids in ``[0, V)`` and unique within a row, or ``-1``
            (padding, whose ``lq`` is not read); or None.
        tail_eps: the ``eps`` of ``rho`` (``> 0``).
        block, num_warps: tile width (a power of two) and warps per program; defaults suit a GPU.

    Returns:
        ``(m, s, t, lse, g)``, each ``[N]`` fp32 (``m, s, t`` as :func:`row_stats`; ``g`` the target's
        coefficient); ``out`` holds the gradient.
    """
    _check_rows("logits", logits)
    _check_rows("out", out)
    n, v = logits.shape
    dev = logits.device
    if out.shape != logits.shape or out.dtype != logits.dtype or out.device != dev:
        raise ValueError(f"out must match logits ({tuple(logits.shape)} {logits.dtype}), got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")  # fmt: skip
    target = _vector("target", target, n, torch.int64, dev)
    inv_temp = _vector("inv_temp", inv_temp, n, torch.float32, dev)
    coef = _vector("coef", coef, n, torch.float32, dev)
    shift = _vector("shift", shift, n, torch.float32, dev)
    if band is not None and (len(band) != 2 or not band[0] <= band[1]):
        raise ValueError(f"band must be (lo, hi) with lo <= hi, got {band!r}")
    if exp_clip is not None and (len(exp_clip) != 3 or not exp_clip[0] >= 0 or not exp_clip[1] <= exp_clip[2]):
        raise ValueError(f"exp_clip must be (c, a, b) with c >= 0 and a <= b, got {exp_clip!r}")
    if not tail_eps > 0:
        raise ValueError(f"tail_eps must be > 0, got {tail_eps!r}")
    head_ids = head_lq = None
    if head is not None:
        head_ids, head_lq = head
        if head_ids.dim() != 2 or head_ids.shape[0] != n or head_ids.dtype != torch.int64 or head_ids.device != dev:
            raise ValueError(f"head ids must be [{n}, K] int64 on {dev}, got {tuple(head_ids.shape)} "
                             f"{head_ids.dtype} on {head_ids.device}")
        if head_lq.shape != head_ids.shape or head_lq.dtype != torch.float32 or head_lq.device != dev:
            raise ValueError(f"head lq must be [{n}, {head_ids.shape[1]}] float32 on {dev}, got "
                             f"{tuple(head_lq.shape)} {head_lq.dtype} on {head_lq.device}")
        head_ids, head_lq = head_ids.contiguous(), head_lq.contiguous()
    m, s, t, lse, g = (torch.zeros(n, dtype=torch.float32, device=dev) for _ in range(5))
    if n == 0:
        return m, s, t, lse, g
    if v == 0:
        lse.fill_(float("inf"))
        return m, s, t, lse, g
    if skip is not None:
        skip = _vector("skip", skip, n, torch.bool, dev).view(torch.uint8)
    lo, hi = band if band is not None else (0.0, 0.0)
    c, a, b = exp_clip if exp_clip is not None else (0.0, 0.0, 0.0)
    k = head_ids.shape[1] if head_ids is not None else 0
    rule64 = (torch.tensor([lo, hi, c, a, b, tail_eps], dtype=torch.float64, device=dev) if head is not None
              else inv_temp)
    default = _INTERPRETER_BLOCK if is_interpreted() else _TWO_PASS_BLOCK
    block, num_warps = _tile(v, block or min(default, triton.next_power_of_2(max(v, 16))),
                             num_warps or _TWO_PASS_WARPS)
    with launch_device(dev):
        _row_loss_grad_kernel[(n,)](
            logits, logits.stride(0), out, out.stride(0), target, inv_temp, skip if skip is not None else inv_temp,
            coef, shift, head_ids if head_ids is not None else target, head_lq if head_lq is not None else shift,
            rule64, m, s, t, lse, g, float(lo), float(hi), float(c), float(a), float(b), v, k,
            BAND=band is not None, EXP=exp_clip is not None, HEAD=head is not None, HAS_SKIP=skip is not None,
            BLOCK=block, K_CHUNK=_HEAD_CHUNK, INT64=_needs_int64(n, logits, out), num_warps=num_warps,
            enable_fp_fusion=_FP_FUSION,
        )  # fmt: skip
    return m, s, t, lse, g

