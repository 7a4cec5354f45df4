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
from offpolicy.adapters.fleet_live.engine_group import EngineGroup, EngineSettings, ServedTurn, rss_mib
from offpolicy.adapters.fleet_live.weight_sync import DiskWeightChannel, WeightChannel
from offpolicy.fleet.groups import SamplerGroup
from offpolicy.fleet.router import Router
from offpolicy.records.token_batch import TokenBatch


@dataclass(frozen=True)
class FleetEvent:
    """A group failure: ``kind`` is ``"died"`` (the call raised) or ``"hung"`` (no answer in time)."""

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
    ):
        self.router = Router(groups)
        self.groups = list(groups)
        names = [g.name for g in self.groups]
        if isinstance(settings, EngineSettings):
            settings = dict.fromkeys(names, settings)
        missing = [n for n in names if n not in settings]
        if missing:
            raise ValueError(f"settings name no EngineSettings for groups {missing}")
        self.settings = {n: settings[n] for n in names}
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.model_dir, self.work_dir = Path(model_dir), Path(work_dir)
        self.channel = channel if channel is not None else DiskWeightChannel(self.work_dir / "weights")
        self.address, self.timeout_s = address, float(timeout_s)
        self.version: int | None = None
        self.events: list[FleetEvent] = []
        self.alive = dict.fromkeys(names, False)
        self.served_turns = dict.fromkeys(names, 0)
        self._actors: dict[str, object] = {}
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

    def close(self) -> None:
        """Stop every engine (and Ray, when this fleet started it)."""
        import ray

        self._pool.shutdown(wait=True)
        for name, a in self._actors.items():
            if self.alive.get(name):
                ray.kill(a)
            self.alive[name] = False
        self._actors.clear()
        if self._own_ray:
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
        import ray
        from ray.exceptions import RayError

        sessions = []
        for p in prompts:
            sessions.append(_Session(f"s{self._next_session}", Trajectory([int(t) for t in p]), turns))
            self._next_session += 1
        events: list[FleetEvent] = []
        pending = list(sessions)
        while pending:
            calls: dict[object, tuple[str, list[_Session]]] = {}
            by_group: dict[str, list[_Session]] = {}
            for s in pending:
                by_group.setdefault(self.router.route(s.id), []).append(s)
            for name, ss in by_group.items():
                ref = self._actors[name].generate.remote([(s.id, s.traj.input_ids) for s in ss], dict(sampling_params))
                calls[ref] = (name, ss)
            pending = []
            waiting = list(calls)
            deadline = time.monotonic() + self.timeout_s
            while waiting:
                done, waiting = ray.wait(waiting, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
                if not done:
                    for ref in waiting:
                        name, ss = calls[ref]
                        events.append(self._fail(name, "hung", f"no answer within {self.timeout_s:g} s", ss))
                        pending += ss
                    break
                name, ss = calls[done[0]]
                try:
                    served = ray.get(done[0])
                except RayError as exc:
                    events.append(self._fail(name, "died", f"{type(exc).__name__}: {str(exc)[:200]}", ss))
                    pending += ss
                    continue
                if [t.session_id for t in served] != [s.id for s in ss]:
                    raise RuntimeError(f"group {name!r} answered for other sessions than it was asked")
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

    def _fail(self, name: str, kind: str, detail: str, sessions: list[_Session]) -> FleetEvent:
        import ray

        if self.alive[name]:
            self.alive[name] = False
            ray.kill(self._actors[name])
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
        import ray

        names = [n for n, ok in self.alive.items() if ok]
        return dict(zip(names, ray.get([self._actors[n].info.remote() for n in names], timeout=self.timeout_s)))

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
        lines = [f"{'group':14s} {'weights':8s} {'state':6s} {'version':>7s} {'turns':>6s} {'moved away':>10s}"]
        for g in self.groups:
            state = "alive" if self.alive[g.name] else "failed"
            lines.append(f"{g.name:14s} {g.weight_format:8s} {state:6s} {str(versions.get(g.name, '-')):>7s} "
                         f"{self.served_turns[g.name]:6d} {moved.get(g.name, 0):10d}")
        return "\n".join(lines)
