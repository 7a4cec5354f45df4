"""Element and scale encodings of the low-precision weight formats, in plain torch.

Three encodings, each written from its published definition (not by calling a torch cast, so that the same
arithmetic can be mirrored in the Triton kernels, where the fp32 -> fp8 conversion is unusable under the
interpreter):

* **FP8 E4M3** ("e4m3fn", OCP 8-bit floating point spec, 2023): 1 sign, 4 exponent (bias 7), 3 mantissa bits.
  No infinities; ``S.1111.111`` is NaN, so the largest finite value is ``1.75 * 2**8 = 448``. Subnormals have
  exponent field 0 and value ``m * 2**-9``. Rounding to nearest, ties to even; values beyond 448 saturate to
  448 (the convention of every FP8 weight recipe, and of ``torch``'s own cast).
* **FP4 E2M1** (OCP Microscaling spec v1.0, section 5.3.3): 1 sign, 2 exponent (bias 1), 1 mantissa bit, no
  infinities or NaN. Magnitudes ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}`` for codes ``0..7``; the sign is bit 3. Ties
  round to the even code (the one whose mantissa bit is 0); values beyond 6 saturate to 6.
* **E8M0** (OCP MX spec, section 5.4.1): an unsigned biased exponent (bias 127) encoding ``2**(e - 127)``;
  ``0xFF`` is NaN. It can only hold powers of two.

Two FP4 codes share a byte: element ``2 i`` in the low nibble, element ``2 i + 1`` in the high nibble (the
layout of ``torch.float4_e2m1fn_x2`` storage and of the NVIDIA/OCP packed tensors).
"""

from __future__ import annotations

import torch
from torch import Tensor

#: Largest finite FP8 E4M3 ("fn") magnitude: exponent field 15, mantissa 110 -> 1.75 * 2**8.
E4M3_MAX = 448.0
#: Smallest normal E4M3 exponent (field 1, bias 7).
E4M3_MIN_NORMAL_EXP = -6
#: E4M3 mantissa bits.
E4M3_MANTISSA_BITS = 3

#: FP4 E2M1 magnitudes, indexed by the 3-bit code (sign excluded).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: Largest FP4 E2M1 magnitude.
E2M1_MAX = 6.0
#: ``floor(log2(E2M1_MAX))``, the element format's largest exponent ("emax_elem" in the MX spec).
E2M1_EMAX = 2

#: Midpoints between consecutive E2M1 magnitudes, and for each whether an exact tie goes *up* (to the even
#: code above) or stays down (the code below is even). Codes 0, 2, 4, 6 are even.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIE_UP = (False, True, False, True, False, True, False)

#: E8M0 exponent bias; code 255 is NaN, so codes 0..254 encode 2**-127 .. 2**127.
E8M0_BIAS = 127


def _check_finite(x: Tensor, name: str) -> None:
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name}: non-finite values (NaN or inf) cannot be quantised; found them in the input")


def floor_log2(x: Tensor) -> Tensor:
    """``floor(log2(|x|))`` exactly, as int32, for finite non-zero ``x`` (zeros give a large negative value).

    Uses ``frexp`` (``x = m * 2**e`` with ``0.5 <= |m| < 1``), so ``floor(log2|x|) = e - 1`` with no rounding of
    a logarithm.
    """
    _, e = torch.frexp(x.float())
    return torch.where(x == 0, torch.full_like(e, -1000), e - 1).to(torch.int32)


def round_to_e4m3(x: Tensor) -> Tensor:
    """Round fp32 values to the nearest FP8 E4M3 value (ties to even, saturating at +-448), returned as fp32.

    Derivation: a normal E4M3 number with exponent ``e`` has spacing ``2**(e - 3)``; subnormals share the
    smallest normal exponent's spacing ``2**(-6 - 3) = 2**-9``. So with ``e = max(floor(log2|x|), -6)`` the
    rounded value is ``rne(x / 2**(e-3)) * 2**(e-3)``; the division is by a power of two and so exact, and
    ``torch.round`` rounds half to even. A value that rounds up into the next binade (``15.5 -> 16`` in units of
    the spacing) is still exact because the next binade's grid contains it.
    """
    x = x.float()
    _check_finite(x, "round_to_e4m3")
    e = torch.clamp(floor_log2(x), min=E4M3_MIN_NORMAL_EXP)
    step = torch.ldexp(torch.ones_like(x), (e - E4M3_MANTISSA_BITS).to(torch.int32))
    y = torch.round(x / step) * step
    return torch.clamp(y, -E4M3_MAX, E4M3_MAX)


