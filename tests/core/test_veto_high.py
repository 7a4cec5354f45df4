"""The high side of the veto (docs/spec.md#veto): ``Correction(veto_high=H)`` drops a sequence any of whose trained
tokens has ``r > H``. Checked against the float64 reference and against a transcription of SkyRL's
``compute_outlier_token_mask`` (``outlier_token_is_threshold_high``)."""

from __future__ import annotations

import math

import pytest
import torch

import offpolicy as op
from offpolicy.reference import reference_metrics
from support.agreement import assert_matches_reference


def _skyrl_outlier_mask(old_log_probs, rollout_logprobs, loss_mask, low, high):
    """Transcribed from SkyRL (NovaSky-AI/SkyRL at a956457, skyrl/backends/skyrl_train/utils/
    off_policy_correction_utils.py, ``compute_outlier_token_mask``) on ``[B, T]`` rows: the ratio
    ``exp(clamp(old - rollout, -20, 20))`` (``safe_exp_delta``), a token over ``high`` or under ``low`` on the loss
    mask makes its row invalid; returns the ``[B, 1]`` float mask of valid rows."""
    token_tis_ratio = torch.exp((old_log_probs - rollout_logprobs).clamp(-20.0, 20.0))
    if high is not None:
        token_over_high = (token_tis_ratio > high) & (loss_mask > 0)
    else:
        token_over_high = torch.zeros_like(loss_mask, dtype=torch.bool)
    if low is not None:
        token_under_low = (token_tis_ratio < low) & (loss_mask > 0)
    else:
        token_under_low = torch.zeros_like(loss_mask, dtype=torch.bool)
    token_in_bounds = ~token_over_high & ~token_under_low
    return (token_in_bounds | (loss_mask == 0)).all(dim=-1, keepdim=True).float()


def _batch(seed: int, b: int = 6, t: int = 7, vocab: int = 9, spread: float = 0.5):
    g = torch.Generator().manual_seed(seed)
    n = b * t
    z = 2 * torch.randn(n, vocab, generator=g, dtype=torch.float64)
    y = torch.randint(0, vocab, (n,), generator=g)
    lq = torch.log_softmax(z + spread * torch.randn(n, vocab, generator=g, dtype=torch.float64), 1)[torch.arange(n), y]
    prox = (lq + spread * torch.randn(n, generator=g, dtype=torch.float64)).clamp(max=0.0)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.rand(n, generator=g) < 0.85
    seq = torch.arange(n) // t
    return z, y, lq, prox, adv, mask, seq, b, t


CORRECTIONS = [
    op.Correction(veto_high=1.8),
    op.Correction(veto_high=1.5, veto=0.5, weights="tis"),
    op.Correction(veto_high=2.0, ppo_clip=(0.2, 0.2), weights="mis", rejected_in_normalizer=False),
]


@pytest.mark.parametrize("corr", CORRECTIONS, ids=lambda c: f"{c.veto_high:g}-{c.surrogate.name}")
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("seed", range(3))
def test_veto_high_matches_the_reference(corr, aggregation, seed):
    z, y, lq, prox, adv, mask, seq, _, _ = _batch(seed)
    kw = dict(loss_mask=mask, correction=corr, seq_ids=seq,
              proximal_logprobs=prox if corr.tree.surrogate.needs_proximal else None)
    out = assert_matches_reference(z, y, lq, adv, aggregation=aggregation, **kw)
    ref = reference_metrics(z, y, lq, adv, **kw)
    key = "rejected_frac/veto_high"
    assert math.isclose(float(out.metrics[key]), ref[key], abs_tol=1e-14)
    assert 0 < ref[key] < 1 or seed != 0  # seed 0 drops some sequences, not all


@pytest.mark.parametrize("low, high", [(None, 1.3), (None, 1.6), (0.7, 1.4)])
@pytest.mark.parametrize("seed", [11, 13])
def test_it_keeps_the_sequences_skyrl_keeps(low, high, seed):
    """SkyRL's ratio is ``old / rollout``: offpolicy's ``proximal_logprobs=old``, ``sampler_logprobs=rollout``;
    ``outlier_token_is_threshold_high=H`` is ``veto_high=H`` and ``_low=L`` is ``veto=L``."""
    z, y, lq, prox, adv, mask, seq, b, t = _batch(seed, spread=0.25)
    kept = _skyrl_outlier_mask(prox.view(b, t), lq.view(b, t), mask.view(b, t).double(), low, high)
    out = op.policy_loss(z, y, lq, torch.ones_like(adv), loss_mask=mask, seq_ids=seq, proximal_logprobs=prox,
                         correction=op.Correction(veto_high=high, veto=low, ppo_clip=(0.2, 0.2)))
    has_tokens = mask.view(b, t).any(1)
    ours = (out.token_loss.view(b, t) != 0).any(1)
    assert (ours == (kept.squeeze(1).bool() & has_tokens)).all()
    assert not kept.bool().all() and kept.bool().any()  # the case drops some rows and keeps some


def test_bad_threshold_is_named():
    with pytest.raises(ValueError, match="Correction.veto_high must be a finite number > 1"):
        op.Correction(veto_high=0.9)
    with pytest.raises(ValueError, match="needs seq_ids"):
        z, y, lq, _, adv, _, _, _, _ = _batch(0)
        op.policy_loss(z, y, lq, adv, correction=op.Correction(veto_high=1.5))


def test_from_tree_round_trips():
    for corr in CORRECTIONS:
        assert op.Correction.from_tree(corr.tree) == corr
