"""Run a function on ``world_size`` gloo processes on 127.0.0.1 and collect what each rank returns.

Used by the ``test_distributed*`` files. One spawn serves many cases, even across test files (process start-up
dominates the cost): :func:`suite_worker` imports each named test module in every rank, runs the cases its
``build_cases(rank, world)`` returns, and reports per case None (passed) or the failure text, so that a pytest
test per case can report it (:func:`case_verdict`).

Bounded and clean: rank 0 opens a ``TCPStore`` on a free port chosen by the OS (port 0) and hands the port to the
other ranks through a queue, so there is no race for a port; every collective has a timeout
(``COLLECTIVE_TIMEOUT``); the parent waits at most ``timeout`` seconds, then kills the processes it started; every
rank calls ``destroy_process_group`` on the way out.
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HOST = "127.0.0.1"
#: Seconds a collective may wait before gloo raises (turns a desynchronised case into an error, not a hang).
COLLECTIVE_TIMEOUT = 60


def _entry(rank: int, world: int, port_q, result_q, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)
    store = None
    try:
        if rank == 0:
            store = dist.TCPStore(HOST, 0, world, True, timedelta(seconds=COLLECTIVE_TIMEOUT),
                                  wait_for_workers=False)
            for _ in range(world - 1):
                port_q.put(store.port)
        else:
            port = port_q.get(timeout=COLLECTIVE_TIMEOUT)
            store = dist.TCPStore(HOST, port, world, False, timedelta(seconds=COLLECTIVE_TIMEOUT))
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT)
        )
        result_q.put((rank, True, fn(rank, world, *args)))
    except BaseException:  # report anything, including a failing import or init, to the parent
        result_q.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 150.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; return the per-rank results.

    ``fn`` must be a module-level function (it is pickled by name). Raises ``RuntimeError`` with the failing
    rank's traceback, or on timeout.
    """
    ctx = mp.get_context("spawn")
    port_q, result_q = ctx.Queue(), ctx.Queue()
    env = {"OMP_NUM_THREADS": "1"}
    if not torch.cuda.is_available():
        # Cases that ask for backend="triton" run Triton's CPU interpreter (read when the kernels are defined).
        env["TRITON_INTERPRET"] = os.environ.get("TRITON_INTERPRET", "1")
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        procs = [ctx.Process(target=_entry, args=(r, world_size, port_q, result_q, fn, args), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"distributed run timed out after {timeout:.0f} s ({len(results)} ranks done)")
            try:
                rank, ok, payload = result_q.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead and result_q.empty():
                    time.sleep(0.5)
                    if result_q.empty():
                        raise RuntimeError(f"a rank died with exit code {dead[0].exitcode} before reporting")
                continue
            if ok:
                results[rank] = payload
            else:
                errors.append(f"rank {rank}:\n{payload}")
        if errors:
            raise RuntimeError("distributed run failed on " + "\n".join(errors))
        return [results[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=max(0.1, min(10.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def run_cases(cases: dict[str, Callable[[], None]]) -> dict[str, str | None]:
    """Run each case (a closure over this rank's state) in order; None where it passed, else its traceback.

    Cases must issue the same collectives on every rank whether their checks pass or not: compute first,
    assert after the last collective.
    """
    out: dict[str, str | None] = {}
    for name, case in cases.items():
        try:
            case()
            out[name] = None
        except Exception:
            out[name] = traceback.format_exc()
    return out


def merge_rank_reports(reports: list[dict[str, str | None]]) -> dict[str, str | None]:
    """One verdict per case over all ranks: None if every rank passed, else the failures by rank."""
    merged: dict[str, str | None] = {}
    for name in reports[0]:
        fails = [f"rank {r}: {rep[name]}" for r, rep in enumerate(reports) if rep.get(name)]
        merged[name] = "\n".join(fails) if fails else None
    return merged


_RUNS: dict[tuple, dict[str, str | None] | str] = {}


def case_verdict(fn: Callable, world_size: int, args: tuple, case: str, timeout: float = 150.0) -> str | None:
    """The merged verdict of one case of ``run_distributed(fn, world_size, *args)``, spawning once per key.

    A failed run (crash, timeout) is remembered too, so the other cases of that run fail at once instead of
    spawning again.
    """
    key = (fn.__module__, fn.__qualname__, world_size, args)
    if key not in _RUNS:
        try:
            _RUNS[key] = merge_rank_reports(run_distributed(fn, world_size, *args, timeout=timeout))
        except RuntimeError as err:
            _RUNS[key] = str(err)
    run = _RUNS[key]
    if isinstance(run, str):
        return run
    if case not in run:
        return f"case {case!r} was not run (cases: {sorted(run)})"
    return run[case]


#: The test modules whose cases share one spawn per world size (they need only torch and offpolicy).
SUITES = ("test_distributed_tp", "test_distributed_cp_dp")


def suite_worker(rank: int, world: int, modules: tuple[str, ...]) -> dict[str, str | None]:
    """Run ``build_cases(rank, world)`` of every module in ``modules``; cases are named ``module:case``."""
    import importlib

    torch.manual_seed(0)
    verdicts: dict[str, str | None] = {}
    for name in modules:
        cases = importlib.import_module(name).build_cases(rank, world)
        verdicts.update({f"{name}:{k}": v for k, v in run_cases(cases).items()})
    return verdicts


def suite_verdict(module: str, world_size: int, case: str) -> str | None:
    """The verdict of ``case`` of ``module`` from the shared spawn of :data:`SUITES` on ``world_size`` ranks."""
    return case_verdict(suite_worker, world_size, (SUITES,), f"{module}:{case}")
