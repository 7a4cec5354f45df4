"""One registry of backends for both primitives (the logits op and the fused-linear op).

A backend is a :class:`Backend` record: the modules that implement each op's contract and the capabilities the
autograd functions read (instead of testing a backend's name):

* ``caches_probs``: the logits op's ``full_stats`` can leave ``exp(x - m)`` in a caller's buffer that the backward
  turns into the gradient in place (one pass over ``[N, V]`` saved);
* ``float64``: it runs float64 itself; otherwise float64 inputs (references, gradcheck) go to the ``torch``
  backend, which keeps float64 throughout;
* ``needs_kernels``: it launches Triton kernels, so it needs CUDA tensors, or ``TRITON_INTERPRET=1`` set before
  Triton is imported for CPU tensors.

The logits contract (:mod:`offpolicy.ops.logits_op.torch_backend`): ``full_stats(logits, inv_temp, skip) -> (m, s, t)`` and
``full_grad(logits, ids, inv_temp, lse, grad, grad_sum, out) -> out``. The fused-linear contract
(:mod:`offpolicy.ops.linear_op.linear_torch_backend`): ``gathered_logits``, ``full_stats`` and ``backward``.

Backends: ``torch`` (chunked PyTorch: the CPU fallback, and float64 everywhere), ``cpu`` (fused C loops built at
first use, :mod:`offpolicy.ops.logits_op.cpu_backend`) and ``triton`` (the GPU kernels).

Choice, in order: the ``backend=`` argument, the ``OFFPOLICY_BACKEND`` environment variable, then ``triton`` for
CUDA tensors, and for CPU tensors ``cpu`` where its kernels build, else ``torch``. float64 logits go to ``torch``
whatever is chosen.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from types import ModuleType

import torch

ENV_VAR = "OFFPOLICY_BACKEND"


@dataclass(frozen=True)
class Backend:
    """A registered backend: its name, its modules for each op, and what it can do."""

    name: str
    logits_module: str
    linear_module: str
    caches_probs: bool
    float64: bool
    needs_kernels: bool

    def logits(self) -> ModuleType:
        """The module implementing the logits op's contract (imported on first use)."""
        return _import(self, self.logits_module)

    def linear(self) -> ModuleType:
        """The module implementing the fused-linear op's contract (imported on first use)."""
        return _import(self, self.linear_module)


BACKENDS: dict[str, Backend] = {
    "torch": Backend("torch", "offpolicy.ops.logits_op.torch_backend", "offpolicy.ops.linear_op.linear_torch_backend",
                     caches_probs=True, float64=True, needs_kernels=False),
    "cpu": Backend("cpu", "offpolicy.ops.logits_op.cpu_backend", "offpolicy.ops.linear_op.linear_torch_backend",
                   caches_probs=False, float64=False, needs_kernels=False),
    "triton": Backend("triton", "offpolicy.ops.logits_op.triton_backend", "offpolicy.ops.linear_op.linear_triton_backend",
                      caches_probs=False, float64=False, needs_kernels=True),
}


def _default(device: torch.device) -> str:
    """``triton`` on CUDA; on CPU ``cpu`` where its C kernels build (:mod:`offpolicy.ops.cpu_native`), else ``torch``."""
    if device.type == "cuda":
        return "triton"
    from offpolicy.ops import cpu_native  # noqa: PLC0415 (builds the kernels on first use)

    return "cpu" if cpu_native.load() is not None else "torch"


def _import(backend: Backend, module: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(f"backend {backend.name!r} could not be imported ({module}): {err}") from err


def get(name: str) -> Backend:
    """The backend registered as ``name``."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"backend {name!r} is not registered; expected one of {tuple(BACKENDS)}") from None


def choose(name: str | None, device: torch.device, dtype: torch.dtype) -> Backend:
    """The backend for tensors of ``dtype`` on ``device``, given the ``backend=`` argument (or None).

    Raises ``ValueError`` for an unknown name and for a kernel backend on CPU tensors without
    ``TRITON_INTERPRET=1``.
    """
    chosen = name or os.environ.get(ENV_VAR) or _default(device)
    if chosen not in BACKENDS:
        source = "backend=" if name else f"${ENV_VAR}="
        raise ValueError(f"{source}{chosen!r} is not a backend; expected one of {tuple(BACKENDS)}")
    backend = BACKENDS[chosen]
    if dtype == torch.float64 and not backend.float64:
        return BACKENDS["torch"]
    if chosen == "cpu" and device.type != "cpu":
        raise ValueError(f"backend 'cpu' runs C loops on CPU tensors, got tensors on {device}")
    if backend.needs_kernels and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"backend {chosen!r} runs Triton kernels: it needs CUDA tensors, or TRITON_INTERPRET=1 set "
                         "before Triton is imported to run them on CPU; use backend='torch' on CPU")
    return backend
