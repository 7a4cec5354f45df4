"""Sampler groups as live inference engines (vLLM, one Ray actor and one process per group), one trainer in the
driver, weight sync with versions, per-group records (docs/fleet.md#live-engine-groups-under-ray).

    from offpolicy.adapters.fleet_live import LiveFleet, EngineSettings
    fleet = LiveFleet(groups, model_dir, work_dir, settings=EngineSettings(kv_cache_mib=64))
    fleet.start(); fleet.publish(model.state_dict(), 0)
    batch = fleet.rollout(prompts, sampling_params, turns=2, between=[tool_id])

``LiveFleet(sync_every=k, max_staleness=m)`` amortises reloads and bounds staleness as the loss sees it
(``rollout(trained_at=)``: no trained token more than ``m`` versions behind the trainer's version at its step); a
group whose process dies or hangs is restarted with backoff (``max_restarts``), a weight version that fails to load
leaves the group on its last good one; ``LiveFleet.start_in_process(engines)`` serves the groups with in-process objects instead
of Ray actors (the engine-free tests). Needs ``ray`` and ``vllm`` (``bash tools/setup_vllm_env.sh`` builds ``.venv-vllm`` with both); importing this
package does not import either.
"""

from offpolicy.adapters.fleet_live.engine_group import EngineGroup, EngineSettings, ServedTurn
from offpolicy.adapters.fleet_live.calls import BelowStalenessFloor, EngineProcessDied, WeightLoadError
from offpolicy.adapters.fleet_live.fleet_runner import EVENT_KINDS, FleetEvent, GroupRequestError, LiveBatch, LiveFleet
from offpolicy.adapters.fleet_live.object_channel import (
    FsspecObjectStore,
    LocalObjectStore,
    ObjectStore,
    ObjectStoreWeightChannel,
    RayObjectStore,
)
from offpolicy.adapters.fleet_live.weight_sync import DiskWeightChannel, WeightChannel, group_checkpoint

__all__ = [
    "EVENT_KINDS",
    "BelowStalenessFloor",
    "DiskWeightChannel",
    "EngineGroup",
    "EngineProcessDied",
    "EngineSettings",
    "FleetEvent",
    "GroupRequestError",
    "LiveBatch",
    "LiveFleet",
    "FsspecObjectStore",
    "LocalObjectStore",
    "ObjectStore",
    "ObjectStoreWeightChannel",
    "RayObjectStore",
    "ServedTurn",
    "WeightChannel",
    "WeightLoadError",
    "group_checkpoint",
]
