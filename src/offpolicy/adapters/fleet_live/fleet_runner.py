"""A fleet of live engine groups under Ray: the trainer (the driver) routes sessions to groups with
:class:`offpolicy.fleet.Router`, collects every turn with its group, served version and record, collates them, and
publishes weights after each step; a group that dies or hangs is restarted (a bounded number of times) and its
sessions move to the others meanwhile.

    fleet = LiveFleet(groups, model_dir, work_dir)          # ray.init() locally, or address="ray://head:10001"
    fleet.start()
    fleet.publish(model.state_dict(), 0)
    batch = fleet.rollout(prompts, sampling_params, turns=2, between=[tool_id])   # a LiveBatch
    out = op.policy_loss(batch.batch.gather(model(batch.sequences).logits), ..., groups=batch.group_ids,
                         versions=batch.batch.versions, current_version=fleet.version)
    fleet.publish(model.state_dict(), 1)
    fleet.close()

Calls: each group has at most one call in flight; a session whose turn is answered goes on to its next turn at
once (its group's next call), so a slow group never holds back the others' sessions. A call's time limit is the
group's ``timeout_s`` plus ``token_timeout_s`` per token it asks for (requests x ``max_tokens``).

Faults, by cause (:class:`FleetEvent` ``kind``):

- ``"died"`` (the engine process is gone: ``RayActorError``), ``"hung"`` (no answer within the call's limit) and
  ``"invalid"`` (an answer that fails :func:`~.validate.check_answer`): the group's actor is killed (a late answer
  can never arrive), the group is drained in the router, and the call's sessions are sent again, unchanged, to the
  groups left. The group is started again after ``restart_backoff_s`` (doubling per restart), at most
  ``max_restarts`` times (``"restarted"`` when it serves again); then it is dropped (``"dropped"``). "every engine
  group has failed" is raised only when no group is alive or starting again.
- ``"load_failed"`` (``sync`` raised :class:`~.calls.WeightLoadError`: a corrupt or mismatched checkpoint): that
  call fails, its sessions are sent again, and the group goes on serving the last version it loaded (it skips
  the bad version). A group that cannot serve at all in a rollout (its loads keep failing, or it cannot reach
  the staleness floor) gets no more sessions in that rollout; when no group can, the rollout raises naming why.
- ``"error"`` (``generate`` raised anything else inside a living engine, e.g. a request it refuses): the rollout
  raises :class:`GroupRequestError` naming the group and the cause; the group stays alive.

A session's trajectory grows only from a call that succeeded and passed the checks, so no turn is lost or kept
twice; the turns a failed group served earlier stay. Event details are plain text with the cause first.

Staleness, as the loss sees it: a batch is trained at the trainer's version ``trained_at`` (the ``current_version``
of ``op.policy_loss``; a rollout that runs one step ahead of the trainer is trained after one more publish, so the
trainer passes ``trained_at = version + 1``). With ``max_staleness = m`` every call asks its group to sync when the
group's loaded version is below the floor ``trained_at - m``, before generating, and is sent only once the floor is
published (the rollout waits for the trainer's publish when the floor is ahead of it: ``m = 0`` with a one-step
lookahead is on-policy). So every turn of the batch was served at ``>= trained_at - m``. An answer below the floor
(a group that did not sync) is refused (``"stale"``, its turns counted in the status table's ``refused``
column) and its sessions sent again. A group loads the newest version otherwise only when it is ``sync_every`` or
more versions behind (``1``: every call).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from offpolicy.adapters.common import RecordError, Trajectory, collate
from offpolicy.adapters.fleet_live.calls import DETAIL_CHARS, GroupCallFailed, RayCalls, ThreadCalls, plain
from offpolicy.adapters.fleet_live.validate import check_answer
from offpolicy.adapters.fleet_live.engine_group import EngineGroup, EngineSettings, ServedTurn, rss_mib
from offpolicy.adapters.fleet_live.object_channel import ObjectStoreWeightChannel
from offpolicy.adapters.fleet_live.weight_sync import DiskWeightChannel, WeightChannel
from offpolicy.fleet.groups import SamplerGroup
from offpolicy.fleet.router import Router
from offpolicy.records.token_batch import TokenBatch


#: Every :attr:`FleetEvent.kind`.
EVENT_KINDS = ("died", "hung", "invalid", "load_failed", "error", "stale", "restarted", "dropped")


@dataclass(frozen=True)
class FleetEvent:
    """Something that happened to a group (see the module docstring for each ``kind`` of :data:`EVENT_KINDS`).

    Attributes:
        kind: one of :data:`EVENT_KINDS`.
        group: the group's name.
        detail: plain text, the cause first.
        moved_sessions: the sessions of the failed or refused call, sent again (empty when none).
    """

    kind: str
    group: str
    detail: str
    moved_sessions: tuple[Hashable, ...]


class GroupRequestError(RuntimeError):
    """A living group's ``generate`` raised (a request it refuses); the group stays alive."""


