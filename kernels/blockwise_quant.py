"""Block-scaled weight quantisation in Triton: FP8 E4M3 with 128x128 tile scales, NVFP4 and MXFP4.

Bit-exact with the torch reference (``offpolicy.fleet.quant.blockwise``). Every rounding is done arithmetically on
fp32 and the codes are stored as uint8, without Triton's fp32 -> fp8 conversion (which the CPU interpreter
cannot run):

* E4M3 round-to-nearest-even: with ``e = max(floor(log2|x|), -6)`` (read from the fp32 exponent bits) and the
  exact power of two ``step = 2**(e - 3)`` (built from bits), ``rne(|x| / step)`` is computed with the
  magic-number trick ``(y + 1.5 * 2**23) - 1.5 * 2**23`` (exact RNE for ``0 <= y < 2**22``; here ``y < 16``),
  then saturated at 448. The byte is ``sign << 7 | (e + 7) << 3 | mantissa`` (exponent field 0 for
  subnormals).
* E2M1: the code is the number of midpoints ``(0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5)`` below ``|x|``, ties going
  to the even code, so ``>`` or ``>=`` alternate; two codes per byte, element ``2 i`` in the low nibble.
* E8M0: ``floor(log2(amax)) - 2`` read from the exponent bits, clamped to ``[-127, 127]`` and biased by 127.

Layouts (``x`` is ``[M, N]`` fp32/fp16/bf16, contiguous):
``fp8``: ``data [M, N]`` uint8, ``scales [ceil(M/128), ceil(N/128)]`` fp32.
``nvfp4``: ``data [M, Np/2]`` uint8, ``scales [M, Np/16]`` uint8 (E4M3 bits), ``tensor_scale`` fp32 scalar.
``mxfp4``: ``data [M, Np/2]`` uint8, ``scales [M, Np/32]`` uint8 (E8M0), ``Np`` = ``N`` rounded up to the block.

FMA contraction is off on every launch (explicit: Triton 3.10 changes the default), so that each rounding is the
one written. These kernels know nothing about what the weights are for.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from torch import Tensor

_E4M3_MAX: tl.constexpr = tl.constexpr(448.0)
_MAGIC: tl.constexpr = tl.constexpr(12582912.0)  # 1.5 * 2**23
_TWO_POW_M127: tl.constexpr = tl.constexpr(5.877471754111438e-39)
#: Rows of an FP8 tile quantised at once (a 128 x 128 tile in one step spills at 4 warps).
_FP8_STRIP = 32


@triton.jit
def _exp_field(a):
    """Unbiased fp32 exponent of ``a >= 0`` (``-127`` for zero and subnormals)."""
    return ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@triton.jit
def _pow2(e):
    """``2**e`` for integer ``e`` in the fp32 normal range, built exactly from its bits."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round_e4m3(x):
    """fp32 -> nearest E4M3 value (RNE, saturating at 448), as fp32."""
    a = tl.abs(x)
    e = tl.maximum(_exp_field(a), -6)
    step = _pow2(e - 3)
    r = ((a / step + _MAGIC) - _MAGIC) * step
    r = tl.minimum(r, _E4M3_MAX)
    return tl.where(x < 0, -r, r)


@triton.jit
def _e4m3_bits(v, x):
    """Bits of the exact E4M3 value ``v`` (from :func:`_round_e4m3`); the sign comes from ``x``."""
    a = tl.abs(v)
    e = _exp_field(a)
    normal = e >= -6
    ec = tl.maximum(e, -6)
    scaled = a / _pow2(ec - 3)
    mant = tl.where(normal, scaled - 8.0, scaled).to(tl.int32)
    field = tl.where(normal, ec + 7, 0)
    sign = (x.to(tl.int32, bitcast=True) >> 31) & 1
    return ((sign << 7) | (field << 3) | mant).to(tl.uint8)


@triton.jit
def _e4m3_value(bits):
    b = bits.to(tl.int32)
    field = (b >> 3) & 0xF
    mant = (b & 0x7).to(tl.float32)
    mag = tl.where(field == 0, mant * 0.001953125, (1.0 + mant * 0.125) * _pow2(field - 7))
    return tl.where(((b >> 7) & 1) == 1, -mag, mag)


