"""Native CPU backend for the vocabulary pass: the fused C loops of ``kernels/vocab_pass_cpu.c``, the CPU default
wherever they build (:mod:`offpolicy.ops.cpu_native`).

Both functions follow the logits contract of :mod:`offpolicy.ops.backend_registry`, as the chunked PyTorch backend
(:mod:`offpolicy.ops.logits_op.torch_backend`) does, and hand it what the C loops leave out: rows holding NaN or ``+inf``
logits (recomputed there, so their statistics are the same as that backend's) and float64 logits (the registry
routes those to it). Rows are shared out to the workers of :mod:`offpolicy.ops.row_threads` in chunks of whole
rows; each C call works on one row at a time:

* ``full_stats``: per row, one read of the logits from memory (the max) and one from L2 (``exp2`` and the two
  sums, three with ``sum_p2``), and nothing written but ``3 N`` floats (``4 N``). Against the PyTorch backend's
  eight passes over a chunk.
* ``full_grad``: per row, one read of the logits and one write of the gradient; 16-bit gradients are assembled
  in an fp32 row (in L2, one per worker, its length passed to C and checked there) and rounded once.

fp16 logits go to the PyTorch backend, with one warning, where the library was built without fp16 kernels (a
compiler without ``_Float16``, :func:`offpolicy.ops.cpu_native.dtypes`). Every buffer here has an explicit dtype:
none follows ``torch.set_default_dtype``.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from offpolicy.ops import cpu_native, row_threads
from offpolicy.ops.logits_op import torch_backend
from offpolicy.ops.logits_op.torch_backend import LN2, LOG2E

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
#: Rows per C call: a call's work is then milliseconds, against microseconds of ctypes overhead.
ROWS_PER_CALL = 8
_WARNED: set[str] = set()


def available() -> bool:
    """Whether the C kernels are built and loaded (building them on first call)."""
    return cpu_native.load() is not None


def _kernels(logits: Tensor):
    """The library and the kernels' dtype suffix for ``logits``; None where this dtype was not built."""
    lib = cpu_native.load()
    if lib is None:
        reason = cpu_native.unavailable_reason()
        raise RuntimeError(f"backend 'cpu': the native CPU kernels are unavailable ({reason}); use backend='torch'")
    if logits.device.type != "cpu" or logits.dtype not in _SUFFIX:
        raise ValueError(f"backend 'cpu' takes CPU fp32/bf16/fp16 logits, got {logits.dtype} on {logits.device}")
    suffix = _SUFFIX[logits.dtype]
    if suffix not in cpu_native.dtypes():
        if suffix not in _WARNED:
            _WARNED.add(suffix)
            warnings.warn(f"offpolicy: the native CPU kernels were built without {logits.dtype} (the compiler lacks "
                          "_Float16: GCC >= 12 or Clang has it); those logits use the chunked PyTorch backend",
                          RuntimeWarning, stacklevel=3)
        return None
    return lib, suffix


def _unit_stride(logits: Tensor) -> Tensor:
    """``logits`` in the C loops' layout, unit stride along ``V``: the boundaries refuse other logits
    (:func:`offpolicy.ops.input_checks.check_unit_stride`), so only a direct call of this module pays a copy."""
    return logits if logits.shape[1] <= 1 or logits.stride(1) == 1 else logits.contiguous()