@dataclass(frozen=True)
class LiveBatch:
    """One rollout's sessions, collated.

    Attributes:
        sequences: ``[B, L]`` int64 right-padded token ids of the ``B`` sessions (``collate``'s output).
        batch: the :class:`TokenBatch` of their ``N`` sampled tokens; ``batch.versions`` holds each token's served
            weight version.
        group_ids: ``[N]`` int64 index into ``LiveFleet.groups`` of the group that sampled each token.
        session_ids: the ``B`` session ids, in row order.
        turns: per session, its served turns (group, version, record) in order.
        events: failures during this rollout.
    """

    sequences: Tensor
    batch: TokenBatch
    group_ids: Tensor
    session_ids: list[Hashable]
    turns: list[list[ServedTurn]]
    events: list[FleetEvent]

    def served_counts(self) -> dict[str, int]:
        """Turns served per group name."""
        out: dict[str, int] = {}
        for ts in self.turns:
            for t in ts:
                out[t.group] = out.get(t.group, 0) + 1
        return out


@dataclass
class _Session:
    id: Hashable
    traj: Trajectory
    left: int
    served: list[ServedTurn] = field(default_factory=list)


@dataclass
class _Call:
    name: str
    sessions: list[_Session]
    deadline: float
    requests: list[tuple[Hashable, tuple[int, ...]]] = field(default_factory=list)
    synced: bool = False


@dataclass
class _Rollout:
    pending: list[_Session]
    floor: int | None
    between: tuple[int, ...]
    sampling_params: dict[str, object]
    max_tokens: int
    in_flight: dict[object, _Call] = field(default_factory=dict)
    blocked: dict[str, str] = field(default_factory=dict)
    blocked_at: dict[str, int] = field(default_factory=dict)
    load_failures: dict[str, int] = field(default_factory=dict)
    stuck_since: float | None = None


def _per_group(value: object, names: Sequence[str], what: str, check) -> dict[str, object]:
    """One value for every group, or a mapping from group name, each checked."""
    values = value if isinstance(value, Mapping) else dict.fromkeys(names, value)
    for n in names:
        if n not in values or not check(values[n]):
            raise ValueError(f"{what}[{n!r}] must be {check.__doc__}, got {values.get(n)!r}")
    return {n: values[n] for n in names}


def _positive(v: object) -> bool:
    """a number > 0"""
    return not isinstance(v, bool) and isinstance(v, (int, float)) and v > 0


def _non_negative(v: object) -> bool:
    """a number >= 0"""
    return not isinstance(v, bool) and isinstance(v, (int, float)) and v >= 0


def _count_at_least_1(v: object) -> bool:
    """an integer >= 1"""
    return not isinstance(v, bool) and isinstance(v, int) and v >= 1


