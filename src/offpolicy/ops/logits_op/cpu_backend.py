"""Native CPU backend for the vocabulary pass: the fused C loops of ``kernels/vocab_pass_cpu.c``, the CPU default
wherever they build (:mod:`offpolicy.ops.cpu_native`).

Both functions follow the logits contract of :mod:`offpolicy.ops.backend_registry`, as the chunked PyTorch backend
(:mod:`offpolicy.ops.logits_op.torch_backend`) does, and hand it what the C loops leave out: rows holding NaN or ``+inf``
logits (recomputed there, so their statistics are the same as that backend's) and float64 logits (the registry
routes those to it). Rows are shared out to the workers of :mod:`offpolicy.ops.row_threads` in chunks of whole
rows; each C call works on one row at a time:

* ``full_stats``: per row, one read of the logits from memory (the max) and one from L2 (``exp2`` and the two
  sums, three with the extra ``sum_p2``), and nothing written but ``3 N`` floats (``4 N``). Against the PyTorch backend's
  eight passes over a chunk.
* ``full_grad``: per row, one read of the logits and one write of the gradient; 16-bit gradients are assembled
  in an fp32 row (in L2, one per worker, its length passed to C and checked there) and rounded once.

* ``support_stats`` / ``support_grad``: the support pass over CSR rows of any width
  (:mod:`offpolicy.ops.support_pass`), ``O(K)`` per row of ``K`` ids: one gather, passes over the gathered copy in
  cache, each gradient entry written once. Their C loops are declared here and checked against the library's
  ``offpolicy_support_abi()`` on first use.

fp16 logits go to the PyTorch backend, with one warning, where the library was built without fp16 kernels (a
compiler without ``_Float16``, :func:`offpolicy.ops.cpu_native.dtypes`). Every buffer here has an explicit dtype:
none follows ``torch.set_default_dtype``.
"""

from __future__ import annotations

import ctypes
import threading
import warnings

import torch
from torch import Tensor

from offpolicy.ops import cpu_native, row_stats, row_threads
from offpolicy.ops.logits_op import torch_backend
from offpolicy.ops.logits_op.torch_backend import LN2, LOG2E
from offpolicy.ops.row_stats import RowStats

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
#: Rows per C call: a call's work is then milliseconds, against microseconds of ctypes overhead.
ROWS_PER_CALL = 8
_WARNED: set[str] = set()
#: The extras (:data:`offpolicy.ops.row_stats.STATISTICS`) the C loops accumulate: ``q = sum exp(2 (x - m))``.
NATIVE_STATS = frozenset({"sum_p2"})


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


def full_stats(logits: Tensor, inv_temp: Tensor, skip: Tensor | None, *,
               extras: tuple[str, ...] = ()) -> RowStats:
    """Per-row statistics of ``x = logits * inv_temp`` (with the extras in :data:`NATIVE_STATS` from the same
    pass): the contract of :func:`torch_backend.full_stats`, for CPU fp32/bf16/fp16 logits and fp32 ``inv_temp``;
    results in fp32. Asked for another extra, the whole pass is the PyTorch backend's."""
    kernels = _kernels(logits)
    if kernels is None or not NATIVE_STATS.issuperset(extras):
        return torch_backend.full_stats(logits, inv_temp, skip, extras=extras)
    lib, suffix = kernels
    logits = _unit_stride(logits)
    n, v = logits.shape
    zero = row_stats.zeros(n, extras, torch.float32, logits.device)
    mz, s, t2 = zero.m, zero.s, zero.t
    q = zero.extras.get("sum_p2")
    bad = torch.zeros(n, dtype=torch.uint8)
    rows = torch.arange(n, dtype=torch.int64) if skip is None else (~skip).nonzero().view(-1)
    if rows.numel() == 0 or v == 0:
        return zero
    a = (inv_temp.float() * LOG2E).contiguous()
    call = getattr(lib, f"stats_{suffix}")
    stride = logits.stride(0) * logits.element_size()
    q_ptr = None if q is None else q.data_ptr()  # NULL: the C loop without the q accumulator

    def body(lo: int, hi: int) -> None:
        call(logits.data_ptr(), stride, v, rows[lo:].data_ptr(), hi - lo, a.data_ptr(), mz.data_ptr(), s.data_ptr(),
             t2.data_ptr(), q_ptr, bad.data_ptr())

    row_threads.for_chunks(rows.numel(), ROWS_PER_CALL, body)
    # q = sum 2^(2y) needs no unit change (e^(2 (x - m)) = (2^y)^2)
    stats = RowStats(mz * inv_temp, s, t2 * LN2, zero.extras)
    redo = bad.bool()
    if bool(redo.any()):  # NaN or +inf logits: the PyTorch backend's statistics for those rows
        redone = torch_backend.full_stats(logits, inv_temp, ~redo, extras=extras)
        stats = RowStats(*(torch.where(redo, new, old) for new, old in zip(redone[:3], stats[:3])),
                         {k: torch.where(redo, redone.extras[k], old) for k, old in stats.extras.items()})
    return stats


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


