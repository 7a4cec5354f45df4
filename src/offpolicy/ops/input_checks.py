"""The input checks of both ops (:func:`~offpolicy.ops.sparse_log_softmax` and
:func:`~offpolicy.ops.linear_sparse_log_softmax`), made once, at the public boundary of a call: nothing below it
(autograd functions, backends) checks its arguments again. :func:`offpolicy.policy_loss` is a boundary too: it
makes the same stride and temperature checks with these functions (:func:`check_unit_stride`,
:func:`check_temperature`), then calls the ops' unchecked entries (``sparse_log_softmax_unchecked``,
``linear_sparse_log_softmax_unchecked``), so each check runs once per call, whichever entry point it came in by.

Shape, dtype, stride and option checks cost nothing and always run at an op's boundary. Value checks (ids in
range, temperatures ``> 0``) read the tensors, which is a host sync on a GPU: the boundary runs them unless the
caller passes ``validate=False`` or ``torch.compile`` is tracing (a graph cannot hold a host sync).
"""

from __future__ import annotations

import math
from numbers import Real

import torch
from torch import Tensor

from offpolicy.ops import row_stats
from offpolicy.ops.vocab_parallel import VocabShard
from offpolicy.records.candidates import first_duplicate_row

FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
#: Integer dtypes accepted for ids (PyTorch has no comparison or min/max kernels for uint16/32/64 on CPU).
INTS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
INT_NAMES = "/".join(str(d).removeprefix("torch.") for d in INTS)


def describe(x: object) -> str:
    """A short description of ``x`` for error messages."""
    if isinstance(x, Tensor):
        return f"{x.dtype} tensor of shape {list(x.shape)} on {x.device}"
    return f"{type(x).__name__} {x!r}"


def check_logits(logits: object) -> None:
    """``logits`` must be a ``[N, V]`` float tensor with unit stride along ``V`` (any stride when ``V <= 1`` or
    ``N = 0``: such logits are contiguous), holding data (not on the meta device)."""
    if not isinstance(logits, Tensor) or logits.dim() != 2 or logits.dtype not in FLOATS:
        raise ValueError(f"logits: expected a [N, V] fp32/bf16/fp16/float64 tensor, got {describe(logits)}")
    check_has_data("logits", logits)
    check_unit_stride("logits", logits)


def check_unit_stride(name: str, x: Tensor) -> None:
    """``x [N, V]`` has unit stride along ``V`` where a row holds two or more entries to address (``V <= 1`` or
    ``N = 0`` logits of any stride are contiguous): the one stride check of both boundaries
    (:func:`~offpolicy.ops.sparse_log_softmax` and :func:`offpolicy.policy_loss`); the backends rely on it."""
    if x.shape[0] > 0 and x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"{name}: expected unit stride along V (call .contiguous()), got strides {x.stride()}")


def check_has_data(name: str, x: Tensor) -> None:
    """``x`` is not a meta tensor (which has a shape but no values to compute with or check)."""
    if x.device.type == "meta":
        raise ValueError(f"{name}: a meta tensor holds no values; pass a CPU or CUDA tensor")


def check_inplace_grad(logits: Tensor, inplace_grad: object) -> None:
    """``inplace_grad`` is a bool, and when True no two entries of ``logits [N, V]`` (unit stride along ``V``)
    share memory: each row's gradient is written over its logits, so rows that overlap (``z.expand(N, V)``, an
    ``as_strided`` view with a row stride below ``V``) would receive one another's gradient."""
    if not isinstance(inplace_grad, bool):
        raise ValueError(f"inplace_grad: expected a bool, got {describe(inplace_grad)}")
    n, v = logits.shape
    if inplace_grad and n > 1 and v > 0 and logits.stride(0) < v:
        raise ValueError(
            f"inplace_grad=True writes the gradient over the logits, but their rows overlap in memory (shape "
            f"{[n, v]}, strides {list(logits.stride())}, e.g. from expand or as_strided): pass inplace_grad=False, "
            "or logits.contiguous()")


