"""Per-turn (segment) importance sampling, ROLL's ``"segment"`` granularity: ``Correction(level="segment")`` with a
``segment_ids`` input. Checked against the independent float64 reference (weights, loss, gradient, metrics) on
random multi-turn batches, and for its errors (ROLL's own convention: tests/core/test_migrating_peers.py,
``test_roll_segment_is_weight``)."""

from __future__ import annotations

import math

import pytest
import torch

import offpolicy as op
from offpolicy.corrections import SegmentLevel
from offpolicy.reference import reference_metrics, reference_policy_loss
from offpolicy.testing import LossConfig


def _batch(seed: int, n_seq: int = 3, turns: int = 3, turn_len: int = 4, vocab: int = 9, hostile: bool = False):
    """``n_seq`` trajectories of ``turns`` assistant turns separated by untrained observation tokens, flattened."""
    g = torch.Generator().manual_seed(seed)
    seq, segm, mask = [], [], []
    for s in range(n_seq):
        for k in range(turns):
            length = int(torch.randint(1, turn_len + 1, (1,), generator=g))
            seq += [s] * (length + 2)
            segm += [k] * length + [k, k]
            mask += [True] * length + [False, False]  # two observation tokens after each turn
    n = len(seq)
    z = 2 * torch.randn(n, vocab, generator=g, dtype=torch.float64)
    y = torch.randint(0, vocab, (n,), generator=g)
    zq = z + torch.randn(n, vocab, generator=g, dtype=torch.float64)
    lq = torch.log_softmax(zq, 1)[torch.arange(n), y]
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    if hostile:
        z[0, y[0]] = -math.inf  # a trained token the trainer finds impossible
    # Shuffle the flat order: a turn is a (sequence, segment) pair, not a run of neighbours.
    perm = torch.randperm(n, generator=g)
    return (z[perm], y[perm], lq[perm], adv[perm], torch.tensor(seq)[perm], torch.tensor(segm)[perm],
            torch.tensor(mask)[perm])


CORRECTIONS = [
    op.Correction(weights="tis", level="segment"),
    op.Correction(weights="tis", level="segment", bounds=(0.5, 1.5)),
    op.Correction(weights="mis", level="segment", bounds=(0.3, 3.0)),
    op.Correction(weights="reject", level="segment", bounds=(0.4, 2.5), rejected_in_normalizer=False),
    op.Correction(weights="mis", level="segment", bounds=(0.3, 3.0), veto=0.05,
                  rejections=(op.RatioRejection(0.2, 5.0),)),
    op.Correction(weights="tis", level="segment", ppo_clip=(0.2, 0.28)),
]


@pytest.mark.parametrize("corr", CORRECTIONS, ids=lambda c: f"{c.weights}-{len(c.tree.rejections)}-{c.surrogate.name}")
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("seed", range(4))
def test_segment_level_matches_the_reference(corr, aggregation, seed):
    z, y, lq, adv, seq, segm, mask = _batch(seed, hostile=seed == 3)
    prox = None
    if corr.tree.surrogate.needs_proximal:
        prox = lq + 0.1 * torch.randn(lq.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        prox = prox.clamp(max=0.0)
    kw = dict(loss_mask=mask, correction=corr, seq_ids=seq, aggregation=aggregation, proximal_logprobs=prox)
    z1, z2 = z.clone().requires_grad_(), z.clone().requires_grad_()
    out = op.policy_loss(z1, y, lq, adv, segment_ids=segm, **kw)
    loss, token_loss, w = reference_policy_loss(z2, y, lq, adv, segment_ids=segm, **kw)
    out.loss.backward()
    loss.backward()
    torch.testing.assert_close(out.token_weight, w, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(out.loss.detach(), loss.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(z1.grad, z2.grad, rtol=1e-10, atol=1e-13)
    ref = reference_metrics(z, y, lq, adv, segment_ids=segm, **{k: v for k, v in kw.items() if k != "aggregation"})
    for key in ("weight_mean", "weight_max", "weight_before_bound_mean", "ratio_below_lower_frac",
                "ratio_above_upper_frac", "ess", "seq_ess"):
        assert math.isclose(float(out.metrics[key]), ref[key], rel_tol=1e-10, abs_tol=1e-12), key


def test_each_turn_gets_its_own_geometric_mean():
    """Two trajectories, two turns each; the weight of every token is exp(mean of its turn's log r), turn k of
    one trajectory independent of turn k of the other, untrained tokens taking no part."""
    z, y, lq, adv, seq, segm, mask = _batch(7, n_seq=2, turns=2)
    out = op.policy_loss(z, y, lq, adv, loss_mask=mask, seq_ids=seq, segment_ids=segm,
                         correction=op.Correction(weights="tis", level="segment", bounds=(0.0, 1e6)))
    log_r = torch.log_softmax(z, 1)[torch.arange(len(y)), y] - lq
    for s in (0, 1):
        for k in (0, 1):
            turn = (seq == s) & (segm == k) & mask
            want = torch.exp(log_r[turn].mean())
            torch.testing.assert_close(out.token_weight[turn], want.expand(int(turn.sum())), rtol=1e-13, atol=0)


def test_segment_level_errors_name_the_argument():
    z, y, lq, adv, seq, segm, mask = _batch(1)
    corr = op.Correction(weights="tis", level="segment")
    assert isinstance(corr.tree.weighting.level, SegmentLevel) and not corr.needs_sequences
    with pytest.raises(ValueError, match="level='segment'\\) and segment_ids go together"):
        op.policy_loss(z, y, lq, adv, loss_mask=mask, correction=corr)
    with pytest.raises(ValueError, match="segment_ids go together"):
        op.policy_loss(z, y, lq, adv, loss_mask=mask, segment_ids=segm, correction=op.Correction(weights="tis"))
    with pytest.raises((ValueError, TypeError), match="segment_ids"):
        op.policy_loss(z, y, lq, adv, loss_mask=mask, segment_ids=segm.double(), correction=corr)
    with pytest.raises(ValueError, match="segment_ids"):
        op.policy_loss(z, y, lq, adv, loss_mask=mask, segment_ids=segm[:-1], correction=corr)
    with pytest.raises(ValueError, match="needs weights="):
        op.Correction(level="segment")
    with pytest.raises(ValueError, match="token-level weights only"):
        op.Correction(weights="mis", level="segment", score_centering=True)
    with pytest.raises(ValueError, match="no segment_ids"):
        LossConfig(weights="mis", level="segment")
    # Without seq_ids a turn is one segment id.
    out = op.policy_loss(z, y, lq, adv, loss_mask=mask, segment_ids=seq * 10 + segm, correction=corr)
    ref = op.policy_loss(z, y, lq, adv, loss_mask=mask, seq_ids=seq, segment_ids=segm, correction=corr)
    torch.testing.assert_close(out.token_weight, ref.token_weight, rtol=0, atol=0)
