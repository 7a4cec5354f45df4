"""M2PO's second-moment mask (docs/spec.md#m2po): ``Correction(m2po=tau)`` drops the trained tokens with the largest
``(log r)^2`` until the rest's mean is below ``tau``. Checked against the float64 reference (loss, weights,
gradient, metric) and against a transcription of AReaL's ``_apply_m2po_masking`` / ``_get_m2po_loss_mask``."""

from __future__ import annotations

import math

import pytest
import torch

import offpolicy as op
from offpolicy.reference import reference_metrics
from support.agreement import assert_matches_reference


def _areal_m2po_mask(old_logp: torch.Tensor, prox_logp: torch.Tensor, loss_mask: torch.Tensor,
                     m2_threshold: float) -> torch.Tensor:
    """Transcribed from AReaL (areal/trainer/ppo/actor.py, ``_apply_m2po_masking`` and ``_get_m2po_loss_mask``):
    sort the trained tokens' ``(old - prox)^2`` descending, find the first index whose suffix mean is below the
    threshold, mask everything before it (all but one when none is)."""
    delta = old_logp - prox_logp
    m2 = delta * delta
    mask_flat = loss_mask.view(-1)
    m2_selected = m2.view(-1)[mask_flat]
    if m2_selected.numel() == 0:
        return loss_mask
    sorted_m2, indices = torch.sort(m2_selected, descending=True)
    restored_indices = torch.argsort(indices)
    n = sorted_m2.numel()
    suffix_sums = sorted_m2.flip(0).cumsum(0).flip(0)
    counts = torch.arange(n, 0, -1, dtype=sorted_m2.dtype)
    below = torch.where(suffix_sums / counts < m2_threshold)[0]
    num_to_mask = below[0].item() if len(below) > 0 else n - 1
    sorted_mask = torch.ones_like(sorted_m2, dtype=torch.bool)
    if num_to_mask > 0:
        sorted_mask[:num_to_mask] = False
    full = torch.zeros_like(mask_flat, dtype=torch.bool)
    full[mask_flat] = sorted_mask[restored_indices]
    return full.view_as(loss_mask)


def _batch(seed: int, n: int = 40, vocab: int = 9, spread: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    z = 2 * torch.randn(n, vocab, generator=g, dtype=torch.float64)
    y = torch.randint(0, vocab, (n,), generator=g)
    lq = torch.log_softmax(z + spread * torch.randn(n, vocab, generator=g, dtype=torch.float64), 1)[torch.arange(n), y]
    prox = (lq + spread * torch.randn(n, generator=g, dtype=torch.float64)).clamp(max=0.0)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.rand(n, generator=g) < 0.9
    seq = torch.arange(n) // 5
    return z, y, lq, prox, adv, mask, seq


CORRECTIONS = [
    op.Correction(m2po=0.04, ppo_clip=(0.2, 0.2)),
    op.Correction(m2po=0.01, ppo_clip=(0.2, 0.28), weights="tis"),
    op.Correction(m2po=0.04, cispo=(0.0, 2.0), rejected_in_normalizer=False),
    op.Correction(m2po=1e-5, ppo_clip=(0.2, 0.2), veto=0.01),
    op.Correction(m2po=100.0, ppo_clip=(0.2, 0.2)),
]


@pytest.mark.parametrize("corr", CORRECTIONS, ids=lambda c: f"{c.m2po:g}-{c.surrogate.name}-{len(c.tree.rejections)}")
@pytest.mark.parametrize("seed", range(4))
def test_m2po_matches_the_reference(corr, seed):
    z, y, lq, prox, adv, mask, seq = _batch(seed)
    kw = dict(loss_mask=mask, correction=corr, seq_ids=seq, proximal_logprobs=prox)
    out = assert_matches_reference(z, y, lq, adv, **kw)
    ref = reference_metrics(z, y, lq, adv, **kw)
    assert math.isclose(float(out.metrics["rejected_frac/m2po"]), ref["rejected_frac/m2po"], abs_tol=1e-14)


@pytest.mark.parametrize("tau", [1e-4, 0.01, 0.04, 0.2, 10.0])
@pytest.mark.parametrize("seed", range(3))
def test_m2po_masks_what_areal_masks(tau, seed):
    """The tokens M2PO keeps are AReaL's kept tokens (its ``old_logp`` is the sampler's, its ``prox_logp`` the
    proximal policy's); the loss keeps the original token denominator (the dropped tokens stay in token_mean's
    count, as in AReaL's ``n_tokens``)."""
    z, y, lq, prox, adv, mask, _ = _batch(seed, n=60, spread=0.4)
    areal_keep = _areal_m2po_mask(lq, prox, mask, tau)
    out = op.policy_loss(z, y, lq, torch.ones_like(adv), loss_mask=mask, proximal_logprobs=prox,
                         correction=op.Correction(m2po=tau, ppo_clip=(0.2, 0.2)))
    assert ((out.token_loss != 0) == areal_keep).all()
    kept = areal_keep.sum()
    assert math.isclose(float(out.metrics["rejected_frac/m2po"]), 1 - float(kept) / float(mask.sum()), abs_tol=1e-12)
    # After the mask, the kept tokens' second moment is below tau (or one token is left).
    m2 = ((prox - lq)[areal_keep] ** 2).mean()
    assert float(m2) < tau or int(kept) == 1


def test_without_a_proximal_policy_it_reads_the_current_ratio():
    z, y, lq, _, adv, mask, _ = _batch(0)
    out = op.policy_loss(z, y, lq, adv, loss_mask=mask, correction=op.Correction(m2po=0.04))
    lp = torch.log_softmax(z, 1)[torch.arange(z.shape[0]), y]
    keep = _areal_m2po_mask(lq, lp, mask, 0.04)
    assert ((out.token_weight != 0) == keep).all()


@pytest.mark.parametrize("kw, match", [
    (dict(m2po=0.0), "Correction.m2po must be a finite number > 0"),
    (dict(m2po=math.inf), "Correction.m2po must be a finite number > 0"),
    (dict(m2po="0.04"), "Correction.m2po must be a number"),
])
def test_bad_keywords_are_named(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        op.Correction(**kw)


def test_from_tree_round_trips():
    for corr in CORRECTIONS:
        assert op.Correction.from_tree(corr.tree) == corr
