"""Every metric key against the float64 reference, overall, per group and per staleness."""

from __future__ import annotations

import math

import pytest
import torch

import offpolicy as op
from offpolicy.reference import reference_metrics, reference_policy_loss

from support.batches import make_batch


@pytest.mark.parametrize("corr", [op.Correction(), op.Correction(weights="mis", bounds=(0.7, 1.4)),
                                  op.Correction(weights="tis", bounds=1.2)])
def test_metrics_match_reference(corr):
    z, y, lq, cands = make_batch(40, 30, 4, "head", seed=7, mismatch=1.5)
    mask = torch.rand(40, generator=torch.Generator().manual_seed(0)) > 0.3
    adv = torch.randn(40, generator=torch.Generator().manual_seed(1))
    out = op.policy_loss(z, y, lq, adv, cands, mask, correction=corr)
    _, _, w = reference_policy_loss(z, y, lq, adv, cands, mask, correction=corr)
    ref = reference_metrics(z, y, lq, adv, cands, mask, correction=corr)
    assert set(ref) == set(out.metrics)
    for key, val in ref.items():
        assert math.isclose(float(out.metrics[key]), val, rel_tol=1e-9, abs_tol=1e-12), key
    assert float(out.metrics["num_tokens"]) == int(mask.sum())
    assert math.isclose(float(out.metrics["weight_max"]), float(w[mask].max()), rel_tol=1e-12)


def test_group_and_staleness_metrics():
    z, y, lq, cands = make_batch(40, 30, 4, "head", seed=8, mismatch=2.0)
    groups = torch.arange(40) % 3
    versions = torch.tensor([5, 4, 3, 5] * 10)
    seq = torch.arange(40) // 4
    out = op.policy_loss(z, y, lq, torch.randn(40), cands, groups=groups, versions=versions, seq_ids=seq)
    m = out.metrics
    shares = [float(m[f"group/{g}/share_tokens"]) for g in range(3)]
    assert math.isclose(sum(shares), 1.0) and math.isclose(shares[0], 14 / 40)
    extreme = [float(m[f"group/{g}/share_extreme"]) for g in range(3)]
    assert float(m["extreme_ratio_frac"]) > 0 and math.isclose(sum(extreme), 1.0)
    # Every sequence (4 consecutive tokens) holds a token of each of the 3 groups: each group touches all 10.
    assert [float(m[f"group/{g}/share_samples"]) for g in range(3)] == [1.0, 1.0, 1.0]
    for g in range(3):
        sel = groups == g
        k3 = (torch.expm1(out.log_ratio[sel]) - out.log_ratio[sel]).mean()
        assert math.isclose(float(m[f"group/{g}/kl_k3"]), float(k3), rel_tol=1e-9)
    assert math.isclose(float(m["staleness/0/share_tokens"]), 0.5)
    assert math.isclose(float(m["staleness/2/share_tokens"]), 0.25)
