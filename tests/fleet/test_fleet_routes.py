"""The per-group fleet table's route-agreement columns (issue 46 item 3, metrics): from per-token ``route_flips`` and
from ``op.route_agreement``'s metrics merged with a ``policy_loss`` metrics dict, against float64 sums written out
in Python; no route columns when no routes are given."""

from __future__ import annotations

import math
import random

import pytest
import torch

import offpolicy as op
from offpolicy.fleet import FleetMetrics, SamplerGroup, fleet_table

GROUPS = [SamplerGroup("bf16-h100", "H100", "bf16", "bf16", 1.0), SamplerGroup("nvfp4-b200", "B200", "nvfp4", "fp8",
                                                                                   1.0),
          SamplerGroup("fp8-mi300", "MI300X", "fp8", "fp8", 1.0)]


def _case(seed, n=60, layers=6):
    rng = random.Random(seed)
    groups = [rng.randrange(2) for _ in range(n)]          # group 2 samples nothing
    flips = [rng.choice([0, 0, 0, 1, 2, layers]) if g else rng.choice([0, 0, 1]) for g in groups]
    mask = [rng.random() < 0.85 for _ in range(n)]
    routed = [rng.random() < 0.9 for _ in range(n)]
    lq = [-rng.random() * 3 for _ in range(n)]
    lp = [x + rng.gauss(0, 0.3) for x in lq]
    return groups, flips, mask, routed, lq, lp


def _literal(groups, flips, sel):
    out = {}
    for g in (0, 1, 2):
        rows = [f for gg, f, s in zip(groups, flips, sel) if s and gg == g]
        out[g] = (len(rows), sum(rows) / len(rows) if rows else None,
                  sum(1 for f in rows if f) / len(rows) if rows else None)
    rows = [f for f, s in zip(flips, sel) if s]
    out["all"] = (len(rows), sum(rows) / len(rows), sum(1 for f in rows if f) / len(rows))
    return out


@pytest.mark.parametrize("seed", range(3))
def test_route_columns_from_per_token_flips(seed):
    groups, flips, mask, routed, lq, lp = _case(seed)
    table = fleet_table(GROUPS, torch.tensor(groups), torch.tensor(lq), torch.tensor(lp), torch.tensor(mask),
                        route_flips=torch.tensor(flips), route_valid=torch.tensor(routed))
    want = _literal(groups, flips, [m and r for m, r in zip(mask, routed)])
    for row, key in [*zip(table.rows, (0, 1, 2)), (table.total, "all")]:
        n, mean, anyf = want[key]
        assert row.route_tokens == n
        if mean is None:
            assert row.route_flip_layers_mean is None and row.route_any_flip_frac is None
        else:
            assert row.route_flip_layers_mean == pytest.approx(mean, abs=1e-12)
            assert row.route_any_flip_frac == pytest.approx(anyf, abs=1e-12)
    text = table.format()
    assert "flip layers" in text and "any flip" in text
    d = table.to_dict()
    assert math.isnan(d["fleet/fp8-mi300/route_flip_layers_mean"])
    assert d["fleet/all/route_tokens"] == want["all"][0]


def test_no_route_columns_without_routes():
    groups, _, mask, _, lq, lp = _case(0)
    table = fleet_table(GROUPS, torch.tensor(groups), torch.tensor(lq), torch.tensor(lp), torch.tensor(mask))
    assert not table.has_routes and "flip" not in table.format()
    assert not any("route" in k for k in table.to_dict())


def test_route_columns_from_route_agreement_metrics():
    rng = random.Random(4)
    t, layers, k, e = 40, 4, 2, 16
    a = torch.tensor([[rng.sample(range(e), k) for _ in range(layers)] for _ in range(t)])
    b = a.clone()
    for i in range(t):
        if rng.random() < 0.4:
            b[i, rng.randrange(layers)] = torch.tensor(rng.sample(range(e), k))
    sampler, trainer = op.RoutedExperts.from_ids(a, e), op.RoutedExperts.from_ids(b, e)
    groups = torch.tensor([i % 2 for i in range(t)])
    lq = -0.05 - torch.rand(t, dtype=torch.float64)
    out = op.policy_loss_from_logprobs(lq + 0.01, lq, torch.randn(t, dtype=torch.float64), groups=groups)
    metrics = {**out.metrics, **op.route_agreement(sampler, trainer, groups=groups)}
    acc = FleetMetrics(GROUPS[:2])
    acc.update_from_metrics(metrics)
    table = acc.table()
    flips = op.route_flips(sampler, trainer).tolist()
    want = _literal(groups.tolist(), flips, [True] * t)
    for row, key in [*zip(table.rows, (0, 1)), (table.total, "all")]:
        assert row.route_tokens == want[key][0]
        assert row.route_flip_layers_mean == pytest.approx(want[key][1], abs=1e-12)
        assert row.route_any_flip_frac == pytest.approx(want[key][2], abs=1e-12)
    # the route metrics alone (no loss metrics) still make the route columns
    alone = FleetMetrics(GROUPS[:2])
    alone.update_from_metrics(op.route_agreement(sampler, trainer, groups=groups))
    assert alone.table().total.route_tokens == t


def test_route_flips_input_is_checked():
    acc = FleetMetrics(GROUPS)
    with pytest.raises(ValueError, match="route_flips must be an integer tensor"):
        acc.update(torch.zeros(3, dtype=torch.int64), torch.zeros(3), torch.zeros(3), route_flips=torch.zeros(3))
    with pytest.raises(ValueError, match="route_flips must be >= 0"):
        acc.update(torch.zeros(3, dtype=torch.int64), torch.zeros(3), torch.zeros(3),
                   route_flips=torch.tensor([0, -1, 2]))
