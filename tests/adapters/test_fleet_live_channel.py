"""The disk weight channel's privacy and retention, and the engine settings per device kind, without engines."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from offpolicy.adapters.fleet_live import DiskWeightChannel, EngineSettings, LiveFleet
from offpolicy.fleet import SamplerGroup

pytest.importorskip("safetensors")
W = {"x.weight": torch.ones(2, 2)}


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_new_channel_folder_is_private(tmp_path):
    ch = DiskWeightChannel(tmp_path / "a" / "weights")
    ch.publish(W, 0)
    assert mode(ch.root) == 0o700 and mode(ch.path(0)) == 0o700


def test_an_open_folder_of_this_user_is_made_private(tmp_path):
    root = tmp_path / "w"
    root.mkdir(mode=0o777)
    os.chmod(root, 0o777)
    DiskWeightChannel(root)
    assert mode(root) == 0o700


def test_a_folder_another_user_owns_is_refused(tmp_path, monkeypatch):
    root = tmp_path / "w"
    root.mkdir(mode=0o700)
    real_stat = os.stat

    def other_owner(path, *a, **k):
        st = real_stat(path, *a, **k)
        if Path(path) == root:
            fields = list(st)
            fields[stat.ST_UID] = os.getuid() + 1
            return os.stat_result(fields)
        return st

    monkeypatch.setattr(os, "stat", other_owner)
    with pytest.raises(PermissionError, match=rf"{root} belongs to user id {os.getuid() + 1}, not to this user"):
        DiskWeightChannel(root)
    monkeypatch.undo()
    (tmp_path / "f").write_text("")
    with pytest.raises((NotADirectoryError, FileExistsError)):
        DiskWeightChannel(tmp_path / "f")


def test_old_versions_are_collected_except_those_in_use(tmp_path):
    ch = DiskWeightChannel(tmp_path / "w", keep=2)
    for v in range(5):
        ch.publish(W, v, in_use={1})
    assert ch.versions() == [1, 3, 4]  # the newest 2, and 1 still served
    ch.publish(W, 5)
    assert ch.versions() == [4, 5]
    with pytest.raises(FileNotFoundError, match="version 1 is not under .* collected: the channel keeps the newest 2"):
        ch.fetch(1)
    every = DiskWeightChannel(tmp_path / "all", keep=None)
    for v in range(4):
        every.publish(W, v)
    assert every.versions() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="keep must be None or an integer >= 1"):
        DiskWeightChannel(tmp_path / "k", keep=0)


def test_the_fleet_keeps_the_versions_its_groups_serve(tmp_path):
    groups = [SamplerGroup("a", "CPU", "bf16", "fp32", 1.0), SamplerGroup("b", "CPU", "bf16", "fp32", 1.0)]
    fleet = LiveFleet(groups, "m", tmp_path, channel=DiskWeightChannel(tmp_path / "w", keep=1))
    fleet.loaded.update(a=0, b=2)
    for v in range(5):
        fleet.publish(W, v)
    assert fleet.channel.versions() == [0, 2, 4]


def test_a_call_sent_while_a_version_is_published_keeps_what_it_may_load(tmp_path):
    """keep=1: a syncing call registered after the trainer began publishing version 1 but before the channel
    collected version 0 may have resolved version 0 as the newest: the fleet reads what is in use only once version 1
    is the newest, so version 0 stays (it was deleted when the set was taken before publishing)."""
    groups = [SamplerGroup("a", "CPU", "bf16", "fp32", 1.0)]

    class Channel(DiskWeightChannel):
        def collect(self, in_use=()):
            if self.latest() == 1:  # the call is sent inside publish's window, after version 1 went up
                fleet._syncing["a"] = fleet.version
            return super().collect(in_use)

    fleet = LiveFleet(groups, "m", tmp_path, channel=Channel(tmp_path / "w", keep=1))
    fleet.publish(W, 0)
    fleet.publish(W, 1)
    assert fleet.channel.versions() == [0, 1]
    seen = []
    ch = DiskWeightChannel(tmp_path / "plain", keep=1)
    ch.publish(W, 0)
    ch.publish(W, 1, in_use=lambda: seen.append(ch.latest()) or ())
    assert seen == [1] and ch.versions() == [1]


def test_engine_settings_per_device_kind():
    cpu = EngineSettings().llm_kwargs()
    assert cpu["kv_cache_memory_bytes"] == 64 << 20 and cpu["enforce_eager"] is True
    gpu = EngineSettings(num_gpus=1, dtype="bfloat16", gpu_memory_utilization=0.8).llm_kwargs()
    assert "kv_cache_memory_bytes" not in gpu  # vLLM sizes the cache from gpu_memory_utilization
    assert gpu["gpu_memory_utilization"] == 0.8 and gpu["enforce_eager"] is False and gpu["dtype"] == "bfloat16"
    assert EngineSettings(num_gpus=1).llm_kwargs()["gpu_memory_utilization"] == 0.9
    asked = EngineSettings(num_gpus=1, kv_cache_mib=4096).llm_kwargs()
    assert asked["kv_cache_memory_bytes"] == 4096 << 20
    override = EngineSettings(num_gpus=1, engine_kwargs={"enforce_eager": True, "kv_cache_dtype": "fp8"})
    assert override.llm_kwargs()["enforce_eager"] is True and override.llm_kwargs()["kv_cache_dtype"] == "fp8"
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="gpu_memory_utilization must be None or in"):
            EngineSettings(gpu_memory_utilization=bad)
