"""Sampler groups: one kind of serving replica (accelerator, weight format, KV-cache format) and its capacity."""

from __future__ import annotations

import math
from dataclasses import dataclass

from offpolicy.fleet.quant.fake import FAKE_FORMATS

#: KV-cache formats a group may declare (informational; the reference sampler has no KV cache).
KV_FORMATS = ("bf16", "fp16", "fp8", "fp32", "none")


@dataclass(frozen=True)
class SamplerGroup:
    """A group of identical sampler replicas.

    Attributes:
        name: unique name, used as the group's key in routing and metrics.
        accelerator: e.g. ``"B200"``, ``"H100"``.
        weight_format: the format the trainer's weights are synced in: one of
            :data:`offpolicy.fleet.quant.FAKE_FORMATS` (``"bf16"``, ``"fp8"``, ``"nvfp4"``, ``"mxfp4"``, ...), so a
            simulation can call ``fake_quantize_module(model, group.weight_format)``.
        kv_format: the KV-cache format, one of :data:`KV_FORMATS`.
        capacity: relative serving capacity (e.g. sessions or tokens per second), ``>= 0``. Routing shares are
            proportional to it; 0 means scaled to zero (no new sessions).
        endpoint: where the group is served (a URL), or ``None`` in simulations.
    """

    name: str
    accelerator: str
    weight_format: str
    kv_format: str
    capacity: float
    endpoint: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"SamplerGroup.name must be a non-empty string, got {self.name!r}")
        if "/" in self.name:
            raise ValueError(f"SamplerGroup.name must not contain '/' (it is a metrics key), got {self.name!r}")
        if self.weight_format not in FAKE_FORMATS:
            raise ValueError(
                f"SamplerGroup.weight_format must be one of {FAKE_FORMATS}, got {self.weight_format!r}"
            )
        if self.kv_format not in KV_FORMATS:
            raise ValueError(f"SamplerGroup.kv_format must be one of {KV_FORMATS}, got {self.kv_format!r}")
        if not isinstance(self.capacity, (int, float)) or not math.isfinite(self.capacity) or self.capacity < 0:
            raise ValueError(f"SamplerGroup.capacity must be a finite number >= 0, got {self.capacity!r}")


def seed_fleet(endpoints: dict[str, str] | None = None) -> list[SamplerGroup]:
    """The mixed-fleet study's fleet (docs/spec.md#sources): six accelerator types, eight groups, FP8 KV caches.

    B200 and B300 serve NVFP4 weights, H100 and H200 serve FP8 and BF16, A100 and RTX PRO 6000 serve BF16.
    The capacities are illustrative: the study gives only two shares (B200 + B300 NVFP4 about 47% of the
    samples, H100 FP8 about 10%); the rest split the remainder. Replace them with measured throughputs.
    """
    endpoints = endpoints or {}
    spec = [
        ("b200-nvfp4", "B200", "nvfp4", 24.0),
        ("b300-nvfp4", "B300", "nvfp4", 23.0),
        ("h100-fp8", "H100", "fp8", 10.0),
        ("h100-bf16", "H100", "bf16", 7.0),
        ("h200-fp8", "H200", "fp8", 12.0),
        ("h200-bf16", "H200", "bf16", 9.0),
        ("a100-bf16", "A100", "bf16", 8.0),
        ("rtxpro6000-bf16", "RTX PRO 6000", "bf16", 7.0),
    ]
    return [SamplerGroup(n, a, w, "fp8", c, endpoints.get(n)) for n, a, w, c in spec]


def homogeneous_fleet(replicas: int = 1, endpoint: str | None = None) -> list[SamplerGroup]:
    """The mixed-fleet study's homogeneous baseline: B200 with BF16 weights and a BF16 KV cache."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    return [SamplerGroup("b200-bf16", "B200", "bf16", "bf16", float(replicas), endpoint)]
