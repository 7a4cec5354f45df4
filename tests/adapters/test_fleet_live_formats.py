"""Quantise once per format: the disk channel writes one quantised copy per (version, weight format) and the engine
groups of that format load it, without engines (``EngineGroup.sync`` with its vLLM engine replaced by a recorder)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

from offpolicy.adapters.fleet_live import DiskWeightChannel, EngineGroup, EngineSettings, LiveFleet, weight_sync
from offpolicy.adapters.fleet_live.calls import WeightLoadError
from offpolicy.adapters.fleet_live.fleet_runner import GroupRequestError
from offpolicy.fleet import SamplerGroup
from offpolicy.fleet.quant import fake_quantize

pytest.importorskip("safetensors")
from safetensors.torch import load_file  # noqa: E402

#: two weight matrices the formats round (the embedding and the 1-D norm are not rounded)
W = {"embed_tokens.weight": torch.randn(8, 32), "q.weight": torch.randn(16, 32), "o.weight": torch.randn(32, 16),
     "norm.weight": torch.ones(32)}
MATRICES = 2


class RecordingLLM:
    """``vllm.LLM.collective_rpc("reload_weights")`` and ``reset_prefix_cache`` recorded; a reload reads the
    checkpoint's ``model.safetensors`` as vLLM's loader would (the start checkpoint, outside the channel, is not
    read)."""

    def __init__(self):
        self.loaded: list[Path] = []

    def collective_rpc(self, method, kwargs):
        assert method == "reload_weights"
        path = Path(kwargs["weights_path"])
        if path.name != "model":
            load_file(str(path / "model.safetensors"))
        self.loaded.append(path)

    def reset_prefix_cache(self):
        pass


def engine_group(tmp_path: Path, name: str, fmt: str, channel) -> EngineGroup:
    eg = EngineGroup.__new__(EngineGroup)
    eg.group, eg.settings, eg.channel = SamplerGroup(name, "CPU", fmt, "fp32", 1.0), EngineSettings(), channel
    eg.model_dir, eg.work_dir, eg.llm = str(tmp_path / "model"), tmp_path / "groups" / name, RecordingLLM()
    eg.version, eg.loads, eg.failed_versions = None, 0, set()
    eg.work_dir.mkdir(parents=True)
    return eg


@pytest.fixture
def quantiser_calls(monkeypatch):
    """Counts calls of the quantiser ``group_checkpoint`` uses, per format."""
    calls: dict[str, int] = {}

    def counted(t, fmt, *a, **k):
        calls[fmt] = calls.get(fmt, 0) + 1
        return fake_quantize(t, fmt, *a, **k)

    monkeypatch.setattr(weight_sync, "fake_quantize", counted)
    return calls


FLEET = [("a", "nvfp4"), ("b", "nvfp4"), ("c", "nvfp4"), ("d", "fp8"), ("e", "fp8")]


def test_a_version_is_quantised_once_per_format_and_shared(tmp_path, quantiser_calls):
    ch = DiskWeightChannel(tmp_path / "weights", formats=["nvfp4", "fp8", "nvfp4"])
    assert ch.formats == ("nvfp4", "fp8")
    groups = [engine_group(tmp_path, n, f, ch) for n, f in FLEET]
    for v in range(3):
        ch.publish(W, v)
        assert [g.sync() for g in groups] == [v] * len(groups)
    # 3 versions x 2 formats x 2 matrices, whatever the number of groups of each format (3 nvfp4, 2 fp8)
    assert quantiser_calls == {"nvfp4": 3 * MATRICES, "fp8": 3 * MATRICES} and ch.quantised == 6
    for g in groups:  # each loaded the channel's copy of its format and wrote nothing of its own
        assert g.llm.loaded == [ch.format_dir(v, g.group.weight_format) for v in range(3)]
        assert list(g.work_dir.iterdir()) == []
    for fmt in ch.formats:  # the copy is the group's numerics, exactly
        want = weight_sync.group_checkpoint(W, fmt)
        got = ch.fetch(2, fmt)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        assert not torch.equal(got["q.weight"], W["q.weight"]) and torch.equal(got["norm.weight"], W["norm.weight"])
    files = [ch.path(v) / "model.safetensors" for v in range(3)]
    files += [ch.format_dir(v, f) / "model.safetensors" for v in range(3) for f in ch.formats]
    assert ch.bytes_written == sum(p.stat().st_size for p in files)


def test_without_formats_each_group_quantises_for_itself(tmp_path, quantiser_calls):
    """Today's path, kept for channels without per-format copies (and formats the channel does not hold)."""
    ch = DiskWeightChannel(tmp_path / "weights", formats=["fp8"])
    groups = [engine_group(tmp_path, n, f, ch) for n, f in FLEET]
    ch.publish(W, 0)
    assert [g.sync() for g in groups] == [0] * len(groups)
    # fp8 once on the channel; nvfp4 once per nvfp4 group (3), each writing its own checkpoint
    assert quantiser_calls == {"fp8": MATRICES, "nvfp4": 3 * MATRICES}
    for g in groups[:3]:
        assert g.llm.loaded == [g.work_dir / "v000000"] and [p.name for p in g.work_dir.iterdir()] == ["v000000"]
    plain = DiskWeightChannel(tmp_path / "plain")
    assert plain.formats == () and weight_sync.channel_formats(plain) == ()
    plain.publish(W, 0)
    assert sorted(p.name for p in plain.path(0).iterdir()) == ["model.safetensors"]