@triton.jit
def _e8m0_value(code):
    """``2**(code - 127)``; code 0 is ``2**-127``, an fp32 subnormal that has no exponent-bits form."""
    return tl.where(code >= 1, _pow2(code - 127), _TWO_POW_M127)


@triton.jit
def _e2m1_code(q):
    a = tl.abs(q)
    code = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
    code += (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32)
    sign = ((q < 0) & (code > 0)).to(tl.int32)
    return code | (sign << 3)


@triton.jit
def _e2m1_value(code):
    c = code & 7
    e = c >> 1
    m = (c & 1).to(tl.float32)
    mag = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * _pow2(e - 1))
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def _fp8_quant_kernel(x_ptr, q_ptr, s_ptr, M, N, n_cb, BLOCK: tl.constexpr, SUB: tl.constexpr):
    """One ``BLOCK x BLOCK`` tile in ``SUB``-row strips: the amax over the strips, then each strip quantised (its
    second read hits the cache). A whole tile in registers spills at 4 warps."""
    pid = tl.program_id(0)
    bi, bj = pid // n_cb, pid % n_cb
    cols = bj * BLOCK + tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], tl.float32)
    for r0 in range(0, BLOCK, SUB):
        rows = bi * BLOCK + r0 + tl.arange(0, SUB)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        offs = rows[:, None].to(tl.int64) * N + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=0))
    amax_all = tl.max(amax, axis=0)
    scale = tl.where(amax_all > 0, amax_all / _E4M3_MAX, 1.0)
    for r0 in range(0, BLOCK, SUB):
        rows = bi * BLOCK + r0 + tl.arange(0, SUB)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        offs = rows[:, None].to(tl.int64) * N + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        v = _round_e4m3(x / scale)
        tl.store(q_ptr + offs, _e4m3_bits(v, x), mask=mask)
    tl.store(s_ptr + pid, scale)


