"""A fleet of live engine groups under Ray: the trainer (the driver) routes sessions to groups with
:class:`offpolicy.fleet.Router`, collects every turn with its group, served version and record, collates them, and
publishes weights after each step; a group that dies or hangs is drained and its sessions move to the others.

    fleet = LiveFleet(groups, model_dir, work_dir)          # ray.init() locally, or address="ray://head:10001"
    fleet.start()
    fleet.publish(model.state_dict(), 0)
    batch = fleet.rollout(prompts, sampling_params, turns=2, between=[tool_id])   # a LiveBatch
    out = op.policy_loss(batch.batch.gather(model(batch.sequences).logits), ..., groups=batch.group_ids,
                         versions=batch.batch.versions, current_version=fleet.version)
    fleet.publish(model.state_dict(), 1)
    fleet.close()

Faults: a call to a group that raises (the actor's process died: ``ray.exceptions.RayActorError``) or does not
answer within ``timeout_s`` fails the group: it is drained in the router (capacity 0), its actor is killed (so a
late answer can never arrive), and the sessions of that call are sent again, unchanged, to the groups left. A
session's trajectory only grows from a call that succeeded, so no turn is lost or kept twice; the turns a failed
group served earlier stay (they were sampled and recorded correctly). :attr:`LiveFleet.events` lists every failure
with the sessions it moved.

Staleness: a group loads the newest version at a call when it is ``sync_every`` or more versions behind (``1``:
every call; a larger value amortises reloads, as real fleets do). With ``max_staleness`` set, a group whose loaded
version is more than ``max_staleness`` behind the trainer's published version is drained and reloaded: at the
start of each routing round it gets capacity 0 in the router (its sticky sessions move at their next turn), a
reload (``sync``) is sent to it, and its capacity comes back once the reload answers; the last group with capacity
is not drained but reloads at the start of its next call. A call whose answer arrives with turns served more than
``max_staleness`` behind (the trainer published during a long generate) is refused: its turns are dropped, its
sessions are sent again unchanged, and the group is reloaded as above. So every turn of a :class:`LiveBatch` was
served at most ``max_staleness`` versions behind the version published when its answer arrived. Each drain is a
``"stale"`` event; :meth:`LiveFleet.status` counts them per group.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from offpolicy.adapters.common import Trajectory, collate
from offpolicy.adapters.fleet_live.calls import GroupCallFailed, RayCalls, ThreadCalls
from offpolicy.adapters.fleet_live.engine_group import EngineGroup, EngineSettings, ServedTurn, rss_mib
from offpolicy.adapters.fleet_live.weight_sync import DiskWeightChannel, WeightChannel
from offpolicy.fleet.groups import SamplerGroup
from offpolicy.fleet.router import Router
from offpolicy.records.token_batch import TokenBatch


@dataclass(frozen=True)
class FleetEvent:
    """A group failure or drain: ``kind`` is ``"died"`` (the call raised), ``"hung"`` (no answer in time) or
    ``"stale"`` (drained and reloaded; ``moved_sessions`` are those of a refused answer, empty if none)."""

    kind: str
    group: str
    detail: str
    moved_sessions: tuple[Hashable, ...]


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


class LiveFleet:
    """Sampler groups as live vLLM engines (one Ray actor, one process each) and the trainer's side of them.

    Args:
        groups: the fleet (names unique, at least one capacity > 0); each group's ``weight_format`` is applied at
            every weight sync.
        model_dir: the Hugging Face checkpoint every engine starts from (its weights are replaced at the first
            sync).
        work_dir: a directory every engine can reach (the disk weight channel and each group's checkpoints).
        settings: one :class:`EngineSettings` for every group, or a mapping from group name to settings.
        channel: the weight channel (default a :class:`DiskWeightChannel` under ``work_dir / "weights"``).
        address: a Ray cluster address (``"auto"``, ``"ray://head:10001"``); ``None`` starts a local instance.
        timeout_s: a call not answered in this time fails its group (``"hung"``).
        sync_every: a group loads the newest version at a call only when it is this many versions behind (one
            integer ``>= 1`` for every group, or a mapping from group name).
        max_staleness: drain and reload a group more than this many versions behind (``None``: no limit).
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
        timeout_s: float = 300.0,
        sync_every: int | Mapping[str, int] = 1,
        max_staleness: int | None = None,
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
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if not isinstance(sync_every, Mapping):
            sync_every = dict.fromkeys(names, sync_every)
        for n in names:
            k = sync_every.get(n)
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise ValueError(f"sync_every[{n!r}] must be an integer >= 1, got {k!r}")
        if max_staleness is not None and (isinstance(max_staleness, bool) or not isinstance(max_staleness, int)
                                          or max_staleness < 0):
            raise ValueError(f"max_staleness must be None or an integer >= 0, got {max_staleness!r}")
        self.sync_every = {n: sync_every[n] for n in names}
        self.max_staleness = max_staleness
        self.model_dir, self.work_dir = Path(model_dir), Path(work_dir)
        self.channel = channel if channel is not None else DiskWeightChannel(self.work_dir / "weights")
        self.address, self.timeout_s = address, float(timeout_s)
        self.version: int | None = None
        self.events: list[FleetEvent] = []
        self.alive = dict.fromkeys(names, False)
        self.served_turns = dict.fromkeys(names, 0)
        self.loaded: dict[str, int | None] = dict.fromkeys(names)
        self.stale_reloads = dict.fromkeys(names, 0)
        self._actors: dict[str, object] = {}
        self._calls: RayCalls | ThreadCalls = RayCalls()
        self._own_ray = False
        self._next_session = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="live-fleet-rollout")

    # ------------------------------------------------------------------ life cycle
    def start(self, start_timeout_s: float = 600.0) -> float:
        """Start Ray (unless already initialised) and one engine actor per group; returns the seconds it took."""
        import ray

        t0 = time.monotonic()
        if not ray.is_initialized():
            env = {k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ}
            kwargs = {"runtime_env": {"env_vars": env}, "include_dashboard": False, "log_to_driver": False}
            if self.address is None:
                kwargs["num_cpus"] = max(2, int(sum(s.num_cpus for s in self.settings.values())))
            ray.init(address=self.address, **kwargs)
            self._own_ray = True
        actor = ray.remote(EngineGroup)
        for g in self.groups:
            s = self.settings[g.name]
            self._actors[g.name] = actor.options(num_cpus=s.num_cpus, num_gpus=s.num_gpus, max_restarts=0,
                                                 runtime_env={"env_vars": s.env()}).remote(
                g, str(self.model_dir), self.channel, str(self.work_dir / "groups" / g.name), s)
        ray.get([a.info.remote() for a in self._actors.values()], timeout=start_timeout_s)
        self.alive = dict.fromkeys(self.alive, True)
        return time.monotonic() - t0

    def start_in_process(self, engines: Mapping[str, object], calls: ThreadCalls | None = None) -> None:
        """Serve every group with an object in this process instead of a Ray actor (no Ray, no engine process):
        ``engines`` maps each group name to an object with :class:`EngineGroup`'s ``generate``, ``sync`` and
        ``info``; calls run on ``calls`` (a :class:`ThreadCalls`)."""
        if set(engines) != set(self.alive):
            raise ValueError(f"engines must name every group {sorted(self.alive)}, got {sorted(engines)}")
        self._calls = calls if calls is not None else ThreadCalls()
        self._actors = dict(engines)
        self.alive = dict.fromkeys(self.alive, True)

    def close(self) -> None:
        """Stop every engine (and Ray, when this fleet started it)."""
        self._pool.shutdown(wait=True)
        for name, a in self._actors.items():
            if self.alive.get(name):
                self._calls.kill(a)
            self.alive[name] = False
        self._actors.clear()
        if self._own_ray:
            import ray

            ray.shutdown()
            self._own_ray = False

    def __enter__(self) -> LiveFleet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ weights
    def publish(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        """Publish the trainer's weights as ``version``; every group loads it when next free."""
        self.channel.publish(state_dict, version)
        self.version = version

    @property
    def settings_max_logprobs(self) -> int:
        """The smallest ``max_logprobs`` of the groups (the most a request may ask of every group)."""
        return min(s.max_logprobs for s in self.settings.values())

    # ------------------------------------------------------------------ sampling
    def submit(self, prompts: Sequence[Sequence[int]], sampling_params: Mapping[str, object], *, turns: int = 1,
               between: Sequence[int] = ()) -> concurrent.futures.Future:
        """:meth:`rollout` in the background (one at a time); ``.result()`` gives the :class:`LiveBatch`."""
        return self._pool.submit(self.rollout, prompts, sampling_params, turns=turns, between=between)

    def rollout(self, prompts: Sequence[Sequence[int]], sampling_params: Mapping[str, object], *, turns: int = 1,
                between: Sequence[int] = ()) -> LiveBatch:
        """One session per prompt, ``turns`` turns each (``between``, e.g. a tool's output, appended untrained
        after every turn but the last), each turn routed to its session's group (sticky).

        Args:
            prompts: ``B`` lists of token ids.
            sampling_params: :func:`offpolicy.adapters.vllm.build_sampling_params` (every turn uses them).
            turns: turns per session (``>= 1``).
            between: token ids inserted between turns.
        """
        if self.version is None:
            raise RuntimeError("rollout: publish a weight version first (LiveFleet.publish)")
        if isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
            raise ValueError(f"turns must be an integer >= 1, got {turns!r}")
        if not prompts:
            raise ValueError("prompts must be non-empty")
        sessions = []
        for p in prompts:
            sessions.append(_Session(f"s{self._next_session}", Trajectory([int(t) for t in p]), turns))
            self._next_session += 1
        events: list[FleetEvent] = []
        pending = list(sessions)
        refused: dict[str, list[_Session]] = {}
        while pending:
            calls: dict[object, tuple[str, list[_Session]]] = {}
            stale = self._stale_groups()
            for name in stale:
                why = (f"answer served at version {self.loaded[name]} refused" if name in refused
                       else f"loaded version {self.loaded[name]}")
                events.append(self._drain_stale(name, why, refused.pop(name, [])))
            reloading = {name for name in stale if self.router.shares()[name] == 0}
            for name in reloading:
                calls[self._calls.call(self._actors[name], "sync")] = (name, [])
            by_group: dict[str, list[_Session]] = {}
            for s in pending:
                by_group.setdefault(self.router.route(s.id), []).append(s)
            for name, ss in by_group.items():
                ref = self._calls.call(self._actors[name], "generate", [(s.id, s.traj.input_ids) for s in ss],
                                       dict(sampling_params), self._sync_due(name))
                calls[ref] = (name, ss)
            pending = []
            waiting = list(calls)
            deadline = time.monotonic() + self.timeout_s
            while waiting:
                done, waiting = self._calls.wait(waiting, timeout=max(0.0, deadline - time.monotonic()))
                if not done:
                    for ref in waiting:
                        name, ss = calls[ref]
                        events.append(self._fail(name, "hung", f"no answer within {self.timeout_s:g} s", ss))
                        pending += ss
                    break
                name, ss = calls[done[0]]
                try:
                    served = self._calls.get(done[0])
                except GroupCallFailed as exc:
                    events.append(self._fail(name, "died", str(exc), ss))
                    pending += ss
                    continue
                if name in reloading and not ss:  # a stale group's reload answered: it serves again
                    self.loaded[name] = int(served)
                    reloading.discard(name)
                    if self.alive[name]:
                        self.router.set_capacity(name, self._capacity[name])
                    continue
                if [t.session_id for t in served] != [s.id for s in ss]:
                    raise RuntimeError(f"group {name!r} answered for other sessions than it was asked")
                self.loaded[name] = min(t.version for t in served)
                if self._behind(name):  # refused; the next round drains and reloads the group
                    refused.setdefault(name, []).extend(ss)
                    pending += ss
                    continue
                for s, turn in zip(ss, served):
                    s.traj.add_turn(turn.record)
                    s.served.append(turn)
                    self.served_turns[name] += 1
                    s.left -= 1
                    if s.left:
                        if between:
                            s.traj.add_tokens(between)
                        pending.append(s)
        for s in sessions:
            self.router.release(s.id)
        index = {g.name: i for i, g in enumerate(self.groups)}
        seqs, batch = collate([s.traj for s in sessions])
        gids = torch.cat([torch.full((len(t.record),), index[t.group], dtype=torch.int64)
                          for s in sessions for t in s.served])
        return LiveBatch(seqs, batch, gids, [s.id for s in sessions], [s.served for s in sessions], events)

    def _sync_due(self, name: str) -> bool:
        """Whether ``name`` loads the newest version at its next call: ``sync_every`` behind, or over the limit."""
        loaded = self.loaded[name]
        return loaded is None or self.version - loaded >= self.sync_every[name] or self._behind(name)

    def _behind(self, name: str) -> bool:
        loaded = self.loaded[name]
        return self.max_staleness is not None and loaded is not None and self.version - loaded > self.max_staleness

    def _stale_groups(self) -> list[str]:
        return [n for n in self.alive if self.alive[n] and self._behind(n) and self.router.shares()[n] > 0]

    def _drain_stale(self, name: str, detail: str, sessions: list[_Session]) -> FleetEvent:
        """Drain ``name`` (unless it is the last group with capacity) for a reload; record a ``"stale"`` event."""
        shares = self.router.shares()
        if shares[name] > 0 and any(shares[n] > 0 for n in shares if n != name):
            self.router.set_capacity(name, 0.0)
        self.stale_reloads[name] += 1
        event = FleetEvent("stale", name, f"{detail}; trainer at {self.version}, max_staleness "
                                          f"{self.max_staleness}: drained and reloaded", tuple(s.id for s in sessions))
        self.events.append(event)
        return event

    def _fail(self, name: str, kind: str, detail: str, sessions: list[_Session]) -> FleetEvent:
        if self.alive[name]:
            self.alive[name] = False
            self._calls.kill(self._actors[name])
            if any(self.alive.values()):
                self.router.set_capacity(name, 0.0)
        event = FleetEvent(kind, name, detail, tuple(s.id for s in sessions))
        self.events.append(event)
        if not any(self.alive.values()):
            raise RuntimeError(f"every engine group has failed; the last: {name!r} {kind} ({detail})")
        return event

    # ------------------------------------------------------------------ state
    def engine_info(self) -> dict[str, dict[str, object]]:
        """Per live group: its process id, resident memory (MiB), loaded version and number of loads."""
        names = [n for n, ok in self.alive.items() if ok]
        return {n: self._calls.get(self._calls.call(self._actors[n], "info"), self.timeout_s) for n in names}

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
        """A text table: per group its numerics, whether it is alive, its loaded version, turns served, and the
        sessions moved away from it by failures."""
        versions = {n: i["version"] for n, i in self.engine_info().items()}
        moved: dict[str, int] = {}
        for e in self.events:
            moved[e.group] = moved.get(e.group, 0) + len(e.moved_sessions)
        lines = [f"{'group':14s} {'weights':8s} {'state':6s} {'version':>7s} {'turns':>6s} {'stale':>5s} "
                 f"{'moved away':>10s}"]
        for g in self.groups:
            state = "alive" if self.alive[g.name] else "failed"
            lines.append(f"{g.name:14s} {g.weight_format:8s} {state:6s} {str(versions.get(g.name, '-')):>7s} "
                         f"{self.served_turns[g.name]:6d} {self.stale_reloads[g.name]:5d} {moved.get(g.name, 0):10d}")
        return "\n".join(lines)
