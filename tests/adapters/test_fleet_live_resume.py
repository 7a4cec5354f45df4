"""Resume of the live fleet's training loop (``toy_run.train(checkpoint=)``) without engines: the groups are
in-process objects returning support records, the trainer is the tiny Qwen3. A run is killed after a step, a
second run on the same channel and checkpoint resumes: no step repeated or skipped, no session trained twice, and
only the batch in flight at the kill lost."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from offpolicy.adapters.common import TurnRecord, csr_record
from offpolicy.adapters.fleet_live import LiveFleet, ServedTurn
from offpolicy.adapters.fleet_live.toy_run import (
    RunConfig,
    audit,
    build_tiny_qwen3,
    check_history,
    resumed_history,
    train,
)
from offpolicy.fleet import SamplerGroup

from test_fleet_live_staleness import MemoryChannel

pytest.importorskip("transformers")
HALF = math.log(0.5)


class SupportGroup:
    """EngineGroup's calls: each turn ``max_tokens`` tokens, each drawn from a two-token support {t, t + 1}."""

    def __init__(self, name, channel):
        self.name, self.channel, self.version = name, channel, None
        self.gen = torch.Generator().manual_seed(len(name))

    def sync(self):
        self.version = self.channel.latest()
        return self.version

    def generate(self, requests, sampling_params, sync=True, min_version=None):
        version = self.sync() if sync or self.version is None else self.version
        n = int(sampling_params["max_tokens"])
        out = []
        for sid, ctx in requests:
            base = torch.randint(2, 120, (n,), generator=self.gen)
            tokens = base + torch.randint(0, 2, (n,), generator=self.gen)
            cands = csr_record([[int(b), int(b) + 1] for b in base], [[HALF, HALF]] * n)
            rec = TurnRecord(tuple(ctx), tokens, torch.full((n,), HALF), cands, 1.0, 0.95, 24,
                             versions=(str(version),) * n)
            out.append(ServedTurn(sid, self.name, version, rec))
        return out

    def info(self):
        return {"pid": 0, "rss_mib": 0.0, "version": self.version, "loads": 0, "vocab_size": 128}


def fleet_on(channel, tmp_path):
    groups = [SamplerGroup(n, "CPU", "bf16", "fp32", 1.0) for n in ("a", "b")]
    fleet = LiveFleet(groups, "unused", tmp_path, channel=channel)
    fleet.start_in_process({n: SupportGroup(n, channel) for n in ("a", "b")})
    return fleet


def test_a_killed_run_resumes_from_its_checkpoint(tmp_path):
    cfg = RunConfig(steps=5, prompts=2, samples=2, turns=2, turn_tokens=3)
    channel, ckpt = MemoryChannel(), tmp_path / "trainer.pt"
    first = fleet_on(channel, tmp_path)
    model = build_tiny_qwen3(None, seed=0)
    first.publish(model.state_dict(), first.next_version())
    weights_at_kill = {}

    def kill_after_step_1(log, batch, metrics):
        if log.step == 1:
            weights_at_kill.update({k: v.clone() for k, v in model.state_dict().items()})
            raise KeyboardInterrupt("trainer killed")

    with pytest.raises(KeyboardInterrupt):
        train(first, model, cfg, kill_after_step_1, checkpoint=ckpt)
    first.close()
    assert [h.step for h in resumed_history(ckpt)] == [0, 1]
    versions_before = channel.latest()

    second = fleet_on(channel, tmp_path)  # a rerun: new process, new model object, the same folder
    fresh = build_tiny_qwen3(None, seed=1)
    second.publish(fresh.state_dict(), second.next_version())
    resumed_weights = []
    history, _ = train(second, fresh, cfg, lambda log, b, m: resumed_weights.append(log.version), checkpoint=ckpt)
    assert [h.step for h in history] == [0, 1, 2, 3, 4]
    assert min(resumed_weights) > versions_before  # the restored weights were published as a new version
    # the restored weights, not the fresh ones, were trained from: the second run's first published version
    restored = channel.fetch(versions_before + 2)
    assert all(torch.equal(restored[k], weights_at_kill[k]) for k in weights_at_kill)
    steps = [{"sessions": h.sessions} for h in history]
    counts = audit(steps, second.sessions_opened, cfg.turns)
    in_flight = cfg.prompts * cfg.samples
    assert counts == {"sent": 6 * in_flight, "trained": 5 * in_flight, "duplicated": 0, "incomplete": 0,
                      "lost": in_flight}
    assert check_history([vars(h) for h in history], cfg.turns, resumed_at=2) == []
    again, _ = train(second, fresh, cfg, checkpoint=ckpt)  # complete: nothing more to do
    assert [h.step for h in again] == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="checkpoint_every must be an integer >= 1"):
        train(second, fresh, cfg, checkpoint=ckpt, checkpoint_every=0)