# ---- The support pass (CSR rows of any width): the C loops support_* of kernels/vocab_pass_cpu.c ----

_P, _I = ctypes.c_void_p, ctypes.c_int64
#: The support loops' ctypes declarations, checked against the library's ``offpolicy_support_abi()`` before use
#: (the loader :mod:`offpolicy.ops.cpu_native` checks the vocabulary passes' ABI; these are declared here).
SUPPORT_ABI = ("2;int64_t support_stats(const void *z, int64_t z_stride, int64_t v, const int64_t *rows, "
               "int64_t n_rows, const int64_t *offsets, const int64_t *ids, const uint8_t *skip, const float *it, "
               "float *xe, float *m_out, float *s_out, float *t_out, float *ls_out, uint8_t *bad, uint8_t *mask, "
               "int64_t *slot);"
               "int64_t support_grad(void *out, int64_t out_stride, int64_t v, const int64_t *rows, int64_t n_rows, "
               "const int64_t *offsets, const int64_t *ids, const int64_t *tokens, const float *lp, const float *gc, "
               "const float *gt, const float *it, const void *z, int64_t z_stride, const uint8_t *mask, "
               "const int64_t *slot, const float *m, const float *ls)")
_SUPPORT_SIGS = {"support_stats": (_I, [_P, _I, _I, _P, _I, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P]),
                 "support_grad": (_I, [_P, _I, _I, _P, _I, _P, _P, _P, _P, _P, _P, _P, _P, _I, _P, _P, _P, _P])}
_SUPPORT_LOCK = threading.Lock()
_SUPPORT_READY: dict[int, bool] = {}
#: A row whose support holds at least ``V / WIDE_DIVISOR`` ids is *wide*: its forward also writes a ``V``-byte
#: membership mask (in the gather's loop), and its backward is one streaming write of the gradient row from the
#: logits and that mask instead of a scatter of its entries (see :class:`WideRows`). The masks take ``V`` bytes
#: per wide row, at most ``WIDE_DIVISOR / 8`` of the bytes of the row's int64 ids.
WIDE_DIVISOR = 2


class WideRows:
    """What the forward of the ``cpu`` support pass keeps for the streaming backward of its wide rows.

    Attributes:
        slot: ``[N]`` int64, the row's index into ``mask`` or ``-1`` (a narrow row, a skipped one, a row whose ids
            repeat: the entry path).
        mask: ``[n_wide, V]`` uint8, ``mask[slot[r], v] = [v in S_r]``.
        m: ``[N]`` fp32 the max of the support's logits; ls: ``[N]`` fp32 the log of the row's sum (the C loop's own
            values, so that the backward's ``p^S`` is the forward's ``exp(lp)`` to the last bit).
    """

    __slots__ = ("slot", "mask", "m", "ls")

    def __init__(self, slot: Tensor, mask: Tensor, m: Tensor, ls: Tensor):
        self.slot, self.mask, self.m, self.ls = slot, mask, m, ls


def _canonical(text: str) -> str:
    return " ".join(text.replace("\\", " ").split())


def _support_kernels(logits: Tensor):
    """``(lib, suffix)`` with the support loops declared, or None where this dtype takes the PyTorch backend."""
    kernels = _kernels(logits)
    if kernels is None:
        return None
    lib, suffix = kernels
    with _SUPPORT_LOCK:
        if id(lib) not in _SUPPORT_READY:
            fn = getattr(lib, "offpolicy_support_abi", None)
            ok = fn is not None
            if ok:
                fn.restype = ctypes.c_char_p
                ok = _canonical(fn().decode(errors="replace")) == _canonical(SUPPORT_ABI)
            if ok:
                for name, (ret, args) in _SUPPORT_SIGS.items():
                    for sfx in cpu_native.dtypes():
                        f = getattr(lib, f"{name}_{sfx}")
                        f.argtypes, f.restype = args, ret
            _SUPPORT_READY[id(lib)] = ok
        if not _SUPPORT_READY[id(lib)]:
            raise RuntimeError("backend 'cpu': the native library's support loops do not match this module's "
                               "declarations (offpolicy_support_abi); rebuild it or use backend='torch'")
    return lib, suffix


