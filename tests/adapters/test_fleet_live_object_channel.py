"""The object-store weight channel on a local-directory store (the fsspec-like fake), without engines: versions
round-trip, ``LATEST`` is put last, retention, per-format copies made once and fetched by the groups, a corrupt
object fails as a corrupt version does, and the fleet passes it the versions its groups serve."""

from __future__ import annotations

import pytest
import torch

from offpolicy.adapters.fleet_live import (
    LiveFleet,
    LocalObjectStore,
    ObjectStoreWeightChannel,
    RayObjectStore,
    weight_sync,
)
from offpolicy.adapters.fleet_live.calls import WeightLoadError
from offpolicy.fleet import SamplerGroup
from offpolicy.fleet.quant import fake_quantize

pytest.importorskip("safetensors")

from test_fleet_live_formats import FLEET, MATRICES, W, engine_group  # noqa: E402


def test_versions_round_trip_and_are_collected(tmp_path):
    store = LocalObjectStore(tmp_path / "store")
    ch = ObjectStoreWeightChannel(store, keep=2, formats=["nvfp4"])
    assert ch.latest() is None and ch.versions() == []
    for v in range(4):
        ch.publish({k: t + v for k, t in W.items()}, v, in_use={0})
    assert ch.latest() == 3 and ch.versions() == [0, 2, 3]
    got = ch.fetch(3)
    assert all(torch.equal(got[k], W[k] + 3) for k in W)
    want = weight_sync.group_checkpoint({k: t + 3 for k, t in W.items()}, "nvfp4")
    assert all(torch.equal(ch.fetch(3, "nvfp4")[k], want[k]) for k in want)
    assert store.list("weights/v000001") == [] and not (tmp_path / "store" / "weights" / "v000001").exists()
    assert store.list("weights/v000002/") == ["weights/v000002/model.safetensors",
                                              "weights/v000002/nvfp4/model.safetensors"]
    with pytest.raises(FileNotFoundError, match=r"version 1 is not in the store .* never published, or collected"):
        ch.fetch(1)
    with pytest.raises(ValueError, match="version must grow, got 3 after 3"):
        ch.publish(W, 3)
    per_version = len(store.get(ch.key(3))) + len(store.get(ch.key(3, "nvfp4")))  # same shapes: same sizes
    assert ch.bytes_written == 4 * per_version
    assert sum(len(store.get(k)) for k in store.list("weights/v")) == 3 * per_version


def test_latest_is_put_after_every_object_of_the_version(tmp_path):
    """A publish that fails half-way (the store refuses the per-format copy) leaves LATEST on the old version."""
    store = LocalObjectStore(tmp_path / "store")
    ch = ObjectStoreWeightChannel(store, formats=["fp8"])
    ch.publish(W, 0)
    order = []
    real_put = store.put

    def put(key, data):
        order.append(key)
        if key.endswith("fp8/model.safetensors") and "v000001" in key:
            raise OSError("bucket full")
        real_put(key, data)

    store.put = put
    with pytest.raises(OSError, match="bucket full"):
        ch.publish(W, 1)
    assert ch.latest() == 0 and "weights/LATEST" not in order
    store.put = real_put
    order.clear()
    ch.publish(W, 1)
    assert ch.latest() == 1


def test_groups_fetch_the_format_copy_made_once(tmp_path, monkeypatch):
    calls: dict[str, int] = {}

    def counted(t, fmt, *a, **k):
        calls[fmt] = calls.get(fmt, 0) + 1
        return fake_quantize(t, fmt, *a, **k)

    monkeypatch.setattr(weight_sync, "fake_quantize", counted)
    ch = ObjectStoreWeightChannel(LocalObjectStore(tmp_path / "store"), formats=["nvfp4", "fp8"])
    groups = [engine_group(tmp_path, n, f, ch) for n, f in FLEET]
    for v in range(2):
        ch.publish(W, v)
        assert [g.sync() for g in groups] == [v] * len(groups)
    assert calls == {"nvfp4": 2 * MATRICES, "fp8": 2 * MATRICES}  # not once per group
    for g in groups:  # each wrote the fetched copy (no shared folder to reload from) and kept only the newest
        assert g.llm.loaded == [g.work_dir / "v000000", g.work_dir / "v000001"]
        assert [p.name for p in g.work_dir.iterdir()] == ["v000001"]