def _too_small(acc: torch.dtype) -> str:
    return (f"1 / temperature must be finite in {str(acc).removeprefix('torch.')}, so temperature >= "
            f"{1 / torch.finfo(acc).max:.3g}")


def check_rows(n: int, device: torch.device, targets: object, candidate_ids: object, support: object, skip: object,
               shard: object) -> None:
    """Static checks of the per-row arguments both primitives take besides the temperature (no tensor values are
    read)."""
    if not isinstance(targets, Tensor) or targets.shape != (n,) or targets.dtype not in INTS:
        raise ValueError(f"targets: expected an integer ({INT_NAMES}) [N={n}] tensor, got {describe(targets)}")
    if candidate_ids is not None and (not isinstance(candidate_ids, Tensor) or candidate_ids.dim() != 2
                                      or candidate_ids.shape[0] != n or candidate_ids.dtype not in INTS):
        raise ValueError(f"candidate_ids: expected an integer ({INT_NAMES}) [N={n}, K] tensor or None, got "
                         f"{describe(candidate_ids)}")
    if not isinstance(support, bool):
        raise ValueError(f"support: expected a bool, got {describe(support)}")
    if support and candidate_ids is None:
        raise ValueError("support=True normalises over each row's candidates: candidate_ids is required")
    if skip is not None and (not isinstance(skip, Tensor) or skip.shape != (n,) or skip.dtype != torch.bool):
        raise ValueError(f"skip: expected a bool [N={n}] tensor or None, got {describe(skip)}")
    if shard is not None and not isinstance(shard, VocabShard):
        raise ValueError(f"shard: expected a VocabShard or None, got {describe(shard)}")
    for name, x in (("targets", targets), ("candidate_ids", candidate_ids), ("skip", skip)):
        if isinstance(x, Tensor) and x.device != device:
            raise ValueError(f"{name}: expected a tensor on {device}, got one on {x.device}")


def check_values(v: int, targets: Tensor, candidate_ids: Tensor | None, shard: VocabShard | None,
                 support: bool = False) -> None:
    """Value checks of the ids (host syncs): ids in ``[0, V)`` (candidates may be ``-1``), no id twice in a row
    under ``support`` (the normaliser would count it twice).

    Under ``shard`` the global vocabulary size is not known here, so only the lower bounds are checked. Call it
    eagerly only (the boundary does not while ``torch.compile`` traces).
    """
    # One min/max pass per id tensor (each host sync costs a pass and, on a busy CPU, a thread wake-up).
    for name, x, lowest in (("targets", targets, 0), ("candidate_ids", candidate_ids, -1)):
        if x is None or not x.numel():
            continue
        lo, hi = (int(b) for b in torch.aminmax(x))
        if lo < lowest:
            what = "is negative; expected ids in [0, V)" if name == "targets" else "is below -1 (the padding id)"
            raise ValueError(f"{name}: id {lo} {what}")
        if shard is None and hi >= v:
            raise ValueError(f"{name}: id {hi} is out of range for V={v}")
    if support and candidate_ids is not None:
        row = first_duplicate_row(candidate_ids)
        if row is not None:
            raise ValueError(f"candidate_ids: row {row} holds an id twice; support=True normalises over each row's "
                             "ids, so a repeated id would count twice (pass each id once)")


