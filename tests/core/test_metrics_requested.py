"""The metrics users asked for (issue 26): both KL directions, the pre-clamp weight's max, masked shares by
advantage sign, the per-sequence ESS and staleness split in flight / in queue, against the float64 reference
(``offpolicy.reference.reference_metrics``) and against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

import offpolicy as op
from offpolicy.reference import reference_metrics

from support.batches import make_batch

NEW = ("kl_sampler_trainer", "kl_trainer_sampler", "kl_trainer_sampler_k1", "weight_before_bound_max",
       "masked_share_pos_adv", "masked_share_neg_adv")


@pytest.mark.parametrize("corr", [
    op.Correction(weights="mis", bounds=(0.7, 1.4)),
    op.Correction(weights="tis", bounds=1.2, level="sequence"),
    op.Correction(weights="mis", bounds=(0.8, 1.25), level="geometric", opsm_delta=0.05),
    op.Correction(weights="tis", bounds=(0.5, 2.0), batch_normalize=True),
])
def test_requested_metrics_match_reference(corr):
    n = 37
    z, y, lq, cands = make_batch(n, 30, 4, "head", seed=11, mismatch=1.5)
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(n, generator=g) > 0.25
    adv = torch.randn(n, generator=g)
    adv[::5] = 0.0
    seq = torch.arange(n) // 5
    versions = torch.randint(3, 7, (n,), generator=g)
    out = op.policy_loss(z, y, lq, adv, cands, mask, correction=corr, seq_ids=seq, versions=versions,
                         current_version=8)
    ref = reference_metrics(z, y, lq, adv, cands, mask, correction=corr, seq_ids=seq, versions=versions,
                            current_version=8)
    assert set(ref) == set(out.metrics)
    assert set(NEW) | {"staleness_in_flight", "staleness_in_queue"} <= set(ref)
    assert ("seq_ess" in ref) == corr.sequence_level
    for key, val in ref.items():
        assert math.isclose(float(out.metrics[key]), val, rel_tol=1e-9, abs_tol=1e-12), key


def test_requested_metrics_by_hand():
    """Four trained tokens in two sequences, MIS at [0.5, 2]; sequence 0 finished under version 4, sequence 1
    under 5; the trainer is at 7.

    ===  ===  =======  ======  =====  ======
    tok  seq  version  log r   A      w
    ===  ===  =======  ======  =====  ======
    t0   0    3        0       +1     1
    t1   0    4        log 4   +1     0 (masked)
    t2   1    5        log 4   -1     0 (masked)
    t3   1    5        log .8  +2     0.8
    ===  ===  =======  ======  =====  ======
    """
    log_r = torch.tensor([0.0, math.log(4.0), math.log(4.0), math.log(0.8)], dtype=torch.float64)
    lq = torch.full((4,), -2.0, dtype=torch.float64)
    out = op.policy_loss_from_logprobs(
        lq + log_r, lq, torch.tensor([1.0, 1.0, -1.0, 2.0], dtype=torch.float64),
        correction=op.Correction(weights="mis", bounds=(0.5, 2.0)), seq_ids=torch.tensor([0, 0, 1, 1]),
        versions=torch.tensor([3, 4, 5, 5]), current_version=7)
    m = {k: float(v) for k, v in out.metrics.items()}
    r = [1.0, 4.0, 4.0, 0.8]
    expected = {
        "kl_sampler_trainer": sum(x - 1 - math.log(x) for x in r) / 4,
        "kl_trainer_sampler": sum(x * math.log(x) - x + 1 for x in r) / 4,
        "kl_trainer_sampler_k1": sum(x * math.log(x) for x in r) / 4,
        "weight_before_bound_max": 4.0, "weight_max": 1.0,
        "masked_share_pos_adv": 1 / 3, "masked_share_neg_adv": 1.0,
        # in flight: (4-3, 0, 0, 0); in queue: 7 - 4 twice, 7 - 5 twice.
        "staleness_in_flight": 0.25, "staleness_in_queue": 2.5,
    }
    for key, val in expected.items():
        assert math.isclose(m[key], val, rel_tol=1e-12, abs_tol=1e-15), key
    assert m["kl_sampler_trainer"] == m["kl_k3"]


def test_requested_metrics_hostile():
    """All masked: every new key is 0 (never NaN). A ratio at the clamp (log r = +-1e4): finite values."""
    lq = torch.full((3,), -1.0, dtype=torch.float64)
    kw = dict(seq_ids=torch.tensor([0, 0, 1]), versions=torch.tensor([1, 2, 3]))
    out = op.policy_loss_from_logprobs(lq, lq, torch.ones(3, dtype=torch.float64),
                                       loss_mask=torch.zeros(3, dtype=torch.bool), **kw)
    for key in NEW + ("staleness_in_flight", "staleness_in_queue"):
        assert float(out.metrics.get(key, 0.0)) == 0.0, key
    lp = torch.tensor([-1e4, -1.0, -1e-9], dtype=torch.float64)
    lq2 = torch.tensor([-1.0, -1.0, -1e4], dtype=torch.float64)
    out = op.policy_loss_from_logprobs(lp, lq2, torch.tensor([1.0, -1.0, 1.0], dtype=torch.float64),
                                       correction=op.Correction(weights="tis", bounds=2.0), **kw)
    for key in NEW + ("staleness_in_flight", "staleness_in_queue"):
        assert math.isfinite(float(out.metrics[key])), key
    # One token r = e^20 (clamped at max_log_ratio) dominates the reverse KL: r log r / 3.
    assert math.isclose(float(out.metrics["kl_trainer_sampler_k1"]), (math.exp(20) * 20 - math.exp(-20) * 20) / 3,
                        rel_tol=1e-9)
    assert math.isclose(float(out.metrics["weight_before_bound_max"]), math.exp(20), rel_tol=1e-12)


def test_seq_ess_equal_and_one_hot_weights():
    """Sequence-level TIS: equal sequence weights give seq_ess 1; one live sequence of four gives 1/4."""
    lq = torch.full((8,), -8.0, dtype=torch.float64)
    seq = torch.arange(8) // 2
    corr = op.Correction(weights="mis", bounds=(0.5, 2.0), level="sequence")
    out = op.policy_loss_from_logprobs(lq, lq, torch.ones(8, dtype=torch.float64), correction=corr, seq_ids=seq)
    assert math.isclose(float(out.metrics["seq_ess"]), 1.0, rel_tol=1e-12)
    lp = lq + torch.tensor([0.0, 0.0] + [3.0] * 6, dtype=torch.float64)
    out = op.policy_loss_from_logprobs(lp, lq, torch.ones(8, dtype=torch.float64), correction=corr, seq_ids=seq)
    assert math.isclose(float(out.metrics["seq_ess"]), 0.25, rel_tol=1e-12)