def _check_support_offsets(offsets: Tensor, nnz: int, n: int) -> None:
    """The C support loops index ``ids`` and the ``[nnz]`` outputs by ``offsets`` without bounds: refuse offsets
    that are not ``0 = offsets[0] <= ... <= offsets[n] = nnz`` (a record's offsets changed in place after its
    construction check, then used with ``validate=False``). ``O(N)`` on CPU tensors, before any native call."""
    if offsets.numel() != n + 1 or int(offsets[0]) != 0 or int(offsets[-1]) != nnz or \
            bool((offsets[1:] < offsets[:-1]).any()):
        raise ValueError(f"candidates.offsets must start at 0, end at nnz = {nnz} and never decrease over {n} rows "
                         "(were they changed in place after the record was built?)")


def support_stats(logits: Tensor, offsets: Tensor, ids: Tensor, inv_temp: Tensor, skip: Tensor | None, *,
                  keep_wide: bool = False):
    """The contract of :func:`torch_backend.support_stats` in C: per row, one gather of its support's logits into
    the ``[nnz]`` output, then two vector passes over that contiguous copy while it is in cache (the max and the
    sums; the log-probabilities, in place). Rows holding NaN or ``+inf`` in their support are recomputed by the
    PyTorch backend.

    With ``keep_wide``, returns ``(lp, lse, entropy, wide)``: ``wide`` is a :class:`WideRows` for the rows of at
    least ``V / WIDE_DIVISOR`` ids (their byte masks written in the gather's loop), or None where there are none
    (or the dtype takes the PyTorch backend); :func:`support_grad` takes it with the same logits."""
    kernels = _support_kernels(logits)
    if kernels is None:
        out = torch_backend.support_stats(logits, offsets, ids, inv_temp, skip)
        return (*out, None) if keep_wide else out
    lib, suffix = kernels
    logits = _unit_stride(logits)
    n, v = logits.shape
    nnz = ids.numel()
    if n == 0 or v == 0 or nnz == 0:
        out = (torch.full((nnz,), -float("inf"), dtype=torch.float32),
               torch.full((n,), float("inf"), dtype=torch.float32), torch.zeros(n, dtype=torch.float32))
        return (*out, None) if keep_wide else out
    offsets, ids = offsets.to(torch.int64).contiguous(), ids.to(torch.int64).contiguous()
    _check_support_offsets(offsets, nnz, n)
    it = inv_temp.float().contiguous()
    sk = None if skip is None else skip.to(torch.uint8).contiguous()
    mz, s, t2, ls = (torch.empty(n, dtype=torch.float32) for _ in range(4))
    bad = torch.empty(n, dtype=torch.uint8)
    lp = torch.empty(nnz, dtype=torch.float32)
    rows = torch.arange(n, dtype=torch.int64)
    slot = mask = None
    if keep_wide:
        wide = (offsets[1:] - offsets[:-1]) * WIDE_DIVISOR >= v
        if sk is not None:
            wide &= ~sk.bool()
        n_wide = int(wide.sum())
        if n_wide:
            slot = torch.where(wide, torch.cumsum(wide, 0) - 1, torch.full_like(offsets[1:], -1))
            mask = torch.empty(n_wide, v, dtype=torch.uint8)
    call = getattr(lib, f"support_stats_{suffix}")
    stride = logits.stride(0) * logits.element_size()

    def body(lo: int, hi: int) -> None:
        if call(logits.data_ptr(), stride, v, rows[lo:].data_ptr(), hi - lo, offsets.data_ptr(), ids.data_ptr(),
                None if sk is None else sk.data_ptr(), it.data_ptr(), lp.data_ptr(), mz.data_ptr(), s.data_ptr(),
                t2.data_ptr(), ls.data_ptr(), bad.data_ptr(), None if mask is None else mask.data_ptr(),
                None if slot is None else slot.data_ptr()) != 0:
            raise RuntimeError(f"backend 'cpu': support_stats_{suffix}: an id outside [0, {v}) in the record (not read; the outputs are discarded)")

    row_threads.for_chunks(n, ROWS_PER_CALL, body)
    # s = 0 on rows without mass and on skipped rows: lse = +inf, entropy 0 (and lp = -inf from the C loop)
    has = s > 0
    safe_s = torch.where(has, s, torch.ones_like(s))
    log_s = torch.log(safe_s)
    lse = torch.where(has, mz * it + log_s, torch.full_like(s, float("inf")))
    entropy = torch.where(has, log_s - t2 * LN2 / safe_s, torch.zeros_like(s))
    # NaN or +inf in a support, or z / tau overflowing: the PyTorch backend's values (NaN) for those rows
    redo = bad.bool() | (has & ~torch.isfinite(lse))
    if bool(redo.any()):
        lengths = offsets[1:] - offsets[:-1]
        r_lp, r_lse, r_ent = torch_backend.support_stats(logits, offsets, ids, it, ~redo)
        lp = torch.where(torch.repeat_interleave(redo, lengths, output_size=nnz), r_lp, lp)
        lse, entropy = torch.where(redo, r_lse, lse), torch.where(redo, r_ent, entropy)
        if slot is not None:
            slot.masked_fill_(redo, -1)
    if not keep_wide:
        return lp, lse, entropy
    return lp, lse, entropy, None if slot is None else WideRows(slot, mask, mz, ls)


