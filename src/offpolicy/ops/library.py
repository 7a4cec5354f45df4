"""The backend functions as ``torch.library`` custom ops, so that ``torch.compile(fullgraph=True)`` traces them.

Compiled graphs see three opaque ops with shape-only fake implementations; at run time each one calls the
backend named by its ``backend`` argument (:mod:`offpolicy.ops.backends`):

* ``offpolicy::full_stats(logits, inv_temp, skip, backend) -> (m, s, t)``
* ``offpolicy::full_grad(logits, ids, inv_temp, lse, grad, grad_sum, backend) -> dz`` (a new ``[N, V]`` tensor)
* ``offpolicy::full_grad_inplace_(logits, ids, inv_temp, lse, grad, grad_sum, backend)``: writes ``dz`` into
  ``logits``. Under ``torch.compile`` functionalization may replace the mutation of a graph input by a copy.

They are called inside :class:`~offpolicy.ops.sparse_log_softmax` 's autograd function, so they carry no
autograd formula of their own.
"""

from __future__ import annotations

import torch
from torch import Tensor

from offpolicy.ops import backends


@torch.library.custom_op("offpolicy::full_stats", mutates_args=())
def full_stats(logits: Tensor, inv_temp: Tensor, skip: Tensor | None, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """``(m, s, t)`` per row of ``logits * inv_temp`` (the backend contract's ``full_stats``)."""
    return backends.load(backend).full_stats(logits, inv_temp, skip)


@full_stats.register_fake
def _full_stats_fake(logits: Tensor, inv_temp: Tensor, skip: Tensor | None, backend: str):
    return tuple(inv_temp.new_empty(logits.shape[:1]) for _ in range(3))


@torch.library.custom_op("offpolicy::full_grad", mutates_args=())
def full_grad(
    logits: Tensor, ids: Tensor, inv_temp: Tensor, lse: Tensor, grad: Tensor, grad_sum: Tensor, backend: str
) -> Tensor:
    """A new contiguous ``[N, V]`` gradient in the logits' dtype (the backend contract's ``full_grad``)."""
    out = torch.empty_like(logits, memory_format=torch.contiguous_format)
    return backends.load(backend).full_grad(logits, ids, inv_temp, lse, grad, grad_sum, out)


@full_grad.register_fake
def _full_grad_fake(logits, ids, inv_temp, lse, grad, grad_sum, backend):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


@torch.library.custom_op("offpolicy::full_grad_inplace_", mutates_args=("logits",))
def full_grad_inplace_(
    logits: Tensor, ids: Tensor, inv_temp: Tensor, lse: Tensor, grad: Tensor, grad_sum: Tensor, backend: str
) -> None:
    """Overwrite ``logits`` with their gradient (the backend contract's ``full_grad`` with ``out = logits``)."""
    backends.load(backend).full_grad(logits, ids, inv_temp, lse, grad, grad_sum, logits)


@full_grad_inplace_.register_fake
def _full_grad_inplace_fake(logits, ids, inv_temp, lse, grad, grad_sum, backend) -> None:
    return None
