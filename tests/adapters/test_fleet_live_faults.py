"""LiveFleet's faults by cause, without engines or Ray (groups as in-process objects, as in
tests/adapters/test_fleet_live_staleness.py): a dead or hung group restarted with backoff and dropped after
``max_restarts``, a weight version that fails to load (the group keeps serving the last good one), a request the
engine refuses, answers that fail the boundary checks, event details in plain text with the cause first, and call
time limits scaled by the tokens asked for. Every test counts sessions sent / trained / duplicated / lost."""

from __future__ import annotations

import dataclasses
import re
import threading
import time
from pathlib import Path

import pytest
import torch

from offpolicy.adapters.fleet_live import LiveFleet
from offpolicy.adapters.fleet_live.calls import (
    EngineProcessDied,
    GroupCallFailed,
    ThreadCalls,
    WeightLoadError,
    describe,
    plain,
)
from offpolicy.adapters.fleet_live.fleet_runner import GroupRequestError
from offpolicy.fleet import SamplerGroup

from test_fleet_live_staleness import SP, FakeGroup, MemoryChannel, stamps, status_row

W = {"w": torch.zeros(1)}


def fleet_with_factory(tmp_path, names=("a", "b"), hooks=None, **kwargs):
    """A fleet whose groups can be restarted: ``hooks[name](engine)`` makes a fresh engine's ``before`` hook."""
    groups = [SamplerGroup(n, "CPU", "bf16", "fp32", 1.0) for n in names]
    ch = MemoryChannel()
    fleet = LiveFleet(groups, "unused", tmp_path, channel=ch, **kwargs)
    made: dict[str, list[FakeGroup]] = {n: [] for n in names}

    def factory(name):
        g = FakeGroup(name, ch, before=(hooks or {}).get(name))
        made[name].append(g)
        return g

    fleet.start_in_process({n: factory(n) for n in names}, factory=factory)
    fleet.publish(W, 0)
    return fleet, made


def audit(batch, sent: int, turns: int) -> None:
    """Every session sent was trained once with all its turns: none lost, none duplicated."""
    assert len(batch.session_ids) == sent and len(set(batch.session_ids)) == sent
    assert all(len(ts) == turns for ts in batch.turns)
    assert batch.batch.tokens.shape[0] == sum(len(t.record) for ts in batch.turns for t in ts) == sent * turns * 2


def test_a_dead_group_is_restarted_after_its_backoff_and_serves_again(tmp_path):
    def die_once(g):
        if len(made["b"]) == 1:  # only the first engine of b dies, at its first call
            raise EngineProcessDied("engine process died (SIGKILL) " + "x" * 900)

    fleet, made = fleet_with_factory(tmp_path, hooks={"b": die_once}, restart_backoff_s=0.05)
    batch = fleet.rollout([[1]] * 4, SP, turns=2)
    audit(batch, 4, 2)
    died = batch.events[0]
    assert (died.kind, died.group, len(died.moved_sessions)) == ("died", "b", 2)
    cause, note = died.detail.split("...; ")  # a long cause is cut to 600 characters, the restart note kept
    assert cause.startswith("EngineProcessDied: engine process died (SIGKILL) xxx") and len(cause) == 597
    assert note == "restart 1 of 2 in 0.05 s"
    t0 = time.monotonic()
    while not fleet.alive["b"] and time.monotonic() - t0 < 5:  # the restart finishes in a later rollout
        fleet.rollout([[1]], SP)
    assert fleet.alive["b"] and len(made["b"]) == 2
    assert [e.kind for e in fleet.events] == ["died", "restarted"]
    back = fleet.rollout([[1]] * 4, SP)
    assert back.served_counts() == {"a": 2, "b": 2}
    assert status_row(fleet, "b")[2] == "alive" and status_row(fleet, "b")[7] == "1"  # restarts


def test_a_group_that_keeps_dying_is_dropped_after_max_restarts_with_backoff(tmp_path):
    def always(g):
        raise EngineProcessDied("engine process died")

    fleet, made = fleet_with_factory(tmp_path, hooks={"b": always}, max_restarts=2, restart_backoff_s=0.05)
    seen = []
    for _ in range(40):
        batch = fleet.rollout([[1]] * 4, SP)
        audit(batch, 4, 1)
        seen += batch.session_ids
        if any(e.kind == "dropped" for e in fleet.events):
            break
        time.sleep(0.03)
    assert len(seen) == len(set(seen))
    kinds = [e.kind for e in fleet.events if e.group == "b"]
    assert kinds == ["died", "restarted", "died", "restarted", "died", "dropped"], kinds
    delays = [e.detail.split(" in ")[-1] for e in fleet.events if e.kind == "died"][:2]
    assert delays == ["0.05 s", "0.1 s"]  # backoff doubles
    assert "no restarts left (max_restarts=2) after died: EngineProcessDied" in fleet.events[-1].detail
    assert status_row(fleet, "b")[2] == "failed" and fleet.alive["a"]


