"""Triton quantisers (offpolicy.kernels.blockwise_quant) against the torch reference: bit-identical codes and scales.

Without a GPU the kernels run in Triton's CPU interpreter. ``TRITON_INTERPRET`` must be set before the first
``@triton.jit`` function is defined, so the checks run in a subprocess that sets it (this file run as a
script); with a GPU they run in-process on the device. What the interpreter cannot run and these kernels
therefore avoid: the fp32 -> fp8 conversion (rounding is done arithmetically, codes stored as uint8) and
``libdevice`` calls. What stays unchecked without a GPU: the compiled kernels' own codegen (GPU exp2, FTZ
behaviour on fp32 subnormals), which the in-process GPU branch covers when a device is present.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch


def run_checks(device: str) -> None:
    """Every comparison; raises AssertionError with the case on the first mismatch."""
    from offpolicy.fleet.quant import dequantize, quantize
    from offpolicy.fleet.quant.error_report import weight_like

    g = torch.Generator().manual_seed(0)
    cases = []
    for shape, kind in [((130, 200), "outlier_cols"), ((64, 96), "student_t"), ((5, 37), "gaussian"),
                        ((1, 16), "gaussian"), ((33, 64), "outlier_rows")]:
        cases.append((f"{kind}{shape}", weight_like(kind, shape, seed=1)))
    hostile = torch.randn(40, 70, generator=g) * torch.exp(torch.randn(40, 70, generator=g) * 5)
    hostile[0, :6] = torch.tensor([1e-40, -0.0, 0.0, 1e30, -1e30, 2.0**-130])
    hostile[3] = 0.0  # an all-zero row: zero blocks everywhere in it
    cases.append(("hostile", hostile))
    cases.append(("bf16", weight_like("gaussian", (48, 80), seed=2).bfloat16()))
    cases.append(("fp16", weight_like("gaussian", (16, 50), seed=3).half()))
    cases.append(("3d", torch.randn(2, 3, 40, generator=g)))
    for name, x in cases:
        x = x.to(device)
        for fmt in ("fp8", "nvfp4", "mxfp4"):
            ref, tri = quantize(x.cpu(), fmt), quantize(x, fmt, backend="triton")
            assert torch.equal(tri.data.cpu(), ref.data), (name, fmt, "codes")
            assert torch.equal(tri.scales.cpu(), ref.scales), (name, fmt, "scales")
            if ref.tensor_scale is not None:
                assert torch.equal(tri.tensor_scale.cpu(), ref.tensor_scale), (name, fmt, "tensor scale")
            back_ref = dequantize(ref, torch.float32)
            back_tri = dequantize(tri, torch.float32, backend="triton").cpu()
            assert torch.equal(back_tri, back_ref), (name, fmt, "dequantised values")
            assert back_tri.shape == x.shape


def test_triton_quantisers_match_the_reference_bit_for_bit():
    if torch.cuda.is_available():
        run_checks("cuda")
        return
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.strip().endswith("triton quant checks passed")


if __name__ == "__main__":
    run_checks("cpu")
    print("triton quant checks passed")
