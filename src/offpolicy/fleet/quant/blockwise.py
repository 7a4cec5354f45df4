"""Block-scaled weight formats: quantise to packed storage and dequantise, in plain torch (the reference).

Formats (``x`` is a weight matrix ``[M, N]``; blocks of FP4 formats run along the last, input, dimension, the
reduction dimension of ``y = x @ W.T``):

============  ===============  ==================  ======================================================
name          element          block               scale(s)
============  ===============  ==================  ======================================================
``fp8``       E4M3 (1 byte)    128 x 128 tile      fp32 per tile, ``amax / 448`` (DeepSeek-V3 recipe)
``nvfp4``     E2M1 (4 bits)    16 along a row      E4M3 per block, times one fp32 per-tensor scale
``mxfp4``     E2M1 (4 bits)    32 along a row      E8M0 (a power of two) per block, OCP MX v1.0
============  ===============  ==================  ======================================================

Scale choice, per format:

* ``fp8``: ``s = amax(tile) / 448`` so the tile's largest magnitude maps exactly onto the largest E4M3 value;
  ``q = e4m3(x / s)``, ``x_hat = q * s``.
* ``nvfp4`` (NVIDIA's two-level recipe): per-tensor ``S = amax(x) / (6 * 448)``; per block
  ``s_b = e4m3(amax(block) / 6 / S)`` (so ``s_b <= 448``); ``q = e2m1(x / (s_b S))``, ``x_hat = q * s_b * S``.
  Because ``s_b`` is rounded, ``x / (s_b S)`` may slightly exceed 6 and saturates.
* ``mxfp4`` (OCP MX spec section 6.3): ``X = 2**(floor(log2(amax(block))) - 2)`` where 2 is E2M1's largest
  exponent; ``q = e2m1(x / X)`` with saturation at 6, ``x_hat = q * X``. The block maximum lands in [4, 8) and
  so values in (6, 8) units clip to 6: that is the spec's published algorithm, kept as is.

A shape whose last dimension is not a multiple of the block is padded with zeros for storage (zeros never
change a block's amax) and cropped on dequantisation; the FP8 tiles at the edges are partial tiles.
Tensors of other ranks are viewed as ``[-1, last]`` (a 1-D tensor is one row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from offpolicy.fleet.quant.formats import (
    E2M1_EMAX,
    E2M1_MAX,
    E4M3_MAX,
    _check_finite,
    e2m1_decode,
    e2m1_encode,
    e4m3_from_bits,
    e4m3_to_bits,
    e8m0_decode,
    e8m0_encode_exponent,
    floor_log2,
    pack_nibbles,
    round_to_e4m3,
    unpack_nibbles,
)

#: Block geometry per format: (rows, cols) of one scaling block.
BLOCKS = {"fp8": (128, 128), "nvfp4": (1, 16), "mxfp4": (1, 32)}
#: Bits of storage per element, scales included (for the documentation tables).
BITS_PER_ELEMENT = {"fp8": 8 + 32 / (128 * 128), "nvfp4": 4 + 8 / 16, "mxfp4": 4 + 8 / 32}


@dataclass(frozen=True)
class QuantizedTensor:
    """A tensor in a block-scaled format.

    Attributes:
        format: ``"fp8"``, ``"nvfp4"`` or ``"mxfp4"``.
        data: uint8 storage. ``fp8``: ``[M, N]`` E4M3 bits (view it as ``torch.float8_e4m3fn`` if wanted).
            ``nvfp4`` / ``mxfp4``: ``[M, Np / 2]`` packed E2M1 pairs, ``Np`` = ``N`` rounded up to the block.
        scales: ``fp8``: fp32 ``[ceil(M / 128), ceil(N / 128)]``. ``nvfp4``: uint8 E4M3 bits ``[M, Np / 16]``.
            ``mxfp4``: uint8 E8M0 bytes ``[M, Np / 32]``.
        tensor_scale: ``nvfp4`` only: fp32 scalar tensor ``S``; ``None`` otherwise.
        shape: the original shape.
        dtype: the original dtype (what :func:`dequantize` returns by default).
        block: ``(rows, cols)`` of one scaling block.
    """

    format: str
    data: Tensor
    scales: Tensor
    tensor_scale: Tensor | None
    shape: tuple[int, ...]
    dtype: torch.dtype
    block: tuple[int, int]

    @property
    def nbytes(self) -> int:
        """Bytes of storage, scales included."""
        n = self.data.numel() * self.data.element_size() + self.scales.numel() * self.scales.element_size()
        return n + (4 if self.tensor_scale is not None else 0)


def _as_matrix(x: Tensor, name: str) -> Tensor:
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {type(x).__name__}")
    if x.dim() == 0 or x.numel() == 0:
        raise ValueError(f"{name}: expected a non-empty tensor of rank >= 1, got shape {tuple(x.shape)}")
    m = x.detach().float().reshape(-1, x.shape[-1])
    _check_finite(m, name)
    return m


def _pad_cols(m: Tensor, multiple: int) -> Tensor:
    pad = (-m.shape[1]) % multiple
    return F.pad(m, (0, pad)) if pad else m


def quantize_fp8_blockwise(x: Tensor, block: int = 128) -> QuantizedTensor:
    """FP8 E4M3 with one fp32 scale per ``block x block`` tile (``s = amax / 448``; all-zero tile: ``s = 1``)."""
    m = _as_matrix(x, "quantize_fp8_blockwise")
    rows, cols = m.shape
    rb, cb = -(-rows // block), -(-cols // block)
    padded = F.pad(m, (0, cb * block - cols, 0, rb * block - rows))
    tiles = padded.reshape(rb, block, cb, block)
    amax = tiles.abs().amax(dim=(1, 3))
    scales = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = round_to_e4m3(tiles / scales[:, None, :, None])
    bits = e4m3_to_bits(q).reshape(rb * block, cb * block)[:rows, :cols].contiguous()
    return QuantizedTensor("fp8", bits, scales, None, tuple(x.shape), x.dtype, (block, block))


def _dequantize_fp8(qt: QuantizedTensor) -> Tensor:
    rows, cols = qt.data.shape
    br, bc = qt.block
    s = qt.scales.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:rows, :cols]
    return e4m3_from_bits(qt.data) * s


def quantize_nvfp4(x: Tensor, block: int = 16) -> QuantizedTensor:
    """NVFP4: E2M1 values in ``block``-element row blocks, E4M3 block scales and an fp32 per-tensor scale."""
    m = _pad_cols(_as_matrix(x, "quantize_nvfp4"), block)
    rows = m.shape[0]
    blocks = m.reshape(rows, -1, block)
    amax_t = m.abs().max()
    # S maps the tensor's largest magnitude onto the largest (block scale x element) product, 448 * 6.
    tensor_scale = torch.where(amax_t > 0, amax_t / (E4M3_MAX * E2M1_MAX), torch.ones_like(amax_t))
    amax_b = blocks.abs().amax(dim=2)
    s_b = round_to_e4m3(amax_b / E2M1_MAX / tensor_scale)
    eff = s_b * tensor_scale
    scaled = torch.where(eff[..., None] > 0, blocks / torch.where(eff > 0, eff, 1.0)[..., None], 0.0)
    codes = e2m1_encode(scaled).reshape(rows, -1)
    return QuantizedTensor(
        "nvfp4", pack_nibbles(codes), e4m3_to_bits(s_b), tensor_scale, tuple(x.shape), x.dtype, (1, block)
    )


def _dequantize_nvfp4(qt: QuantizedTensor) -> Tensor:
    vals = e2m1_decode(unpack_nibbles(qt.data))
    rows = vals.shape[0]
    s = e4m3_from_bits(qt.scales) * qt.tensor_scale
    return (vals.reshape(rows, -1, qt.block[1]) * s[..., None]).reshape(rows, -1)


def quantize_mxfp4(x: Tensor, block: int = 32) -> QuantizedTensor:
    """MXFP4 (OCP MX v1.0): E2M1 values in ``block``-element row blocks with one E8M0 scale each."""
    m = _pad_cols(_as_matrix(x, "quantize_mxfp4"), block)
    rows = m.shape[0]
    blocks = m.reshape(rows, -1, block)
    amax_b = blocks.abs().amax(dim=2)
    # shared exponent = floor(log2(amax)) - emax_elem; an all-zero block takes the smallest scale.
    exp = torch.where(amax_b > 0, floor_log2(amax_b) - E2M1_EMAX, torch.full_like(amax_b, -127, dtype=torch.int32))
    scale_bits = e8m0_encode_exponent(exp)
    scale = e8m0_decode(scale_bits)
    codes = e2m1_encode(blocks / scale[..., None]).reshape(rows, -1)
    return QuantizedTensor("mxfp4", pack_nibbles(codes), scale_bits, None, tuple(x.shape), x.dtype, (1, block))


def _dequantize_mxfp4(qt: QuantizedTensor) -> Tensor:
    vals = e2m1_decode(unpack_nibbles(qt.data))
    rows = vals.shape[0]
    return (vals.reshape(rows, -1, qt.block[1]) * e8m0_decode(qt.scales)[..., None]).reshape(rows, -1)


_QUANTIZERS = {"fp8": quantize_fp8_blockwise, "nvfp4": quantize_nvfp4, "mxfp4": quantize_mxfp4}
_DEQUANTIZERS = {"fp8": _dequantize_fp8, "nvfp4": _dequantize_nvfp4, "mxfp4": _dequantize_mxfp4}


def quantize(x: Tensor, fmt: str, backend: str = "torch") -> QuantizedTensor:
    """Quantise ``x`` to packed storage in format ``fmt`` (``"fp8"``, ``"nvfp4"`` or ``"mxfp4"``).

    ``backend="triton"`` runs the bit-identical kernels of ``offpolicy.kernels.blockwise_quant`` (GPU, or Triton's CPU
    interpreter with ``TRITON_INTERPRET=1``).
    """
    if fmt not in _QUANTIZERS:
        raise ValueError(f"quantize: fmt must be one of {sorted(_QUANTIZERS)}, got {fmt!r}")
    if backend == "torch":
        return _QUANTIZERS[fmt](x)
    if backend != "triton":
        raise ValueError(f"quantize: backend must be 'torch' or 'triton', got {backend!r}")
    from offpolicy.kernels import blockwise_quant as kq

    if fmt == "fp8":
        data, scales = kq.quantize_fp8(x)
        return QuantizedTensor("fp8", data, scales, None, tuple(x.shape), x.dtype, BLOCKS["fp8"])
    data, scales, ts = kq.quantize_fp4(x, fmt)
    return QuantizedTensor(fmt, data, scales, ts, tuple(x.shape), x.dtype, BLOCKS[fmt])


def dequantize(qt: QuantizedTensor, dtype: torch.dtype | None = None, backend: str = "torch") -> Tensor:
    """Decode a :class:`QuantizedTensor` to its original shape, in ``dtype`` (default: the original dtype)."""
    if qt.format not in _DEQUANTIZERS:
        raise ValueError(f"dequantize: unknown format {qt.format!r}")
    cols = qt.shape[-1]
    if backend == "torch":
        full = _DEQUANTIZERS[qt.format](qt)
    elif backend == "triton":
        from offpolicy.kernels import blockwise_quant as kq

        if qt.block != BLOCKS[qt.format]:
            raise ValueError(f"dequantize: the Triton kernels use the standard blocks {BLOCKS[qt.format]}")
        if qt.format == "fp8":
            full = kq.dequantize_fp8(qt.data, qt.scales)
        else:
            full = kq.dequantize_fp4(qt.data, qt.scales, qt.tensor_scale, cols, qt.format)
    else:
        raise ValueError(f"dequantize: backend must be 'torch' or 'triton', got {backend!r}")
    return full[:, :cols].reshape(qt.shape).to(dtype or qt.dtype)
