"""How :class:`~.fleet_runner.LiveFleet` calls its groups: :class:`RayCalls` (each group a Ray actor, the default)
or :class:`ThreadCalls` (each group a plain object in this process, called on a thread; what the engine-free tests
use, with objects implementing :class:`~.engine_group.EngineGroup`'s ``generate``/``sync``/``info``).

Both give the same four operations: ``call(actor, method, *args)`` returns a handle at once; ``wait(handles,
timeout)`` returns ``(done, waiting)`` with at most one handle done; ``get(handle, timeout=None)`` gives the result or raises
:class:`GroupCallFailed`; ``kill(actor)`` stops it (a thread cannot be stopped: the fleet never reads a killed
group's answer, which is what the Ray kill also guarantees).

A failed call is classified by its cause (:attr:`GroupCallFailed.kind`): ``"died"`` (the engine's process is
gone: Ray's ``RayActorError``; an in-process engine raises :class:`EngineProcessDied` to stand for it), ``"load"``
(the group could not load a weight version: :class:`WeightLoadError`, raised by ``sync``; the group still serves
what it had), ``"stale"`` (:class:`BelowStalenessFloor`: the group cannot reach the staleness floor and generated
nothing), ``"error"`` (the method raised anything else, e.g. a request the engine refuses; the process lives
on) or ``"hung"`` (``get`` ran out of time). :attr:`GroupCallFailed.detail` is plain text, the cause first.
"""

from __future__ import annotations

import concurrent.futures
import re
from collections.abc import Sequence

#: Longest event detail kept (the cause comes first, so a cut never hides it).
DETAIL_CHARS = 600
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


class GroupCallFailed(RuntimeError):
    """A call to a group failed.

    Attributes:
        kind: ``"died"``, ``"load"``, ``"stale"``, ``"error"`` or ``"hung"`` (see the module docstring).
        detail: plain text (no terminal colour codes): ``"<exception type>: <message>"`` of the cause (for
            ``"load"`` and ``"stale"`` the message alone, which names its own cause first).
        version: the weight version the group serves after the failed call, as the group reported it with the
            error (:func:`mark_served`); ``None`` when it did not (a process that died or hung, an error raised
            before anything was loaded).
    """

    def __init__(self, kind: str, detail: str, version: int | None = None):
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail, self.version = kind, detail, version


class EngineProcessDied(RuntimeError):
    """Raised by an in-process engine (:class:`ThreadCalls`) to stand for its process dying."""


class BelowStalenessFloor(RuntimeError):
    """Raised by ``generate`` before sampling when the group cannot serve at the staleness floor it was given (its
    newest loadable version is older): nothing was generated."""


class WeightLoadError(RuntimeError):
    """A group could not load a published weight version (a corrupt or mismatched checkpoint); it keeps serving
    the version it had loaded."""


def mark_served(exc: BaseException, version: int | None) -> BaseException:
    """Attach to ``exc`` (raised by a group's ``sync`` or ``generate``) the version the group serves after it, so
    the fleet counts that version as served (and keeps it) even though the call failed. Returns ``exc``."""
    try:
        exc.served_version = version
    except AttributeError:  # an exception type without attributes: the fleet treats the version as unknown
        pass
    return exc


def served_version(exc: BaseException | None) -> int | None:
    """The version :func:`mark_served` attached to ``exc`` (``None`` when none was)."""
    v = getattr(exc, "served_version", None)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def plain(text: str, limit: int = DETAIL_CHARS) -> str:
    """``text`` without terminal colour codes, whitespace runs collapsed, cut to ``limit`` characters."""
    out = " ".join(_ANSI.sub("", text).split())
    return out if len(out) <= limit else out[: limit - 3] + "..."


def describe(exc: BaseException) -> str:
    """``"<type>: <message>"``, plain text, for an event detail."""
    return plain(f"{type(exc).__name__}: {exc}")


class RayCalls:
    """Groups as Ray actors (``ray.remote(EngineGroup)`` handles)."""

    def call(self, actor: object, method: str, *args: object) -> object:
        return getattr(actor, method).remote(*args)

    def wait(self, handles: Sequence[object], timeout: float) -> tuple[list[object], list[object]]:
        import ray

        return ray.wait(list(handles), num_returns=1, timeout=timeout)

    def get(self, handle: object, timeout: float | None = None) -> object:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

        try:
            return ray.get(handle, timeout=timeout)
        except GetTimeoutError as exc:
            raise GroupCallFailed("hung", f"no answer within {timeout:g} s") from exc
        except RayTaskError as exc:  # the method raised inside a living process; exc.cause is what it raised
            cause = getattr(exc, "cause", None)
            if cause is None:
                raise GroupCallFailed("error", plain(str(exc).strip().splitlines()[-1])) from exc
            kind = ("load" if isinstance(cause, WeightLoadError) else "stale" if isinstance(cause, BelowStalenessFloor)
                    else "error")
            raise GroupCallFailed(kind, describe(cause) if kind == "error" else plain(str(cause)),
                                  served_version(cause)) from exc
        except RayActorError as exc:
            raise GroupCallFailed("died", describe(exc)) from exc
        except RayError as exc:  # object lost, node died, out of memory: the process cannot be trusted
            raise GroupCallFailed("died", describe(exc)) from exc

    def kill(self, actor: object) -> None:
        import ray

        try:
            ray.kill(actor)
        except Exception:  # already gone
            pass


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
        except concurrent.futures.TimeoutError as exc:
            raise GroupCallFailed("hung", f"no answer within {timeout:g} s") from exc
        except EngineProcessDied as exc:
            raise GroupCallFailed("died", describe(exc)) from exc
        except WeightLoadError as exc:  # its message starts with the cause
            raise GroupCallFailed("load", plain(str(exc)), served_version(exc)) from exc
        except BelowStalenessFloor as exc:
            raise GroupCallFailed("stale", plain(str(exc)), served_version(exc)) from exc
        except Exception as exc:
            raise GroupCallFailed("error", describe(exc), served_version(exc)) from exc

    def kill(self, actor: object) -> None:
        """Nothing to stop: the fleet reads no answer of a killed group."""