def support_grad(lp: Tensor, offsets: Tensor, ids: Tensor, tokens: Tensor, inv_temp: Tensor, grad_lp: Tensor | None,
                 grad_target: Tensor, live: Tensor, out: Tensor, *, wide: WideRows | None = None,
                 logits: Tensor | None = None) -> Tensor:
    """The contract of :func:`torch_backend.support_grad` in C: per live row, the gradient row zeroed and each
    support entry written once (the token's term folded in); rows not live are zeroed. With ``wide`` (from
    :func:`support_stats` on ``logits``, unchanged since) and no ``grad_lp``, a wide row's gradient is one streaming
    write of the row, from its logits and byte mask (the same values)."""
    kernels = _support_kernels(out)
    if kernels is None:
        return torch_backend.support_grad(lp, offsets, ids, tokens, inv_temp, grad_lp, grad_target, live, out)
    lib, suffix = kernels
    n, v = out.shape
    if n == 0 or v == 0:
        return out
    if v > 1 and out.stride(1) != 1:
        raise ValueError(f"out must have unit stride along V, got strides {out.stride()}")
    rows = live.nonzero().view(-1)
    dead = (~live).nonzero().view(-1)
    if dead.numel():
        out.index_fill_(0, dead, 0)
    if rows.numel() == 0:
        return out
    offsets, ids = offsets.to(torch.int64).contiguous(), ids.to(torch.int64).contiguous()
    _check_support_offsets(offsets, ids.numel(), n)
    tok = tokens.to(torch.int64).contiguous()
    it = inv_temp.float().contiguous()
    lp = lp.float().contiguous()
    gt = grad_target.float().contiguous()
    gc = None if grad_lp is None else grad_lp.float().contiguous()
    stream = wide is not None and gc is None
    if stream:
        if logits is None or logits.shape != out.shape or logits.dtype != out.dtype or \
                wide.mask.shape[1:] != (v,) or wide.slot.shape != (n,):
            raise ValueError("support_grad: wide rows need the forward's logits [N, V] (the gradient's dtype) and "
                             "its WideRows")
        z = _unit_stride(logits)
        z_ptr, z_stride = z.data_ptr(), z.stride(0) * z.element_size()
        mask_ptr, slot_ptr, m_ptr, ls_ptr = (wide.mask.data_ptr(), wide.slot.data_ptr(), wide.m.data_ptr(),
                                             wide.ls.data_ptr())
    else:
        z_ptr, z_stride, mask_ptr, slot_ptr, m_ptr, ls_ptr = None, 0, None, None, None, None
    call = getattr(lib, f"support_grad_{suffix}")
    stride = out.stride(0) * out.element_size()

    def body(lo: int, hi: int) -> None:
        if call(out.data_ptr(), stride, v, rows[lo:].data_ptr(), hi - lo, offsets.data_ptr(), ids.data_ptr(),
                tok.data_ptr(), lp.data_ptr(), None if gc is None else gc.data_ptr(), gt.data_ptr(),
                it.data_ptr(), z_ptr, z_stride, mask_ptr, slot_ptr, m_ptr, ls_ptr) != 0:
            raise RuntimeError(f"backend 'cpu': support_grad_{suffix}: an id or token outside [0, {v}) (not written; the gradient is discarded)")

    row_threads.for_chunks(rows.numel(), ROWS_PER_CALL, body)
    return out
