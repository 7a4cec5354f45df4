"""Per-group mismatch table: each sampler group's share of the samples and of the extreme-ratio tokens, and
its sampler-trainer KL (the mixed-fleet study's per-group table, docs/spec.md#metrics), as formatted text and as a
dict for loggers.

Two ways in, accumulated over as many steps as wanted:

* :meth:`FleetMetrics.update` from per-token arrays (group ids, sampler and trainer log-probabilities of the
  sampled tokens, trained mask, optionally sequence ids): exact counts, no loss needed;
* :meth:`FleetMetrics.update_from_metrics` from ``op.policy_loss(...).metrics`` computed with ``groups=``
  (keys ``group/{g}/<name>``): counts are rebuilt from each group's ``num_tokens``.

Definitions (docs/spec.md#metrics; ``log r = log p - lq`` clamped to ``[-20, 20]`` as in the loss):
``share_samples`` is the group's share of sequences (of tokens when no sequence ids are known),
``share_tokens`` its share of trained tokens, ``share_extreme`` its share of all tokens whose ratio lies
outside ``[0.2, 5]``, ``extreme_frac`` the fraction of its own tokens that are extreme, ``kl_k1`` /
``kl_k2`` / ``kl_k3`` Schulman's estimators of KL(q || p) averaged over its tokens.

Route agreement (mixture-of-experts fleets, docs/routing.md#agreement-metrics), when routes are given (per-token
``route_flips`` to :meth:`FleetMetrics.update`, or the ``group/{g}/route_*`` keys of
:func:`offpolicy.route_agreement` in the metrics): ``route_tokens`` the tokens compared, ``route_flip_layers_mean``
the mean number of MoE layers whose expert set differs between the group's sampler and the trainer,
``route_any_flip_frac`` the share of its tokens with at least one flipped layer. The table shows these columns only
when some group has routes; a group without is ``None`` there (``nan`` in :meth:`FleetTable.to_dict`).
The KL's trend over steps (the growth verl#7519 reports): every ``update`` / ``update_from_metrics`` call is one step,
and each group's mean ``k3`` over that step's tokens is kept for the last ``trend_window`` steps in which the group
had a trained token (the ``all`` row: the step's mean over all tokens). ``kl_k3_slope`` is the least-squares slope of
those values against the step number (per step; steps without the group's tokens leave a gap, not a 0),
``kl_k3_growth`` the last of them divided by the first, ``trend_steps`` how many there are; the slope and growth are 0
with fewer than two steps, and the growth is 0 where the first value is 0.
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from offpolicy.fleet.groups import SamplerGroup
from offpolicy.loss.metrics import EXTREME_RATIO
from offpolicy.corrections.weights import kl_estimate

#: log-ratios are clamped to this magnitude, as ``Correction.max_log_ratio`` does by default.
MAX_LOG_RATIO = 20.0
_KEY = re.compile(r"^group/(-?\d+)/(\w+)$")
_SUMS = ("tokens", "extreme", "k1", "k2", "k3", "abs_lr", "sequences", "route_tokens", "route_flips", "route_any")


@dataclass(frozen=True)
class GroupRow:
    """One line of the table (see the module docstring for the definitions)."""

    name: str
    accelerator: str
    weight_format: str
    kv_format: str
    tokens: int
    share_samples: float
    share_tokens: float
    share_extreme: float
    extreme_frac: float
    kl_k1: float
    kl_k2: float
    kl_k3: float
    abs_log_ratio_mean: float
    abs_log_ratio_max: float
    route_tokens: int = 0
    route_flip_layers_mean: float | None = None
    route_any_flip_frac: float | None = None
    kl_k3_slope: float = 0.0
    kl_k3_growth: float = 0.0
    trend_steps: int = 0


def kl_trend(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """``(slope, growth)`` of ``[(step, k3), ...]``: the least-squares slope of ``k3`` against ``step`` and the
    ratio of the last ``k3`` to the first; ``(0, 0)`` under two points, growth 0 where the first ``k3`` is 0."""
    if len(points) < 2:
        return 0.0, 0.0
    xs = [float(x) for x, _ in points]
    ys = [y for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    return slope, (ys[-1] / ys[0] if ys[0] != 0 else 0.0)


@dataclass(frozen=True)
class FleetTable:
    """Rows per group plus an ``all`` row."""

    rows: list[GroupRow]
    total: GroupRow

    _METRICS = ("share_samples", "share_tokens", "share_extreme", "extreme_frac", "kl_k1", "kl_k2", "kl_k3",
                "abs_log_ratio_mean", "abs_log_ratio_max", "tokens", "kl_k3_slope", "kl_k3_growth", "trend_steps")

    def to_dict(self, prefix: str = "fleet") -> dict[str, float]:
        """Flat ``{f"{prefix}/{group}/{metric}": value}`` for a logger (``group`` = name, or ``all``)."""
        out: dict[str, float] = {}
        for row in [*self.rows, self.total]:
            for m in self._METRICS:
                out[f"{prefix}/{row.name}/{m}"] = float(getattr(row, m))
            if self.has_routes:
                for m in ("route_tokens", "route_flip_layers_mean", "route_any_flip_frac"):
                    v = getattr(row, m)
                    out[f"{prefix}/{row.name}/{m}"] = math.nan if v is None else float(v)
        return out

    @property
    def has_routes(self) -> bool:
        """Whether any group's routes were compared (the route columns are shown)."""
        return self.total.route_tokens > 0

    def format(self) -> str:
        """A fixed-width text table, one line per group and a final ``all`` line."""
        head = ("group", "accelerator", "weights", "kv", "samples", "tokens", "extreme", "extr.frac",
                "KL k1", "KL k3", "|log r|")
        if self.has_routes:
            head = (*head, "flip layers", "any flip")
        lines = [head]
        for r in [*self.rows, self.total]:
            line = (
                r.name, r.accelerator, r.weight_format, r.kv_format,
                f"{100 * r.share_samples:.1f}%", f"{100 * r.share_tokens:.1f}%", f"{100 * r.share_extreme:.1f}%",
                f"{100 * r.extreme_frac:.3f}%", f"{r.kl_k1:.2e}", f"{r.kl_k3:.2e}", f"{r.abs_log_ratio_mean:.2e}",
            )
            if self.has_routes:
                line = (*line, "-" if r.route_flip_layers_mean is None else f"{r.route_flip_layers_mean:.3f}",
                        "-" if r.route_any_flip_frac is None else f"{100 * r.route_any_flip_frac:.1f}%")
            lines.append(line)
        widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
        text = ["  ".join(c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
                for line in lines]
        text.insert(1, "-" * len(text[0]))
        text.insert(len(text) - 1, "-" * len(text[0]))
        return "\n".join(text)

    def __str__(self) -> str:
        return self.format()


class FleetMetrics:
    """Accumulate per-group mismatch statistics and render them as a :class:`FleetTable`.

    Args:
        groups: the fleet; group id ``g`` in the inputs is the index into this list.
        trend_window: how many of each group's latest steps the KL trend (``kl_k3_slope``, ``kl_k3_growth``) is
            fitted over; an int ``>= 2``.
    """

    def __init__(self, groups: Sequence[SamplerGroup], trend_window: int = 10):
        self.groups = list(groups)
        if not self.groups:
            raise ValueError("groups must be a non-empty sequence of SamplerGroup")
        if isinstance(trend_window, bool) or not isinstance(trend_window, int) or trend_window < 2:
            raise ValueError(f"trend_window must be an int >= 2, got {trend_window!r}")
        self.trend_window = trend_window
        self.reset()

    def reset(self) -> None:
        m = len(self.groups)
        self._sum = {k: [0.0] * m for k in _SUMS}
        self._max = [0.0] * m
        self._seq_total = 0.0
        self._step = 0
        self._trend = [deque(maxlen=self.trend_window) for _ in range(m + 1)]  # the last one: the all row

    def _record_step(self, tokens: Sequence[float], k3_sums: Sequence[float]) -> None:
        """Keep this step's mean k3 per group with tokens, and over all tokens."""
        for g, (n, k3) in enumerate(zip(tokens, k3_sums)):
            if n > 0:
                self._trend[g].append((self._step, k3 / n))
        if sum(tokens) > 0:
            self._trend[-1].append((self._step, sum(k3_sums) / sum(tokens)))
        self._step += 1

    def update(
        self,
        groups: Tensor,
        sampler_logprobs: Tensor,
        trainer_logprobs: Tensor,
        mask: Tensor | None = None,
        seq_ids: Tensor | None = None,
        route_flips: Tensor | None = None,
        route_valid: Tensor | None = None,
    ) -> None:
        """Add one batch of sampled tokens.

        Args:
            groups: ``[N]`` int group index of each token.
            sampler_logprobs: ``[N]`` float ``lq`` of the sampled tokens.
            trainer_logprobs: ``[N]`` float ``log p`` of the same tokens (under the same support when replayed).
            mask: ``[N]`` bool trained tokens (default all).
            seq_ids: ``[N]`` int sequence id of each token, for ``share_samples`` by sequence.
            route_flips: ``[N]`` int flipped MoE layers of each token (:func:`offpolicy.route_flips`), for the
                route-agreement columns; counted over ``mask`` tokens with ``route_valid``.
            route_valid: ``[N]`` bool tokens whose routes were compared (default all; padded routes: False).
        """
        n = groups.shape[0] if isinstance(groups, Tensor) else -1
        for name, t in (("groups", groups), ("sampler_logprobs", sampler_logprobs),
                        ("trainer_logprobs", trainer_logprobs)):
            if not isinstance(t, Tensor) or t.dim() != 1 or t.shape[0] != n:
                raise ValueError(f"{name} must be a 1-D tensor of length N={n} (the length of groups)")
        if groups.is_floating_point():
            raise TypeError(f"groups must be an integer tensor, got {groups.dtype}")
        if n and (int(groups.min()) < 0 or int(groups.max()) >= len(self.groups)):
            raise ValueError(f"groups must hold indices in [0, {len(self.groups)}); got {groups.min()}..{groups.max()}")
        mask = torch.ones(n, dtype=torch.bool) if mask is None else mask.to(torch.bool)
        if mask.shape != (n,):
            raise ValueError(f"mask must be [N] with N={n}, got {tuple(mask.shape)}")
        if bool(torch.isnan(sampler_logprobs).any()) or bool(torch.isnan(trainer_logprobs).any()):
            raise ValueError("sampler_logprobs / trainer_logprobs hold NaN")
        # -inf - -inf is NaN: a token impossible under both policies counts as no mismatch
        lr = (trainer_logprobs.double() - sampler_logprobs.double()).nan_to_num(
            nan=0.0, posinf=MAX_LOG_RATIO, neginf=-MAX_LOG_RATIO).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        extreme = (lr < math.log(EXTREME_RATIO[0])) | (lr > math.log(EXTREME_RATIO[1]))
        if seq_ids is not None:
            if seq_ids.shape != (n,):
                raise ValueError(f"seq_ids must be [N] with N={n}, got {tuple(seq_ids.shape)}")
            self._seq_total += float(torch.unique(seq_ids[mask]).numel())
        flips = None
        if route_flips is not None:
            if not isinstance(route_flips, Tensor) or route_flips.shape != (n,) or route_flips.is_floating_point() \
                    or route_flips.dtype == torch.bool:
                raise ValueError(f"route_flips must be an integer tensor [N] with N={n}, got "
                                 f"{getattr(route_flips, 'dtype', type(route_flips))} of shape "
                                 f"{tuple(getattr(route_flips, 'shape', ()))}")
            if n and int(route_flips.min()) < 0:
                raise ValueError("route_flips must be >= 0 (flipped layers per token)")
            flips = route_flips.to(torch.float64)
            rmask = mask if route_valid is None else mask & route_valid.to(torch.bool)
            if rmask.shape != (n,):
                raise ValueError(f"route_valid must be [N] with N={n}, got {tuple(route_valid.shape)}")
        step_tokens, step_k3 = [], []
        for g in range(len(self.groups)):
            sel = mask & (groups == g)
            x = lr[sel]
            s = self._sum
            step_tokens.append(float(sel.sum()))
            step_k3.append(float(kl_estimate(x, "k3").sum()))
            s["tokens"][g] += step_tokens[-1]
            s["extreme"][g] += float(extreme[sel].sum())
            s["k1"][g] += float(kl_estimate(x, "k1").sum())
            s["k2"][g] += float(kl_estimate(x, "k2").sum())
            s["k3"][g] += step_k3[-1]
            s["abs_lr"][g] += float(x.abs().sum())
            if x.numel():
                self._max[g] = max(self._max[g], float(x.abs().max()))
            if seq_ids is not None:
                s["sequences"][g] += float(torch.unique(seq_ids[sel]).numel())
            if flips is not None:
                rsel = rmask & (groups == g)
                s["route_tokens"][g] += float(rsel.sum())
                s["route_flips"][g] += float(flips[rsel].sum())
                s["route_any"][g] += float((flips[rsel] > 0).sum())
        self._record_step(step_tokens, step_k3)

    def update_from_metrics(self, metrics: Mapping[str, Tensor | float]) -> None:
        """Add one step from ``op.policy_loss(..., groups=...).metrics`` (keys ``group/{g}/<name>``).

        Needs each group's ``num_tokens``, ``extreme_ratio_frac``, ``kl_k1``, ``kl_k2``, ``kl_k3``,
        ``abs_log_ratio_mean`` and ``abs_log_ratio_max``; ``share_samples`` (of sequences) is used when it
        differs from ``share_tokens``.
        """
        per: dict[int, dict[str, float]] = {}
        for key, value in metrics.items():
            m = _KEY.match(key)
            if m:
                per.setdefault(int(m.group(1)), {})[m.group(2)] = float(value)
        # groups that carry only route keys (route_agreement's dict alone) add no token statistics
        routes_only = {g for g, v in per.items() if "num_tokens" not in v and "route_tokens" in v}
        if not per:
            raise ValueError("metrics hold no 'group/{g}/<name>' keys: was policy_loss called with groups=?")
        needed = ("num_tokens", "extreme_ratio_frac", "kl_k1", "kl_k2", "kl_k3", "abs_log_ratio_mean",
                  "abs_log_ratio_max")
        for g, vals in per.items():
            if not 0 <= g < len(self.groups):
                raise ValueError(f"metrics name group {g}, but the fleet has {len(self.groups)} groups")
            if g in routes_only:
                continue
            missing = [k for k in needed if k not in vals]
            if missing:
                raise ValueError(f"metrics for group {g} lack {missing}")
        seq_mode = any(abs(v.get("share_samples", 0.0) - v.get("share_tokens", 0.0)) > 1e-12 for v in per.values())
        step_tokens, step_k3 = [0.0] * len(self.groups), [0.0] * len(self.groups)
        for g, v in per.items():
            n = v.get("num_tokens", 0.0)
            if g not in routes_only:
                step_tokens[g], step_k3[g] = n, v["kl_k3"] * n
            s = self._sum
            s["tokens"][g] += n
            s["extreme"][g] += round(v.get("extreme_ratio_frac", 0.0) * n)
            if g not in routes_only:
                s["k1"][g] += v["kl_k1"] * n
                s["k2"][g] += v["kl_k2"] * n
                s["k3"][g] += v["kl_k3"] * n
                s["abs_lr"][g] += v["abs_log_ratio_mean"] * n
                self._max[g] = max(self._max[g], v["abs_log_ratio_max"])
            if seq_mode:
                # sequence counts are not in the dict; accumulate shares per step (a mean over steps)
                s["sequences"][g] += v.get("share_samples", 0.0)
            if "route_tokens" in v:
                # route_agreement's keys (offpolicy.loss.route_metrics), merged into the metrics dict
                for key in ("route_flip_layers_mean", "route_any_flip_frac"):
                    if key not in v:
                        raise ValueError(f"metrics for group {g} have route_tokens but lack {key}")
                m = v["route_tokens"]
                s["route_tokens"][g] += m
                s["route_flips"][g] += v["route_flip_layers_mean"] * m
                s["route_any"][g] += round(v["route_any_flip_frac"] * m)
        if seq_mode:
            self._seq_total += 1.0
        self._record_step(step_tokens, step_k3)

    def table(self) -> FleetTable:
        """The accumulated table."""
        s = self._sum
        n_all = sum(s["tokens"])
        e_all = sum(s["extreme"])
        by_seq = self._seq_total > 0
        rows = []
        for g, grp in enumerate(self.groups):
            n = s["tokens"][g]
            share_tok = n / n_all if n_all else 0.0
            slope, growth = kl_trend(self._trend[g])
            rows.append(GroupRow(
                name=grp.name, accelerator=grp.accelerator, weight_format=grp.weight_format,
                kv_format=grp.kv_format, tokens=int(n),
                share_samples=(s["sequences"][g] / self._seq_total) if by_seq else share_tok,
                share_tokens=share_tok,
                share_extreme=s["extreme"][g] / e_all if e_all else 0.0,
                extreme_frac=s["extreme"][g] / n if n else 0.0,
                kl_k1=s["k1"][g] / n if n else 0.0,
                kl_k2=s["k2"][g] / n if n else 0.0,
                kl_k3=s["k3"][g] / n if n else 0.0,
                abs_log_ratio_mean=s["abs_lr"][g] / n if n else 0.0,
                abs_log_ratio_max=self._max[g],
                **_route_cols(s["route_tokens"][g], s["route_flips"][g], s["route_any"][g]),
                kl_k3_slope=slope, kl_k3_growth=growth, trend_steps=len(self._trend[g]),
            ))
        slope, growth = kl_trend(self._trend[-1])
        total = GroupRow(
            name="all", accelerator="", weight_format="", kv_format="", tokens=int(n_all),
            share_samples=1.0 if n_all else 0.0, share_tokens=1.0 if n_all else 0.0,
            share_extreme=1.0 if e_all else 0.0,
            extreme_frac=e_all / n_all if n_all else 0.0,
            kl_k1=sum(s["k1"]) / n_all if n_all else 0.0,
            kl_k2=sum(s["k2"]) / n_all if n_all else 0.0,
            kl_k3=sum(s["k3"]) / n_all if n_all else 0.0,
            abs_log_ratio_mean=sum(s["abs_lr"]) / n_all if n_all else 0.0,
            abs_log_ratio_max=max(self._max),
            **_route_cols(sum(s["route_tokens"]), sum(s["route_flips"]), sum(s["route_any"])),
            kl_k3_slope=slope, kl_k3_growth=growth, trend_steps=len(self._trend[-1]),
        )
        return FleetTable(rows, total)


def _route_cols(tokens: float, flips: float, anyflip: float) -> dict[str, object]:
    if not tokens:
        return {"route_tokens": 0, "route_flip_layers_mean": None, "route_any_flip_frac": None}
    return {"route_tokens": int(tokens), "route_flip_layers_mean": flips / tokens, "route_any_flip_frac": anyflip / tokens}


def fleet_table(
    groups: Sequence[SamplerGroup],
    group_ids: Tensor | None = None,
    sampler_logprobs: Tensor | None = None,
    trainer_logprobs: Tensor | None = None,
    mask: Tensor | None = None,
    seq_ids: Tensor | None = None,
    metrics: Mapping[str, Tensor | float] | None = None,
    route_flips: Tensor | None = None,
    route_valid: Tensor | None = None,
) -> FleetTable:
    """One-shot table: from per-token arrays (with ``route_flips`` for the route-agreement columns), or from a
    ``policy_loss`` metrics dict (``metrics=``, merged with :func:`offpolicy.route_agreement`'s for routes)."""
    acc = FleetMetrics(groups)
    if metrics is not None:
        acc.update_from_metrics(metrics)
    else:
        if group_ids is None or sampler_logprobs is None or trainer_logprobs is None:
            raise ValueError("fleet_table needs group_ids, sampler_logprobs and trainer_logprobs, or metrics=")
        acc.update(group_ids, sampler_logprobs, trainer_logprobs, mask, seq_ids, route_flips, route_valid)
    return acc.table()