def e4m3_to_bits(v: Tensor) -> Tensor:
    """Encode values that are already exact E4M3 numbers (e.g. from :func:`round_to_e4m3`) as uint8 bits.

    ``bits = sign << 7 | exponent_field << 3 | mantissa``; for normals ``exponent_field = e + 7`` and
    ``mantissa = |v| / 2**(e-3) - 8``; for subnormals (``|v| < 2**-6``) the field is 0 and the mantissa is
    ``|v| / 2**-9``. Raises if a value is not representable (a caller bug, never silently rounded).
    """
    v = v.float()
    a = v.abs()
    sign = (torch.signbit(v)).to(torch.int32)
    e = floor_log2(a)
    normal = e >= E4M3_MIN_NORMAL_EXP
    e_c = torch.clamp(e, min=E4M3_MIN_NORMAL_EXP)
    scaled = torch.ldexp(a, (E4M3_MANTISSA_BITS - e_c).to(torch.int32))  # in [8, 16) for normals
    mant = torch.where(normal, scaled - 8, scaled)
    if not bool((mant == torch.round(mant)).all()) or bool((a > E4M3_MAX).any()):
        raise ValueError("e4m3_to_bits: input holds values that are not exact E4M3 numbers")
    field = torch.where(normal, e_c + 7, torch.zeros_like(e_c))
    bits = (sign << 7) | (field << 3) | mant.to(torch.int32)
    return bits.to(torch.uint8)


def e4m3_from_bits(bits: Tensor) -> Tensor:
    """Decode uint8 E4M3 bits to fp32 (``S.1111.111`` decodes to NaN)."""
    b = bits.to(torch.int32)
    sign = torch.where((b >> 7) & 1 == 1, -1.0, 1.0)
    field = (b >> 3) & 0xF
    mant = (b & 0x7).float()
    normal = torch.ldexp(1.0 + mant / 8.0, (field - 7).to(torch.int32))
    sub = torch.ldexp(mant, torch.full_like(field, -9))
    v = sign * torch.where(field == 0, sub, normal)
    return torch.where((b & 0x7F) == 0x7F, torch.full_like(v, float("nan")), v)


def e2m1_encode(x: Tensor) -> Tensor:
    """Round fp32 values to FP4 E2M1 (ties to even, saturating at +-6) and return the 4-bit codes as uint8.

    The magnitude code is the number of midpoints the magnitude lies above, counting a midpoint it sits
    exactly on only where the tie goes up to an even code (see ``_E2M1_TIE_UP``).
    """
    x = x.float()
    _check_finite(x, "e2m1_encode")
    a = x.abs()
    code = torch.zeros(x.shape, dtype=torch.int32, device=x.device)
    for mid, up in zip(_E2M1_MIDPOINTS, _E2M1_TIE_UP):
        code += (a >= mid if up else a > mid).to(torch.int32)
    sign = torch.signbit(x).to(torch.int32) & (code > 0).to(torch.int32)  # no negative zero code
    return (code | (sign << 3)).to(torch.uint8)


def e2m1_decode(codes: Tensor) -> Tensor:
    """Decode 4-bit FP4 E2M1 codes (uint8, values 0..15) to fp32."""
    c = codes.to(torch.int64)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    mag = table[c & 0x7]
    return torch.where((c >> 3) & 1 == 1, -mag, mag)


def pack_nibbles(codes: Tensor) -> Tensor:
    """Pack 4-bit codes ``[..., 2 n]`` (uint8) into bytes ``[..., n]``: element ``2 i`` in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles: the last dimension must be even, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def unpack_nibbles(packed: Tensor) -> Tensor:
    """Inverse of :func:`pack_nibbles`: bytes ``[..., n]`` -> codes ``[..., 2 n]``."""
    p = packed.to(torch.uint8)
    out = torch.stack((p & 0xF, (p >> 4) & 0xF), dim=-1)
    return out.reshape(*p.shape[:-1], 2 * p.shape[-1])


def e8m0_encode_exponent(exp: Tensor) -> Tensor:
    """Encode integer exponents ``e`` (the scale ``2**e``) as E8M0 bytes, clamping to the range [-127, 127]."""
    return (torch.clamp(exp.to(torch.int32), -E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS).to(torch.uint8)


def e8m0_decode(bits: Tensor) -> Tensor:
    """Decode E8M0 bytes to fp32 powers of two (code 255 is NaN).

    ``2**-127`` is below fp32's normal range but representable as an fp32 subnormal, so ``ldexp`` is exact.
    """
    b = bits.to(torch.int32)
    v = torch.ldexp(torch.ones(b.shape, dtype=torch.float32, device=b.device), b - E8M0_BIAS)
    return torch.where(b == 255, torch.full_like(v, float("nan")), v)
