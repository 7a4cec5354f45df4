"""How :class:`~.fleet_runner.LiveFleet` calls its groups: :class:`RayCalls` (each group a Ray actor, the default)
or :class:`ThreadCalls` (each group a plain object in this process, called on a thread; what the engine-free tests
use, with objects implementing :class:`~.engine_group.EngineGroup`'s ``generate``/``sync``/``info``).

Both give the same four operations: ``call(actor, method, *args)`` returns a handle at once; ``wait(handles,
timeout)`` returns ``(done, waiting)`` with at most one handle done; ``get(handle, timeout=None)`` gives the result or raises
:class:`GroupCallFailed`; ``kill(actor)`` stops it (a thread cannot be stopped: the fleet never reads a killed
group's answer, which is what the Ray kill also guarantees).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence


class GroupCallFailed(RuntimeError):
    """A call to a group raised (its process died, or its method raised)."""


class RayCalls:
    """Groups as Ray actors (``ray.remote(EngineGroup)`` handles)."""

    def call(self, actor: object, method: str, *args: object) -> object:
        return getattr(actor, method).remote(*args)

    def wait(self, handles: Sequence[object], timeout: float) -> tuple[list[object], list[object]]:
        import ray

        return ray.wait(list(handles), num_returns=1, timeout=timeout)

    def get(self, handle: object, timeout: float | None = None) -> object:
        import ray
        from ray.exceptions import RayError

        try:
            return ray.get(handle, timeout=timeout)
        except RayError as exc:
            raise GroupCallFailed(f"{type(exc).__name__}: {str(exc)[:200]}") from exc

    def kill(self, actor: object) -> None:
        import ray

        ray.kill(actor)


class ThreadCalls:
    """Groups as objects in this process, each call on a worker thread of one pool.

    Args:
        max_workers: threads in the pool (a hung call holds one until it returns).
    """

    def __init__(self, max_workers: int = 16):
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="fleet-group")

    def call(self, actor: object, method: str, *args: object) -> concurrent.futures.Future:
        return self.pool.submit(getattr(actor, method), *args)

    def wait(self, handles: Sequence[concurrent.futures.Future],
             timeout: float) -> tuple[list[concurrent.futures.Future], list[concurrent.futures.Future]]:
        done, _ = concurrent.futures.wait(handles, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)
        first = [h for h in handles if h in done][:1]
        return first, [h for h in handles if h not in first]

    def get(self, handle: concurrent.futures.Future, timeout: float | None = None) -> object:
        try:
            return handle.result(timeout)
        except Exception as exc:
            raise GroupCallFailed(f"{type(exc).__name__}: {str(exc)[:200]}") from exc

    def kill(self, actor: object) -> None:
        """Nothing to stop: the fleet reads no answer of a killed group."""
