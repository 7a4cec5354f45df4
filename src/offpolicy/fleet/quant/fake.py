"""Fake quantisation: round-trip weights through a format so a full-precision model computes like a
low-precision sampler (weights only; activations and the KV cache stay in the model's dtype).

``fake_quantize(x, fmt)`` returns ``dequantize(quantize(x, fmt))`` in ``x``'s dtype and shape. Besides the
block-scaled formats it accepts ``"bf16"`` / ``"fp16"`` (a cast there and back) and ``"fp32"`` / ``"none"``
(identity), so a fleet description's ``weight_format`` can be passed straight in.
"""

from __future__ import annotations

import copy as _copy
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from offpolicy.fleet.quant.blockwise import dequantize, quantize

#: Every format name :func:`fake_quantize` accepts.
FAKE_FORMATS = ("fp32", "none", "bf16", "fp16", "fp8", "nvfp4", "mxfp4")
_CASTS = {"bf16": torch.bfloat16, "fp16": torch.float16}


def fake_quantize(x: Tensor, fmt: str) -> Tensor:
    """``x`` rounded through format ``fmt`` and returned in ``x``'s dtype and shape (no gradient)."""
    if fmt not in FAKE_FORMATS:
        raise ValueError(f"fake_quantize: fmt must be one of {FAKE_FORMATS}, got {fmt!r}")
    x = x.detach()
    if fmt in ("fp32", "none"):
        return x.clone()
    if fmt in _CASTS:
        return x.to(_CASTS[fmt]).to(x.dtype)
    return dequantize(quantize(x, fmt), dtype=x.dtype)


def fake_quantize_module(
    model: nn.Module,
    fmt: str,
    *,
    inplace: bool = False,
    skip: Iterable[str] = (),
    include_embeddings: bool = False,
) -> nn.Module:
    """Fake-quantise the weights of every ``nn.Linear`` (and optionally ``nn.Embedding``) of ``model``.

    Args:
        model: any module.
        fmt: a name from :data:`FAKE_FORMATS` (e.g. a :class:`~offpolicy.fleet.SamplerGroup`'s weight format).
        inplace: overwrite ``model``'s weights; by default a deep copy is quantised and ``model`` is untouched.
        skip: module-name substrings to leave alone (e.g. ``("lm_head",)``: serving stacks usually keep the
            output layer in BF16).
        include_embeddings: also quantise ``nn.Embedding`` tables (off by default, as in serving stacks).

    Returns:
        The quantised module (``model`` itself when ``inplace``). Biases are never quantised.
    """
    if fmt not in FAKE_FORMATS:
        raise ValueError(f"fake_quantize_module: fmt must be one of {FAKE_FORMATS}, got {fmt!r}")
    skip = tuple(skip)
    target = model if inplace else _copy.deepcopy(model)
    kinds: tuple[type, ...] = (nn.Linear, nn.Embedding) if include_embeddings else (nn.Linear,)
    with torch.no_grad():
        for name, module in target.named_modules():
            if isinstance(module, kinds) and not any(s in name for s in skip):
                module.weight.copy_(fake_quantize(module.weight, fmt))
    return target