def test_versions_grow_across_a_resume_onto_an_empty_channel(tmp_path):
    """A channel that did not outlive the killed trainer (Ray's object store dies with it): the rerun publishes
    from 0 again, and the restored weights go out past the checkpoint's version, so versions still grow."""
    cfg = RunConfig(steps=3, prompts=1, samples=2, turns=1, turn_tokens=2)
    ckpt = tmp_path / "trainer.pt"
    first = fleet_on(MemoryChannel(), tmp_path)
    model = build_tiny_qwen3(None, seed=0)
    first.publish(model.state_dict(), first.next_version())

    def kill_after_step_0(log, batch, metrics):
        if log.step == 0:
            raise KeyboardInterrupt("trainer killed")

    with pytest.raises(KeyboardInterrupt):
        train(first, model, cfg, kill_after_step_0, checkpoint=ckpt)
    first.close()
    killed_at = first.version  # 1: the version published after step 0
    channel = MemoryChannel()
    second = fleet_on(channel, tmp_path)
    second.publish(build_tiny_qwen3(None, seed=1).state_dict(), second.next_version())
    assert second.version == 0
    history, _ = train(second, build_tiny_qwen3(None, seed=1), cfg, checkpoint=ckpt)
    assert [h.version for h in history] == [0, killed_at + 1, killed_at + 2]
    assert sorted(channel.versions) == [0, killed_at + 1, killed_at + 2, killed_at + 3]


LIVE_RESUME = Path(__file__).resolve().parents[2] / "docs" / "fleet_results" / "live_resume" / "history.json"


def test_check_history_passes_a_live_resumed_run_and_names_each_fault():
    """``check_history`` on the committed history of a live run killed after step 2 and rerun (resumed at step 3,
    the restored weights served as version 5), then on copies broken one way each."""
    record = json.loads(LIVE_RESUME.read_text())
    steps, at = record["steps"], record["resumed_at"]
    assert at == 3 and check_history(steps, 2, at) == []

    def broken(change):
        s = copy.deepcopy(steps)
        change(s)
        return check_history(s, 2, at)

    first = steps[3]["sessions"][0]["id"]
    assert f"session {first} trained twice (steps 3 and 4)" in broken(
        lambda s: s[4]["sessions"].append(copy.deepcopy(s[3]["sessions"][0])))
    repeated = broken(lambda s: s.insert(3, copy.deepcopy(s[2])))  # a step trained again after the resume
    assert "steps are numbered [0, 1, 2, 2, 3, 4, 5], not 0..6" in repeated
    assert "step 2 trained at version 2, not after the previous step's 2" in repeated
    assert any(p.startswith("session ") and "trained twice (steps 2 and 2)" in p for p in repeated)
    short = broken(lambda s: s[1]["sessions"][0]["turns"].pop())
    assert f"session {steps[1]['sessions'][0]['id']} of step 1 trained with 1 turns, not 2" in short

    def restamp(s):  # a turn's served version that is not what its tokens were stamped with
        s[1]["sessions"][0]["turns"][0][1] -= 1
    off_stamp = broken(restamp)
    assert len(off_stamp) == 1 and off_stamp[0].startswith("step 1: tokens per staleness from the served versions")

    def future(s):
        s[0]["sessions"][0]["turns"][0][1] = 1
    assert any("served version 1, after the step's 0" in p for p in broken(future))

    def old(s):  # served after the resume at version 4, before the restored weights' 5 (stamps kept in step)
        turn = s[4]["sessions"][0]["turns"][0]
        assert s[4]["version"] == 6 and turn[1] == 5  # staleness 1 in the committed run
        turn[1] = 4
        s[4]["staleness"]["1"] -= turn[2]
        s[4]["staleness"]["2"] = turn[2]
    assert broken(old) == ["after the resume at step 3 turns were served at versions [4], older than the restored "
                           "weights' version 5"]
    with pytest.raises(ValueError, match="turns must be an integer >= 1"):
        check_history(steps, 0)
    with pytest.raises(ValueError, match=r"resumed_at must be an integer in \[0, 6\]"):
        check_history(steps, 2, resumed_at=7)


def test_a_rerun_resumes_without_publishing_first(tmp_path):
    """The rerun publishes only the restored weights: the first resumed step trains at the version after the
    killed run's newest; without a checkpoint, training unpublished weights is still refused."""
    cfg = RunConfig(steps=3, prompts=1, samples=2, turns=1, turn_tokens=2)
    channel, ckpt = MemoryChannel(), tmp_path / "trainer.pt"
    first = fleet_on(channel, tmp_path)
    model = build_tiny_qwen3(None, seed=0)
    first.publish(model.state_dict(), first.next_version())

    def kill_after_step_0(log, batch, metrics):
        if log.step == 0:
            raise KeyboardInterrupt("trainer killed")

    with pytest.raises(KeyboardInterrupt):
        train(first, model, cfg, kill_after_step_0, checkpoint=ckpt)
    first.close()
    assert channel.latest() == 1
    second = fleet_on(channel, tmp_path)
    with pytest.raises(RuntimeError, match="publish the model's weights first"):
        train(second, build_tiny_qwen3(None, seed=1), cfg)
    history, _ = train(second, build_tiny_qwen3(None, seed=1), cfg, checkpoint=ckpt)
    assert [h.version for h in history] == [0, 2, 3]
    assert sorted(channel.versions) == [0, 1, 2, 3, 4]
    assert check_history([vars(h) for h in history], cfg.turns, resumed_at=1) == []
