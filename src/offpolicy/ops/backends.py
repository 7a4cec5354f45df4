"""Backend selection for the vocabulary pass.

A backend is a module with two functions (see :mod:`offpolicy.ops.torch_backend` for the reference contract):

* ``full_stats(logits [N, V], inv_temp [N], skip [N] | None) -> (m, s, t)``: row max ``m``,
  ``s = sum exp(x - m)``, ``t = sum exp(x - m) (x - m)`` of ``x = logits * inv_temp``; skipped rows report
  ``m = s = t = 0`` and cost no bandwidth.
* ``full_grad(logits, ids [N, M], inv_temp, lse [N], grad [N, M], grad_sum [N], out [N, V]) -> out`` writing
  ``dz = inv_temp * (scatter(grad at ids) - grad_sum * exp(x - lse))``.

Choice, in order: the ``backend=`` argument, the ``OFFPOLICY_BACKEND`` environment variable (``torch`` or
``triton``), then ``triton`` for CUDA tensors and ``torch`` otherwise. ``triton`` on CPU tensors runs the same
kernels under Triton's interpreter and needs ``TRITON_INTERPRET=1`` set before Triton is imported (tests do this).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

BACKENDS = ("torch", "triton")
ENV_VAR = "OFFPOLICY_BACKEND"


def resolve(name: str | None, device: torch.device) -> str:
    """Name of the backend to use for tensors on ``device``."""
    chosen = name or os.environ.get(ENV_VAR) or ("triton" if device.type == "cuda" else "torch")
    if chosen not in BACKENDS:
        source = "backend=" if name else f"${ENV_VAR}="
        raise ValueError(f"{source}{chosen!r} is not a backend; expected one of {BACKENDS}")
    return chosen


def load(name: str) -> ModuleType:
    """Import the backend module called ``name`` (Triton is imported only when asked for)."""
    if name == "torch":
        return importlib.import_module("offpolicy.ops.torch_backend")
    try:
        return importlib.import_module("offpolicy.ops.triton_backend")
    except ImportError as err:
        raise ImportError(f"backend 'triton' needs the triton package and offpolicy's kernels: {err}") from err
