"""Fleet: sampler groups, the quota-method router (property-tested balance), the per-group metrics table."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import offpolicy as op
from offpolicy.fleet import FleetMetrics, Router, SamplerGroup, fleet_table, homogeneous_fleet, seed_fleet


def groups_from(caps):
    return [SamplerGroup(f"g{i}", "H100", "bf16", "fp8", float(c)) for i, c in enumerate(caps)]


capacities = st.lists(
    st.one_of(st.floats(1e-3, 1.0), st.integers(1, 50).map(float), st.sampled_from([1.0, 2.0, 3.0, 7.0])),
    min_size=1, max_size=8,
)


def test_sampler_group_validation_and_presets():
    with pytest.raises(ValueError, match="weight_format"):
        SamplerGroup("a", "H100", "int3", "fp8", 1.0)
    with pytest.raises(ValueError, match="kv_format"):
        SamplerGroup("a", "H100", "bf16", "fp4", 1.0)
    with pytest.raises(ValueError, match="capacity"):
        SamplerGroup("a", "H100", "bf16", "fp8", -1.0)
    with pytest.raises(ValueError, match="'/'"):
        SamplerGroup("a/b", "H100", "bf16", "fp8", 1.0)
    fleet = seed_fleet({"h100-fp8": "http://h100-fp8:30000"})
    assert len(fleet) == 8 and {g.accelerator for g in fleet} == {"B200", "B300", "H100", "H200", "A100",
                                                                   "RTX PRO 6000"}
    assert all(g.kv_format == "fp8" for g in fleet)
    total = sum(g.capacity for g in fleet)
    nvfp4 = sum(g.capacity for g in fleet if g.weight_format == "nvfp4") / total
    assert math.isclose(nvfp4, 0.47) and math.isclose(fleet[2].capacity / total, 0.10)
    assert fleet[2].endpoint == "http://h100-fp8:30000"
    assert homogeneous_fleet()[0].kv_format == "bf16"


@settings(max_examples=60, deadline=None)
@given(caps=capacities, n=st.integers(1, 400), seed=st.one_of(st.none(), st.integers(0, 100)))
def test_router_quota_property_fixed_capacities(caps, n, seed):
    # Balinski-Young: floor(n w) <= L <= ceil(n w) at every n, i.e. |L - n w| < 1 (float slack 1e-9)
    router = Router(groups_from(caps), seed=seed)
    total = sum(caps)
    for i in range(n):
        router.assign(f"s{i}")
        load = router.load()
        for j, c in enumerate(caps):
            assert abs(load[f"g{j}"] - (i + 1) * c / total) < 1 + 1e-9


@settings(max_examples=40, deadline=None)
@given(
    caps=capacities,
    ops=st.lists(st.tuples(st.sampled_from(["new", "again", "scale", "release"]), st.integers(0, 10**6),
                           st.floats(0.0, 20.0)), min_size=1, max_size=250),
)
def test_router_bounds_under_autoscaling_and_stickiness(caps, ops):
    router = Router(groups_from(caps))
    m = len(caps)
    sessions: list[str] = []
    for kind, x, c in ops:
        if kind == "new" or not sessions:
            sid = f"s{len(sessions)}"
            g = router.assign(sid)
            sessions.append(sid)
            assert router.assign(sid) is g  # sticky
        elif kind == "again":
            sid = sessions[x % len(sessions)]
            pinned = router.group_of(sid)
            g = router.assign(sid)
            if pinned is not None and pinned.capacity > 0:
                assert g.name == pinned.name
        elif kind == "scale":
            name = f"g{x % m}"
            others = any(gr.capacity > 0 for gr in router.groups if gr.name != name)
            if c > 0 or others:
                router.set_capacity(name, c)
        else:
            router.release(sessions[x % len(sessions)])
        load, target = router.load(), router.targets()
        assert math.isclose(sum(load.values()), sum(target.values()), rel_tol=1e-9, abs_tol=1e-9)
        for name in load:
            # proven for any capacity path: never a unit over target; at most m - 1 units under
            assert load[name] - target[name] < 1 + 1e-9
            assert target[name] - load[name] < m - 1 + 1e-9


def test_router_drain_seed_order_and_errors():
    groups = groups_from([1, 1])
    router = Router(groups)
    assert router.route("a") == "g0" and router.route("b") == "g1"
    router.set_capacity("g0", 0)
    assert router.route("a") == "g1"  # drained group: the session moves
    assert router.active_sessions() == {"g0": 0, "g1": 2}
    with pytest.raises(ValueError, match="last group"):
        router.set_capacity("g1", 0)
    with pytest.raises(KeyError):
        router.set_capacity("zz", 1)
    with pytest.raises(ValueError, match="unique"):
        Router(groups + groups)
    with pytest.raises(ValueError, match="capacity > 0"):
        Router(groups_from([0, 0]))
    with pytest.raises(ValueError, match="weight"):
        router.assign("c", weight=0)
    order = [Router(groups_from([1, 1, 1]), seed=3).route("x") for _ in range(3)]
    assert len(set(order)) == 1  # seeded tie order is deterministic
    router.add_group(SamplerGroup("g2", "A100", "bf16", "fp8", 2.0))
    assert router.shares()["g2"] == 2.0 / 3.0


def test_router_request_balance_with_sticky_sessions():
    # 4 groups, 3000 sessions of 1-20 requests, up to 16 sessions in flight: the realised shares of
    # *requests* converge to capacity shares although sessions cannot move (fixed seed, deterministic).
    caps = [5.0, 3.0, 1.5, 0.5]
    router = Router(groups_from(caps), balance="requests")
    rng = random.Random(0)
    live: dict[str, int] = {}
    started = 0
    while started < 3000 or live:
        if started < 3000 and (len(live) < 16):
            live[f"s{started}"] = rng.randint(1, 20)
            started += 1
        sid = rng.choice(list(live))
        router.assign(sid)
        live[sid] -= 1
        if live[sid] == 0:
            del live[sid]
            router.release(sid)
    shares = router.realised_shares()
    for j, c in enumerate(caps):
        assert abs(shares[f"g{j}"] - c / sum(caps)) < 0.01, shares


# ---------------------------------------------------------------- the table
def test_table_from_arrays_matches_hand_computation():
    groups = groups_from([1, 1, 1])
    g = torch.tensor([0, 0, 1, 1, 1, 2, 2, 0])
    lq = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.0, -1.0, -0.1, -4.0])
    lp = torch.tensor([-1.0, -0.2, -0.5, -5.0, -1.1, -1.0, -0.1, -4.0])
    mask = torch.tensor([True] * 7 + [False])
    t = fleet_table(groups, g, lq, lp, mask, seq_ids=torch.tensor([0, 0, 1, 1, 2, 3, 3, 0]))
    lr = lp.double() - lq.double()
    extreme = (lr < math.log(0.2)) | (lr > math.log(5))  # tokens 1 (r=e^1.8) and 3 (r=e^-2)
    assert extreme.tolist()[:7] == [False, True, False, True, False, False, False]
    r0, r1, r2 = t.rows
    assert (r0.tokens, r1.tokens, r2.tokens) == (2, 3, 2)
    assert r0.share_extreme == 0.5 and r1.share_extreme == 0.5 and r2.share_extreme == 0.0
    assert math.isclose(r1.extreme_frac, 1 / 3)
    assert math.isclose(r0.kl_k1, float(-(lr[0] + lr[1]) / 2))
    k3 = torch.expm1(lr) - lr
    assert math.isclose(r1.kl_k3, float(k3[2:5].mean()), rel_tol=1e-12)
    assert math.isclose(t.total.kl_k3, float(k3[:7].mean()), rel_tol=1e-12)
    assert (r0.share_samples, r1.share_samples, r2.share_samples) == (0.25, 0.5, 0.25)  # 4 sequences
    assert math.isclose(r1.share_tokens, 3 / 7)
    assert math.isclose(t.total.abs_log_ratio_max, 2.0, rel_tol=1e-6)
    d = t.to_dict()
    assert d["fleet/g1/share_extreme"] == 0.5 and "fleet/all/kl_k3" in d
    text = t.format()
    assert "g0" in text and "all" in text and text.count("\n") == 6


def test_table_reproduces_the_study_pattern_share_of_extremes_follows_kl_not_samples():
    # synthetic fleet: the FP8 group has 10% of samples but the largest mismatch; NVFP4 groups have 47%
    groups = seed_fleet()
    gen = torch.Generator().manual_seed(0)
    n = 200_000
    shares = torch.tensor([g.capacity for g in groups])
    gid = torch.multinomial(shares / shares.sum(), n, replacement=True, generator=gen)
    noise = torch.tensor([0.15, 0.15, 0.5, 0.05, 0.3, 0.05, 0.05, 0.05])[gid]
    lq = -torch.rand(n, generator=gen) * 2
    lp = lq + noise * torch.randn(n, generator=gen)
    t = fleet_table(groups, gid, lq, lp)
    rows = {r.name: r for r in t.rows}
    nvfp4 = rows["b200-nvfp4"].share_samples + rows["b300-nvfp4"].share_samples
    assert abs(nvfp4 - 0.47) < 0.01 and abs(rows["h100-fp8"].share_samples - 0.10) < 0.005
    assert rows["h100-fp8"].share_extreme > 3 * rows["h100-fp8"].share_samples
    assert rows["b200-nvfp4"].share_extreme + rows["b300-nvfp4"].share_extreme < nvfp4
    assert rows["h100-fp8"].kl_k3 == max(r.kl_k3 for r in t.rows)


def test_table_from_policy_loss_metrics_equals_table_from_arrays():
    torch.manual_seed(0)
    n, v = 300, 17
    logits = torch.randn(n, v) * 2
    tokens = torch.randint(0, v, (n,))
    lp = torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1)
    lq = (lp + torch.randn(n) * 0.8).clamp(max=0.0)
    gid = torch.randint(0, 3, (n,))
    mask = torch.rand(n) > 0.1
    out = op.policy_loss(logits, tokens, lq, torch.randn(n), loss_mask=mask, groups=gid)
    groups = groups_from([1, 2, 3])
    a = fleet_table(groups, gid, lq, lp, mask).to_dict()
    b = fleet_table(groups, metrics=out.metrics).to_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-6), (key, a[key], b[key])
    acc = FleetMetrics(groups)
    acc.update_from_metrics(out.metrics)
    acc.update(gid, lq, lp, mask)
    assert acc.table().total.tokens == 2 * int(mask.sum())


def _closed_form_slope(xs, ys):
    """``(n sum xy - sum x sum y) / (n sum x^2 - (sum x)^2)``: the least-squares slope, written apart from the
    centred form of offpolicy.fleet.table.kl_trend."""
    n = len(xs)
    return (n * sum(x * y for x, y in zip(xs, ys)) - sum(xs) * sum(ys)) / (n * sum(x * x for x in xs) - sum(xs) ** 2)


def test_kl_trend_over_steps_per_group():
    """Six steps: group 0's mismatch grows, group 1's stays, group 2 is absent at steps 1 and 4 (a gap, not a 0);
    a window of 4 keeps each group's last four steps with tokens. Slope, growth and steps against float64 values
    worked out here from the log-ratios, the arrays path against the metrics path, and the all row."""
    groups = groups_from([1, 1, 1])
    fm, fm_metrics = FleetMetrics(groups, trend_window=4), FleetMetrics(groups, trend_window=4)
    gen = torch.Generator().manual_seed(7)
    per_step = {0: [], 1: [], 2: []}
    all_steps = []
    for step in range(6):
        gid = torch.tensor([0] * 20 + [1] * 20 + ([] if step in (1, 4) else [2] * 20))
        scale = torch.tensor([0.05 * (1 + step)] * 20 + [0.2] * 20 + [0.1] * (gid.numel() - 40), dtype=torch.float64)
        lq = -torch.rand(gid.numel(), generator=gen, dtype=torch.float64) - 0.1
        lp = (lq + scale * torch.randn(gid.numel(), generator=gen, dtype=torch.float64)).clamp(max=0.0)
        fm.update(gid, lq, lp)
        k3 = [math.exp(a - b) - 1 - (a - b) for a, b in zip(lp.tolist(), lq.tolist())]
        for g in per_step:
            vals = [k for k, gg in zip(k3, gid.tolist()) if gg == g]
            if vals:
                per_step[g].append((step, sum(vals) / len(vals)))
        all_steps.append((step, sum(k3) / len(k3)))
        out = op.policy_loss_from_logprobs(lp, lq, torch.ones_like(lq), groups=gid)
        fm_metrics.update_from_metrics(out.metrics)
    table, other = fm.table(), fm_metrics.table()
    for row, row_m, g in zip(table.rows, other.rows, range(3)):
        pts = per_step[g][-4:]
        xs, ys = [float(x) for x, _ in pts], [y for _, y in pts]
        assert row.trend_steps == 4 and row_m.trend_steps == 4
        assert math.isclose(row.kl_k3_slope, _closed_form_slope(xs, ys), rel_tol=1e-9, abs_tol=1e-12), g
        assert math.isclose(row.kl_k3_growth, ys[-1] / ys[0], rel_tol=1e-9), g
        assert math.isclose(row_m.kl_k3_slope, row.kl_k3_slope, rel_tol=1e-6, abs_tol=1e-9), g
        assert math.isclose(row_m.kl_k3_growth, row.kl_k3_growth, rel_tol=1e-6), g
    assert [x for x, _ in per_step[2]] == [0, 2, 3, 5]  # the gaps are skipped, not zeros
    assert table.rows[0].kl_k3_slope > 0 and table.rows[0].kl_k3_growth > 1.5  # growing mismatch (k3 ~ scale^2: 4x in expectation)
    pts = all_steps[-4:]
    assert math.isclose(table.total.kl_k3_slope, _closed_form_slope([float(x) for x, _ in pts], [y for _, y in pts]),
                        rel_tol=1e-9, abs_tol=1e-12)
    d = table.to_dict()
    assert d["fleet/g0/kl_k3_slope"] == table.rows[0].kl_k3_slope and d["fleet/all/trend_steps"] == 4.0
    fm.reset()
    assert fm.table().rows[0].trend_steps == 0 and fm.table().rows[0].kl_k3_slope == 0.0
    one = FleetMetrics(groups)
    one.update(torch.tensor([0]), torch.tensor([-1.0]), torch.tensor([-1.0]))
    row = one.table().rows[0]
    assert (row.kl_k3_slope, row.kl_k3_growth, row.trend_steps) == (0.0, 0.0, 1)
    one.update(torch.tensor([0]), torch.tensor([-1.0]), torch.tensor([-1.5]))
    assert one.table().rows[0].kl_k3_growth == 0.0 and one.table().rows[0].kl_k3_slope > 0  # first k3 was 0
    for bad in (1, 0, 2.5, True, "3"):
        with pytest.raises(ValueError, match="trend_window"):
            FleetMetrics(groups, trend_window=bad)


def test_table_rejects_bad_inputs():
    groups = groups_from([1])
    fm = FleetMetrics(groups)
    with pytest.raises(ValueError, match="indices"):
        fm.update(torch.tensor([1]), torch.zeros(1), torch.zeros(1))
    with pytest.raises(ValueError, match="length N"):
        fm.update(torch.tensor([0, 0]), torch.zeros(1), torch.zeros(2))
    with pytest.raises(ValueError, match="NaN"):
        fm.update(torch.tensor([0]), torch.tensor([float("nan")]), torch.zeros(1))
    with pytest.raises(ValueError, match="groups="):
        fm.update_from_metrics({"kl_k1": torch.tensor(0.0)})
    with pytest.raises(ValueError, match="lack"):
        fm.update_from_metrics({"group/0/kl_k1": 0.0})
    fm.update(torch.tensor([0]), torch.tensor([float("-inf")]), torch.tensor([float("-inf")]))
    assert fm.table().rows[0].kl_k3 == 0.0


def test_docs_examples_run():
    # every python block of docs/fleet.md runs as written (they assert their own claims)
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "fleet.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/fleet.md#{i}", "exec"), {})
