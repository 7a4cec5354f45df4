"""Both primitives' backend functions as ``torch.library`` custom ops, so that ``torch.compile(fullgraph=True)``
traces them as opaque ops with shape-only fake (meta) implementations. At run time each op calls the backend
named by its ``backend`` argument (:mod:`offpolicy.ops.backend_registry`; a graph holds a name, not the record).
The autograd functions (:mod:`offpolicy.ops.logits_op.logits_function`,
:mod:`offpolicy.ops.linear_op.linear_function`) call them only while ``torch.compile`` traces (eagerly they call the
backend record directly), so they carry no autograd formula. :func:`tracing` is the one place the call path asks
whether it is being traced.

At run time (a compiled graph executing) the logits ops enter the single-intra-op-thread context of
:mod:`offpolicy.ops.row_threads` on CPU: the boundary that enters it eagerly was traced, not run.

Logits op:

* ``offpolicy::full_stats(logits, inv_temp, skip, backend, extras) -> (m, s, t, acc)``: the backend's
  :class:`~offpolicy.ops.row_stats.RowStats` as tensors; ``extras`` names the asked statistics, comma-separated
  (a schema holds a string, not a list of them: :func:`offpolicy.ops.row_stats.pack`), and ``acc [E, N]`` holds
  their accumulators in that order (``[0, N]`` without: the default pass then runs unchanged)
* ``offpolicy::full_grad(logits, ids, inv_temp, lse, grad, grad_sum, backend) -> dz`` (a new ``[N, V]`` tensor)
* ``offpolicy::full_grad_inplace_(logits, ids, inv_temp, lse, grad, grad_sum, backend)``: writes ``dz`` into
  ``logits``. Under ``torch.compile`` functionalization may replace the mutation of a graph input by a copy.

Fused-linear op:

* ``offpolicy::linear_gathered_logits(hidden, weight, bias, ids, chunk_bytes, backend) -> z [N, M]``
* ``offpolicy::linear_full_stats(hidden, weight, bias, ids, inv_temp, chunk_bytes, backend, extras) ->
  (m, s, t, x, acc)``, ``extras`` and ``acc`` as in ``full_stats``
* ``offpolicy::linear_backward(hidden, weight, bias, ids, dz_ids, inv_temp, lse, coef, chunk_bytes, grad_filter,
  need_h, need_w, need_b, backend) -> (dh, dw, db)``; a gradient that is not needed comes back as an empty tensor.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from offpolicy.ops import backend_registry, row_stats, row_threads
from offpolicy.ops.row_stats import RowStats


def tracing() -> bool:
    """Whether ``torch.compile`` is tracing the calling code: the custom-op dispatch's question.

    A traced graph can hold neither a host sync nor a Python object as an op's argument. So while tracing, the
    boundaries (:func:`offpolicy.policy_loss`, :func:`~offpolicy.ops.sparse_log_softmax`,
    :func:`~offpolicy.ops.linear_sparse_log_softmax`) skip their value checks and the single-thread context, and
    the autograd functions reach the backend through the custom ops below, which carry its name. Each boundary asks
    once and passes the answer down in the op's plan; each autograd ``backward`` asks once itself (compiled
    autograd may trace a backward whose forward ran eagerly).
    """
    return torch.compiler.is_compiling()


def _threads(logits: Tensor):
    """The single-thread context for CPU logits (see the module docstring), else a null context."""
    return row_threads.single_intra_op() if logits.device.type == "cpu" else contextlib.nullcontext()


@torch.library.custom_op("offpolicy::full_stats", mutates_args=())
def full_stats(logits: Tensor, inv_temp: Tensor, skip: Tensor | None, backend: str,
               extras: str = "") -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(m, s, t) [N]`` per row of ``logits * inv_temp`` and the accumulators ``[E, N]`` of the ``E`` statistics
    named in ``extras`` (the logits contract's ``full_stats``; see the module docstring)."""
    with _threads(logits):
        stats = backend_registry.get(backend).logits.full_stats(logits, inv_temp, skip,
                                                                extras=row_stats.unpack(extras))
    return stats.m, stats.s, stats.t, _stacked(stats, inv_temp)


@full_stats.register_fake
def _full_stats_fake(logits: Tensor, inv_temp: Tensor, skip: Tensor | None, backend: str, extras: str = ""):
    n = logits.shape[:1]
    return (*(inv_temp.new_empty(n) for _ in range(3)), inv_temp.new_empty(len(row_stats.unpack(extras)), *n))


def as_record(m: Tensor, s: Tensor, t: Tensor, acc: Tensor, extras: str) -> RowStats:
    """The record from a ``full_stats`` op's tensors."""
    return RowStats(m, s, t, dict(zip(row_stats.unpack(extras), acc.unbind(0))))


def _stacked(stats: RowStats, like: Tensor) -> Tensor:
    """The extras' accumulators as one ``[E, N]`` tensor (a new one: an op's outputs may not alias)."""
    if not stats.extras:
        return like.new_empty(0, stats.m.shape[0])
    return torch.stack(list(stats.extras.values()))


