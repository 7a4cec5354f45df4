"""The sparse log-softmax straight from hidden states: ``z = h W^T + b`` is never materialised.

:func:`linear_sparse_log_softmax` returns exactly what ``sparse_log_softmax(hidden @ weight.T + bias, ...)``
returns (the same :class:`~offpolicy.ops.sparse_log_softmax.SparseLogSoftmax`, the same padding, skip and
temperature semantics), differentiable with respect to ``hidden``, ``weight`` and ``bias``, without the ``[N, V]``
logits or their gradient:

* support mode (mask replay): only the ``K`` support rows of ``W`` per token, ``O(N K D)``
  (:mod:`offpolicy.ops.linear_support`);
* full mode (head records, no record): vocabulary tiles x token chunks with an online log-sum-exp forward and a
  recompute backward, ``8 N D V`` FLOPs in all (:mod:`offpolicy.ops.linear_full`).

Backends, chosen like the logits path's (:func:`offpolicy.ops.backends.resolve`): ``torch``
(:mod:`offpolicy.ops.linear_torch_backend`, chunked, the CPU default) and ``triton``
(:mod:`offpolicy.ops.linear_triton_backend`, the CUDA default).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch
from torch import Tensor

from offpolicy.ops import backends
from offpolicy.ops.linear_full import LinearFullLogSoftmax
from offpolicy.ops.linear_support import LinearSupportLogSoftmax
from offpolicy.ops.sparse_log_softmax import SparseLogSoftmax, VocabShard, _localise

_MODULES = {"torch": "offpolicy.ops.linear_torch_backend", "triton": "offpolicy.ops.linear_triton_backend"}
_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def load_backend(name: str) -> ModuleType:
    """The fused-linear backend module for a name returned by :func:`offpolicy.ops.backends.resolve`."""
    try:
        return importlib.import_module(_MODULES[name])
    except ImportError as err:
        raise ImportError(f"fused-linear backend {name!r} could not be imported: {err}") from err


def _check(hidden, weight, bias, targets, candidate_ids, temperature, skip, shard, chunk_bytes, grad_filter):
    if not isinstance(hidden, Tensor) or hidden.dim() != 2 or hidden.dtype not in _FLOATS:
        raise ValueError(f"hidden: expected a [N, D] fp32/bf16/fp16/float64 tensor, got {_describe(hidden)}")
    n, d = hidden.shape
    if not isinstance(weight, Tensor) or weight.dim() != 2 or weight.shape[1] != d:
        raise ValueError(f"weight: expected a [V, D={d}] tensor, got {_describe(weight)}")
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise ValueError(f"weight: expected dtype {hidden.dtype} on {hidden.device} like hidden, "
                         f"got {weight.dtype} on {weight.device}")
    v = weight.shape[0]
    if bias is not None and (not isinstance(bias, Tensor) or bias.shape != (v,) or bias.dtype not in _FLOATS
                             or bias.device != hidden.device):
        raise ValueError(f"bias: expected a [V={v}] float tensor on {hidden.device} or None, got {_describe(bias)}")
    if not isinstance(targets, Tensor) or targets.shape != (n,) or targets.is_floating_point():
        raise ValueError(f"targets: expected an integer [N={n}] tensor, got {_describe(targets)}")
    if candidate_ids is not None and (not isinstance(candidate_ids, Tensor) or candidate_ids.dim() != 2
                                      or candidate_ids.shape[0] != n or candidate_ids.is_floating_point()):
        raise ValueError(
            f"candidate_ids: expected an integer [N={n}, K] tensor or None, got {_describe(candidate_ids)}"
        )
    if isinstance(temperature, Tensor):
        if temperature.numel() not in (1, n) or temperature.dim() > 1:
            raise ValueError(f"temperature: expected a float or a [N={n}] tensor, got {_describe(temperature)}")
        if temperature.numel() and not bool((temperature > 0).all()):
            raise ValueError("temperature: every entry must be > 0")
    elif not float(temperature) > 0:
        raise ValueError(f"temperature: expected > 0, got {temperature!r}")
    if skip is not None and (not isinstance(skip, Tensor) or skip.shape != (n,) or skip.dtype != torch.bool):
        raise ValueError(f"skip: expected a bool [N={n}] tensor or None, got {_describe(skip)}")
    if shard is not None and not isinstance(shard, VocabShard):
        raise ValueError(f"shard: expected a VocabShard or None, got {type(shard).__name__}")
    if not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes: expected a positive int, got {chunk_bytes!r}")
    if grad_filter is not None and not 0.0 <= float(grad_filter) < 1.0:
        raise ValueError(f"grad_filter: expected None or a threshold in [0, 1), got {grad_filter!r}")


def _describe(x) -> str:
    if isinstance(x, Tensor):
        return f"{x.dtype} tensor of shape {list(x.shape)} on {x.device}"
    return type(x).__name__


def linear_sparse_log_softmax(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    candidate_ids: Tensor | None = None,
    temperature: float | Tensor = 1.0,
    *,
    bias: Tensor | None = None,
    support: bool = False,
    skip: Tensor | None = None,
    shard: VocabShard | None = None,
    backend: str | None = None,
    chunk_bytes: int | None = None,
    grad_filter: float | None = None,
) -> SparseLogSoftmax:
    """Log-softmax of ``(hidden @ weight.T + bias) / temperature`` at the sampled token and the candidates.

    Args:
        hidden: ``[N, D]`` fp32/bf16/fp16 hidden states (the input of the output layer); float64 is accepted for
            references and keeps float64 statistics (torch backend only).
        weight: ``[V, D]`` output-layer weight, same dtype and device (``V`` local under ``shard``).
        targets: ``[N]`` int sampled token ids (global ids).
        candidate_ids: ``[N, K]`` int candidate ids, ``-1`` padding; None means ``K = 0``.
        temperature: float or ``[N]`` tensor, ``> 0``.
        bias: ``[V]`` output bias or None.
        support: normalise over each row's candidates (mask replay); costs ``O(N K D)``, never touches all ``V``.
        skip: ``[N]`` bool rows to leave out (``-inf`` log-probabilities, ``lse = +inf``; in full mode they cost
            no vocabulary work).
        shard: vocabulary-parallel shard (``VocabShard(group, start)``), or None.
        backend: ``"torch"`` or ``"triton"``; default by device (see :mod:`offpolicy.ops.backends`).
        chunk_bytes: working-set budget of the chunked torch backend (default
            :data:`offpolicy.ops.linear_torch_backend.CHUNK_BYTES`); peak extra memory is about this plus
            ``O(N (K + D))``.
        grad_filter: full mode only: skip backward blocks whose probabilities are all below this threshold
            (Cut Cross-Entropy's gradient filtering; each dropped gradient entry is below
            ``grad_filter * |sum_j g_j| / tau``). None (default) computes the exact gradient.

    Returns:
        :class:`SparseLogSoftmax` (fp32; float64 for float64 inputs): ``target [N]``, ``candidates [N, K]``
        (``-inf`` at padding), ``lse [N]``,
        ``entropy [N]`` (not differentiable). ``target`` and ``candidates`` are differentiable with respect to
        ``hidden``, ``weight`` and ``bias``. Under ``shard`` the gradient of ``hidden`` is this shard's part.
    """
    from offpolicy.ops import linear_torch_backend

    budget = linear_torch_backend.CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    _check(hidden, weight, bias, targets, candidate_ids, temperature, skip, shard, budget, grad_filter)
    n, v = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    ids = targets.to(device=dev, dtype=torch.int64)[:, None]
    if candidate_ids is not None:
        ids = torch.cat([ids, candidate_ids.to(device=dev, dtype=torch.int64)], dim=1)
    if shard is None and ids.numel() and int(ids.max()) >= v:
        raise ValueError(f"targets/candidate_ids: ids must be < V={v} (or -1 padding), got {int(ids.max())}")
    # fp32 statistics for 16/32-bit inputs; float64 inputs keep float64 throughout (gradcheck, references).
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    if isinstance(temperature, Tensor):
        inv_temp = (1.0 / temperature.to(device=dev, dtype=acc)).reshape(-1).expand(n).contiguous()
    else:
        inv_temp = torch.full((n,), 1.0 / float(temperature), dtype=acc, device=dev)
    local = _localise(ids, shard, v)
    skip = None if skip is None else skip.to(dev)
    be = load_backend(backends.resolve(backend, dev))
    if support:
        logp, lse, entropy = LinearSupportLogSoftmax.apply(hidden, weight, bias, ids, local, inv_temp, skip, shard,
                                                           be, budget)
    else:
        logp, lse, entropy = LinearFullLogSoftmax.apply(hidden, weight, bias, ids, local, inv_temp, skip, shard, be,
                                                        budget, grad_filter)
    return SparseLogSoftmax(logp[:, 0], logp[:, 1:], lse, entropy)
