"""Round-trip error of each format on weight-like matrices (the numbers in docs/quantisation.md).

Run ``python -m offpolicy.fleet.quant.error_report`` to print the table (a few seconds on CPU at the default size).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from offpolicy.fleet.quant.blockwise import BITS_PER_ELEMENT
from offpolicy.fleet.quant.fake import fake_quantize

#: Weight-matrix families: what trained LLM weights look like to a block quantiser.
WEIGHT_KINDS = ("gaussian", "outlier_rows", "outlier_cols", "student_t")


def weight_like(kind: str, shape: tuple[int, int] = (1024, 1024), seed: int = 0, std: float = 0.02) -> Tensor:
    """A synthetic fp32 weight matrix ``[M, N]``.

    * ``gaussian``: i.i.d. ``N(0, std^2)``, the initialisation-like bulk.
    * ``outlier_rows``: gaussian with 1% of output rows scaled by 20 (a few output channels that dominate).
    * ``outlier_cols``: gaussian with 1% of input columns scaled by 20 (the "massive activation" input
      channels, which put outliers *inside* every row block).
    * ``student_t``: heavy-tailed i.i.d. entries, Student-t with 3 degrees of freedom scaled to ``std``.
    """
    if kind not in WEIGHT_KINDS:
        raise ValueError(f"weight_like: kind must be one of {WEIGHT_KINDS}, got {kind!r}")
    g = torch.Generator().manual_seed(seed)
    m, n = shape
    w = torch.randn(m, n, generator=g) * std
    if kind == "outlier_rows":
        rows = torch.randperm(m, generator=g)[: max(1, m // 100)]
        w[rows] *= 20.0
    elif kind == "outlier_cols":
        cols = torch.randperm(n, generator=g)[: max(1, n // 100)]
        w[:, cols] *= 20.0
    elif kind == "student_t":
        # t_3 = z / sqrt(chi2_3 / 3); its variance is 3, so divide by sqrt(3) to match std.
        chi2 = (torch.randn(m, n, 3, generator=g) ** 2).sum(-1)
        w = w / torch.sqrt(chi2 / 3.0) / math.sqrt(3.0)
    return w


def roundtrip_error(x: Tensor, fmt: str) -> dict[str, float]:
    """Errors of ``fake_quantize(x, fmt)`` against ``x`` (computed in float64).

    Returns ``rel_fro`` = ``||x_hat - x||_F / ||x||_F``, ``sqnr_db`` = ``-20 log10(rel_fro)``, ``max_abs`` =
    ``max |x_hat - x|``, ``max_rel`` = ``max_abs / max |x|``, and ``flushed`` = the share of non-zero weights
    that became zero.
    """
    x64 = x.detach().double()
    x_hat = fake_quantize(x, fmt)
    err = x_hat.double() - x64
    norm = x64.norm()
    rel = float(err.norm() / norm) if float(norm) > 0 else 0.0
    nonzero = x64 != 0
    flushed = float(((x_hat == 0) & nonzero).sum()) / max(int(nonzero.sum()), 1)
    return {
        "rel_fro": rel,
        "sqnr_db": -20.0 * math.log10(rel) if rel > 0 else float("inf"),
        "max_abs": float(err.abs().max()),
        "max_rel": float(err.abs().max() / x64.abs().max()) if float(x64.abs().max()) > 0 else 0.0,
        "flushed": flushed,
    }


def roundtrip_table(
    shape: tuple[int, int] = (1024, 1024),
    seed: int = 0,
    formats: tuple[str, ...] = ("bf16", "fp8", "mxfp4", "nvfp4"),
    kinds: tuple[str, ...] = WEIGHT_KINDS,
) -> str:
    """A markdown table of :func:`roundtrip_error` for each weight kind and format."""
    lines = [
        "| weights | format | bits/elem | rel. Frobenius error | SQNR (dB) | max abs error / max abs | flushed to 0 |",
        "|---|---|---|---|---|---|---|",
    ]
    bits = {"bf16": 16.0, **BITS_PER_ELEMENT}
    for kind in kinds:
        w = weight_like(kind, shape, seed)
        for fmt in formats:
            e = roundtrip_error(w, fmt)
            lines.append(
                f"| {kind} | {fmt} | {bits[fmt]:.3f} | {e['rel_fro']:.4f} | {e['sqnr_db']:.1f} | "
                f"{e['max_rel']:.4f} | {100 * e['flushed']:.2f}% |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    print(f"torch {torch.__version__}, shape 1024x1024, seed 0")
    print(roundtrip_table())