def test_the_last_group_dying_waits_for_its_restart_instead_of_failing_the_fleet(tmp_path):
    def die_once(g):
        if len(made["a"]) == 1:
            raise EngineProcessDied("gone")

    fleet, made = fleet_with_factory(tmp_path, names=("a",), hooks={"a": die_once}, restart_backoff_s=0.05)
    batch = fleet.rollout([[1]] * 3, SP, turns=2)
    audit(batch, 3, 2)
    assert [e.kind for e in batch.events] == ["died", "restarted"]
    assert stamps(batch) == {("a", 0)}


def test_every_group_failed_only_when_none_is_left_to_restart(tmp_path):
    def always(g):
        raise EngineProcessDied("gone")

    fleet, _ = fleet_with_factory(tmp_path, names=("a",), hooks={"a": always}, max_restarts=1,
                                  restart_backoff_s=0.01)
    with pytest.raises(RuntimeError, match="every engine group has failed; the last: 'a' died"):
        fleet.rollout([[1]], SP)
    assert [e.kind for e in fleet.events] == ["died", "restarted", "died", "dropped"]


class CorruptAt:
    """A group's ``sync`` as EngineGroup's: version ``bad`` fails to load once, naming the cause; the group keeps
    its version and skips ``bad`` afterwards."""

    def __init__(self, engine: FakeGroup, bad: int):
        self.engine, self.bad, self.failed = engine, bad, False

    def __call__(self):
        e, newest = self.engine, self.engine.channel.latest()
        if newest == self.bad:
            if not self.failed:
                self.failed = True
                raise WeightLoadError(f"SafetensorsError: Error while deserializing header: HeaderTooLarge "
                                      f"(loading version {newest} in group {e.name!r}; it keeps serving version "
                                      f"{e.version})")
            return e.version
        if newest != e.version:
            e.version, e.loads = newest, e.loads + 1
        return newest


def test_a_corrupt_version_fails_one_call_per_group_and_the_fleet_keeps_the_last_good_version(tmp_path):
    fleet, made = fleet_with_factory(tmp_path)
    for n in ("a", "b"):
        made[n][0].sync = CorruptAt(made[n][0], bad=2)
    fleet.rollout([[1]] * 4, SP)
    fleet.publish(W, 1)
    fleet.rollout([[1]] * 4, SP)
    fleet.publish(W, 2)  # corrupt
    batch = fleet.rollout([[1]] * 4, SP, turns=2)
    audit(batch, 4, 2)
    assert sorted((e.kind, e.group) for e in batch.events) == [("load_failed", "a"), ("load_failed", "b")]
    assert all(e.detail.startswith("SafetensorsError: Error while deserializing header") for e in batch.events)
    assert all("keeps serving version 1" in e.detail for e in batch.events)
    assert stamps(batch) == {("a", 1), ("b", 1)} and all(fleet.alive.values())
    again = fleet.rollout([[1]] * 4, SP)  # no further failure: the bad version is skipped
    assert not again.events and stamps(again) == {("a", 1), ("b", 1)}
    fleet.publish(W, 3)
    assert stamps(fleet.rollout([[1]] * 4, SP)) == {("a", 3), ("b", 3)}


def test_a_corrupt_floor_version_waits_for_the_next_publish_or_is_named(tmp_path):
    """With ``max_staleness=0`` a batch trained at the corrupt version cannot be served: the groups generate
    nothing below the floor; a newer publish within a call time limit unblocks them, otherwise the rollout raises
    naming why each group cannot serve."""
    fleet, made = fleet_with_factory(tmp_path, max_staleness=0, timeout_s=0.3, token_timeout_s=0)
    for n in ("a", "b"):
        made[n][0].sync = CorruptAt(made[n][0], bad=1)
    fleet.rollout([[1]] * 2, SP)
    fleet.publish(W, 1)
    with pytest.raises(RuntimeError, match=r"no engine group could serve 2 sessions for \d+\.\d s: 'a': serves 0, below 1; 'b': serves 0, below 1"):
        fleet.rollout([[1]] * 2, SP)
    kinds = sorted((e.kind, e.group) for e in fleet.events)
    assert kinds == [("load_failed", "a"), ("load_failed", "b"), ("stale", "a"), ("stale", "b")]
    assert fleet.refused_turns == {"a": 0, "b": 0} and all(fleet.alive.values())
    fleet.max_staleness = 1  # trained at 2, floor 1 (corrupt): served once 2 is published meanwhile
    threading.Timer(0.1, fleet.publish, (W, 2)).start()
    batch = fleet.rollout([[1]] * 2, SP, trained_at=2)
    audit(batch, 2, 1)
    assert stamps(batch) <= {("a", 2), ("b", 2)}


