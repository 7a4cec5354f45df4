"""Row-parallel loops for the CPU backend: each worker thread takes a contiguous share of the row chunks and runs
its PyTorch ops with one intra-op thread.

Why not PyTorch's own intra-op threads: every op on a cache-sized chunk is a parallel region, and each region
waits for all its threads; on a machine whose cores are shared (2 cores, other jobs) one descheduled thread stalls
every op, and a pass over a chunk that takes 0.1 ms alone can take 10-30 ms. Independent workers only meet once,
at the end of the loop. The number of workers is ``torch.get_num_threads()`` of the calling thread (at most the
number of chunks); the ops release the GIL, so the workers run in parallel. Around the loops the logits
primitive runs its small ops with one intra-op thread too (:func:`single_intra_op`), entered once per call where
the call starts running: eagerly at the public boundary (:func:`offpolicy.policy_loss` with CPU logits, or
:func:`~offpolicy.ops.sparse_log_softmax`) and in the autograd function's backward, and in a compiled graph by the
custom ops of :mod:`offpolicy.ops.library`; the loops below run inside it.

Threads and fork: the worker pool is global and shared by every calling thread (their chunks queue on it; a task
never waits on another task, so callers cannot deadlock each other). One lock covers taking the pool, growing it
and submitting a loop's shares, so a thread growing the pool never shuts down one that another thread is about to
submit to. A forked child inherits the pool object but not its threads (work submitted there would wait forever):
:func:`os.register_at_fork` drops the pool and its lock in the child, which makes a new pool on its first loop. The
per-thread state (:func:`single_intra_op`'s saved thread count) needs no reset: Python discards the other threads'
in the child, and the forking thread's still matches its own stack there.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

import torch

T = TypeVar("T")
_POOL: ThreadPoolExecutor | None = None
_POOL_SIZE = 0
_POOL_LOCK = threading.Lock()
_LOCAL = threading.local()


def _reset_after_fork() -> None:
    """In a forked child: forget the parent's pool (its threads do not exist here) and take a fresh lock."""
    global _POOL, _POOL_SIZE, _POOL_LOCK
    _POOL, _POOL_SIZE, _POOL_LOCK = None, 0, threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


@contextmanager
def single_intra_op() -> Iterator[None]:
    """Run the calling thread's ops with one intra-op thread, keeping its thread count for :func:`for_chunks`.

    The ``O(N K)`` ops around the vocabulary passes are small parallel regions; on a shared machine each can wait
    milliseconds for a descheduled thread. Inside this context only :func:`for_chunks` runs in parallel. Eager
    code only (the callers do not enter it while ``torch.compile`` traces); nested, it is a no-op.
    """
    if getattr(_LOCAL, "workers", None) is not None:
        yield
        return
    threads = torch.get_num_threads()
    _LOCAL.workers = threads
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        _LOCAL.workers = None


def _pool(workers: int) -> ThreadPoolExecutor:
    """The shared pool, grown to at least ``workers`` threads; call with ``_POOL_LOCK`` held."""
    global _POOL, _POOL_SIZE
    if _POOL is None or _POOL_SIZE < workers:
        if _POOL is not None:
            _POOL.shutdown(wait=False)
        _POOL = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="offpolicy-rows",
                                   initializer=torch.set_num_threads, initargs=(1,))
        _POOL_SIZE = workers
    return _POOL


def for_chunks(total: int, step: int, body: Callable[[int, int], None]) -> None:
    """Call ``body(lo, hi)`` for every chunk ``[lo, hi)`` of ``range(total)`` in steps of ``step``.

    Chunks are split into contiguous shares, one per worker; ``body`` must only write outputs of its own rows. The
    calling thread takes the first share; inside :func:`single_intra_op` (where the op's callers run it) it does so
    with one intra-op thread, like the workers. Eager code only: the backends call it at run time (directly, or
    inside a custom op), never while ``torch.compile`` traces.
    """
    starts = list(range(0, total, step))
    threads = getattr(_LOCAL, "workers", None) or torch.get_num_threads()
    workers = min(len(starts), max(1, threads))
    if workers <= 1:
        for lo in starts:
            body(lo, min(total, lo + step))
        return

    grad_enabled = torch.is_grad_enabled()  # thread-local: the workers take the caller's mode

    def share(first: int, last: int) -> None:
        with torch.set_grad_enabled(grad_enabled):
            for lo in starts[first:last]:
                body(lo, min(total, lo + step))

    bounds = [len(starts) * w // workers for w in range(workers + 1)]
    with _POOL_LOCK:
        pool = _pool(workers)
        futures = [pool.submit(share, bounds[w], bounds[w + 1]) for w in range(1, workers)]
    share(bounds[0], bounds[1])  # the calling thread works too
    for f in futures:
        f.result()


def per_worker(make: Callable[[], T]) -> Callable[[], T]:
    """A getter that returns one object per worker thread, made by ``make()`` on that worker's first call (scratch
    buffers of a :func:`for_chunks` body: each worker reuses its own across its chunks)."""
    made: dict[int, T] = {}

    def get() -> T:
        key = threading.get_ident()
        if key not in made:  # only this thread writes this key
            made[key] = make()
        return made[key]

    return get