def full_stats(logits: Tensor, inv_temp: Tensor, skip: Tensor | None, *, sum_p2: bool = False) -> tuple[Tensor, ...]:
    """Per-row ``(m, s, t)`` of ``x = logits * inv_temp`` (and ``q = sum exp(2 (x - m))`` with ``sum_p2``, from the
    same pass): the contract of :func:`torch_backend.full_stats`, for CPU fp32/bf16/fp16 logits and fp32
    ``inv_temp``; results in fp32."""
    kernels = _kernels(logits)
    if kernels is None:
        return torch_backend.full_stats(logits, inv_temp, skip, sum_p2=sum_p2)
    lib, suffix = kernels
    logits = _unit_stride(logits)
    n, v = logits.shape
    mz, s, t2 = (torch.zeros(n, dtype=torch.float32) for _ in range(3))
    q = torch.zeros(n, dtype=torch.float32) if sum_p2 else None
    bad = torch.zeros(n, dtype=torch.uint8)
    rows = torch.arange(n, dtype=torch.int64) if skip is None else (~skip).nonzero().view(-1)
    if rows.numel() == 0 or v == 0:
        return (mz, s, t2) if q is None else (mz, s, t2, q)
    a = (inv_temp.float() * LOG2E).contiguous()
    call = getattr(lib, f"stats_{suffix}")
    stride = logits.stride(0) * logits.element_size()
    q_ptr = None if q is None else q.data_ptr()  # NULL: the C loop without the q accumulator

    def body(lo: int, hi: int) -> None:
        call(logits.data_ptr(), stride, v, rows[lo:].data_ptr(), hi - lo, a.data_ptr(), mz.data_ptr(), s.data_ptr(),
             t2.data_ptr(), q_ptr, bad.data_ptr())

    row_threads.for_chunks(rows.numel(), ROWS_PER_CALL, body)
    # q = sum 2^(2y) needs no unit change (e^(2 (x - m)) = (2^y)^2)
    m, t = mz * inv_temp, t2 * LN2
    redo = bad.bool()
    if bool(redo.any()):  # NaN or +inf logits: the PyTorch backend's statistics for those rows
        redone = torch_backend.full_stats(logits, inv_temp, ~redo, sum_p2=sum_p2)
        m, s, t = (torch.where(redo, new, old) for new, old in zip(redone[:3], (m, s, t)))
        if q is not None:
            q = torch.where(redo, redone[3], q)
    return (m, s, t) if q is None else (m, s, t, q)


def full_grad(
    logits: Tensor,
    ids: Tensor,
    inv_temp: Tensor,
    lse: Tensor,
    grad: Tensor,
    grad_sum: Tensor,
    out: Tensor,
) -> Tensor:
    """Write ``dz = inv_temp * (scatter(grad at ids) - grad_sum * exp(x - lse))`` into ``out`` and return it: the
    contract of :func:`torch_backend.full_grad`, for CPU fp32/bf16/fp16 logits with fp32 ``inv_temp``, ``lse``,
    ``grad`` and ``grad_sum``. Rows whose dense part vanishes get the scatter only, without reading their logits."""
    kernels = _kernels(logits)
    if kernels is None:
        return torch_backend.full_grad(logits, ids, inv_temp, lse, grad, grad_sum, out)
    lib, suffix = kernels
    logits = _unit_stride(logits)
    n, v = logits.shape
    if n == 0 or v == 0:
        return out
    if out.shape != logits.shape or out.dtype != logits.dtype or (v > 1 and out.stride(1) != 1):
        raise ValueError(f"out must be [N, V] {logits.dtype} with unit stride along V, got {tuple(out.shape)} "
                         f"{out.dtype} strides {out.stride()}")
    coef, g_scaled, cols, live = torch_backend.scatter_terms(ids, inv_temp, lse, grad, grad_sum)
    if not bool(live.all()):
        torch_backend.scatter_only(out, ~live, cols, g_scaled)
    rows = live.nonzero().view(-1)
    if rows.numel() == 0:
        return out
    shift = (lse / inv_temp).float().contiguous()
    a = (inv_temp.float() * LOG2E).contiguous()
    c = coef.float().contiguous()
    cols, g_scaled = cols.to(torch.int64).contiguous(), g_scaled.float().contiguous()
    call = getattr(lib, f"grad_{suffix}")
    z_stride, out_stride = logits.stride(0) * logits.element_size(), out.stride(0) * out.element_size()
    # a 16-bit gradient's fp32 row, one per worker (fp32 gradients are assembled in place and need none)
    scratch = row_threads.per_worker(lambda: torch.empty(v if suffix != "f32" else 1, dtype=torch.float32))

    def body(lo: int, hi: int) -> None:
        row = scratch()
        status = call(logits.data_ptr(), z_stride, out.data_ptr(), out_stride, v, rows[lo:].data_ptr(), hi - lo,
                      shift.data_ptr(), a.data_ptr(), c.data_ptr(), cols.data_ptr(), g_scaled.data_ptr(),
                      ids.shape[1], row.data_ptr(), row.numel() * row.element_size())
        if status != 0:
            why = (f"a scratch row of {row.numel() * row.element_size()} bytes, V = {v} needs {4 * v}" if status == 1
                   else f"a candidate column outside [0, {v})")
            raise RuntimeError(f"backend 'cpu': grad_{suffix} wrote nothing: {why}")

    row_threads.for_chunks(rows.numel(), ROWS_PER_CALL, body)
    return out
