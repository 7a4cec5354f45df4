"""One registry of backends for both ops (the logits op and the fused-linear op), each a :class:`Backend` resolved
once per call: the call's boundary picks it (:func:`choose`; the op's public function, or :func:`offpolicy.policy_loss`,
which hands it to the ops' unchecked entries) and the record goes down in the op's plan, never as a name; the
autograd functions call its modules directly (eager) or, while ``torch.compile`` traces, through the custom ops of
:mod:`offpolicy.ops.library`, which carry only the backend's name (a graph holds no Python object).

A backend's modules implement the contracts :class:`LogitsBackend` (``full_stats``, ``full_grad``; with
``caches_probs`` also :class:`CachingLogitsBackend`'s ``grad_from_probs``) and :class:`LinearBackend`
(``gathered_logits``, ``full_stats``, ``backward``); the capabilities the autograd functions read (instead of
testing a backend's name):

* ``caches_probs``: the logits op's ``full_stats`` can leave ``exp(x - m)`` in a caller's buffer that the backward
  turns into the gradient in place (one pass over ``[N, V]`` saved);
* ``float64``: it runs float64 itself; otherwise float64 inputs (references, gradcheck) go to the ``torch``
  backend, which keeps float64 throughout;
* ``needs_kernels``: it launches Triton kernels, so it needs CUDA tensors, or ``TRITON_INTERPRET=1`` set before
  Triton is imported for CPU tensors.

Backends: ``torch`` (chunked PyTorch: the CPU fallback, and float64 everywhere;
:mod:`offpolicy.ops.logits_op.torch_backend`, :mod:`offpolicy.ops.linear_op.linear_torch_backend`), ``cpu`` (fused
C loops built at first use, :mod:`offpolicy.ops.logits_op.cpu_backend`; the fused-linear op runs the torch module)
and ``triton`` (the GPU kernels, :mod:`offpolicy.ops.logits_op.triton_backend`,
:mod:`offpolicy.ops.linear_op.linear_triton_backend`).

Choice, in order: the ``backend=`` argument, the ``OFFPOLICY_BACKEND`` environment variable, then ``triton`` for
CUDA tensors, and for CPU tensors ``cpu`` where its kernels build, else ``torch``. float64 inputs go to ``torch``
whatever is chosen.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import torch
from torch import Tensor

from offpolicy.ops.row_stats import RowStats

ENV_VAR = "OFFPOLICY_BACKEND"


class LogitsBackend(Protocol):
    """The logits op's contract (documented on :mod:`offpolicy.ops.logits_op.torch_backend`)."""

    def full_stats(self, logits: Tensor, inv_temp: Tensor, skip: Tensor | None, *,
                   extras: tuple[str, ...] = ()) -> RowStats:
        """Per-row statistics (``m, s, t`` and the named ``extras``) of ``logits [N, V] * inv_temp [N]``."""

    def full_grad(self, logits: Tensor, ids: Tensor, inv_temp: Tensor, lse: Tensor, grad: Tensor,
                  grad_sum: Tensor, out: Tensor) -> Tensor:
        """``dz [N, V] = inv_temp (scatter(grad at ids) - grad_sum exp(x - lse))`` written into ``out``."""


class TwoPassLogitsBackend(LogitsBackend, Protocol):
    """A logits backend with ``two_pass``: the statistics and a closed-form row gradient in one program."""

    def full_stats_grad(self, logits: Tensor, target: Tensor, inv_temp: Tensor, skip: Tensor | None, coef: Tensor,
                        shift: Tensor, out: Tensor, *, band: tuple[float, float] | None,
                        exp_clip: tuple[float, float, float] | None, head: tuple[Tensor, Tensor] | None = None,
                        tail_eps: float = 1e-6) -> tuple[Tensor, ...]:
        """``(m, s, t, lse, g) [N]``, the gradient of ``sum_rows g log p(target)`` (plus the head term of
        ``head = (ids, lq)``) written into ``out``."""