def test_a_corrupt_object_fails_as_a_corrupt_version(tmp_path):
    store = LocalObjectStore(tmp_path / "store")
    ch = ObjectStoreWeightChannel(store, formats=["nvfp4"])
    g = engine_group(tmp_path, "a", "nvfp4", ch)
    ch.publish(W, 0)
    assert g.sync() == 0
    ch.publish(W, 1)
    store.put(ch.key(1, "nvfp4"), b"\xff" * 64)
    with pytest.raises(WeightLoadError) as info:
        g.sync()
    assert str(info.value).startswith("SafetensorError") and str(info.value).endswith(
        "(loading version 1 in group 'a'; it keeps serving version 0)")
    assert g.sync() == 0 and g.llm.loaded[-1] == g.work_dir / "v000000"
    ch.publish(W, 2)
    assert g.sync() == 2


def test_the_fleet_keeps_the_versions_its_groups_serve(tmp_path):
    ch = ObjectStoreWeightChannel(LocalObjectStore(tmp_path / "store"), keep=1)
    fleet = LiveFleet([SamplerGroup("a", "CPU", "bf16", "fp32", 1.0)], "m", tmp_path, channel=ch)
    fleet.loaded = {"a": 0}
    for v in range(3):
        fleet.publish(W, v)
    assert ch.versions() == [0, 2]


@pytest.mark.parametrize("kwargs, match", [({"prefix": "/w"}, "prefix must be"), ({"prefix": ""}, "prefix must be"),
                                           ({"keep": 0}, "keep must be"), ({"formats": "fp8"}, "formats must be a"),
                                           ({"formats": ["int4"]}, "formats must be among"),
                                           ({"dtype": torch.int8}, "dtype must be")])
def test_bad_arguments_are_named(tmp_path, kwargs, match):
    store = LocalObjectStore(tmp_path / "store")
    with pytest.raises(ValueError, match=match):
        ObjectStoreWeightChannel(store, **kwargs)
    for key in ("", "../x", "a//b", "a/./b", "a.tmp"):
        with pytest.raises(ValueError, match="key must be"):
            store.put(key, b"")
    with pytest.raises(FileNotFoundError, match="no object 'nope'"):
        store.get("nope")


def test_the_ray_store_pickles_its_name_not_its_actor():
    """What can be checked without Ray (the ``test_ray_store_*`` tests of tests/adapters/test_fleet_live_cases.py
    run it on a real Ray)."""
    import pickle

    store = RayObjectStore(name="idx", namespace="ns")
    store._index = object()  # a handle held by the writer is not what a reader gets
    copy = pickle.loads(pickle.dumps(store))
    assert (copy.name, copy.namespace, copy._index) == ("idx", "ns", None)
    assert RayObjectStore().name.startswith("offpolicy-weights-") and RayObjectStore().name != RayObjectStore().name
    for kwargs in ({"name": ""}, {"namespace": ""}, {"name": 3}):
        with pytest.raises(ValueError, match="must be a non-empty string"):
            RayObjectStore(**kwargs)


@pytest.mark.parametrize("where", ["memory", "local"])
def test_the_fsspec_store_carries_the_channel(tmp_path, where):
    """FsspecObjectStore (fsspec's memory file system and a local path): the channel's versions round-trip and are
    collected, a partial key prefix lists, a missing key is FileNotFoundError, an object is never read half-written
    (the temporary names are never listed), and a pickled store (what each engine actor gets) reconnects to the
    same objects."""
    import pickle
    import uuid

    from offpolicy.adapters.fleet_live import FsspecObjectStore

    url = f"memory://offpolicy-{uuid.uuid4().hex[:8]}" if where == "memory" else str(tmp_path / "bucket")
    store = FsspecObjectStore(url)
    ch = ObjectStoreWeightChannel(store, keep=2, formats=["fp8"])
    w = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    for v in range(4):
        ch.publish({k: t + v for k, t in w.items()}, v, in_use=lambda: {0})
    assert ch.latest() == 3 and ch.versions() == [0, 2, 3]
    assert torch.equal(ch.fetch(2)["w"], w["w"] + 2)
    assert store.list("weights/v00000") == ["weights/v000000/fp8/model.safetensors", "weights/v000000/model.safetensors",
                                            "weights/v000002/fp8/model.safetensors", "weights/v000002/model.safetensors",
                                            "weights/v000003/fp8/model.safetensors", "weights/v000003/model.safetensors"]
    assert not [p for p in store.fs.find(store.root) if p.endswith(".tmp")]
    with pytest.raises(FileNotFoundError, match="no object 'weights/v000001/model.safetensors'"):
        store.get("weights/v000001/model.safetensors")
    store.delete("weights/nothing")  # no error
    assert store.list("other/") == []
    with pytest.raises(ValueError, match="key must be a relative"):
        store.put("../escape", b"x")
    again = ObjectStoreWeightChannel(pickle.loads(pickle.dumps(store)), keep=2, formats=["fp8"])
    assert again.store.url == url and again.latest() == 3 and torch.equal(again.fetch(3, "fp8")["w"],
                                                                         ch.fetch(3, "fp8")["w"])
