"""Sampler groups as live inference engines (vLLM, one Ray actor and one process per group), one trainer in the
driver, weight sync with versions, per-group records (docs/fleet.md#live-engine-groups-under-ray).

    from offpolicy.adapters.fleet_live import LiveFleet, EngineSettings
    fleet = LiveFleet(groups, model_dir, work_dir, settings=EngineSettings(kv_cache_mib=64))
    fleet.start(); fleet.publish(model.state_dict(), 0)
    batch = fleet.rollout(prompts, sampling_params, turns=2, between=[tool_id])

``LiveFleet(sync_every=k, max_staleness=m)`` amortises reloads and bounds staleness (a group further behind is
drained and reloaded); ``LiveFleet.start_in_process(engines)`` serves the groups with in-process objects instead
of Ray actors (the engine-free tests). Needs ``ray`` and ``vllm`` (``bash tools/setup_vllm_env.sh`` builds ``.venv-vllm`` with both); importing this
package does not import either.
"""

from offpolicy.adapters.fleet_live.engine_group import EngineGroup, EngineSettings, ServedTurn
from offpolicy.adapters.fleet_live.fleet_runner import FleetEvent, LiveBatch, LiveFleet
from offpolicy.adapters.fleet_live.weight_sync import DiskWeightChannel, WeightChannel, group_checkpoint

__all__ = [
    "DiskWeightChannel",
    "EngineGroup",
    "EngineSettings",
    "FleetEvent",
    "LiveBatch",
    "LiveFleet",
    "ServedTurn",
    "WeightChannel",
    "group_checkpoint",
]