def check_temperature(temperature: object, n: int, acc: torch.dtype, *, values: bool) -> None:
    """The one temperature check of both boundaries (:func:`~offpolicy.ops.sparse_log_softmax`, its fused-linear
    twin, and :func:`offpolicy.policy_loss`); every failure is a ``ValueError`` naming ``temperature``.

    ``temperature`` is a real number (Python or NumPy; not a bool), finite and ``> 0``, or a float tensor of
    ``[N]`` (or one element) holding data (not on the meta device, whose tensors have no values to divide by);
    ``1 / temperature`` must be finite in ``acc``, the dtype of the statistics. A tensor's entries are read only
    with ``values`` (a host sync: the boundary skips it with ``validate=False`` and while ``torch.compile``
    traces).
    """
    if isinstance(temperature, Tensor):
        if temperature.dim() > 1 or temperature.numel() not in (1, n) or not temperature.is_floating_point():
            raise ValueError(f"temperature: expected a float or a float [N={n}] tensor, got {describe(temperature)}")
        check_has_data("temperature", temperature)
        if not values or not temperature.numel():
            return
        if not bool((torch.isfinite(temperature) & (temperature > 0)).all()):
            raise ValueError("temperature: every entry must be finite and > 0")
        if not bool(torch.isfinite(1 / temperature.to(acc)).all()):
            raise ValueError(f"temperature: an entry of {float(temperature.min()):.3g} is too small: "
                             f"{_too_small(acc)}")
    elif isinstance(temperature, bool) or not isinstance(temperature, Real) \
            or not (0 < float(temperature) < math.inf):
        raise ValueError(f"temperature: expected a finite number > 0, got {describe(temperature)}")
    elif 1 / float(temperature) > torch.finfo(acc).max:
        raise ValueError(f"temperature: {float(temperature):.3g} is too small: {_too_small(acc)}")


def check_stats(stats: object, sum_p2: object) -> tuple[str, ...]:
    """The extra statistics a call asks for, as names in :data:`offpolicy.ops.row_stats.STATISTICS` order.

    ``stats`` must be a tuple, list, set or frozenset of known names (a bare string would ask for its letters);
    ``sum_p2`` a bool (a tensor or a number would be a different question), the shorthand for
    ``"sum_p2" in stats``.
    """
    if not isinstance(sum_p2, bool):
        raise ValueError(f"sum_p2: expected True or False, got {sum_p2!r}")
    if not isinstance(stats, (tuple, list, set, frozenset)):
        raise ValueError(f"stats: expected a tuple, list or set of statistic names, got {stats!r}")
    unknown = [s for s in stats if not isinstance(s, str) or s not in row_stats.STATISTICS]
    if unknown:
        raise ValueError(f"stats: unknown statistic {unknown[0]!r}; expected names among "
                         f"{', '.join(row_stats.STATISTICS)}")
    return row_stats.names([*stats, "sum_p2"] if sum_p2 else stats)


def check_layer(hidden: object, weight: object, bias: object, chunk_bytes: object, grad_filter: object) -> None:
    """The fused-linear op's layer: ``hidden [N, D]`` float, ``weight [V, D]`` of its dtype and device, ``bias [V]``
    or None, a positive ``chunk_bytes`` and ``grad_filter`` None or in ``[0, 1)``."""
    if not isinstance(hidden, Tensor) or hidden.dim() != 2 or hidden.dtype not in FLOATS:
        raise ValueError(f"hidden: expected a [N, D] fp32/bf16/fp16/float64 tensor, got {describe(hidden)}")
    d = hidden.shape[1]
    if not isinstance(weight, Tensor) or weight.dim() != 2 or weight.shape[1] != d:
        raise ValueError(f"weight: expected a [V, D={d}] tensor (D of hidden {tuple(hidden.shape)}), got "
                         f"{describe(weight)}")
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise ValueError(f"weight: expected dtype {hidden.dtype} on {hidden.device} like hidden, "
                         f"got {weight.dtype} on {weight.device}")
    v = weight.shape[0]
    if bias is not None and (not isinstance(bias, Tensor) or bias.shape != (v,) or bias.dtype not in FLOATS
                             or bias.device != hidden.device):
        raise ValueError(f"bias: expected a [V={v}] float tensor on {hidden.device} or None, got {describe(bias)}")
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes: expected a positive int, got {chunk_bytes!r}")
    if grad_filter is not None and not 0.0 <= float(grad_filter) < 1.0:
        raise ValueError(f"grad_filter: expected None or a threshold in [0, 1), got {grad_filter!r}")
