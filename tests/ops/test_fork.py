"""A forked child after first use (issue 22, finding 3): data-loader workers and ``multiprocessing`` with the fork
start method inherit the parent's row-worker pool, whose threads do not exist in the child. The child must run a
forward and backward with several workers and get the parent's results bit for bit; each child is bounded by a
timeout, so a deadlock fails the test instead of hanging it."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch

from offpolicy.ops import sparse_log_softmax
from offpolicy.ops.logits_op import torch_backend

TIMEOUT_S = 30
WORKERS = 3
N, V, K = 40, 301, 4


def _forward_backward(backend):
    gen = torch.Generator().manual_seed(5)
    z = torch.randn(N, V, generator=gen).requires_grad_()
    y = torch.randint(0, V, (N,), generator=gen)
    c = torch.randint(-1, V, (N, K), generator=gen)
    out = sparse_log_softmax(z, y, c, torch.linspace(0.6, 1.4, N), backend=backend)
    (out.target.sum() + torch.where(c >= 0, out.candidates, 0.0).sum()).backward()
    return out.lse.detach(), z.grad


def _child(backend, expected) -> int:
    """The child's work: 0 when its results equal the parent's, 1 when they differ."""
    torch.set_num_threads(WORKERS)
    got = _forward_backward(backend)
    return 0 if all(torch.equal(a, b) for a, b in zip(got, expected)) else 1


def _mp_target(backend, expected) -> None:
    raise SystemExit(_child(backend, expected))


def _wait_os_fork(pid: int) -> int:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail(f"the forked child did not finish within {TIMEOUT_S} s (deadlock)")


@pytest.mark.parametrize("start", ["os.fork", "multiprocessing"])
@pytest.mark.parametrize("backend", ["torch", None], ids=["torch", "default"])
def test_forked_child_after_first_use(monkeypatch, backend, start):
    monkeypatch.setattr(torch_backend, "CHUNK_BYTES", 4 * 4 * V)  # 4 rows per chunk: every worker gets chunks
    before = torch.get_num_threads()
    torch.set_num_threads(WORKERS)
    try:
        expected = _forward_backward(backend)  # first use: the parent's pool now has worker threads
        if start == "os.fork":
            pid = os.fork()
            if pid == 0:  # the child: never return into pytest
                code = 2
                try:
                    code = _child(backend, expected)
                finally:
                    os._exit(code)
            code = _wait_os_fork(pid)
        else:
            proc = multiprocessing.get_context("fork").Process(target=_mp_target, args=(backend, expected))
            proc.start()
            proc.join(TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
                pytest.fail(f"the forked child did not finish within {TIMEOUT_S} s (deadlock)")
            code = proc.exitcode
    finally:
        torch.set_num_threads(before)
    assert code == 0, f"the child exited with {code} (1: results unlike the parent's, 2: it raised)"


def test_forked_child_while_another_thread_holds_the_build_lock():
    """A fork while a thread is inside ``cpu_native.load`` (the first build holds its lock): the child's own
    ``load()`` must not wait on a lock whose holder does not exist in the child."""
    import threading

    from offpolicy.ops import cpu_native

    cpu_native.load()  # the library is built; the child only has to take the lock
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with cpu_native._LOCK:
            held.set()
            release.wait(TIMEOUT_S)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(TIMEOUT_S)
    try:
        pid = os.fork()
        if pid == 0:
            code = 2
            try:
                cpu_native.load()
                code = 0
            finally:
                os._exit(code)
        code = _wait_os_fork(pid)
    finally:
        release.set()
        holder.join()
    assert code == 0, f"the child exited with {code}"
