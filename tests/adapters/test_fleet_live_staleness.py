"""LiveFleet's routing, staleness limit and faults without engines or Ray: each group is an in-process object with
EngineGroup's ``generate``/``sync``/``info`` (``LiveFleet.start_in_process``), weights travel on an in-memory
channel, and a turn is two tokens stamped with the version the fake group had loaded."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest
import torch

from offpolicy.adapters.common import TurnRecord
from offpolicy.adapters.fleet_live import LiveFleet, ServedTurn
from offpolicy.adapters.fleet_live.calls import BelowStalenessFloor, EngineProcessDied
from offpolicy.fleet import SamplerGroup

SP = {"temperature": 1.0}


class MemoryChannel:
    """The WeightChannel calls, in memory."""

    def __init__(self):
        self.versions: dict[int, dict] = {}

    def publish(self, state_dict, version):
        self.versions[version] = dict(state_dict)

    def latest(self):
        return max(self.versions) if self.versions else None

    def fetch(self, version):
        return self.versions[version]


class FakeGroup:
    """EngineGroup's interface; ``before(group)`` and ``during(group)`` run inside every generate, before and after
    its version is fixed."""

    def __init__(self, name: str, channel: MemoryChannel, during=None, before=None):
        self.name, self.channel, self.during, self.before = name, channel, during, before
        self.version, self.loads, self.calls = None, 0, 0
        self.honours_floor = True

    def sync(self) -> int:
        newest = self.channel.latest()
        if newest != self.version:
            self.version, self.loads = newest, self.loads + 1
        return newest

    def generate(self, requests, sampling_params, sync=True, min_version=None):
        if self.before is not None:
            self.before(self)
        version = self.sync() if sync or self.version is None else self.version
        if min_version is not None and version < min_version and self.honours_floor:
            raise BelowStalenessFloor(f"serves {version}, below {min_version}")
        self.calls += 1
        if self.during is not None:
            self.during(self)
        out = []
        for sid, ctx in requests:
            rec = TurnRecord(tuple(ctx), torch.tensor([5, 6]), torch.tensor([-1.0, -2.0]), None, 1.0, 1.0, None,
                             versions=(str(version),) * 2)
            out.append(ServedTurn(sid, self.name, version, rec))
        return out

    def info(self):
        return {"pid": 0, "rss_mib": 0.0, "version": self.version, "loads": self.loads}


def make_fleet(tmp_path, names=("a", "b"), during=None, before=None, **kwargs):
    groups = [SamplerGroup(n, "CPU", "bf16", "fp32", 1.0) for n in names]
    ch = MemoryChannel()
    fleet = LiveFleet(groups, "unused", tmp_path, channel=ch, **kwargs)
    engines = {n: FakeGroup(n, ch, (during or {}).get(n), (before or {}).get(n)) for n in names}
    fleet.start_in_process(engines)
    fleet.publish({"w": torch.zeros(1)}, 0)
    return fleet, engines


def stamps(batch) -> set[tuple[str, int]]:
    return {(t.group, t.version) for ts in batch.turns for t in ts}


def status_row(fleet, name) -> list[str]:
    return next(ln for ln in fleet.status().splitlines() if ln.startswith(name)).split()


def test_sync_every_lets_a_group_fall_behind_without_a_limit(tmp_path):
    fleet, eng = make_fleet(tmp_path, names=("a",), sync_every=3)
    served = []
    for v in range(1, 6):
        served.append(sorted(stamps(fleet.rollout([[1, 2]], SP)))[0][1])
        fleet.publish({"w": torch.zeros(1)}, v)
    # loaded 0 at the first call; reloads when 3 behind
    assert served == [0, 0, 0, 3, 3] and eng["a"].loads == 2
    assert not fleet.events


def test_a_group_below_the_floor_syncs_before_it_serves(tmp_path):
    """``b`` syncs only every 4 versions, the limit is 1: exactly 1 behind it still serves its old version; when it
    would be 2 behind, its call syncs first, so it serves the new version: nothing is generated and then refused."""
    fleet, eng = make_fleet(tmp_path, sync_every={"a": 1, "b": 4}, max_staleness=1)
    first = fleet.rollout([[1]] * 4, SP)
    assert first.served_counts() == {"a": 2, "b": 2}
    fleet.publish({"w": torch.zeros(1)}, 1)
    at_limit = fleet.rollout([[1]] * 4, SP)  # b is 1 behind: within the limit, serves version 0
    assert stamps(at_limit) == {("a", 1), ("b", 0)} and not fleet.events
    fleet.publish({"w": torch.zeros(1)}, 2)
    synced = fleet.rollout([[1]] * 4, SP, turns=2)
    assert stamps(synced) == {("a", 2), ("b", 2)} and not fleet.events
    assert all(len(ts) == 2 for ts in synced.turns) and eng["b"].loads == 2
    # state, version, turns, reloads only the floor asked for, refused turns, restarts
    assert status_row(fleet, "b")[2:8] == ["alive", "2", "8", "1", "0", "0"]
    assert status_row(fleet, "a")[5] == "0"


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_the_floor_counts_the_one_step_lookahead(tmp_path, max_staleness):
    """A batch sampled during the trainer's step is trained after its publish (``trained_at = version + 1``): with
    ``max_staleness`` 0 the rollout waits for that publish and serves it; with 1 it serves the current version
    at once. Either way no trained token is more than ``max_staleness`` behind ``trained_at``."""
    fleet, eng = make_fleet(tmp_path, max_staleness=max_staleness)
    pending = fleet.submit([[1]] * 4, SP, turns=2, trained_at=1)
    if max_staleness == 0:
        with pytest.raises(concurrent.futures.TimeoutError):
            pending.result(timeout=0.3)  # waiting for version 1
        assert eng["a"].calls == eng["b"].calls == 0
    fleet.publish({"w": torch.zeros(1)}, 1)
    batch = pending.result(timeout=10)
    lag = 1 - batch.batch.versions
    assert int(lag.max()) <= max_staleness and all(len(ts) == 2 for ts in batch.turns)
    assert stamps(batch) == ({("a", 1), ("b", 1)} if max_staleness == 0 else stamps(batch))
    assert not batch.events and all(v == 0 for v in fleet.refused_turns.values())
    with pytest.raises(ValueError, match="trained_at must be an integer >= the published version 1"):
        fleet.rollout([[1]], SP, trained_at=0)


def test_an_answer_below_the_floor_is_refused_counted_and_its_sessions_resent(tmp_path):
    """A group that ignores the floor (serves without syncing) has its answer refused: its turns are counted as
    refused in the status table, its sessions are served by ``a``, and it gets no more sessions in that rollout."""
    fleet, eng = make_fleet(tmp_path, sync_every={"a": 1, "b": 9}, max_staleness=0)
    fleet.rollout([[1]] * 4, SP)
    fleet.publish({"w": torch.zeros(1)}, 1)
    eng["b"].honours_floor = False
    eng["b"].sync = lambda: eng["b"].version  # a broken group: never loads again
    batch = fleet.rollout([[1]] * 4, SP, turns=2)
    [event] = batch.events
    assert event.kind == "stale" and event.group == "b" and len(event.moved_sessions) == 2
    assert event.detail.startswith("answer served at version 0 refused: below the staleness floor 1")
    assert all(len(ts) == 2 for ts in batch.turns) and len(batch.batch.tokens) == 4 * 2 * 2  # each session once
    assert stamps(batch) == {("a", 1)}
    assert status_row(fleet, "b")[6] == "2" and status_row(fleet, "b")[-1] == "2"  # refused turns, moved away


def test_a_group_that_cannot_reach_the_floor_generates_nothing_and_waits_for_a_newer_version(tmp_path):
    """``b`` cannot load past version 0 (``BelowStalenessFloor`` before sampling): no turn is generated and
    refused; its sessions go to ``a``; once a newer version appears, ``b`` is asked again."""
    fleet, eng = make_fleet(tmp_path, max_staleness=0)
    fleet.rollout([[1]] * 4, SP)
    fleet.publish({"w": torch.zeros(1)}, 1)
    eng["b"].sync = lambda: eng["b"].version
    batch = fleet.rollout([[1]] * 4, SP)
    assert [(e.kind, e.group, len(e.moved_sessions)) for e in batch.events] == [("stale", "b", 2)]
    assert stamps(batch) == {("a", 1)} and fleet.refused_turns == {"a": 0, "b": 0}
    del eng["b"].sync  # b loads again
    fleet.publish({"w": torch.zeros(1)}, 2)
    assert stamps(fleet.rollout([[1]] * 4, SP)) == {("a", 2), ("b", 2)}


def test_the_last_group_reloads_before_serving(tmp_path):
    fleet, eng = make_fleet(tmp_path, names=("a",), sync_every=5, max_staleness=0)
    fleet.rollout([[1]], SP)
    fleet.publish({"w": torch.zeros(1)}, 1)
    batch = fleet.rollout([[1]], SP)
    assert stamps(batch) == {("a", 1)} and not batch.events
    assert fleet.router.shares()["a"] == 1.0 and fleet.stale_reloads["a"] == 1


def test_a_hung_group_moves_its_sessions_to_a_living_group(tmp_path):
    """``b`` never answers its first call: after ``timeout_s`` it is failed as hung, its sessions are served by
    ``a`` with every turn, no session twice, and later rollouts use only ``a``."""
    release = threading.Event()
    fleet, eng = make_fleet(tmp_path, during={"b": lambda g: release.wait(30)}, timeout_s=0.3, token_timeout_s=0)
    try:
        batch = fleet.rollout([[1]] * 4, SP, turns=2)
        [event, dropped] = batch.events  # no factory to restart it with: dropped at once
        assert (event.kind, event.group, len(event.moved_sessions)) == ("hung", "b", 2)
        assert (dropped.kind, dropped.group) == ("dropped", "b") and "no restarts left" in dropped.detail
        assert all(len(ts) == 2 and {t.group for t in ts} == {"a"} for ts in batch.turns)
        assert len(batch.batch.tokens) == 4 * 2 * 2
        assert not fleet.alive["b"] and fleet.alive["a"]
        assert fleet.rollout([[1]] * 4, SP).served_counts() == {"a": 4}
        row = status_row(fleet, "b")
        assert row[2] == "failed" and row[-1] == "2"  # no factory: dropped at once
    finally:
        release.set()


@pytest.mark.parametrize("dies_at_call", [1, 2])
def test_a_dead_group_sends_its_sessions_again_to_a_living_group(tmp_path, dies_at_call):
    """``b``'s process dies (``EngineProcessDied``, what Ray's ``RayActorError`` is to a thread) at its first or
    second call: the sessions of that call are sent again, unchanged, to ``a``; every session gets every turn
    exactly once, the turns ``b`` served before it died stay, and later rollouts use only ``a`` (no factory to
    restart ``b`` with: it is dropped). (Helper D's test of issue 40, with the death named as the fleet now
    classifies it: a plain exception inside ``generate`` is a refused request, not a dead process.)"""

    def die(group):
        if group.calls + 1 == dies_at_call:
            raise EngineProcessDied("engine process died")

    fleet, eng = make_fleet(tmp_path, before={"b": die})
    batch = fleet.rollout([[1]] * 4, SP, turns=2)
    [event, dropped] = batch.events
    assert (event.kind, event.group, len(event.moved_sessions)) == ("died", "b", 2)
    assert "engine process died" in event.detail and (dropped.kind, dropped.group) == ("dropped", "b")
    assert all(len(ts) == 2 for ts in batch.turns) and len(batch.batch.tokens) == 4 * 2 * 2
    by_session = dict(zip(batch.session_ids, batch.turns))
    moved = [[t.group for t in by_session[s]] for s in event.moved_sessions]
    assert moved == [["a", "a"] if dies_at_call == 1 else ["b", "a"]] * 2
    assert batch.group_ids.tolist().count(1) == (0 if dies_at_call == 1 else 2 * 2)  # b's tokens: turns it served
    assert not fleet.alive["b"] and fleet.alive["a"]
    assert fleet.rollout([[1]] * 4, SP).served_counts() == {"a": 4}
    assert status_row(fleet, "b")[2] == "failed" and status_row(fleet, "b")[-1] == "2"


def test_when_every_group_dies_the_rollout_says_so(tmp_path):
    def die(group):
        raise EngineProcessDied("engine process died")

    fleet, _ = make_fleet(tmp_path, before={"a": die, "b": die})
    with pytest.raises(RuntimeError, match="every engine group has failed; the last: '[ab]' died"):
        fleet.rollout([[1]] * 4, SP)


def test_staleness_arguments_are_checked(tmp_path):
    groups = [SamplerGroup("a", "CPU", "bf16", "fp32", 1.0)]
    with pytest.raises(ValueError, match=r"sync_every\['a'\] must be an integer >= 1"):
        LiveFleet(groups, "m", tmp_path, sync_every=0)
    with pytest.raises(ValueError, match="max_staleness must be None or an integer >= 0"):
        LiveFleet(groups, "m", tmp_path, max_staleness=-1)
    with pytest.raises(ValueError, match=r"engines must name every group \['a'\]"):
        LiveFleet(groups, "m", tmp_path).start_in_process({})
