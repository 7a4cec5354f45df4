"""The route-flip rejection (docs/spec.md#route-flip-rejection): ``Correction(max_route_flips=k)`` rejects trained
tokens whose ``route_flips`` input (MoE layers where the sampler's top-k expert set differs from the trainer's)
exceeds ``k``; ``RouteFlipRejection(k, "sequence")`` in ``rejections=`` rejects their whole sequences. Checked
against the float64 reference (loss, weights, gradient, the rule's metric); no peer has this rule."""

from __future__ import annotations

import math

import pytest
import torch

import offpolicy as op
from offpolicy.corrections import RouteFlipRejection
from offpolicy.reference import reference_metrics
from support.agreement import assert_matches_reference


def _batch(seed: int, n_seq: int = 5, vocab: int = 11, hostile: bool = False):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 7, (n_seq,), generator=g)
    seq = torch.repeat_interleave(torch.arange(n_seq), lengths)
    n = int(lengths.sum())
    z = 2 * torch.randn(n, vocab, generator=g, dtype=torch.float64)
    y = torch.randint(0, vocab, (n,), generator=g)
    lq = torch.log_softmax(z + torch.randn(n, vocab, generator=g, dtype=torch.float64), 1)[torch.arange(n), y]
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.rand(n, generator=g) < 0.85
    flips = torch.randint(0, 4, (n,), generator=g) * (torch.rand(n, generator=g) < 0.4)
    flips[~mask] = -5  # untrained rows may hold anything (padding)
    if hostile:
        z[0, y[0]] = -math.inf
    perm = torch.randperm(n, generator=g)
    return z[perm], y[perm], lq[perm], adv[perm], seq[perm], mask[perm], flips[perm]


CORRECTIONS = [
    op.Correction(max_route_flips=0),
    op.Correction(weights="mis", max_route_flips=2, veto=0.05),
    op.Correction(weights="tis", rejections=(RouteFlipRejection(1, "sequence"),)),
    op.Correction(weights="reject", bounds=(0.3, 3.0), max_route_flips=1, max_staleness=3,
                  rejected_in_normalizer=False),
    op.Correction(weights="tis", ppo_clip=(0.2, 0.28), max_route_flips=0,
                  rejections=(RouteFlipRejection(2, "sequence"),)),
]


@pytest.mark.parametrize("corr", CORRECTIONS, ids=lambda c: "-".join(c.tree.rule_names) + f"-{c.surrogate.name}")
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("seed", range(4))
def test_route_flip_rejection_matches_the_reference(corr, aggregation, seed):
    z, y, lq, adv, seq, mask, flips = _batch(seed, hostile=seed == 3)
    prox = None
    if corr.tree.surrogate.needs_proximal:
        prox = (lq + 0.1 * torch.randn(lq.shape, generator=torch.Generator().manual_seed(seed),
                                       dtype=torch.float64)).clamp(max=0.0)
    kw = dict(loss_mask=mask, correction=corr, seq_ids=seq, proximal_logprobs=prox, route_flips=flips,
              versions=torch.full_like(seq, 7), current_version=8)
    out = assert_matches_reference(z, y, lq, adv, aggregation=aggregation, **kw)
    ref = reference_metrics(z, y, lq, adv, **kw)
    for key in [k for k in ref if k.startswith("rejected_frac")]:
        assert math.isclose(float(out.metrics[key]), ref[key], rel_tol=1e-12, abs_tol=1e-14), key


def test_the_token_level_drops_only_the_flipped_tokens():
    z = torch.zeros(4, 3, dtype=torch.float64)
    y = torch.zeros(4, dtype=torch.long)
    lq = torch.log_softmax(z, 1)[:, 0]
    out = op.policy_loss(z, y, lq, torch.ones(4, dtype=torch.float64), route_flips=torch.tensor([0, 1, 2, 3]),
                         correction=op.Correction(max_route_flips=1))
    assert (out.token_loss != 0).tolist() == [True, True, False, False]
    assert float(out.metrics["rejected_frac/route_flips"]) == 0.5


def test_errors_name_the_input_and_keyword():
    z = torch.zeros(2, 3, dtype=torch.float64)
    y = torch.zeros(2, dtype=torch.long)
    lq = torch.log_softmax(z, 1)[:, 0]
    one = torch.ones(2, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"RouteFlipRejection \(Correction.max_route_flips\) needs the route_flips"):
        op.policy_loss(z, y, lq, one, correction=op.Correction(max_route_flips=1))
    with pytest.raises(ValueError, match="route_flips: a negative count"):
        op.policy_loss(z, y, lq, one, route_flips=torch.tensor([-1, 0]), correction=op.Correction(max_route_flips=1))
    with pytest.raises(ValueError, match="Correction.max_route_flips must be an int >= 0"):
        op.Correction(max_route_flips=-1)
    with pytest.raises(TypeError, match="Correction.max_route_flips must be an integer"):
        op.Correction(max_route_flips=0.5)


def test_from_tree_round_trips():
    for corr in CORRECTIONS:
        assert op.Correction.from_tree(corr.tree) == corr


def test_route_flips_reach_the_metrics_per_group_and_the_fleet_table():
    """``route_flips`` given to policy_loss puts the route-agreement keys in ``out.metrics`` over the trained tokens
    (a literal count here), overall and per group, and FleetMetrics reads them."""
    from offpolicy.fleet import FleetMetrics, SamplerGroup

    gen = torch.Generator().manual_seed(3)
    n, v = 12, 9
    logits = torch.randn(n, v, generator=gen, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, v, (n,), generator=gen)
    lq = torch.log_softmax(torch.randn(n, v, generator=gen, dtype=torch.float64), -1)[torch.arange(n), tokens]
    flips = torch.tensor([0, 1, 0, 2, 0, 0, 3, 0, 0, 1, 0, 0])
    groups = torch.tensor([0, 1] * 6)
    mask = torch.ones(n, dtype=torch.bool)
    mask[3] = False
    out = op.policy_loss(logits, tokens, lq, torch.randn(n, generator=gen, dtype=torch.float64), loss_mask=mask,
                         route_flips=flips, groups=groups)
    m = out.metrics
    kept = [i for i in range(n) if mask[i]]
    assert float(m["route_tokens"]) == len(kept)
    assert float(m["route_flip_layers_mean"]) == pytest.approx(sum(int(flips[i]) for i in kept) / len(kept))
    assert float(m["route_any_flip_frac"]) == pytest.approx(sum(int(flips[i]) > 0 for i in kept) / len(kept))
    for g in (0, 1):
        mine = [i for i in kept if int(groups[i]) == g]
        assert float(m[f"group/{g}/route_tokens"]) == len(mine)
        assert float(m[f"group/{g}/route_flip_layers_mean"]) == pytest.approx(
            sum(int(flips[i]) for i in mine) / len(mine))
        assert float(m[f"group/{g}/route_any_flip_frac"]) == pytest.approx(
            sum(int(flips[i]) > 0 for i in mine) / len(mine))
    assert not any("route" in k for k in op.policy_loss(
        logits, tokens, lq, torch.ones(n, dtype=torch.float64), groups=groups).metrics)
    fleet = FleetMetrics([SamplerGroup("a", "h100", "bf16", "bf16", 1.0), SamplerGroup("b", "b200", "nvfp4", "bf16", 1.0)])
    fleet.update_from_metrics(m)
    rows = {r.name: r for r in fleet.table().rows}
    assert rows["a"].route_flip_layers_mean == pytest.approx(0.5)
    assert rows["b"].route_any_flip_frac == pytest.approx(0.4)
