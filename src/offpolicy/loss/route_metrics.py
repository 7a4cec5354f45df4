"""Route-agreement metrics of a mixture-of-experts sampler against the trainer (docs/routing.md#agreement-metrics).

For each token the sampler routed and the trainer re-routed (:func:`~offpolicy.records.routed_experts.layer_flips`:
a layer *flips* when the two expert sets differ, slot order ignored), over the selected tokens (``loss_mask``,
and both records' ``valid``):

* ``route_flip_layers_mean``: mean number of flipped layers per token;
* ``route_any_flip_frac``: share of tokens with at least one flipped layer;
* ``route_layer_flip_frac/{l}``: share of tokens whose layer ``l`` flipped (from the per-layer flips only);
* ``route_tokens``: the tokens compared;
* per sampler group ``g`` (``groups [T]``): ``group/{g}/<name>`` of the same keys, the keys
  :class:`~offpolicy.fleet.table.FleetMetrics` reads.

All values are detached float64 scalar tensors (``0`` for an empty selection).
"""

from __future__ import annotations

import torch
from torch import Tensor

from offpolicy.records.routed_experts import RoutedExperts, layer_flips


def route_flip_metrics(flips: Tensor, compared: Tensor | None = None, loss_mask: Tensor | None = None,
                       groups: Tensor | None = None) -> dict[str, Tensor]:
    """The metrics of the module docstring from ``flips``: ``[T, L]`` bool per-layer flips, or ``[T]`` int flipped
    layers per token (the output of :func:`~offpolicy.records.routed_experts.route_flips`; then no per-layer
    keys). ``compared [T]`` bool: tokens both records route (None: all); ``loss_mask [T]``: trained tokens (None:
    all); ``groups [T]`` int sampler group (None: no per-group keys)."""
    if not isinstance(flips, Tensor) or flips.dim() not in (1, 2):
        raise ValueError(f"flips must be [T, L] bool or [T] int, got {getattr(flips, 'shape', type(flips))}")
    if flips.dim() == 2 and flips.dtype != torch.bool:
        raise TypeError(f"flips [T, L] must be bool (per-layer flips), got {flips.dtype}")
    if flips.dim() == 1 and (flips.is_floating_point() or flips.dtype == torch.bool):
        raise TypeError(f"flips [T] must be an integer count of flipped layers, got {flips.dtype}")
    t = flips.shape[0]
    sel = torch.ones(t, dtype=torch.bool, device=flips.device)
    for name, m in (("compared", compared), ("loss_mask", loss_mask)):
        if m is not None:
            if not isinstance(m, Tensor) or m.shape != (t,):
                raise ValueError(f"{name} must be [T] = [{t}], got {getattr(m, 'shape', type(m))}")
            sel = sel & m.to(device=flips.device, dtype=torch.bool)
    if groups is not None and (not isinstance(groups, Tensor) or groups.shape != (t,) or groups.is_floating_point()):
        raise ValueError(f"groups must be an integer tensor [T] = [{t}], got {getattr(groups, 'shape', type(groups))}")
    per_layer = flips if flips.dim() == 2 else None
    counts = (flips.sum(dim=1) if per_layer is not None else flips).to(torch.float64).detach()

    def stats(s: Tensor) -> dict[str, Tensor]:
        n = s.sum().to(torch.float64)
        d = n.clamp_min(1)
        out = {"route_tokens": n,
               "route_flip_layers_mean": torch.where(s, counts, 0.0).sum() / d,
               "route_any_flip_frac": (s & (counts > 0)).sum().to(torch.float64) / d}
        if per_layer is not None:
            rate = (per_layer & s[:, None]).sum(dim=0).to(torch.float64) / d
            out.update({f"route_layer_flip_frac/{layer}": rate[layer] for layer in range(per_layer.shape[1])})
        return out

    out = stats(sel)
    if groups is not None:
        g = groups.to(flips.device)
        for value in torch.unique(g[sel]).tolist():
            out.update({f"group/{value}/{k}": v for k, v in stats(sel & (g == value)).items()})
    return out


def route_agreement(sampler: RoutedExperts, trainer: RoutedExperts, loss_mask: Tensor | None = None,
                    groups: Tensor | None = None) -> dict[str, Tensor]:
    """The metrics of the module docstring for the sampler's and the trainer's routing records of the same ``T``
    tokens (with the per-layer flip rates)."""
    flips = layer_flips(sampler, trainer)
    compared = sampler.token_valid & trainer.token_valid.to(sampler.ids.device)
    return route_flip_metrics(flips, compared, loss_mask, groups)