def test_retention_collects_the_per_format_copies(tmp_path):
    ch = DiskWeightChannel(tmp_path / "weights", keep=2, formats=["nvfp4", "mxfp4"])
    for v in range(5):
        ch.publish(W, v, in_use={1})
    assert ch.versions() == [1, 3, 4]
    for v in (1, 3, 4):
        assert sorted(p.name for p in ch.path(v).iterdir()) == ["model.safetensors", "mxfp4", "nvfp4"]
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["LATEST", "v000001", "v000003", "v000004"]
    with pytest.raises(FileNotFoundError, match="version 2 is not under"):
        ch.fetch(2, "nvfp4")


def test_a_corrupt_per_format_copy_fails_as_a_corrupt_version(tmp_path):
    """A corrupt nvfp4 copy of version 1: each nvfp4 group raises WeightLoadError once, cause first, and is put
    back on its version-0 copy; the fp8 groups load version 1; the next version loads everywhere."""
    ch = DiskWeightChannel(tmp_path / "weights", formats=["nvfp4", "fp8"])
    groups = [engine_group(tmp_path, n, f, ch) for n, f in FLEET]
    ch.publish(W, 0)
    assert [g.sync() for g in groups] == [0] * 5
    ch.publish(W, 1)
    (ch.format_dir(1, "nvfp4") / "model.safetensors").write_bytes(b"\xff" * 64)
    for g in groups[:3]:
        with pytest.raises(WeightLoadError) as info:
            g.sync()
        msg = str(info.value)
        assert msg.startswith("SafetensorError") and msg.endswith(
            f"(loading version 1 in group {g.group.name!r}; it keeps serving version 0)"), msg
        assert g.llm.loaded == [ch.format_dir(0, "nvfp4")] * 2  # the bad copy failed to read; put back on v0
        assert g.sync() == 0 and g.failed_versions == {1}
    assert [g.sync() for g in groups[3:]] == [1, 1]
    assert ch.format_dir(1, "nvfp4").exists()  # a group does not delete the channel's copy
    ch.publish(W, 2)
    assert [g.sync() for g in groups] == [2] * 5


