"""The simulated sampler fleet: groups of samplers, each serving *its* copy of the trainer's weights in *its* numerics.

A group is described by an :class:`offpolicy.fleet.SamplerGroup` (name, accelerator, weight format, KV format,
capacity) plus what only a simulation needs (:class:`GroupSim`): the compute dtype, the attention kernel, and the
group's update lag.

Numerics of a group's copy (built when it receives weights):

* weights fake-quantised through :func:`offpolicy.fleet.quant.fake_quantize_module` (``fp32`` / ``bf16`` / ``fp8`` /
  ``nvfp4`` / ``mxfp4``): every ``nn.Linear``, the output layer included (embeddings and biases are kept);
* compute in bf16 (``compute="bf16"``) or the trainer's fp32;
* an FP8 E4M3 key/value path (``kv_format="fp8"``): keys and values rounded to E4M3 with scale 1, as an FP8 KV
  cache without calibrated scales stores them;
* an attention kernel (``"sdpa"`` or ``"math"``; the trainer uses ``"sdpa"``): the same function computed
  another way (another accumulation order).

Asynchrony and staleness: after every optimizer step each group independently receives the latest weights with
probability ``1 / (1 + lag)``, so its staleness (trainer version minus the version it serves) is geometric with
mean ``lag`` and unbounded; ``max_staleness`` caps it (a group that falls further behind is synced at once).
Staleness 0 is synchronous RL: every group serves the trainer's current weights. Every sampled token is tagged
with its group and the version that sampled it.

Three fleets share the same slots (capacities and lags), so their staleness is identical by construction and only
numerics tell them apart:

* ``mixed``: the mixed-fleet study's six groups (B200 / B300 NVFP4, H100 FP8, H200 / A100 / RTX PRO 6000 BF16,
  all with an FP8 KV cache), in bf16 compute and different attention kernels; ``weight_format`` other than
  ``"seed"`` gives every group that one format (the dose-response sweep);
* ``homogeneous``: every slot serves BF16 weights in bf16 compute with no KV quantisation, half of them with the
  other attention kernel: the study's homogeneous fleet, whose mismatch is small but not zero;
* ``onpolicy``: every slot in the trainer's own numerics (fp32 weights and compute, the trainer's kernel) and no
  staleness whatever the ``staleness`` argument: the exact on-policy control.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from offpolicy.demo.model import TinyLM
from offpolicy.fleet import Router, SamplerGroup
from offpolicy.fleet.quant import fake_quantize_module
from offpolicy.fleet.quant.formats import E4M3_MAX

FLEETS = ("mixed", "homogeneous", "onpolicy")
WEIGHT_FORMATS = ("seed", "fp32", "bf16", "fp8", "nvfp4", "mxfp4")
COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class GroupSim:
    """One simulated sampler group.

    Attributes:
        group: the fleet description (name, accelerator, weight/KV format, capacity).
        compute: ``"fp32"`` or ``"bf16"``, the dtype the copy computes in.
        attn_impl: ``"sdpa"`` or ``"math"``.
        lag: mean staleness in optimizer steps (geometric, unbounded unless capped).
    """

    group: SamplerGroup
    compute: str
    attn_impl: str
    lag: float

    @property
    def name(self) -> str:
        return self.group.name


# The study's fleet: (name, accelerator, weight format, capacity share in %, attention kernel, relative lag).
# Capacities follow the study's shares where it gives them (B200 + B300 NVFP4 47 %, H100 FP8 10 %); the rest of
# the split and the relative lags are this demo's choice.
_SEED_SLOTS = (
    ("b200-nvfp4", "B200", "nvfp4", 27.0, "sdpa", 0.6),
    ("b300-nvfp4", "B300", "nvfp4", 20.0, "math", 0.8),
    ("h100-fp8", "H100", "fp8", 10.0, "sdpa", 1.0),
    ("h200-bf16", "H200", "bf16", 15.0, "math", 1.0),
    ("a100-bf16", "A100", "bf16", 14.0, "sdpa", 1.6),
    ("rtx6000-bf16", "RTX PRO 6000", "bf16", 14.0, "math", 1.4),
)


def build_fleet(kind: str, staleness: float, weight_format: str = "seed", kv_format: str = "fp8",
                compute: str = "bf16") -> list[GroupSim]:
    """The groups of fleet ``kind`` (one of :data:`FLEETS`).

    Args:
        staleness: the capacity-weighted mean staleness of the fleet (each slot's relative lag is rescaled so
            that the mean over samples is exactly this). 0 makes every group sync after every step.
        weight_format: ``"seed"`` (the study's per-group formats) or one format for every mixed group.
        kv_format: ``"fp8"`` or ``"none"``: the mixed groups' KV path.
        compute: the mixed groups' compute dtype, ``"bf16"`` or ``"fp32"``.
    """
    if kind not in FLEETS:
        raise ValueError(f"fleet must be one of {FLEETS}, got {kind!r}")
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
    if kv_format not in ("fp8", "none"):
        raise ValueError(f"kv_format must be 'fp8' or 'none', got {kv_format!r}")
    if compute not in COMPUTE_DTYPES:
        raise ValueError(f"compute must be one of {tuple(COMPUTE_DTYPES)}, got {compute!r}")
    if not (math.isfinite(staleness) and staleness >= 0):
        raise ValueError(f"staleness must be a finite number >= 0, got {staleness}")
    total = sum(s[3] for s in _SEED_SLOTS)
    mean_rel = sum(s[3] * s[5] for s in _SEED_SLOTS) / total
    out = []
    for i, (name, acc, fmt, cap, attn, rel) in enumerate(_SEED_SLOTS):
        lag = staleness * rel / mean_rel
        if kind == "mixed":
            fmt = fmt if weight_format == "seed" else weight_format
            group = SamplerGroup(name=name if weight_format == "seed" else f"{acc.split()[0].lower()}-{fmt}",
                                 accelerator=acc, weight_format=fmt, kv_format=kv_format, capacity=cap)
            out.append(GroupSim(group, compute, attn, lag))
        elif kind == "homogeneous":
            group = SamplerGroup(name=f"b200-bf16-{attn}-{i}", accelerator="B200", weight_format="bf16",
                                 kv_format="bf16", capacity=cap)
            out.append(GroupSim(group, "bf16", attn, lag))
        else:
            group = SamplerGroup(name=f"trainer-{i}", accelerator="B200", weight_format="fp32", kv_format="none",
                                 capacity=cap)
            out.append(GroupSim(group, "fp32", "sdpa", 0.0))
    _unique_names(out)
    return out


def _unique_names(groups: list[GroupSim]) -> None:
    seen: dict[str, int] = {}
    for i, g in enumerate(groups):
        n = seen.get(g.name, 0)
        seen[g.name] = n + 1
        if n:
            groups[i] = replace(g, group=replace(g.group, name=f"{g.name}-{n}"))


def kv_fp8(x: Tensor) -> Tensor:
    """Keys/values ``[...]`` (any float dtype) through FP8 E4M3 with scale 1 (an uncalibrated FP8 KV cache), back
    in ``x``'s dtype.

    Bit for bit :func:`~offpolicy.fleet.quant.formats.round_to_e4m3` (round to nearest even, saturating at +-448,
    non-finite input refused), computed by torch's native ``float8_e4m3fn`` cast after clamping to +-448 (explicit:
    the cast's own overflow behaviour is not relied on), about 4x faster than the fake quantiser's frexp/ldexp
    path, which ran on every key and value of every sampler forward (a fifth of a grid-C step under cProfile).
    ``tests/demo/test_demo_moe.py`` checks the equality on every finite bf16 value and on random and hostile fp32
    ones.
    """
    if not bool(torch.isfinite(x).all()):
        raise ValueError("kv_fp8: non-finite keys/values (NaN or inf) cannot be quantised")
    # Via fp32 (exact for bf16/fp16 input): faster here than clamping and casting from bf16 directly.
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype)


def sampler_copy(trainer: TinyLM, sim: GroupSim, memo: dict | None = None) -> TinyLM:
    """The copy of ``trainer`` that group ``sim`` serves: quantised weights, compute dtype, KV path, kernel.

    ``memo``: a dict shared by the copies of *one* trainer version; groups with the same weight format and compute
    dtype then quantise once and get deep copies of that model (the same tensors bit for bit: the fake quantiser
    is deterministic)."""
    key = (sim.group.weight_format, sim.compute)
    if memo is not None and key in memo:
        model = copy.deepcopy(memo[key])
    else:
        model = fake_quantize_module(trainer, sim.group.weight_format)
        model = model.to(COMPUTE_DTYPES[sim.compute]).eval()
        model.requires_grad_(False)
        if memo is not None:
            memo[key] = copy.deepcopy(model)
    model.attn_impl = sim.attn_impl
    # A bf16 KV path in bf16 compute is the compute dtype itself; only FP8 rounds further.
    model.kv_quant = kv_fp8 if sim.group.kv_format == "fp8" else None
    return model


class SimulatedFleet:
    """The groups' current weights and versions, the router, and the asynchronous update policy.

    Args:
        groups: from :func:`build_fleet`.
        trainer: the trainer's model at version 0 (copied, not kept).
        generator: the run's random generator (syncs and routing draw from it).
        max_staleness: cap on any group's staleness, or None for unbounded.
    """

    def __init__(self, groups: list[GroupSim], trainer: TinyLM, generator: torch.Generator,
                 max_staleness: int | None = None) -> None:
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None, got {max_staleness}")
        self.groups = groups
        self.gen = generator
        self.max_staleness = max_staleness
        self.router = Router([g.group for g in groups], seed=int(torch.randint(0, 2**31 - 1, (1,),
                                                                                generator=generator)))
        memo: dict = {}
        self.models = [sampler_copy(trainer, g, memo) for g in groups]
        self.versions = [0] * len(groups)

    def route(self, session_ids: list[int]) -> Tensor:
        """``[B]`` int64 group index of each session (capacity-proportional, sticky)."""
        names = [g.name for g in self.groups]
        return torch.tensor([names.index(self.router.route(s)) for s in session_ids], dtype=torch.int64)

    def after_step(self, trainer: TinyLM, version: int) -> None:
        """The trainer reached ``version``: each group receives it with probability ``1 / (1 + lag)``.

        A syncing group's copy is updated in place: the first group of a (weight format, compute dtype) quantises
        ``trainer`` (:func:`sampler_copy`), every syncing group then copies those tensors into its own module (the
        same values bit for bit as a fresh copy, without deep-copying a module per group and version)."""
        fresh: dict = {}
        for i, g in enumerate(self.groups):
            sync = float(torch.rand((), generator=self.gen)) < 1.0 / (1.0 + g.lag)
            if self.max_staleness is not None and version - self.versions[i] > self.max_staleness:
                sync = True
            if sync:
                key = (g.group.weight_format, g.compute)
                if key not in fresh:
                    fresh[key] = sampler_copy(trainer, g).state_dict()
                with torch.no_grad():
                    for name, t in self.models[i].state_dict().items():
                        t.copy_(fresh[key][name])
                self.versions[i] = version


def describe(groups: list[GroupSim]) -> list[dict]:
    """One dict per group for the output files."""
    total = sum(g.group.capacity for g in groups)
    return [{"group": g.name, "accelerator": g.group.accelerator, "weights": g.group.weight_format,
             "kv": g.group.kv_format, "compute": g.compute, "attention": g.attn_impl,
             "capacity_share": g.group.capacity / total, "mean_lag": g.lag} for g in groups]

