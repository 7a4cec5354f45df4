"""LiveFleet's routing, staleness limit and faults without engines or Ray: each group is an in-process object with
EngineGroup's ``generate``/``sync``/``info`` (``LiveFleet.start_in_process``), weights travel on an in-memory
channel, and a turn is two tokens stamped with the version the fake group had loaded."""

from __future__ import annotations

import threading

import pytest
import torch

from offpolicy.adapters.common import TurnRecord
from offpolicy.adapters.fleet_live import LiveFleet, ServedTurn
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

    def sync(self) -> int:
        newest = self.channel.latest()
        if newest != self.version:
            self.version, self.loads = newest, self.loads + 1
        return newest

    def generate(self, requests, sampling_params, sync=True):
        if self.before is not None:
            self.before(self)
        version = self.sync() if sync or self.version is None else self.version
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


def test_a_group_beyond_max_staleness_is_drained_and_reloaded(tmp_path):
    """``b`` syncs only every 4 versions, the limit is 1: exactly 1 behind it still serves; 2 behind it is drained
    for a round (every new session goes to ``a``), reloaded, and serves the next rollout at the new version."""
    fleet, eng = make_fleet(tmp_path, sync_every={"a": 1, "b": 4}, max_staleness=1)
    first = fleet.rollout([[1]] * 4, SP)
    assert first.served_counts() == {"a": 2, "b": 2}
    fleet.publish({"w": torch.zeros(1)}, 1)
    at_limit = fleet.rollout([[1]] * 4, SP)  # b is 1 behind: within the limit, serves version 0
    assert stamps(at_limit) == {("a", 1), ("b", 0)} and not fleet.events
    fleet.publish({"w": torch.zeros(1)}, 2)
    drained = fleet.rollout([[1]] * 4, SP, turns=2)
    assert [(e.kind, e.group, e.moved_sessions) for e in drained.events] == [("stale", "b", ())]
    assert "loaded version 0; trainer at 2, max_staleness 1: drained and reloaded" in drained.events[0].detail
    # drained for the round it reloaded in; the sessions stay (sticky) on a for their second turn
    assert stamps(drained) == {("a", 2)} and all(len(ts) == 2 for ts in drained.turns)
    assert eng["b"].version == 2 and fleet.loaded["b"] == 2
    back = fleet.rollout([[1]] * 4, SP)  # capacity restored: b serves again, at the version it reloaded
    assert stamps(back) == {("a", 2), ("b", 2)}
    assert status_row(fleet, "b")[2:6] == ["alive", "2", "6", "1"]  # state, version, turns, stale drains
    assert status_row(fleet, "a")[5] == "0"


def test_an_answer_served_beyond_the_limit_is_refused_and_its_sessions_resent(tmp_path):
    """The trainer publishes two versions while ``b`` generates: its answer (version 0, now 2 behind) is refused,
    its sessions are served again by ``a``, and ``b`` is reloaded before it serves again."""
    fired = threading.Event()

    def publish_twice(group):
        if not fired.is_set():
            fleet.publish({"w": torch.zeros(1)}, 1)
            fleet.publish({"w": torch.zeros(1)}, 2)
            fired.set()

    # a fixes its version only after the publishes, so only b's answer is behind
    fleet, eng = make_fleet(tmp_path, during={"b": publish_twice}, before={"a": lambda g: fired.wait(10)},
                            max_staleness=1)
    batch = fleet.rollout([[1]] * 4, SP)
    [event] = batch.events
    assert event.kind == "stale" and event.group == "b" and len(event.moved_sessions) == 2
    assert "answer served at version 0 refused" in event.detail
    assert all(len(ts) == 1 for ts in batch.turns) and len(batch.batch.tokens) == 8  # each session once
    by_session = dict(zip(batch.session_ids, batch.turns))
    assert {by_session[s][0].group for s in event.moved_sessions} == {"a"}
    assert ("b", 0) not in stamps(batch) and all(fleet.version - v <= 1 for _, v in stamps(batch))
    assert eng["b"].version == 2 and status_row(fleet, "b")[5] == "1"


def test_the_last_group_is_not_drained_but_reloads_before_serving(tmp_path):
    fleet, eng = make_fleet(tmp_path, names=("a",), sync_every=5, max_staleness=0)
    fleet.rollout([[1]], SP)
    fleet.publish({"w": torch.zeros(1)}, 1)
    batch = fleet.rollout([[1]], SP)
    assert stamps(batch) == {("a", 1)} and [e.kind for e in batch.events] == ["stale"]
    assert fleet.router.shares()["a"] == 1.0


def test_a_hung_group_moves_its_sessions_to_a_living_group(tmp_path):
    """``b`` never answers its first call: after ``timeout_s`` it is failed as hung, its sessions are served by
    ``a`` with every turn, no session twice, and later rollouts use only ``a``."""
    release = threading.Event()
    fleet, eng = make_fleet(tmp_path, during={"b": lambda g: release.wait(30)}, timeout_s=0.3)
    try:
        batch = fleet.rollout([[1]] * 4, SP, turns=2)
        [event] = batch.events
        assert (event.kind, event.group, len(event.moved_sessions)) == ("hung", "b", 2)
        assert all(len(ts) == 2 and {t.group for t in ts} == {"a"} for ts in batch.turns)
        assert len(batch.batch.tokens) == 4 * 2 * 2
        assert not fleet.alive["b"] and fleet.alive["a"]
        assert fleet.rollout([[1]] * 4, SP).served_counts() == {"a": 4}
        row = status_row(fleet, "b")
        assert row[2] == "failed" and row[-1] == "2"
    finally:
        release.set()


@pytest.mark.parametrize("dies_at_call", [1, 2])
def test_a_dead_group_sends_its_sessions_again_to_a_living_group(tmp_path, dies_at_call):
    """``b``'s call raises (its process died) at its first or second call: the sessions of that call are sent again,
    unchanged, to ``a``; every session gets every turn exactly once, the turns ``b`` served before it died stay,
    and later rollouts use only ``a``."""

    def die(group):
        if group.calls + 1 == dies_at_call:
            raise RuntimeError("engine process died")

    fleet, eng = make_fleet(tmp_path, before={"b": die})
    batch = fleet.rollout([[1]] * 4, SP, turns=2)
    [event] = batch.events
    assert (event.kind, event.group, len(event.moved_sessions)) == ("died", "b", 2)
    assert "engine process died" in event.detail
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
        raise RuntimeError("engine process died")

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
