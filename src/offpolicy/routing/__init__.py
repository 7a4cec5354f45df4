"""Mixture-of-experts routing for trainers: record a transformers MoE model's routing and replay a sampler's
recorded routing (R3) in the trainer's forward. See docs/routing_replay.md.

    from offpolicy.routing import capture_routes, replay_routes
    with capture_routes(model) as cap:            # the model's own routing, [B, T, L, K] uint8
        model(input_ids)
    with replay_routes(model, sampler_routes):    # the sampler's experts, the trainer's router weights
        logits = model(input_ids).logits

It sits above the core (like the fleet) and imports transformers only through the model it is given.
"""

from offpolicy.routing.capture import SUPPORTED_ROUTERS, CapturedRoutes, MoeLayer, capture_routes, moe_layers, route_dtype
from offpolicy.routing.replay import check_routes, replay_routes, replayed_weights

__all__ = [
    "SUPPORTED_ROUTERS",
    "CapturedRoutes",
    "MoeLayer",
    "capture_routes",
    "check_routes",
    "moe_layers",
    "replay_routes",
    "replayed_weights",
    "route_dtype",
]