def test_a_request_the_engine_refuses_raises_and_the_group_stays(tmp_path):
    def refuse(g):
        raise ValueError("\x1b[31mThe decoder prompt (length 300) is longer than the maximum model length of 256\x1b[0m")

    fleet, made = fleet_with_factory(tmp_path, names=("a",), hooks={"a": refuse})
    with pytest.raises(GroupRequestError, match=r"group 'a' failed the request: ValueError: The decoder prompt"):
        fleet.rollout([[1]], SP)
    [event] = fleet.events
    assert event.kind == "error" and "\x1b" not in event.detail and fleet.alive["a"] and len(made["a"]) == 1


def _bad(kind):
    def corrupt(turn):
        rec = turn.record
        if kind == "nan":
            rec = dataclasses.replace(rec, sampler_logprobs=torch.tensor([float("nan"), -1.0]))
        elif kind == "positive":
            rec = dataclasses.replace(rec, sampler_logprobs=torch.tensor([0.5, -1.0]))
        elif kind == "vocab":
            rec = dataclasses.replace(rec, tokens=torch.tensor([5, 999]))
        elif kind == "length":
            rec = dataclasses.replace(rec, sampler_logprobs=torch.tensor([-1.0]))
        elif kind == "future":
            return dataclasses.replace(turn, version=turn.version + 5,
                                       record=dataclasses.replace(rec, versions=(str(turn.version + 5),) * 2))
        elif kind == "versions":
            rec = dataclasses.replace(rec, versions=("0", "1"))
        elif kind == "context":
            rec = dataclasses.replace(rec, input_ids=(9, 9))
        return dataclasses.replace(turn, record=rec)
    return corrupt


@pytest.mark.parametrize("kind,message", [
    ("nan", "NaN log-probability"), ("positive", "is not a log-probability"),
    ("vocab", r"token ids outside \[0, 100\)"), ("length", "sampler_logprobs of shape"),
    ("future", "newer than the newest published"), ("versions", "do not all equal the served version"),
    ("context", "is not the one sent"),
])
def test_an_answer_failing_the_boundary_checks_is_refused_and_its_group_restarted(tmp_path, kind, message):
    fleet, made = fleet_with_factory(tmp_path, restart_backoff_s=0.01)
    fleet.vocab_size = 100
    first = made["b"][0]
    real = first.generate
    first.generate = lambda *a, **k: [_bad(kind)(t) for t in real(*a, **k)]
    batch = fleet.rollout([[1]] * 4, SP, turns=2)
    audit(batch, 4, 2)
    invalid = batch.events[0]
    assert (invalid.kind, invalid.group, len(invalid.moved_sessions)) == ("invalid", "b", 2)
    assert invalid.detail.startswith("group 'b', session")
    assert re.search(message, invalid.detail), invalid.detail
    assert all(torch.isfinite(batch.batch.sampler_logprobs)) and int(batch.batch.tokens.max()) < 100
    assert all(t.group == "a" for ts in batch.turns for t in ts if ts[0].session_id in invalid.moved_sessions)


def test_details_are_plain_text_with_the_cause_first():
    long = "\x1b[36m(EngineGroup pid=123)\x1b[0m " + "x" * 900
    assert "\x1b" not in plain(long) and len(plain(long)) == 600 and plain(long).endswith("...")
    exc = RuntimeError("\x1b[1mcorrupt\x1b[0m   header\n  at line 3")
    assert describe(exc) == "RuntimeError: corrupt header at line 3"
    calls = ThreadCalls(max_workers=2)
    for raised, kind in ((EngineProcessDied("x"), "died"), (WeightLoadError("x"), "load"), (KeyError("x"), "error")):
        def boom(e=raised):
            raise e
        with pytest.raises(GroupCallFailed) as info:
            calls.get(calls.pool.submit(boom))
        assert info.value.kind == kind
        assert info.value.detail == ("x" if kind == "load" else f"{type(raised).__name__}: {raised}")
    with pytest.raises(GroupCallFailed) as info:
        calls.get(calls.pool.submit(time.sleep, 0.5), timeout=0.01)
    assert info.value.kind == "hung"