class RefusingLLM(RecordingLLM):
    """A recorder whose ``generate`` refuses every request (after running ``during()``, e.g. the trainer
    publishing while the call is in flight)."""

    def __init__(self, during=None):
        super().__init__()
        self.during = during

    def generate(self, prompts, sampling_params, use_tqdm=False):
        if self.during is not None:
            self.during()
        raise ValueError("the prompt is longer than max_model_len")


def test_a_group_whose_call_failed_after_loading_keeps_its_version(tmp_path, monkeypatch):
    """The real ``EngineGroup.generate`` (vLLM replaced): a call that syncs to version 0 and then fails (a refused
    request; two versions published while it runs) still counts version 0 as served, so retention (``keep=1``)
    keeps it; when the next version is corrupt, the group goes back to version 0 and the failure is the named
    load error, not a missing file."""
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=dict))
    ch = DiskWeightChannel(tmp_path / "weights", keep=1, formats=["nvfp4"])
    eg = engine_group(tmp_path, "a", "nvfp4", ch)
    fleet = LiveFleet([eg.group], "m", tmp_path, channel=ch)
    fleet.start_in_process({"a": eg})
    fleet.publish(W, 0)
    eg.llm = RefusingLLM(during=lambda: [fleet.publish(W, v) for v in (1, 2)])
    with pytest.raises(GroupRequestError, match="ValueError: the prompt is longer"):
        fleet.rollout([[1, 2]], {"max_tokens": 2})
    assert eg.version == 0 and fleet.loaded == {"a": 0}
    assert ch.versions() == [0, 1, 2]  # kept while a call that may load them is in flight
    eg.llm.during = None
    fleet.publish(W, 3)
    (ch.format_dir(3, "nvfp4") / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(GroupRequestError):  # the group goes on serving version 0 and refuses the request again
        fleet.rollout([[1, 2]], {"max_tokens": 2})
    load = [e for e in fleet.events if e.kind == "load_failed"]
    assert [e.kind for e in fleet.events] == ["error", "load_failed", "error"] and len(load) == 1
    assert load[0].detail.startswith("SafetensorError") and load[0].detail.endswith(
        "(loading version 3 in group 'a'; it keeps serving version 0)"), load[0].detail
    assert eg.llm.loaded == [ch.format_dir(0, "nvfp4")] * 2 and eg.version == 0  # v3 failed to read; back on v0
    assert fleet.loaded == {"a": 0} and ch.versions() == [0, 3] and fleet._syncing == {}


def test_the_fleet_channel_quantises_the_groups_formats(tmp_path):
    groups = [SamplerGroup(n, "CPU", f, "fp32", 1.0) for n, f in FLEET + [("f", "bf16")]]
    fleet = LiveFleet(groups, "m", tmp_path / "one")
    assert fleet.channel.formats == ("bf16", "fp8", "nvfp4") and fleet.channel.dtype == torch.float32
    mixed = {n: EngineSettings(dtype="bfloat16" if n == "a" else "float32") for n, _ in FLEET + [("f", "")]}
    assert LiveFleet(groups, "m", tmp_path / "two", settings=mixed).channel.formats == ()  # each group its own
    bf16 = LiveFleet(groups, "m", tmp_path / "three", settings=EngineSettings(dtype="bfloat16")).channel
    assert bf16.dtype == torch.bfloat16


@pytest.mark.parametrize("kwargs, match", [({"formats": "nvfp4"}, "formats must be a collection"),
                                           ({"formats": ["int4"]}, r"formats must be among .* \['int4'\]"),
                                           ({"dtype": "float32"}, "dtype must be a floating torch.dtype"),
                                           ({"dtype": torch.int8}, "dtype must be a floating torch.dtype")])
def test_bad_channel_formats_are_named(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        DiskWeightChannel(tmp_path / "w", **kwargs)
    ch = DiskWeightChannel(tmp_path / "ok", formats=["fp8"])
    with pytest.raises(ValueError, match="weight_format 'nvfp4' is not one this channel quantises"):
        ch.format_dir(0, "nvfp4")