class CachingLogitsBackend(LogitsBackend, Protocol):
    """A logits backend with ``caches_probs``: ``full_stats`` fills ``probs [N, V]`` with ``exp(x - m)``."""

    def grad_from_probs(self, probs: Tensor, ids: Tensor, inv_temp: Tensor, m: Tensor, lse: Tensor, grad: Tensor,
                        grad_sum: Tensor) -> Tensor:
        """The gradient, in place in ``probs``."""


class LinearBackend(Protocol):
    """The fused-linear op's contract (documented on :mod:`offpolicy.ops.linear_op.linear_torch_backend`)."""

    def gathered_logits(self, hidden: Tensor, weight: Tensor, bias: Tensor | None, ids: Tensor,
                        chunk_bytes: int) -> Tensor:
        """``[N, M]`` logits at the ids, 0 where ``ids < 0``."""

    def full_stats(self, hidden: Tensor, weight: Tensor, bias: Tensor | None, ids: Tensor, inv_temp: Tensor,
                   chunk_bytes: int, *, extras: tuple[str, ...] = ()) -> tuple[RowStats, Tensor]:
        """``(stats, x)``: the per-row statistics (``m, s, t`` and the named ``extras``, ``[N]``), ``x [N, M]``."""

    def backward(self, hidden: Tensor, weight: Tensor, bias: Tensor | None, ids: Tensor, dz_ids: Tensor,
                 inv_temp: Tensor, lse: Tensor, coef: Tensor | None, *, chunk_bytes: int,
                 grad_filter: float | None = None, needs: tuple[bool, bool, bool] = (True, True, True)) -> tuple:
        """``(dh, dW, db, filtered tiles)``; a gradient not needed is None."""


@dataclass(frozen=True)
class Backend:
    """A registered backend: its name, the modules implementing each op's contract, and what it can do."""

    name: str
    logits_module: str
    linear_module: str
    caches_probs: bool
    float64: bool
    needs_kernels: bool
    #: ``full_stats_grad`` (:class:`TwoPassLogitsBackend`): the two-pass loss of
    #: :mod:`offpolicy.ops.logits_op.stats_grad_pass`.
    two_pass: bool = False

    @cached_property
    def logits(self) -> LogitsBackend:
        """The module implementing the logits op's contract (imported on first use, then kept)."""
        return _import(self, self.logits_module)

    @cached_property
    def linear(self) -> LinearBackend:
        """The module implementing the fused-linear op's contract (imported on first use, then kept)."""
        return _import(self, self.linear_module)


BACKENDS: dict[str, Backend] = {
    "torch": Backend("torch", "offpolicy.ops.logits_op.torch_backend", "offpolicy.ops.linear_op.linear_torch_backend",
                     caches_probs=True, float64=True, needs_kernels=False),
    "cpu": Backend("cpu", "offpolicy.ops.logits_op.cpu_backend", "offpolicy.ops.linear_op.linear_torch_backend",
                   caches_probs=False, float64=False, needs_kernels=False),
    "triton": Backend("triton", "offpolicy.ops.logits_op.triton_backend",
                      "offpolicy.ops.linear_op.linear_triton_backend",
                      caches_probs=False, float64=False, needs_kernels=True, two_pass=True),
}


def _default(device: torch.device) -> str:
    """``triton`` on CUDA; on CPU ``cpu`` where its C kernels build (:mod:`offpolicy.ops.cpu_native`), else ``torch``."""
    if device.type == "cuda":
        return "triton"
    from offpolicy.ops import cpu_native  # noqa: PLC0415 (builds the kernels on first use)

    return "cpu" if cpu_native.load() is not None else "torch"


def _import(backend: Backend, module: str):
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(f"backend {backend.name!r} could not be imported ({module}): {err}") from err


def get(name: str) -> Backend:
    """The backend registered as ``name`` (the custom ops' look-up: they carry a name, not the record)."""
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
