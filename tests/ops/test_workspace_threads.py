"""Threads sharing the CPU path (issue 22, finding 2): backwards run at once from several threads give bit for bit
the serial gradients, the reused gradient buffer is never handed to two live callers, and threads growing the
shared row-worker pool never break one another's loops.

The race in the workspace needs a thread switch between "nobody holds the kept storage" and "hand it out". Left
to the interpreter's switch interval (even at 1 us) it showed in 5 (torch backend) and 7 (native backend) of 10
runs of 4 threads x 300 backwards; the tests make it likely instead: a yield inside the use-count test
(``_yielding_use_count``) and a barrier before each round, so that the four threads reach the hand-out together.
Without the workspace's lock these tests failed in every run (3 of 3, both backends); with it the yield happens
while the lock is held and changes nothing. The pool test yields the same way between taking the pool and
submitting to it.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from offpolicy.ops import row_threads, sparse_log_softmax, workspace

THREADS = 4
N, V, K = 4, 64, 3


@pytest.fixture(autouse=True)
def _fresh_workspace():
    workspace.release()
    yield
    workspace.release()


@pytest.fixture
def _yielding_use_count(monkeypatch):
    """Give the other threads the interpreter right after each use-count test (where the race needs a switch)."""
    use_count = torch._C._storage_Use_Count

    def yielding(cdata):
        count = use_count(cdata)
        time.sleep(0)
        return count

    monkeypatch.setattr(torch._C, "_storage_Use_Count", yielding)


def _run_threads(work, barrier: threading.Barrier) -> list[BaseException]:
    """Run ``work(i)`` on each of the threads; the errors they raised (a failing thread breaks the barrier, so the
    others stop at once instead of waiting out its timeout)."""
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            work(i)
        except BaseException as err:  # noqa: BLE001 (reported by the test)
            errors.append(err)
            barrier.abort()

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    return errors


def _grad(z, y, c, backend):
    leaf = z.clone().requires_grad_()
    out = sparse_log_softmax(leaf, y, c, 0.8, backend=backend)
    (out.target.sum() + torch.where(c >= 0, out.candidates, 0.0).sum()).backward()
    return leaf.grad


@pytest.mark.parametrize("backend", ["torch", None], ids=["torch", "default"])
@pytest.mark.usefixtures("_yielding_use_count")
def test_concurrent_backwards_equal_serial(backend):
    gen = torch.Generator().manual_seed(3)
    zs = [torch.randn(N, V, generator=gen) for _ in range(THREADS)]
    y = torch.randint(0, V, (N,), generator=gen)
    c = torch.randint(-1, V, (N, K), generator=gen)
    serial = [_grad(z, y, c, backend).clone() for z in zs]
    barrier = threading.Barrier(THREADS)
    wrong = []

    def work(i: int) -> None:
        for step in range(30):
            barrier.wait(timeout=60)
            g = _grad(zs[i], y, c, backend)
            barrier.wait(timeout=60)  # every thread holds its gradient: a shared buffer shows in one of them
            if not torch.equal(g, serial[i]):
                wrong.append((i, step, float((g - serial[i]).abs().max())))
            del g

    assert not _run_threads(work, barrier)
    assert not wrong, f"(thread, step, max difference) of gradients unlike the serial ones: {wrong}"


@pytest.mark.usefixtures("_yielding_use_count")
def test_direct_calls_never_share_a_storage():
    like = torch.empty(3, 5)
    barrier = threading.Barrier(THREADS)
    live: dict[int, int] = {}
    lock = threading.Lock()
    shared = []

    def work(i: int) -> None:
        barrier.wait(timeout=60)
        for _ in range(300):
            buf = workspace.gradient_buffer(like)
            ptr = buf.data_ptr()
            with lock:
                if live.get(ptr):
                    shared.append(ptr)
                live[ptr] = live.get(ptr, 0) + 1
            time.sleep(0)
            with lock:
                live[ptr] -= 1
            del buf

    assert not _run_threads(work, barrier)
    assert not shared, f"{len(shared)} hand-outs of a storage that another thread still held"


def test_threads_growing_the_pool_do_not_break_each_other(monkeypatch):
    """Each round starts without a pool; threads asking for 2..5 workers grow it while the others submit to it
    (a yield after taking the pool gives the others the moment where the race needs a switch)."""
    take_pool = row_threads._pool

    def yielding_pool(workers):
        pool = take_pool(workers)
        time.sleep(0)
        return pool

    monkeypatch.setattr(row_threads, "_pool", yielding_pool)
    done = []
    barrier = threading.Barrier(THREADS)

    def work(i: int) -> None:
        torch.get_num_threads()  # a new thread takes the process's count on its first call, then keeps its own
        torch.set_num_threads(2 + i)
        for _ in range(40):
            barrier.wait(timeout=60)
            if i == 0:
                monkeypatch.setattr(row_threads, "_POOL", None)
                monkeypatch.setattr(row_threads, "_POOL_SIZE", 0)
            barrier.wait(timeout=60)
            seen = []
            row_threads.for_chunks(12, 1, lambda lo, hi: seen.append(lo))
            done.append(sorted(seen) == list(range(12)))

    errors = _run_threads(work, barrier)
    assert not errors, f"{len(errors)} loops failed, e.g. {errors[0]!r}"
    assert len(done) == 40 * THREADS and all(done)
