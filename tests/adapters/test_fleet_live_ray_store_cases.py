"""The object-store weight channel on Ray's object store (``RayObjectStore``), against a real local Ray
(``ray.init(num_cpus=1)``), without engines. Runs inside .venv-vllm (ray 2.60): tests/adapters/test_fleet_live.py
runs this file there.

Versions round-trip through Ray's object store; retention deletes old versions and Ray frees their bytes (the
plasma store's usage falls back); a reader in another process (a Ray task, as an engine actor would) finds the
store by its name through the pickled channel, with no folder shared; a missing or bad key is named.
"""

from __future__ import annotations

import os
import pickle
import re
import time

import pytest
import torch

try:
    import ray
except ImportError:
    pytest.skip("runs inside .venv-vllm, through tests/adapters/test_fleet_live.py (tools/setup_vllm_env.sh builds "
                "it)", allow_module_level=True)

from offpolicy.adapters.fleet_live import ObjectStoreWeightChannel, RayObjectStore, weight_sync  # noqa: E402

W = {"embed_tokens.weight": torch.randn(8, 32), "q.weight": torch.randn(16, 32), "norm.weight": torch.ones(32)}
BIG = {"q.weight": torch.randn(1024, 2048)}  # 8 MiB of float32: the plasma store holds it (not inlined)


@pytest.fixture(scope="module")
def store():
    """One store (one index actor: each costs a worker process) for the module; the tests use their own prefixes."""
    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    yield RayObjectStore(name="offpolicy-test-store")
    ray.shutdown()


def plasma_mib() -> int:
    """MiB in Ray's plasma object store now (Ray's own memory summary)."""
    from ray._private.internal_api import memory_summary

    text = memory_summary(stats_only=True)
    found = re.search(r"Plasma memory usage (\d+) MiB", text)
    return int(found.group(1)) if found else 0


def test_versions_round_trip_and_retention_frees_ray_memory(store):
    ch = ObjectStoreWeightChannel(store, keep=2, formats=["nvfp4"])
    assert ch.latest() is None and ch.versions() == []
    for v in range(4):
        ch.publish({k: t + v for k, t in W.items()}, v, in_use={0})
    assert ch.latest() == 3 and ch.versions() == [0, 2, 3]
    got = ch.fetch(3)
    assert all(torch.equal(got[k], W[k] + 3) for k in W)
    want = weight_sync.group_checkpoint({k: t + 3 for k, t in W.items()}, "nvfp4")
    assert all(torch.equal(ch.fetch(3, "nvfp4")[k], want[k]) for k in want)
    with pytest.raises(FileNotFoundError, match=r"version 1 is not in the store .* never published, or collected"):
        ch.fetch(1)
    kept = store.list("weights/")  # three versions, each with its nvfp4 copy, and LATEST
    assert len(kept) == 7 and store.nbytes() == sum(len(store.get(k)) for k in kept)
    # the bytes themselves: 5 versions of 8 MiB published, 1 kept; Ray frees the others (asynchronously)
    big = ObjectStoreWeightChannel(store, prefix="big", keep=1)
    for v in range(5):
        big.publish(BIG, v)
    assert big.versions() == [4]
    t0, usage = time.monotonic(), plasma_mib()
    while usage > 12 and time.monotonic() - t0 < 20:
        time.sleep(0.5)
        usage = plasma_mib()
    print(f"[ray store] plasma usage after 5 publishes of 8 MiB with keep=1: {usage} MiB")
    assert 8 <= usage <= 12


@ray.remote(num_cpus=1)
def read_in_another_process(channel, version, weight_format):
    """What an engine actor does with the channel it was given: read the newest version, by name, elsewhere."""
    return os.getpid(), channel.latest(), channel.fetch(version, weight_format)


def test_a_reader_in_another_process_finds_the_store_by_name(store):
    ch = ObjectStoreWeightChannel(store, prefix="other", formats=["fp8"])
    ch.publish(W, 0)
    ch.publish({k: 2 * t for k, t in W.items()}, 1)
    copy = pickle.loads(pickle.dumps(store))
    assert copy._index is None and copy.name == "offpolicy-test-store"  # the handle is found again by name
    pid, latest, got = ray.get(read_in_another_process.remote(ch, 1, "fp8"), timeout=120)
    want = weight_sync.group_checkpoint({k: 2 * t for k, t in W.items()}, "fp8")
    assert pid != os.getpid() and latest == 1
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert copy.list("other/v000001/") == ["other/v000001/fp8/model.safetensors", "other/v000001/model.safetensors"]


def test_missing_and_bad_keys_are_named(store):
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
