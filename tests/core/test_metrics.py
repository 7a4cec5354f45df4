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


def test_groups_versions_and_sequences_on_untrained_rows_only_are_ignored():
    """Six tokens, three trained (t0-t2). Untrained rows hold a group (2), a version (9) and a sequence (2) that
    exist nowhere else, and garbage log-ratios; every key is worked out by hand over the trained tokens only:

    ====  ===  =====  =======  ======  ===========
    tok   seq  group  version  mask    log r
    ====  ===  =====  =======  ======  ===========
    t0    0    0      3        yes     -1/2
    t1    0    1      3        yes     0
    t2    1    1      2        yes     log 0.1 (extreme)
    t3    1    0      9        no      -9
    t4    2    0      9        no      -9
    t5    2    2      1        no      -9
    ====  ===  =====  =======  ======  ===========
    """
    log_r = torch.tensor([-0.5, 0.0, math.log(0.1), -9.0, -9.0, -9.0], dtype=torch.float64)
    lq = torch.full((6,), -1.0, dtype=torch.float64)
    out = op.policy_loss_from_logprobs(
        lq + log_r, lq, torch.ones(6, dtype=torch.float64), loss_mask=torch.tensor([True] * 3 + [False] * 3),
        seq_ids=torch.tensor([0, 0, 1, 1, 2, 2]), groups=torch.tensor([0, 1, 1, 0, 0, 2]),
        versions=torch.tensor([3, 3, 2, 9, 9, 1]))
    m = {k: float(v) for k, v in out.metrics.items()}
    assert {k.split("/")[1] for k in m if k.startswith("group/")} == {"0", "1"}
    # The newest *trained* version is 3: staleness 0 (t0, t1) and 1 (t2); nothing for versions 9 or 1.
    assert {k.split("/")[1] for k in m if k.startswith("staleness/")} == {"0", "1"}
    expected = {
        "num_tokens": 3.0, "kl_k1": (0.5 + math.log(10.0)) / 3, "extreme_ratio_frac": 1 / 3,
        "group/0/share_tokens": 1 / 3, "group/1/share_tokens": 2 / 3,
        # two sequences hold a trained token; group 0 trains in sequence 0 only, group 1 in both
        "group/0/share_samples": 1 / 2, "group/1/share_samples": 1.0,
        "group/0/share_extreme": 0.0, "group/1/share_extreme": 1.0,
        "group/0/kl_k1": 0.5, "group/1/kl_k1": math.log(10.0) / 2, "group/0/num_tokens": 1.0,
        "staleness/0/share_tokens": 2 / 3, "staleness/1/share_tokens": 1 / 3,
        "staleness/0/share_samples": 1 / 2, "staleness/1/share_samples": 1 / 2,
        "staleness/1/kl_k1": math.log(10.0), "staleness/1/share_extreme": 1.0,
        # sequence 2 has no trained token: rho of sequence 0 is e^-1/2, of sequence 1 0.1
        "seq_ratio_max": math.exp(-0.5), "seq_ratio_min": 0.1, "seq_ratio_mean": (math.exp(-0.5) + 0.1) / 2,
        "seq_log_ppl_diff_min": 0.25, "seq_log_ppl_diff_max": math.log(10.0),
    }
    for key, val in expected.items():
        assert m[key] == pytest.approx(val, rel=1e-12, abs=1e-15), key
    # An explicit current version moves the reference; untrained versions still make no keys.
    out = op.policy_loss_from_logprobs(
        lq + log_r, lq, torch.ones(6, dtype=torch.float64), loss_mask=torch.tensor([True] * 3 + [False] * 3),
        versions=torch.tensor([3, 3, 2, 9, 9, 1]), current_version=5)
    assert {k.split("/")[1] for k in out.metrics if k.startswith("staleness/")} == {"2", "3"}
    # Without seq_ids a sample is a token.
    assert float(out.metrics["staleness/2/share_samples"]) == pytest.approx(2 / 3, rel=1e-12)


def test_fully_untrained_batch_makes_no_group_or_staleness_keys():
    lq = torch.full((3,), -1.0, dtype=torch.float64)
    out = op.policy_loss_from_logprobs(lq, lq, torch.ones(3, dtype=torch.float64),
                                       loss_mask=torch.zeros(3, dtype=torch.bool), groups=torch.tensor([0, 1, 1]),
                                       versions=torch.tensor([1, 2, 3]), seq_ids=torch.tensor([0, 0, 1]))
    assert not [k for k in out.metrics if k.startswith(("group/", "staleness/"))]
    assert float(out.metrics["num_tokens"]) == 0.0 and float(out.metrics["seq_ratio_max"]) == 0.0
