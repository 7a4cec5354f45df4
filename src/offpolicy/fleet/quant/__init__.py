"""Weight-sync quantisation: FP8 (128x128 blocks), NVFP4 and MXFP4, with packed storage, dequantisation and
fake quantisation of whole modules (to simulate low-precision samplers on CPU).

    from offpolicy.fleet.quant import quantize, dequantize, fake_quantize, fake_quantize_module
    qt = quantize(w, "nvfp4")            # packed uint8 + scales
    w_hat = dequantize(qt)               # back to w's dtype and shape
    sampler = fake_quantize_module(model, "nvfp4")   # a quantised copy

Triton kernels for the same formats live in ``offpolicy.kernels.blockwise_quant`` (GPU); round-trip error measurements in
``offpolicy.fleet.quant.error_report`` (``python -m offpolicy.fleet.quant.error_report``).
"""

from offpolicy.fleet.quant.blockwise import (
    BITS_PER_ELEMENT,
    BLOCKS,
    QuantizedTensor,
    dequantize,
    quantize,
    quantize_fp8_blockwise,
    quantize_mxfp4,
    quantize_nvfp4,
)
from offpolicy.fleet.quant.fake import FAKE_FORMATS, fake_quantize, fake_quantize_module
from offpolicy.fleet.quant.formats import E2M1_VALUES, E4M3_MAX

__all__ = [
    "BITS_PER_ELEMENT",
    "BLOCKS",
    "E2M1_VALUES",
    "E4M3_MAX",
    "FAKE_FORMATS",
    "QuantizedTensor",
    "dequantize",
    "fake_quantize",
    "fake_quantize_module",
    "quantize",
    "quantize_fp8_blockwise",
    "quantize_mxfp4",
    "quantize_nvfp4",
]
