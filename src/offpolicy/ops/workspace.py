"""Reused gradient buffers for the CPU path: a fresh ``[N, V]`` buffer costs a page fault per 4 KiB on first touch,
which on CPU costs as much as reading the logits; a buffer reused across calls has its pages already mapped.

:func:`gradient_buffer` hands out a tensor on a storage kept from the previous call of the same size and dtype when
nothing else holds that storage any more (the previous gradient was released, e.g. ``logits.grad = None``);
otherwise it allocates a new one and keeps that instead. So the workspace never holds memory that a caller could
still see, never more than one buffer per (device, dtype), and peak memory during a call is unchanged; between
calls it keeps the last gradient-sized buffer alive. Set ``OFFPOLICY_REUSE_GRAD=0`` to turn reuse off, or call
:func:`release` to free the kept buffers. Only CPU tensors are pooled (CUDA's caching allocator already reuses).

Threads: one lock makes "nobody else holds the kept storage" and "hand it out" one step, so two threads running a
backward at once never get the same storage (the hand-out takes a reference, and every later test sees it). A lock
rather than one workspace per thread: it keeps the bound of one kept buffer per (device, dtype) whatever the number
of threads, the critical section is a few dictionary and tensor-header operations (no ``[N, V]`` work, nothing
that waits), and an uncontended lock costs well under a microsecond against a backward of milliseconds. Under
contention the loser gets a new buffer, as it would if the storage were held. A forked child gets a fresh lock
(:func:`os.register_at_fork`): a lock held by a parent thread that does not exist in the child would never be
released there.
"""

from __future__ import annotations

import os
import threading

import torch
from torch import Tensor

ENV_VAR = "OFFPOLICY_REUSE_GRAD"
_KEPT: dict[tuple[torch.device, torch.dtype], torch.UntypedStorage] = {}
_LOCK = threading.Lock()


def _reset_after_fork() -> None:
    global _LOCK
    _LOCK = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


def enabled(device: torch.device) -> bool:
    """Whether buffers for ``device`` are reused (CPU, unless ``OFFPOLICY_REUSE_GRAD=0``)."""
    return device.type == "cpu" and os.environ.get(ENV_VAR, "1") != "0"


def gradient_buffer(like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """An uninitialised contiguous tensor of ``like``'s shape (and ``dtype``, default ``like``'s) for a gradient.

    Its contents are arbitrary (a previous gradient): callers overwrite every element. Thread-safe: a storage is
    handed to one caller at a time (see the module docstring). Eager code only (a traced graph allocates its own
    buffers).
    """
    dtype = like.dtype if dtype is None else dtype
    if not enabled(like.device):
        return torch.empty(like.shape, dtype=dtype, device=like.device)
    key = (like.device, dtype)
    nbytes = like.numel() * torch.empty((), dtype=dtype).element_size()
    strides = torch.empty(like.shape, dtype=dtype, device="meta").stride()
    with _LOCK:
        kept = _KEPT.get(key)
        # Use count 1: only this workspace refers to the storage (no tensor, no view, no other storage object).
        if kept is not None and kept.nbytes() == nbytes and torch._C._storage_Use_Count(kept._cdata) == 1:
            return torch.empty(0, dtype=dtype, device=like.device).set_(kept, 0, like.shape, strides)
    out = torch.empty(like.shape, dtype=dtype, device=like.device)
    if nbytes:
        with _LOCK:
            _KEPT[key] = out.untyped_storage()
    return out


def release() -> None:
    """Drop every kept buffer (its memory is freed once no caller holds it)."""
    with _LOCK:
        _KEPT.clear()
