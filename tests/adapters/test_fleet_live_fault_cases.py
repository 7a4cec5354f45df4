"""The live fleet's staleness bound and faults with real engines: two vLLM engine groups under Ray (inside
.venv-vllm; tests/adapters/test_fleet_live.py runs this file there). One fleet for the module, used in order:

1. ``max_staleness=1``, then ``0``: a few training steps each through ``toy_run.train`` (rollouts one step ahead,
   ``trained_at`` passed); no trained token is further behind the loss's ``current_version`` than the bound, and
   no generated turn is refused.
2. A corrupt checkpoint: one published version's ``model.safetensors`` is garbage. Each group fails one call
   naming the cause (``load_failed``, the safetensors error first), keeps serving the last good version, and
   training goes on; no token is stamped with the corrupt version.
3. An engine process killed (SIGKILL): the killed call's sessions move to the other group, each trained once with
   every turn; the group is restarted and serves again; every session is trained once.
4. The trainer killed and resumed: its loop is stopped by an exception out of a step (with the next batch in flight
   on the engines), and a new trainer (a fresh model) resumes from the checkpoint on the same engines: no step
   repeated or skipped, no session trained twice, only the batch in flight lost. (The trainer's process killed and
   the engines started again: the slow opt-in tests/adapters/test_fleet_live_kill.py.)

Each test prints sessions sent / trained / duplicated / lost as measured.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

try:
    import ray  # noqa: F401
    import vllm  # noqa: F401
except ImportError:
    pytest.skip("runs inside .venv-vllm, through tests/adapters/test_fleet_live.py (tools/setup_vllm_env.sh builds "
                "it)", allow_module_level=True)

from offpolicy.adapters.fleet_live import LiveFleet  # noqa: E402
from offpolicy.adapters.fleet_live.toy_run import RunConfig, audit, build_tiny_qwen3, resumed_history, train  # noqa: E402
from offpolicy.fleet import SamplerGroup  # noqa: E402

GROUPS = [SamplerGroup("cpu-bf16", "CPU", "bf16", "fp32", 1.0), SamplerGroup("cpu-nvfp4", "CPU", "nvfp4", "fp32", 1.0)]
CFG = RunConfig(steps=4, prompts=2, samples=4, turns=2, turn_tokens=5, lr=2e-4)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    base = tmp_path_factory.mktemp("fleet_live_faults")
    model = build_tiny_qwen3(base / "model")
    fl = LiveFleet(GROUPS, base / "model", base, timeout_s=120, max_restarts=1, restart_backoff_s=1.0)
    try:
        fl.start()
        fl.publish(model.state_dict(), 0)
        fl.model = model
        yield fl
    finally:
        fl.close()


def run(fleet, cfg, on_step=None):
    logs, batches = [], []

    def hook(log, batch, metrics):
        logs.append(log)
        batches.append(batch)
        if on_step is not None:
            on_step(log, batch)

    train(fleet, fleet.model, cfg, hook)
    sent = cfg.steps * cfg.prompts * cfg.samples
    trained = [sid for b in batches for sid in b.session_ids]
    full = sum(len(ts) == cfg.turns for b in batches for ts in b.turns)
    dup = len(trained) - len(set(trained))
    print(f"sessions sent {sent} trained {len(set(trained))} duplicated {dup} lost {sent - full}")
    assert len(trained) == sent and dup == 0 and full == sent
    return logs, batches


@pytest.mark.parametrize("bound", [1, 0])
def test_no_trained_token_is_beyond_max_staleness(fleet, bound):
    fleet.max_staleness = bound
    refused = dict(fleet.refused_turns)
    t0 = time.monotonic()
    logs, _ = run(fleet, CFG)
    lags = {}
    for log in logs:
        for lag, n in log.staleness.items():
            lags[lag] = lags.get(lag, 0) + n
    print(f"[max_staleness {bound}] trained tokens per staleness {dict(sorted(lags.items()))}, "
          f"{time.monotonic() - t0:.1f} s")
    print(fleet.status())
    assert max(lags) <= bound and min(lags) >= 0
    assert fleet.refused_turns == refused  # nothing generated and thrown away
    fleet.max_staleness = None


def test_a_corrupt_checkpoint_is_named_and_the_fleet_trains_on_the_last_good_version(fleet):
    real_publish = fleet.channel.publish
    corrupt = fleet.version + 2

    def publish(state_dict, version, **kwargs):
        real_publish(state_dict, version, **kwargs)
        if version == corrupt:
            for f in fleet.channel.path(version).rglob("model.safetensors"):  # the weights and each format's copy
                f.write_bytes(b"\xff" * 64)

    fleet.channel.publish = publish
    before = len(fleet.events)
    try:
        logs, batches = run(fleet, CFG)
    finally:
        fleet.channel.publish = real_publish
    events = fleet.events[before:]
    print("\n".join(f"{e.kind} {e.group}: {e.detail}" for e in events))
    failed = [e for e in events if e.kind == "load_failed"]
    assert sorted(e.group for e in failed) == sorted(g.name for g in GROUPS)  # one failed call per group
    for e in failed:
        assert e.detail.startswith("SafetensorError: Error while deserializing header"), e.detail
        assert f"loading version {corrupt} in group {e.group!r}; it keeps serving version {corrupt - 1}" in e.detail
        assert "\x1b" not in e.detail
    assert not any(e.kind in ("died", "dropped", "hung") for e in events) and all(fleet.alive.values())
    stamps = torch.cat([b.batch.versions for b in batches])
    assert corrupt not in stamps.tolist() and corrupt - 1 in stamps.tolist()
    assert all(torch.isfinite(torch.tensor(log.loss)) for log in logs)


def test_a_killed_engine_is_restarted_and_serves_again(fleet):
    victim = "cpu-nvfp4"
    pid = int(fleet.engine_info()[victim]["pid"])
    before = len(fleet.events)

    def kill_first(log, batch):
        if log.step == 0:
            os.kill(pid, signal.SIGKILL)

    cfg = RunConfig(steps=3, prompts=2, samples=4, turns=2, turn_tokens=5, lr=2e-4)
    t0 = time.monotonic()
    _, batches = run(fleet, cfg, kill_first)
    run_s = time.monotonic() - t0
    while not fleet.alive[victim] and time.monotonic() - t0 < 300:  # the restart started during the run
        fleet.rollout([[3, 4, 5, 6]], {"max_tokens": 2, "temperature": 1.0, "logprobs": 1})
        time.sleep(1)
    back_s = time.monotonic() - t0
    events = fleet.events[before:]
    print("\n".join(f"{e.kind} {e.group}: {e.detail}" for e in events))
    kinds = [(e.kind, e.group) for e in events]
    assert kinds[0] == ("died", victim) and ("restarted", victim) in kinds, kinds
    assert "restart 1 of 1" in events[0].detail
    assert fleet.alive[victim] and int(fleet.engine_info()[victim]["pid"]) != pid
    # the killed call's sessions moved: each trained once, with every turn, the turn the kill lost served elsewhere
    moved = set(events[0].moved_sessions)
    turns = {sid: ts for b in batches for sid, ts in zip(b.session_ids, b.turns) if sid in moved}
    assert moved and set(turns) == moved, (moved, set(turns))
    assert all(len(ts) == cfg.turns and ts[-1].group != victim for ts in turns.values())
    print(f"[engine killed after step 0] {len(moved)} sessions moved off {victim!r}, all trained once; run "
          f"{run_s:.1f} s, serving again {back_s:.1f} s after the run began")
    logs, batches = run(fleet, cfg)
    assert any(victim in b.served_counts() for b in batches)  # it serves again
    print(fleet.status())


def test_a_killed_trainer_resumes_from_its_checkpoint(fleet, tmp_path):
    cfg = RunConfig(steps=4, prompts=2, samples=4, turns=2, turn_tokens=5, lr=2e-4)
    ckpt, opened, t0 = tmp_path / "trainer.pt", fleet.sessions_opened, time.monotonic()

    def kill_after_step_1(log, batch, metrics):
        if log.step == 1:
            raise KeyboardInterrupt("trainer killed")

    with pytest.raises(KeyboardInterrupt):
        train(fleet, fleet.model, cfg, kill_after_step_1, checkpoint=ckpt)
    assert [h.step for h in resumed_history(ckpt)] == [0, 1]
    published = fleet.version
    fresh = build_tiny_qwen3(None, seed=1)  # the new trainer's model: its weights come from the checkpoint
    history, _ = train(fleet, fresh, cfg, checkpoint=ckpt)
    assert [h.step for h in history] == [0, 1, 2, 3]
    assert min(h.version for h in history[2:]) > published  # trained on from the restored weights' new version
    served = {v for h in history[2:] for s in h.sessions for _, v, _ in s["turns"]}
    assert served and min(served) >= published  # ... which the engines loaded (nothing older served)
    counts = audit([{"sessions": h.sessions} for h in history], fleet.sessions_opened - opened, cfg.turns)
    in_flight = cfg.prompts * cfg.samples
    print(f"[trainer killed after step 1 of {cfg.steps}, resumed] sessions {counts}, "
          f"{time.monotonic() - t0:.1f} s")
    assert counts == {"sent": 5 * in_flight, "trained": 4 * in_flight, "duplicated": 0, "incomplete": 0,
                      "lost": in_flight}
