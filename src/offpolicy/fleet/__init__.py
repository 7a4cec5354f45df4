"""The heterogeneous sampler fleet: sampler groups, a capacity-proportional sticky router, per-group metrics.

    from offpolicy.fleet import Router, FleetMetrics, seed_fleet
    groups = seed_fleet()                      # the mixed-fleet study's eight groups (illustrative capacities)
    router = Router(groups)
    group = router.assign(session_id)          # sticky for the session's life
    fm = FleetMetrics(groups)
    fm.update(group_ids, sampler_logprobs, trainer_logprobs, mask)    # or fm.update_from_metrics(out.metrics)
    print(fm.table())                          # text; fm.table().to_dict() for a logger
"""

from offpolicy.fleet.groups import KV_FORMATS, SamplerGroup, homogeneous_fleet, seed_fleet
from offpolicy.fleet.router import BALANCE_MODES, Router
from offpolicy.fleet.table import FleetMetrics, FleetTable, GroupRow, fleet_table

__all__ = [
    "BALANCE_MODES",
    "KV_FORMATS",
    "FleetMetrics",
    "FleetTable",
    "GroupRow",
    "Router",
    "SamplerGroup",
    "fleet_table",
    "homogeneous_fleet",
    "seed_fleet",
]