def test_call_limits_scale_with_tokens_and_a_hang_does_not_hold_back_the_other_group(tmp_path):
    """``a`` takes 4 ms per token asked (a 4-request call of 64 tokens takes 0.26 s, over the fixed 0.15 s but
    within 0.15 + 64 x 5 ms): healthy, never declared hung. ``b`` hangs: it is failed after its own limit, and
    ``a``'s sessions went through all their turns meanwhile."""
    release = threading.Event()

    def slow(g):
        time.sleep(0.004 * 16 * 4)

    def hang(g):
        release.wait(20)

    groups = [SamplerGroup(n, "CPU", "bf16", "fp32", 1.0) for n in ("a", "b")]
    ch = MemoryChannel()
    fleet = LiveFleet(groups, "unused", tmp_path, channel=ch, timeout_s=0.15, token_timeout_s=0.005,
                      max_restarts=0)
    eng = {"a": FakeGroup("a", ch, before=slow), "b": FakeGroup("b", ch, before=hang)}
    fleet.start_in_process(eng)
    fleet.publish(W, 0)
    assert fleet.call_timeout("a", 64) == pytest.approx(0.15 + 0.32)
    try:
        t0 = time.monotonic()
        batch = fleet.rollout([[1]] * 8, SP | {"max_tokens": 16}, turns=3)
        took = time.monotonic() - t0
        audit(batch, 8, 3)
        hung = [e for e in batch.events if e.kind == "hung"]
        assert [e.group for e in hung] == ["b"] and "no answer within 0.47 s (4 requests x 16 tokens)" in hung[0].detail
        assert not any(e.group == "a" for e in batch.events)
        # a served its own 4 sessions' three turns while b hung, then b's 4 sessions' three turns
        assert eng["a"].calls >= 4 and took < 0.47 + 6 * 0.3, took
    finally:
        release.set()


@pytest.mark.parametrize("bad", [{"max_restarts": -1}, {"restart_backoff_s": -1}, {"token_timeout_s": -0.1},
                                 {"timeout_s": {"a": 0}}])
def test_fault_arguments_are_checked(tmp_path, bad):
    groups = [SamplerGroup("a", "CPU", "bf16", "fp32", 1.0)]
    with pytest.raises(ValueError, match=list(bad)[0]):
        LiveFleet(groups, "m", tmp_path, **bad)


class RecordingLLM:
    """The two ``vllm.LLM`` calls ``EngineGroup.sync`` makes, recorded."""

    def __init__(self):
        self.loaded: list[str] = []

    def collective_rpc(self, method, kwargs):
        assert method == "reload_weights"
        from safetensors.torch import load_file

        path = Path(kwargs["weights_path"])
        if path.name.startswith("v"):
            load_file(str(path / "model.safetensors"))  # what vLLM's loader reads
        self.loaded.append(path.name)

    def reset_prefix_cache(self):
        pass


def test_engine_group_sync_with_a_corrupt_checkpoint_keeps_the_last_good_version(tmp_path):
    """EngineGroup.sync itself (its vLLM engine replaced by a recorder): a corrupt ``model.safetensors`` in the
    channel raises WeightLoadError once, cause first; the engine is put back on the last good checkpoint, later
    syncs skip the bad version, and the next good version loads."""
    pytest.importorskip("safetensors")
    from offpolicy.adapters.fleet_live import DiskWeightChannel, EngineGroup, EngineSettings

    ch = DiskWeightChannel(tmp_path / "weights")
    eg = EngineGroup.__new__(EngineGroup)
    eg.group, eg.settings, eg.channel = SamplerGroup("g", "CPU", "nvfp4", "fp32", 1.0), EngineSettings(), ch
    eg.model_dir, eg.work_dir, eg.llm = str(tmp_path / "model"), tmp_path / "g", RecordingLLM()
    eg.version, eg.loads, eg.failed_versions = None, 0, set()
    eg.work_dir.mkdir()
    weights = {"lin.weight": torch.randn(4, 16), "norm.weight": torch.ones(4)}
    ch.publish(weights, 0)
    assert eg.sync() == 0
    ch.publish(weights, 1)
    (ch.path(1) / "model.safetensors").write_bytes(b"\xff" * 64)  # corrupt on disk
    with pytest.raises(WeightLoadError) as info:
        eg.sync()
    msg = str(info.value)
    assert msg.startswith("SafetensorError: Error while deserializing header") and msg.endswith("(loading version 1 in group 'g'; it keeps "
                                                                 "serving version 0)"), msg
    assert eg.version == 0 and eg.llm.loaded == ["v000000", "v000000"]  # put back on version 0
    assert eg.sync() == 0 and eg.failed_versions == {1}  # skipped, no second failure
    ch.publish(weights, 2)
    assert eg.sync() == 2 and eg.llm.loaded[-1] == "v000002" and eg.loads == 2
    assert sorted(p.name for p in (tmp_path / "g").iterdir()) == ["v000002"]