class LiveFleet:
    """Sampler groups as live vLLM engines (one Ray actor, one process each) and the trainer's side of them.

    Args:
        groups: the fleet (names unique, at least one capacity > 0); each group's ``weight_format`` is applied at
            every weight sync.
        model_dir: the Hugging Face checkpoint every engine starts from (its weights are replaced at the first
            sync).
        work_dir: a directory every engine can reach (the disk weight channel and each group's checkpoints).
        settings: one :class:`EngineSettings` for every group, or a mapping from group name to settings.
        channel: the weight channel (default a :class:`DiskWeightChannel` under ``work_dir / "weights"`` with the
            groups' weight formats: each published version is quantised once per format, not once per group).
        address: a Ray cluster address (``"auto"``, ``"ray://head:10001"``); ``None`` starts a local instance.
        timeout_s: the fixed part of a call's time limit (a weight reload and the call's overhead), one number
            ``> 0`` or a mapping from group name; a call not answered in time fails its group (``"hung"``).
        token_timeout_s: the time limit's part per token asked for (``>= 0``; one number or a mapping).
        sync_every: a group loads the newest version at a call only when it is this many versions behind (one
            integer ``>= 1`` for every group, or a mapping from group name).
        max_staleness: the most versions a trained token may be behind the trainer's version at the optimizer step
            (``trained_at`` of :meth:`rollout`); ``None``: no limit.
        max_restarts: how many times a group whose process died, hung or answered nonsense is started again before
            it is dropped (``>= 0``).
        restart_backoff_s: the wait before the first restart of a group; doubled for each later one.
    """

    def __init__(
        self,
        groups: Sequence[SamplerGroup],
        model_dir: str | os.PathLike,
        work_dir: str | os.PathLike,
        *,
        settings: EngineSettings | Mapping[str, EngineSettings] = EngineSettings(),
        channel: WeightChannel | None = None,
        address: str | None = None,
        timeout_s: float | Mapping[str, float] = 60.0,
        token_timeout_s: float | Mapping[str, float] = 0.05,
        sync_every: int | Mapping[str, int] = 1,
        max_staleness: int | None = None,
        max_restarts: int = 2,
        restart_backoff_s: float = 1.0,
    ):
        self.router = Router(groups)
        self.groups = list(groups)
        self._capacity = {g.name: g.capacity for g in self.groups}
        names = [g.name for g in self.groups]
        if isinstance(settings, EngineSettings):
            settings = dict.fromkeys(names, settings)
        missing = [n for n in names if n not in settings]
        if missing:
            raise ValueError(f"settings name no EngineSettings for groups {missing}")
        self.settings = {n: settings[n] for n in names}
        if not isinstance(timeout_s, Mapping) and not _positive(timeout_s):
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        _per_group(timeout_s, names, "timeout_s", _positive)
        _per_group(token_timeout_s, names, "token_timeout_s", _non_negative)
        self.sync_every = _per_group(sync_every, names, "sync_every", _count_at_least_1)
        if max_staleness is not None and (isinstance(max_staleness, bool) or not isinstance(max_staleness, int)
                                          or max_staleness < 0):
            raise ValueError(f"max_staleness must be None or an integer >= 0, got {max_staleness!r}")
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
            raise ValueError(f"max_restarts must be an integer >= 0, got {max_restarts!r}")
        if not _non_negative(restart_backoff_s):
            raise ValueError(f"restart_backoff_s must be a number >= 0, got {restart_backoff_s!r}")
        self.max_staleness, self.max_restarts, self.restart_backoff_s = max_staleness, max_restarts, restart_backoff_s
        self.model_dir, self.work_dir = Path(model_dir), Path(work_dir)
        self.channel = channel if channel is not None else self._default_channel()
        self.address = address
        self.timeout_s, self.token_timeout_s = timeout_s, token_timeout_s
        self.start_timeout_s = 600.0
        #: how long a rollout waits for the trainer to publish the staleness floor before it raises
        self.publish_timeout_s = 3600.0
        self.version: int | None = None
        self.vocab_size: int | None = None
        self.events: list[FleetEvent] = []
        self.alive = dict.fromkeys(names, False)
        self.served_turns = dict.fromkeys(names, 0)
        self.loaded: dict[str, int | None] = dict.fromkeys(names)
        #: per group with a syncing call in flight, the newest version published when it was sent (the call may
        #: load that version or any later one before it answers)
        self._syncing: dict[str, int] = {}
        self.stale_reloads = dict.fromkeys(names, 0)
        self.refused_turns = dict.fromkeys(names, 0)
        self.restarts = dict.fromkeys(names, 0)
        self._restart_at: dict[str, float] = {}
        self._starting: dict[str, tuple[object, float]] = {}
        self._spawn: Callable[[str], object] | None = None
        self._actors: dict[str, object] = {}
        self._calls: RayCalls | ThreadCalls = RayCalls()
        self._own_ray = False
        self._next_session = 0
        self._published = threading.Condition()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="live-fleet-rollout")

    # ------------------------------------------------------------------ life cycle
    def start(self, start_timeout_s: float = 600.0) -> float:
        """Start Ray (unless already initialised) and one engine actor per group; returns the seconds it took."""
        import ray

        t0 = time.monotonic()
        self.start_timeout_s = float(start_timeout_s)
        if not ray.is_initialized():
            env = {k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ}
            kwargs = {"runtime_env": {"env_vars": env}, "include_dashboard": False, "log_to_driver": False}
            if self.address is None:
                kwargs["num_cpus"] = max(2, int(sum(s.num_cpus for s in self.settings.values())))
            ray.init(address=self.address, **kwargs)
            self._own_ray = True
        actor = ray.remote(EngineGroup)
        by_name = {g.name: g for g in self.groups}

        def spawn(name: str) -> object:
            s = self.settings[name]
            return actor.options(num_cpus=s.num_cpus, num_gpus=s.num_gpus, max_restarts=0,
                                 runtime_env={"env_vars": s.env()}).remote(
                by_name[name], str(self.model_dir), self.channel, str(self.work_dir / "groups" / name), s)

        self._spawn = spawn
        self._actors = {g.name: spawn(g.name) for g in self.groups}
        infos = ray.get([a.info.remote() for a in self._actors.values()], timeout=start_timeout_s)
        self._note_info(infos)
        self.alive = dict.fromkeys(self.alive, True)
        return time.monotonic() - t0

    def start_in_process(self, engines: Mapping[str, object], calls: ThreadCalls | None = None,
                         factory: Callable[[str], object] | None = None) -> None:
        """Serve every group with an object in this process instead of a Ray actor (no Ray, no engine process):
        ``engines`` maps each group name to an object with :class:`EngineGroup`'s ``generate``, ``sync`` and
        ``info``; calls run on ``calls`` (a :class:`ThreadCalls`). ``factory(name)`` makes a fresh object for a
        restart (without it a failed group is dropped at once)."""
        if set(engines) != set(self.alive):
            raise ValueError(f"engines must name every group {sorted(self.alive)}, got {sorted(engines)}")
        self._calls = calls if calls is not None else ThreadCalls()
        self._actors = dict(engines)
        self._spawn = factory
        self.alive = dict.fromkeys(self.alive, True)

    def _note_info(self, infos: Sequence[Mapping[str, object]]) -> None:
        for info in infos:
            v = info.get("vocab_size") if isinstance(info, Mapping) else None
            if v is not None:
                self.vocab_size = int(v)

    def close(self) -> None:
        """Stop every engine (and Ray, when this fleet started it)."""
        self._pool.shutdown(wait=True)
        for name, a in self._actors.items():
            if self.alive.get(name) or name in self._starting:
                self._calls.kill(a)
            self.alive[name] = False
        self._actors.clear()
        self._starting.clear()
        self._restart_at.clear()
        if self._own_ray:
            import ray

            ray.shutdown()
            self._own_ray = False

    def _default_channel(self) -> DiskWeightChannel:
        """A disk channel under ``work_dir / "weights"`` quantising each of the groups' weight formats once per
        version (when every engine runs in one dtype; with several dtypes each group quantises for itself)."""
        dtypes = {getattr(torch, s.dtype, None) if isinstance(s.dtype, str) else None for s in self.settings.values()}
        dtype = dtypes.pop() if len(dtypes) == 1 else None
        if not isinstance(dtype, torch.dtype):
            return DiskWeightChannel(self.work_dir / "weights")
        formats = sorted({g.weight_format for g in self.groups})
        return DiskWeightChannel(self.work_dir / "weights", formats=formats, dtype=dtype)

    def __enter__(self) -> LiveFleet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ weights
    def publish(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        """Publish the trainer's weights as ``version``; every group loads it when next due.

        The channel's retention keeps :meth:`in_use`: what each group serves (as its last answer, or its last
        failed call, reported) and whatever a syncing call in flight may have loaded, read once ``version`` is the
        channel's newest (a call sent later loads ``version`` itself)."""
        if isinstance(self.channel, (DiskWeightChannel, ObjectStoreWeightChannel)):
            self.channel.publish(state_dict, version, in_use=self.in_use)
        else:
            self.channel.publish(state_dict, version)
        with self._published:
            self.version = version
            self._published.notify_all()

    def in_use(self) -> set[int]:
        """The versions a group may be serving: each live group's loaded version, and for a group with a syncing
        call in flight every version from the newest published when the call was sent (the engine loads the
        channel's newest when the call runs, which may be later)."""
        in_use = {v for v in list(self.loaded.values()) if v is not None}
        low = [v for v in list(self._syncing.values()) if v is not None]
        if low and hasattr(self.channel, "versions"):
            in_use |= {v for v in self.channel.versions() if v >= min(low)}
        return in_use

    @property
    def sessions_opened(self) -> int:
        """Sessions opened so far (ids ``s0`` .. ``s{n-1}``), for auditing sent against trained."""
        return self._next_session

    def continue_sessions_from(self, n: int) -> None:
        """Open the next session as ``s{n}`` (at least): a resumed run never reuses an earlier run's ids."""
        self._next_session = max(self._next_session, int(n))

    def next_version(self) -> int:
        """The version the next :meth:`publish` must use: one past the newest published here or on the channel
        (a rerun on the same channel goes on from the versions the earlier run published)."""
        newest = [v for v in (self.version, self.channel.latest()) if v is not None]
        return max(newest) + 1 if newest else 0

    @property
    def settings_max_logprobs(self) -> int:
        """The smallest ``max_logprobs`` of the groups (the most a request may ask of every group)."""
        return min(s.max_logprobs for s in self.settings.values())

    def call_timeout(self, name: str, tokens: int) -> float:
        """The time limit of a call to ``name`` asking for ``tokens`` tokens in all: ``timeout_s + tokens *
        token_timeout_s`` of that group."""
        base = self.timeout_s[name] if isinstance(self.timeout_s, Mapping) else self.timeout_s
        per = self.token_timeout_s[name] if isinstance(self.token_timeout_s, Mapping) else self.token_timeout_s
        return float(base) + float(per) * tokens

    # ------------------------------------------------------------------ sampling
    def submit(self, prompts: Sequence[Sequence[int]], sampling_params: Mapping[str, object], *, turns: int = 1,
               between: Sequence[int] = (), trained_at: int | None = None) -> concurrent.futures.Future:
        """:meth:`rollout` in the background (one at a time); ``.result()`` gives the :class:`LiveBatch`. A batch
        sampled while the trainer takes its step is trained after the next publish: pass ``trained_at=
        fleet.version + 1``."""
        first = self._next_session  # ids taken now, in the caller's thread: a checkpoint counts them exactly
        self._next_session += len(prompts)
        return self._pool.submit(self._rollout, prompts, sampling_params, turns, between, trained_at, first)

    def rollout(self, prompts: Sequence[Sequence[int]], sampling_params: Mapping[str, object], *, turns: int = 1,
                between: Sequence[int] = (), trained_at: int | None = None) -> LiveBatch:
        """One session per prompt, ``turns`` turns each (``between``, e.g. a tool's output, appended untrained
        after every turn but the last), each turn routed to its session's group (sticky).

        Args:
            prompts: ``B`` lists of token ids.
            sampling_params: :func:`offpolicy.adapters.vllm.build_sampling_params` (every turn uses them).
            turns: turns per session (``>= 1``).
            between: token ids inserted between turns.
            trained_at: the trainer's version at the optimizer step that will use this batch (``None``: the
                version published now); with ``max_staleness`` every turn is served at ``>= trained_at -
                max_staleness``, waiting for that version to be published if need be.
        """
        first = self._next_session
        self._next_session += len(prompts)
        return self._rollout(prompts, sampling_params, turns, between, trained_at, first)

    def _rollout(self, prompts: Sequence[Sequence[int]], sampling_params: Mapping[str, object], turns: int,
                 between: Sequence[int], trained_at: int | None, first: int) -> LiveBatch:
        if self.version is None:
            raise RuntimeError("rollout: publish a weight version first (LiveFleet.publish)")
        if isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
            raise ValueError(f"turns must be an integer >= 1, got {turns!r}")
        if not prompts:
            raise ValueError("prompts must be non-empty")
        if trained_at is None:
            trained_at = self.version
        if isinstance(trained_at, bool) or not isinstance(trained_at, int) or trained_at < self.version:
            raise ValueError(f"trained_at must be an integer >= the published version {self.version}, got "
                             f"{trained_at!r}")
        floor = None if self.max_staleness is None else trained_at - self.max_staleness
        sessions = [_Session(f"s{first + i}", Trajectory([int(t) for t in p]), turns) for i, p in enumerate(prompts)]
        r = _Rollout(list(sessions), floor, tuple(int(t) for t in between), dict(sampling_params),
                     int(sampling_params.get("max_tokens", 16)))  # 16: vLLM's default
        events_before = len(self.events)
        try:
            while r.pending or r.in_flight:
                self._restart_due()
                self._unblock(r)
                if r.pending and self._floor_published(r):
                    self._dispatch(r)
                self._check_progress(r, trained_at)
                self._await(r)
        except BaseException:
            self._abandon(r.in_flight)
            raise
        finally:
            for s in sessions:
                self.router.release(s.id)
            for name in r.blocked:  # blocked for this rollout only
                self._undrain(name)
        index = {g.name: i for i, g in enumerate(self.groups)}
        seqs, batch = collate([s.traj for s in sessions])
        gids = torch.cat([torch.full((len(t.record),), index[t.group], dtype=torch.int64)
                          for s in sessions for t in s.served])
        return LiveBatch(seqs, batch, gids, [s.id for s in sessions], [s.served for s in sessions],
                         self.events[events_before:])

    def _floor_published(self, r: _Rollout) -> bool:
        return r.floor is None or self.version >= r.floor

    def _unblock(self, r: _Rollout) -> None:
        """A group blocked until a newer version than the one it could not reach is published may serve again."""
        for name, at in list(r.blocked_at.items()):
            if self.version > at:
                del r.blocked_at[name], r.blocked[name]
                self._undrain(name)

    def _check_progress(self, r: _Rollout, trained_at: int) -> None:
        """Raise, naming why, when pending sessions have had no group to go to for a whole call time limit."""
        stuck = r.pending and not r.in_flight and not self._starting and not self._restart_at
        if not stuck:
            r.stuck_since = None
            return
        now = time.monotonic()
        r.stuck_since = r.stuck_since or now
        floor_ok = self._floor_published(r)
        limit = max(self.call_timeout(n, 0) for n in self.alive) if floor_ok else self.publish_timeout_s
        if now - r.stuck_since <= limit:
            return
        if not floor_ok:
            raise RuntimeError(
                f"rollout: waited {now - r.stuck_since:.0f} s for version {r.floor} (trained_at {trained_at} - "
                f"max_staleness {self.max_staleness}); the trainer has published {self.version}: publish it, or "
                "raise max_staleness")
        why = "; ".join(f"{n!r}: {w}" for n, w in sorted(r.blocked.items())) or "no group is free"
        raise RuntimeError(f"rollout: no engine group could serve {len(r.pending)} sessions for "
                           f"{now - r.stuck_since:.1f} s: {why}")

    def _dispatch(self, r: _Rollout) -> None:
        """Send each free, unblocked group the pending sessions routed to it."""
        busy = {c.name for c in r.in_flight.values()}
        by_group: dict[str, list[_Session]] = {}
        keep: list[_Session] = []
        for s in r.pending:
            name = self.router.route(s.id)
            if self.alive[name] and name not in busy and name not in r.blocked:
                by_group.setdefault(name, []).append(s)
            else:
                keep.append(s)
        r.pending[:] = keep
        for name, ss in by_group.items():
            sync = self._sync_due(name, r.floor)
            if sync and not self._sync_due(name, None):
                self.stale_reloads[name] += 1  # a reload only the staleness floor asked for
            requests = [(s.id, tuple(s.traj.input_ids)) for s in ss]
            args = [[(sid, list(ctx)) for sid, ctx in requests], r.sampling_params, sync]
            if r.floor is not None:
                args.append(r.floor)
            if sync:  # before the call is sent: it may load a version while the trainer publishes
                self._syncing[name] = self.version
            ref = self._calls.call(self._actors[name], "generate", *args)
            deadline = time.monotonic() + self.call_timeout(name, len(ss) * r.max_tokens)
            r.in_flight[ref] = _Call(name, ss, deadline, requests, sync)

    def _await(self, r: _Rollout) -> None:
        """Wait for the next answer, call expiry, due restart or publish, and handle it."""
        handles = list(r.in_flight) + [h for h, _ in self._starting.values()]
        wake = [c.deadline for c in r.in_flight.values()] + [d for _, d in self._starting.values()]
        wake += list(self._restart_at.values())
        timeout = max(0.0, min(wake) - time.monotonic()) if wake else 0.05
        if r.pending:
            timeout = min(timeout, 0.05)  # also watch for a publish, a group coming free or back
        if handles:
            done, _ = self._calls.wait(handles, timeout=timeout)
            if done and done[0] in r.in_flight:
                self._answer(r, r.in_flight.pop(done[0]), done[0])
            elif done:
                self._started(done[0])
        else:
            with self._published:
                self._published.wait(timeout)
        now = time.monotonic()
        for h, call in list(r.in_flight.items()):
            if now > call.deadline:
                del r.in_flight[h]
                self._syncing.pop(call.name, None)
                r.pending += call.sessions
                limit = self.call_timeout(call.name, len(call.sessions) * r.max_tokens)
                self._down(call.name, "hung", f"no answer within {limit:g} s ({len(call.sessions)} requests x "
                                              f"{r.max_tokens} tokens)", call.sessions)
        for name, (_, deadline) in list(self._starting.items()):
            if now > deadline:
                del self._starting[name]
                self._down(name, "hung", f"not started within {self.start_timeout_s:g} s", [], starting=True)

    def _answer(self, r: _Rollout, call: _Call, handle: object) -> None:
        """Handle one answered call: accept its turns, or fail / refuse it and put its sessions back."""
        name, ss = call.name, call.sessions
        try:
            served = self._calls.get(handle)
        except GroupCallFailed as exc:
            r.pending += ss
            if exc.version is not None:  # the call failed after the group loaded a version: it serves that one
                self.loaded[name] = exc.version
            self._syncing.pop(name, None)
            if exc.kind == "load":
                self._event("load_failed", name, exc.detail, ss)
                r.load_failures[name] = r.load_failures.get(name, 0) + 1
                if r.load_failures[name] >= 2:  # the engine skips a bad version once it has failed: twice is more
                    self._block(r, name, f"loading weights failed twice ({exc.detail})")
            elif exc.kind == "stale":
                self._event("stale", name, exc.detail, ss)
                self._block(r, name, exc.detail)
            elif exc.kind == "error":
                self._event("error", name, exc.detail, ss)
                raise GroupRequestError(f"rollout: group {name!r} failed the request: {exc.detail} (the group "
                                        "stays alive)") from exc
            else:
                self._down(name, exc.kind, exc.detail, ss)
            return
        try:
            check_answer(served, call.requests, name, newest_version=self.version, max_tokens=r.max_tokens,
                         vocab_size=self.vocab_size)
        except RecordError as exc:
            r.pending += ss
            self._down(name, "invalid", plain(str(exc)), ss)
            return
        self.loaded[name] = max(t.version for t in served)
        self._syncing.pop(name, None)
        low = min(t.version for t in served)
        if r.floor is not None and low < r.floor:  # generated below the floor (the group ignored min_version)
            r.pending += ss
            self.refused_turns[name] += len(served)
            self._event("stale", name, f"answer served at version {low} refused: below the staleness floor "
                                       f"{r.floor}", ss)
            self._block(r, name, f"served version {low}, below the floor {r.floor}")
            return
        r.load_failures.pop(name, None)
        for s, turn in zip(ss, served):
            s.traj.add_turn(turn.record)
            s.served.append(turn)
            self.served_turns[name] += 1
            s.left -= 1
            if s.left:
                if r.between:
                    s.traj.add_tokens(r.between)
                r.pending.append(s)

    def _block(self, r: _Rollout, name: str, why: str) -> None:
        """``name`` gets no sessions in this rollout until a version newer than the published one appears."""
        r.blocked[name] = why
        r.blocked_at[name] = self.version
        self._drain(name)

    def _abandon(self, in_flight: Mapping[object, _Call]) -> None:
        """A rollout ended by an error: wait (within their limits) for its other calls, so the next rollout finds
        each group free; a call past its limit fails its group."""
        for h, call in list(in_flight.items()):
            left = max(0.0, call.deadline - time.monotonic())
            try:
                served = self._calls.get(h, timeout=left)
                # the answer is dropped, but the group serves what it loaded for it (kept by the channel)
                versions = [getattr(t, "version", None) for t in served] if isinstance(served, list) else []
                versions = [v for v in versions if isinstance(v, int) and not isinstance(v, bool)]
                if versions:
                    self.loaded[call.name] = max(versions)
            except GroupCallFailed as exc:
                if exc.version is not None:
                    self.loaded[call.name] = exc.version
                if exc.kind in ("died", "hung") and self.alive[call.name]:
                    try:
                        self._down(call.name, exc.kind, exc.detail, [])
                    except RuntimeError:
                        pass
            finally:
                self._syncing.pop(call.name, None)

    def _sync_due(self, name: str, floor: int | None) -> bool:
        """Whether ``name`` loads the newest version at its next call: ``sync_every`` behind, or below the floor."""
        loaded = self.loaded[name]
        return (loaded is None or self.version - loaded >= self.sync_every[name]
                or (floor is not None and loaded < floor))

    # ------------------------------------------------------------------ faults
    def _event(self, kind: str, name: str, detail: str, sessions: Sequence[_Session]) -> FleetEvent:
        # causes arrive cut to DETAIL_CHARS already; what the fleet appends (the restart) is never cut off
        event = FleetEvent(kind, name, plain(detail, limit=4 * DETAIL_CHARS), tuple(s.id for s in sessions))
        self.events.append(event)
        return event

    def _drain(self, name: str) -> None:
        """Capacity 0 in the router (its sessions move at their next turn), unless it is the last with capacity."""
        shares = self.router.shares()
        if shares[name] > 0 and any(shares[n] > 0 for n in shares if n != name):
            self.router.set_capacity(name, 0.0)

    def _undrain(self, name: str) -> None:
        if self.alive[name]:
            self.router.set_capacity(name, self._capacity[name])

    def _down(self, name: str, kind: str, detail: str, sessions: Sequence[_Session], starting: bool = False) -> None:
        """The group's process died, hung or answered nonsense (or, ``starting``, a restart of it failed): kill it,
        then restart it later or drop it."""
        if not self.alive[name] and not starting:
            self._event(kind, name, detail, sessions)
            return
        self.alive[name] = False
        self._calls.kill(self._actors[name])
        self._drain(name)
        self.loaded[name] = None
        self._syncing.pop(name, None)
        if self._spawn is not None and self.restarts[name] < self.max_restarts:
            delay = self.restart_backoff_s * 2 ** self.restarts[name]
            self.restarts[name] += 1
            self._restart_at[name] = time.monotonic() + delay
            self._event(kind, name, f"{detail}; restart {self.restarts[name]} of {self.max_restarts} in "
                                    f"{delay:g} s", sessions)
            return
        self._event(kind, name, detail, sessions)
        self._event("dropped", name, f"no restarts left (max_restarts={self.max_restarts}) after {kind}: {detail}",
                    [])
        if not any(self.alive.values()) and not self._starting and not self._restart_at:
            raise RuntimeError(f"every engine group has failed; the last: {name!r} {kind} ({plain(detail)})")

    def _restart_due(self) -> None:
        now = time.monotonic()
        for name, at in list(self._restart_at.items()):
            if now >= at:
                del self._restart_at[name]
                self._actors[name] = self._spawn(name)
                self._starting[name] = (self._calls.call(self._actors[name], "info"), now + self.start_timeout_s)

    def _started(self, handle: object) -> None:
        name = next(n for n, (h, _) in self._starting.items() if h is handle)
        del self._starting[name]
        try:
            info = self._calls.get(handle)
        except GroupCallFailed as exc:
            self._down(name, "died" if exc.kind != "hung" else "hung", f"restart failed: {exc.detail}", [],
                       starting=True)
            return
        self._note_info([info])
        self.alive[name] = True
        self._undrain(name)
        self._event("restarted", name, f"serving again (restart {self.restarts[name]} of {self.max_restarts})", [])

    # ------------------------------------------------------------------ state
    def engine_info(self) -> dict[str, dict[str, object]]:
        """Per live group: its process id, resident memory (MiB), loaded version and number of loads."""
        names = [n for n, ok in self.alive.items() if ok]
        return {n: self._calls.get(self._calls.call(self._actors[n], "info"), self.call_timeout(n, 0)) for n in names}

    def memory_mib(self) -> dict[str, float]:
        """Resident memory in MiB: ``driver`` (the trainer), each live engine, and ``ray`` (every other process
        under the driver: Ray's GCS, raylet and idle workers; only for a local instance). RSS counts shared pages in
        each process, so the sum is an upper bound."""
        import psutil

        info = self.engine_info()
        out = {"driver": rss_mib(os.getpid())}
        out.update({n: float(i["rss_mib"]) for n, i in info.items()})
        engine_pids = {int(i["pid"]) for i in info.values()}
        others = 0.0
        for child in psutil.Process().children(recursive=True):
            try:
                if child.pid not in engine_pids:
                    others += child.memory_info().rss / 2**20
            except psutil.NoSuchProcess:
                pass
        out["ray"] = others
        return out

    def status(self) -> str:
        """A text table, one row per group: numerics, ``state`` (``alive``; ``restart`` while it is started again;
        ``failed`` once dropped), loaded version, turns served, ``reloads`` (syncs only the staleness floor asked
        for), ``refused`` (turns generated and then refused as below the floor: wasted work), ``restarts`` and
        ``moved away`` (sessions of its failed or refused calls, sent again)."""
        versions = {n: i["version"] for n, i in self.engine_info().items()}
        moved: dict[str, int] = {}
        for e in self.events:
            moved[e.group] = moved.get(e.group, 0) + len(e.moved_sessions)
        lines = [f"{'group':14s} {'weights':8s} {'state':7s} {'version':>7s} {'turns':>6s} {'reloads':>7s} "
                 f"{'refused':>7s} {'restarts':>8s} {'moved away':>10s}"]
        for g in self.groups:
            n = g.name
            state = "alive" if self.alive[n] else "restart" if n in self._starting or n in self._restart_at \
                else "failed"
            lines.append(f"{n:14s} {g.weight_format:8s} {state:7s} {str(versions.get(n, '-')):>7s} "
                         f"{self.served_turns[n]:6d} {self.stale_reloads[n]:7d} {self.refused_turns[n]:7d} "
                         f"{self.restarts[n]:8d} {moved.get(n, 0):10d}")
        return "\n".join(lines)
