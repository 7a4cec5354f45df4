"""Each live group's mismatch attribution: why is ``r != 1`` in this group's row of the per-group table?

    from offpolicy.adapters.fleet_live.group_attribution import attribute_groups
    shares = attribute_groups(batch, fleet.groups, model=trainer, current_version=v, weights={v - 1: old_model})
    print(attribution_table(shares))         # one row per group; shares[name] also goes into history.json

It turns a :class:`~.fleet_runner.LiveBatch` (trained tokens, the group and served version of each, the sampler's
log-probs) into the diagnose record (:func:`offpolicy.diagnose.recorded.from_token_batch`, trained tokens only),
calls :func:`offpolicy.diagnose.attribution.attribute` with the trainer's model, the stored weights of the served
versions and the groups' weight formats, and keeps, per group, each part's share of the group's mean ``|log r|``
(Shapley over staleness, format, routing, residual, with semantics peeled off first:
docs/diagnose.md#attribution-why-is-r--1).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from torch import nn

from offpolicy.adapters.fleet_live.fleet_runner import LiveBatch
from offpolicy.diagnose.attribution import AttributionReport, Rescorer, attribute
from offpolicy.diagnose.recorded import from_token_batch
from offpolicy.diagnose.slices import take
from offpolicy.fleet.groups import SamplerGroup


def attribute_live_batch(
    batch: LiveBatch,
    groups: Sequence[SamplerGroup],
    *,
    model: nn.Module,
    current_version: int,
    weights: Mapping[int, nn.Module] | None = None,
    top_p: float = 1.0,
    top_k: int | None = None,
    replay: Rescorer | None = None,
    max_tokens: int = 4096,
    seed: int = 0,
    step: int | None = None,
    quantize_skip: Sequence[str] = (),
) -> AttributionReport:
    """:func:`~offpolicy.diagnose.attribution.attribute` on the trained tokens (``batch.batch.loss_mask``) of a
    live batch.

    Args:
        batch: the fleet's batch; ``batch.sequences [B, L]`` int64, ``batch.batch`` its ``N`` tokens (``versions
            [N]`` int64 the served versions, ``sampler_logprobs [N]`` fp32), ``batch.group_ids [N]`` int64 into
            ``groups``.
        groups: the fleet's groups (``LiveFleet.groups``; their ``weight_format`` is the format cause).
        model: the trainer's model at ``current_version`` (``input_ids [B, L] -> logits [B, L, V]``).
        current_version: the trainer's version at the step that trains ``batch``.
        weights: ``{version: model}`` for every other served version among the trained tokens.
        top_p, top_k: the declared sampling filter of the batch's sampling parameters.
        replay: the routing re-scorer (MoE; the sampler's routes replayed), or ``None`` (no routing part).
        max_tokens, seed, step, quantize_skip: as in :func:`~offpolicy.diagnose.attribution.attribute`.

    Raises ``ValueError`` naming ``batch`` when it has no trained token or ``group_ids`` does not index
    ``groups``, and whatever ``attribute`` raises for a missing version's weights.
    """
    if not isinstance(batch, LiveBatch):
        raise TypeError(f"batch must be a LiveBatch, got {type(batch).__name__}")
    groups = list(groups)
    if not groups or not all(isinstance(g, SamplerGroup) for g in groups):
        raise ValueError("groups must be the fleet's non-empty list of SamplerGroup")
    tb = batch.batch
    n = tb.tokens.shape[0]
    gi = batch.group_ids
    if gi.shape != (n,) or (n and (int(gi.min()) < 0 or int(gi.max()) >= len(groups))):
        raise ValueError(f"batch.group_ids must be [N] = [{n}] int64 indexing the {len(groups)} groups, got shape "
                         f"{tuple(gi.shape)}")
    trained = tb.loss_mask.nonzero().flatten()
    if trained.numel() == 0:
        raise ValueError("batch: no trained token (batch.batch.loss_mask is all False); nothing to attribute")
    rec = from_token_batch(tb, batch.sequences, group_names=[g.name for g in groups], group_index=gi,
                           top_p=top_p, top_k=top_k)
    return attribute(take(rec, trained), model=model, current_version=current_version, weights=weights,
                     formats=groups, replay=replay, max_tokens=max_tokens, seed=seed, step=step,
                     quantize_skip=quantize_skip)


def group_shares(report: AttributionReport) -> dict[str, dict[str, float]]:
    """``{group: {"tokens", "mean_abs_log_r", part: share}}``: per group with sampled tokens, each part's share of
    the group's mean ``|log r|`` (``semantics``, the measured causes, ``residual``; they sum to 1) and the mean
    itself; a group whose mismatch is 0 has NaN shares."""
    out: dict[str, dict[str, float]] = {}
    parts = ["semantics", *report.causes, "residual"]
    for s in report.slices:
        if s.kind != "group":
            continue
        row = {"tokens": float(s.tokens), "mean_abs_log_r": float(s.total["mean_abs_log_r"])}
        row.update({p: float(s.parts[p]["share_mean_abs_log_r"]) for p in parts})
        out[s.label] = row
    return out


def attribute_groups(batch: LiveBatch, groups: Sequence[SamplerGroup], **kwargs) -> dict[str, dict[str, float]]:
    """:func:`group_shares` of :func:`attribute_live_batch` (same arguments): the per-group attribution a run's
    table and ``history.json`` hold."""
    return group_shares(attribute_live_batch(batch, groups, **kwargs))


def attribution_table(shares: Mapping[str, Mapping[str, float | None]]) -> str:
    """A text table, one row per group: tokens, mean ``|log r|`` and each part's share (``-`` where NaN or
    ``None``, as ``StepLog.attribution`` stores NaN)."""
    parts = [p for p in ("semantics", "staleness", "format", "routing", "residual")
             if any(p in r for r in shares.values())]
    head = f"{'group':<12}{'tokens':>7}{'|log r|':>10}" + "".join(f"{p:>11}" for p in parts)
    lines = [head, "-" * len(head)]
    for name, r in shares.items():
        cells = "".join(f"{r[p]:>11.1%}" if r.get(p) is not None and math.isfinite(r[p]) else f"{'-':>11}"
                        for p in parts)
        lines.append(f"{name[:11]:<12}{int(r['tokens']):>7}{r['mean_abs_log_r']:>10.2e}" + cells)
    return "\n".join(lines)