@torch.library.custom_op("offpolicy::full_grad", mutates_args=())
def full_grad(
    logits: Tensor, ids: Tensor, inv_temp: Tensor, lse: Tensor, grad: Tensor, grad_sum: Tensor, backend: str
) -> Tensor:
    """A new contiguous ``[N, V]`` gradient in the logits' dtype (the logits contract's ``full_grad``)."""
    out = torch.empty_like(logits, memory_format=torch.contiguous_format)
    with _threads(logits):
        return backend_registry.get(backend).logits.full_grad(logits, ids, inv_temp, lse, grad, grad_sum, out)


@full_grad.register_fake
def _full_grad_fake(logits, ids, inv_temp, lse, grad, grad_sum, backend):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


@torch.library.custom_op("offpolicy::full_grad_inplace_", mutates_args=("logits",))
def full_grad_inplace_(
    logits: Tensor, ids: Tensor, inv_temp: Tensor, lse: Tensor, grad: Tensor, grad_sum: Tensor, backend: str
) -> None:
    """Overwrite ``logits`` with their gradient (the logits contract's ``full_grad`` with ``out = logits``)."""
    with _threads(logits):
        backend_registry.get(backend).logits.full_grad(logits, ids, inv_temp, lse, grad, grad_sum, logits)


@full_grad_inplace_.register_fake
def _full_grad_inplace_fake(logits, ids, inv_temp, lse, grad, grad_sum, backend) -> None:
    return None


@torch.library.custom_op("offpolicy::linear_gathered_logits", mutates_args=())
def linear_gathered_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, ids: Tensor, chunk_bytes: int,
                           backend: str) -> Tensor:
    """``[N, M]`` logits at the ids, 0 where ``ids < 0`` (the fused-linear contract's ``gathered_logits``)."""
    return backend_registry.get(backend).linear.gathered_logits(hidden, weight, bias, ids, chunk_bytes)


@linear_gathered_logits.register_fake
def _linear_gathered_logits_fake(hidden, weight, bias, ids, chunk_bytes, backend):
    return hidden.new_empty(ids.shape, dtype=_acc(hidden))


@torch.library.custom_op("offpolicy::linear_full_stats", mutates_args=())
def linear_full_stats(hidden: Tensor, weight: Tensor, bias: Tensor | None, ids: Tensor, inv_temp: Tensor,
                      chunk_bytes: int, backend: str, extras: str = ""
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(m, s, t) [N]`` over the whole (local) vocabulary, ``x [N, M]`` at the ids and the extras' accumulators
    ``[E, N]`` (fused-linear contract; ``extras`` as in ``full_stats``)."""
    stats, x = backend_registry.get(backend).linear.full_stats(hidden, weight, bias, ids, inv_temp, chunk_bytes,
                                                                 extras=row_stats.unpack(extras))
    return stats.m, stats.s, stats.t, x, _stacked(stats, inv_temp)


@linear_full_stats.register_fake
def _linear_full_stats_fake(hidden, weight, bias, ids, inv_temp, chunk_bytes, backend, extras=""):
    n = hidden.shape[0]
    return (inv_temp.new_empty(n), inv_temp.new_empty(n), inv_temp.new_empty(n), inv_temp.new_empty(ids.shape),
            inv_temp.new_empty(len(row_stats.unpack(extras)), n))


@torch.library.custom_op("offpolicy::linear_backward", mutates_args=())
def linear_backward(hidden: Tensor, weight: Tensor, bias: Tensor | None, ids: Tensor, dz_ids: Tensor,
                    inv_temp: Tensor, lse: Tensor, coef: Tensor | None, chunk_bytes: int, grad_filter: float | None,
                    need_h: bool, need_w: bool, need_b: bool, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """``(dh [N, D] in the accumulation dtype, dW [V, D] in the weight's, db [V] in the bias's)``; empty when not
    needed (the fused-linear contract's ``backward``)."""
    dh, dw, db, _ = backend_registry.get(backend).linear.backward(
        hidden, weight, bias, ids, dz_ids, inv_temp, lse, coef, chunk_bytes=chunk_bytes, grad_filter=grad_filter,
        needs=(need_h, need_w, need_b))
    empty = hidden.new_empty(0)
    return (empty if dh is None else dh, empty.clone() if dw is None else dw, empty.clone() if db is None else db)


@linear_backward.register_fake
def _linear_backward_fake(hidden, weight, bias, ids, dz_ids, inv_temp, lse, coef, chunk_bytes, grad_filter,
                          need_h, need_w, need_b, backend):
    dh = hidden.new_empty(hidden.shape, dtype=_acc(hidden)) if need_h else hidden.new_empty(0)
    dw = weight.new_empty(weight.shape) if need_w else hidden.new_empty(0)
    db = bias.new_empty(bias.shape) if need_b and bias is not None else hidden.new_empty(0)
    return dh, dw, db


def _acc(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32