@triton.jit
def _fp8_dequant_kernel(q_ptr, s_ptr, y_ptr, M, N, n_cb, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    bi, bj = pid // n_cb, pid % n_cb
    rows = bi * BLOCK + tl.arange(0, BLOCK)
    cols = bj * BLOCK + tl.arange(0, BLOCK)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offs = rows[:, None].to(tl.int64) * N + cols[None, :]
    scale = tl.load(s_ptr + pid)
    tl.store(y_ptr + offs, _e4m3_value(tl.load(q_ptr + offs, mask=mask, other=0)) * scale, mask=mask)


@triton.jit
def _fp4_quant_kernel(
    x_ptr, q_ptr, s_ptr, ts_ptr, M, N, NP, GROUPS,
    GROUP: tl.constexpr, ROWS: tl.constexpr, GBLOCK: tl.constexpr, NVFP4: tl.constexpr,
):
    """One program: ``ROWS`` rows x ``GBLOCK`` groups of ``GROUP`` elements, as even/odd halves ``[R, G, GROUP/2]``."""
    r0 = tl.program_id(0) * ROWS
    g0 = tl.program_id(1) * GBLOCK
    rows = r0 + tl.arange(0, ROWS)
    groups = g0 + tl.arange(0, GBLOCK)
    pairs = tl.arange(0, GROUP // 2)
    col_even = groups[None, :, None] * GROUP + 2 * pairs[None, None, :]
    rmask = rows[:, None, None] < M
    gmask = groups[None, :, None] < GROUPS
    base = rows[:, None, None].to(tl.int64) * N
    xe = tl.load(x_ptr + base + col_even, mask=rmask & gmask & (col_even < N), other=0.0).to(tl.float32)
    xo = tl.load(x_ptr + base + col_even + 1, mask=rmask & gmask & (col_even + 1 < N), other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(xe), axis=2), tl.max(tl.abs(xo), axis=2))  # [R, G]
    smask = (rows[:, None] < M) & (groups[None, :] < GROUPS)
    soffs = rows[:, None].to(tl.int64) * GROUPS + groups[None, :]
    if NVFP4:
        ts = tl.load(ts_ptr)
        sb = _round_e4m3(amax / 6.0 / ts)
        eff = sb * ts
        tl.store(s_ptr + soffs, _e4m3_bits(sb, sb), mask=smask)
        pos = (eff > 0)[:, :, None]
        denom = tl.where(eff > 0, eff, 1.0)[:, :, None]
        qe = tl.where(pos, xe / denom, 0.0)
        qo = tl.where(pos, xo / denom, 0.0)
    else:
        e = tl.where(amax > 0, _exp_field(amax) - 2, -127)
        e = tl.minimum(tl.maximum(e, -127), 127)
        tl.store(s_ptr + soffs, (e + 127).to(tl.uint8), mask=smask)
        X = _e8m0_value(e + 127)[:, :, None]
        qe = xe / X
        qo = xo / X
    packed = (_e2m1_code(qe) | (_e2m1_code(qo) << 4)).to(tl.uint8)
    poffs = rows[:, None, None].to(tl.int64) * (NP // 2) + groups[None, :, None] * (GROUP // 2) + pairs[None, None, :]
    tl.store(q_ptr + poffs, packed, mask=rmask & gmask)


@triton.jit
def _fp4_dequant_kernel(
    q_ptr, s_ptr, ts_ptr, y_ptr, M, N, NP, GROUPS,
    GROUP: tl.constexpr, ROWS: tl.constexpr, GBLOCK: tl.constexpr, NVFP4: tl.constexpr,
):
    r0 = tl.program_id(0) * ROWS
    g0 = tl.program_id(1) * GBLOCK
    rows = r0 + tl.arange(0, ROWS)
    groups = g0 + tl.arange(0, GBLOCK)
    pairs = tl.arange(0, GROUP // 2)
    rmask = rows[:, None, None] < M
    gmask = groups[None, :, None] < GROUPS
    poffs = rows[:, None, None].to(tl.int64) * (NP // 2) + groups[None, :, None] * (GROUP // 2) + pairs[None, None, :]
    byte = tl.load(q_ptr + poffs, mask=rmask & gmask, other=0).to(tl.int32)
    soffs = rows[:, None].to(tl.int64) * GROUPS + groups[None, :]
    sbits = tl.load(s_ptr + soffs, mask=(rows[:, None] < M) & (groups[None, :] < GROUPS), other=0)
    if NVFP4:
        scale = _e4m3_value(sbits) * tl.load(ts_ptr)
    else:
        scale = _e8m0_value(sbits.to(tl.int32))
    ve = _e2m1_value(byte & 0xF) * scale[:, :, None]
    vo = _e2m1_value((byte >> 4) & 0xF) * scale[:, :, None]
    col_even = groups[None, :, None] * GROUP + 2 * pairs[None, None, :]
    base = rows[:, None, None].to(tl.int64) * N
    tl.store(y_ptr + base + col_even, ve, mask=rmask & gmask & (col_even < N))
    tl.store(y_ptr + base + col_even + 1, vo, mask=rmask & gmask & (col_even + 1 < N))


def _on(device: torch.device) -> contextlib.AbstractContextManager:
    """Makes ``device`` current for the launches (Triton launches on the current CUDA device); a no-op off CUDA."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _matrix(x: Tensor) -> Tensor:
    if x.dim() == 0 or x.numel() == 0 or not x.is_floating_point():
        raise ValueError(f"x must be a non-empty floating-point tensor, got {x.dtype} {tuple(x.shape)}")
    if x.device.type != "meta" and not bool(torch.isfinite(x).all()):  # meta tensors (compiling only) hold no values
        raise ValueError("x holds non-finite values (NaN or inf); they cannot be quantised")
    return x.reshape(-1, x.shape[-1]).contiguous()


def quantize_fp8(x: Tensor, block: int = 128) -> tuple[Tensor, Tensor]:
    """FP8 E4M3 with one fp32 scale per ``block x block`` tile: ``(data [M, N] uint8, scales [rb, cb] fp32)``."""
    m = _matrix(x)
    rows, cols = m.shape
    rb, cb = triton.cdiv(rows, block), triton.cdiv(cols, block)
    q = torch.empty(rows, cols, dtype=torch.uint8, device=m.device)
    s = torch.empty(rb, cb, dtype=torch.float32, device=m.device)
    with _on(m.device):
        _fp8_quant_kernel[(rb * cb,)](m, q, s, rows, cols, cb, BLOCK=block, SUB=min(block, _FP8_STRIP),
                                      enable_fp_fusion=False)
    return q, s


def dequantize_fp8(data: Tensor, scales: Tensor, block: int = 128) -> Tensor:
    """Inverse of :func:`quantize_fp8`: ``[M, N]`` fp32."""
    rows, cols = data.shape
    y = torch.empty(rows, cols, dtype=torch.float32, device=data.device)
    cb = triton.cdiv(cols, block)
    with _on(data.device):
        _fp8_dequant_kernel[(scales.numel(),)](data.contiguous(), scales.contiguous(), y, rows, cols, cb,
                                               BLOCK=block, enable_fp_fusion=False)
    return y


def _fp4_grid(rows: int, groups: int, rows_per: int, gblock: int) -> tuple[int, int]:
    return triton.cdiv(rows, rows_per), triton.cdiv(groups, gblock)


def quantize_fp4(x: Tensor, fmt: str, rows_per: int = 16, gblock: int = 8) -> tuple[Tensor, Tensor, Tensor | None]:
    """NVFP4 (``fmt="nvfp4"``, 16-element blocks) or MXFP4 (``"mxfp4"``, 32): ``(data, scales, tensor_scale)``.

    The NVFP4 per-tensor scale ``S = amax(x) / (6 * 448)`` is one torch reduction; everything else is one
    kernel pass.
    """
    if fmt not in ("nvfp4", "mxfp4"):
        raise ValueError(f"fmt must be 'nvfp4' or 'mxfp4', got {fmt!r}")
    m = _matrix(x)
    rows, cols = m.shape
    group = 16 if fmt == "nvfp4" else 32
    groups = triton.cdiv(cols, group)
    np_ = groups * group
    q = torch.empty(rows, np_ // 2, dtype=torch.uint8, device=m.device)
    s = torch.empty(rows, groups, dtype=torch.uint8, device=m.device)
    ts = None
    if fmt == "nvfp4":
        amax = m.abs().max().float()
        ts = torch.where(amax > 0, amax / (448.0 * 6.0), torch.ones_like(amax)).reshape(1)
    grid = _fp4_grid(rows, groups, rows_per, gblock)
    with _on(m.device):
        _fp4_quant_kernel[grid](m, q, s, ts if ts is not None else s, rows, cols, np_, groups,
                                GROUP=group, ROWS=rows_per, GBLOCK=gblock, NVFP4=fmt == "nvfp4", enable_fp_fusion=False)
    return q, s, (ts.reshape(()) if ts is not None else None)


def dequantize_fp4(data: Tensor, scales: Tensor, tensor_scale: Tensor | None, cols: int, fmt: str,
                   rows_per: int = 16, gblock: int = 8) -> Tensor:
    """Inverse of :func:`quantize_fp4`: ``[M, cols]`` fp32."""
    if fmt not in ("nvfp4", "mxfp4"):
        raise ValueError(f"fmt must be 'nvfp4' or 'mxfp4', got {fmt!r}")
    if fmt == "nvfp4" and tensor_scale is None:
        raise ValueError("nvfp4 needs its tensor_scale")
    rows, groups = scales.shape
    group = 16 if fmt == "nvfp4" else 32
    y = torch.empty(rows, cols, dtype=torch.float32, device=data.device)
    ts = tensor_scale.reshape(1).float() if tensor_scale is not None else scales
    grid = _fp4_grid(rows, groups, rows_per, gblock)
    with _on(data.device):
        _fp4_dequant_kernel[grid](data.contiguous(), scales.contiguous(), ts, y, rows, cols, groups * group,
                                  groups, GROUP=group, ROWS=rows_per, GBLOCK=gblock, NVFP4=fmt == "nvfp4",
                                  enable_fp_fusion=False)
    return y
