"""Clip-Cov (docs/spec.md#clip-cov): ``Correction(clip_cov=(lb, ub), clip_cov_ratio=, clip_cov_eps=, clip_cov_seed=)``
takes PPO's clipped surrogate and zeroes it on tokens drawn with a seeded generator among the unclipped kept trained
tokens whose covariance of advantage and log-probability lies in ``(lb, ub)``. Checked against the float64 reference
and against a transcription of verl's ``compute_policy_loss_clip_cov`` whose ``randperm`` gets the same seeded
generator (tests/adapters/test_verl_cases.py checks the installed verl under ``torch.manual_seed``)."""

from __future__ import annotations

import math

import pytest
import torch

import offpolicy as op
from offpolicy.reference import reference_policy_loss


def _verl_clip_cov(old_log_prob, log_prob, advantages, response_mask, clip_cov_ratio=0.0002, clip_cov_lb=1.0,
                   clip_cov_ub=5.0, cliprange_low=0.2, cliprange_high=0.2, seed=0):
    """Transcribed from verl (verl/trainer/ppo/core_algos.py, ``compute_policy_loss_clip_cov``), the per-token loss
    matrix before ``agg_loss``: ``[B, T]`` inputs. The one change: ``torch.randperm`` gets a CPU generator seeded
    with ``seed`` (verl uses the global one)."""
    def masked_mean(x, m):
        return (x * m).sum() / m.sum()

    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    corr = torch.ones_like(advantages)
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_by_origin = (pg_losses2 > pg_losses1) & (response_mask > 0)
    cov_all = (advantages - masked_mean(advantages, response_mask)) * (
        log_prob - masked_mean(log_prob.detach(), response_mask))
    cov_all[response_mask == 0] = -torch.inf
    cov_all[clip_by_origin] = -torch.inf
    clip_num = max(int(clip_cov_ratio * response_mask.sum().item()), 1)
    top_k_idx = (cov_all < clip_cov_ub) & (cov_all > clip_cov_lb) & (response_mask > 0)
    top_k_idx = torch.nonzero(top_k_idx)
    if len(top_k_idx) > 0:
        perm = torch.randperm(len(top_k_idx), generator=torch.Generator().manual_seed(seed))
        top_k_idx = top_k_idx[perm[: min(clip_num, len(top_k_idx))]]
    else:
        top_k_idx = torch.empty((0, 2), device=cov_all.device, dtype=torch.long)
    corr[top_k_idx[:, 0], top_k_idx[:, 1]] = 0
    return torch.maximum(pg_losses1, pg_losses2) * corr


def _batch(seed: int, n: int = 48, vocab: int = 9, hostile: bool = False):
    g = torch.Generator().manual_seed(seed)
    z = 2 * torch.randn(n, vocab, generator=g, dtype=torch.float64)
    y = torch.randint(0, vocab, (n,), generator=g)
    lq = torch.log_softmax(z + 0.5 * torch.randn(n, vocab, generator=g, dtype=torch.float64), 1)[torch.arange(n), y]
    prox = (torch.log_softmax(z, 1)[torch.arange(n), y] + 0.3 * torch.randn(n, generator=g, dtype=torch.float64))
    adv = 2 * torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.rand(n, generator=g) < 0.9
    if hostile:
        z[2, y[2]] = -math.inf
        adv[5] = 0.0
    return z, y, lq, prox.clamp(max=0.0), adv, mask, torch.arange(n) // 6


CORRECTIONS = [
    op.Correction(clip_cov=(1.0, 5.0)),
    op.Correction(clip_cov=(0.05, 5.0), clip_cov_ratio=0.2, clip_cov_seed=7, weights="tis"),
    op.Correction(clip_cov=(-1.0, 3.0), clip_cov_ratio=0.1, clip_cov_eps=(0.1, 0.28), clip_cov_seed=3,
                  weights="mis", veto=0.02, rejected_in_normalizer=False),
]


def _dropped(corr, z, y, prox, adv, mask):
    """The tokens the node zeroes (its surrogate 0 where PPO's is not)."""
    lp = torch.log_softmax(z, 1)[torch.arange(z.shape[0]), y]
    sur = corr.tree.surrogate
    s = sur.fast(lp, prox, adv, None, 20.0, active=mask)
    u = torch.exp(lp - prox)
    ppo = torch.minimum(u * adv, u.clamp(1 - sur.eps_lo, 1 + sur.eps_hi) * adv)
    return (s == 0) & (ppo != 0)


@pytest.mark.parametrize("corr", CORRECTIONS, ids=lambda c: f"{c.clip_cov}-{c.clip_cov_ratio}-{c.weights}")
@pytest.mark.parametrize("seed", range(4))
def test_clip_cov_matches_the_reference(corr, seed):
    z, y, lq, prox, adv, mask, seq = _batch(seed, hostile=seed == 3)
    kw = dict(loss_mask=mask, correction=corr, seq_ids=seq, proximal_logprobs=prox)
    z1, z2 = z.clone().requires_grad_(), z.clone().requires_grad_()
    out = op.policy_loss(z1, y, lq, adv, **kw)
    loss, token_loss, w = reference_policy_loss(z2, y, lq, adv, **kw)
    out.loss.backward()
    loss.backward()
    torch.testing.assert_close(out.token_loss, token_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(out.loss.detach(), loss.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(z1.grad, z2.grad, rtol=1e-10, atol=1e-13)


def test_the_reference_reads_the_triple_form():
    """The reference spells verl's ``clip_cov=(ratio, lb, ub)`` itself (a mapping keeps the triple as given)."""
    z, y, lq, prox, adv, mask, seq = _batch(2)
    kw = dict(loss_mask=mask, seq_ids=seq, proximal_logprobs=prox)
    triple = reference_policy_loss(z, y, lq, adv, correction={"clip_cov": (0.2, 0.05, 5.0), "clip_cov_seed": 7}, **kw)
    pair = reference_policy_loss(z, y, lq, adv, correction={"clip_cov": (0.05, 5.0), "clip_cov_ratio": 0.2,
                                                            "clip_cov_seed": 7}, **kw)
    out = op.policy_loss(z, y, lq, adv, correction=op.Correction(clip_cov=(0.2, 0.05, 5.0), clip_cov_seed=7), **kw)
    torch.testing.assert_close(triple[1], pair[1], rtol=0, atol=0)
    torch.testing.assert_close(out.token_loss, triple[1], rtol=1e-12, atol=1e-14)
    assert not torch.equal(triple[1], reference_policy_loss(
        z, y, lq, adv, correction={"clip_cov": (0.05, 5.0), "clip_cov_seed": 7}, **kw)[1])  # the ratio is read


def test_the_draw_drops_tokens_and_follows_the_seed():
    """The cases above do drop tokens (the comparison is not vacuous), the number asked for, and another seed draws
    other tokens."""
    z, y, _, prox, adv, mask, _ = _batch(1)
    a = _dropped(op.Correction(clip_cov=(-9.0, 9.0), clip_cov_ratio=0.1, clip_cov_seed=7), z, y, prox, adv, mask)
    b = _dropped(op.Correction(clip_cov=(-9.0, 9.0), clip_cov_ratio=0.1, clip_cov_seed=8), z, y, prox, adv, mask)
    assert int(a.sum()) == int(b.sum()) == int(0.1 * int(mask.sum())) > 1
    assert not torch.equal(a, b)
    assert int(_dropped(CORRECTIONS[0], z, y, prox, adv, mask).sum()) == 1


@pytest.mark.parametrize("ratio, lb, ub, eps", [(0.0002, 1.0, 5.0, (0.2, 0.2)), (0.1, 0.05, 5.0, (0.2, 0.28)),
                                                (0.3, -0.5, 2.0, (0.1, 0.1))])
@pytest.mark.parametrize("seed", range(3))
def test_clip_cov_is_verl_clip_cov(ratio, lb, ub, eps, seed):
    """verl's per-token loss and gradient on ``[B, T]``, token for token, its ``randperm`` under the generator
    seeded with ``clip_cov_seed``: offpolicy with ``proximal_logprobs=old_log_prob`` (the sampler's
    log-probabilities equal to them, so the weights are 1) and ``aggregation="constant", constant_normalizer=1``."""
    g = torch.Generator().manual_seed(seed)
    b, t, vocab = 4, 8, 7
    z = torch.randn(b * t, vocab, generator=g, dtype=torch.float64)
    y = torch.randint(0, vocab, (b * t,), generator=g)
    old = (torch.log_softmax(z, 1)[torch.arange(b * t), y]
           + 0.3 * torch.randn(b * t, generator=g, dtype=torch.float64)).clamp(max=0.0)
    adv = 2 * torch.randn(b * t, generator=g, dtype=torch.float64)
    mask = torch.rand(b * t, generator=g) < 0.85
    z1, z2 = z.clone().requires_grad_(), z.clone().requires_grad_()
    lp = torch.log_softmax(z2, 1)[torch.arange(b * t), y]
    theirs = _verl_clip_cov(old.view(b, t), lp.view(b, t), adv.view(b, t), mask.view(b, t).double(), ratio, lb, ub,
                            *eps, seed=seed)
    (theirs * mask.view(b, t)).sum().backward()
    # verl's three knobs as one keyword, (clip_cov_ratio, clip_cov_lb, clip_cov_ub): the same correction as the pair
    corr = op.Correction(clip_cov=(ratio, lb, ub), clip_cov_eps=eps, clip_cov_seed=seed)
    assert corr == op.Correction(clip_cov=(lb, ub), clip_cov_ratio=ratio, clip_cov_eps=eps, clip_cov_seed=seed)
    out = op.policy_loss(z1, y, old, adv, loss_mask=mask, proximal_logprobs=old, aggregation="constant",
                         constant_normalizer=1.0, correction=corr)
    out.loss.backward()
    torch.testing.assert_close(out.token_loss, (theirs * mask.view(b, t)).detach().view(-1), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(z1.grad, z2.grad, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("kw, match", [
    (dict(clip_cov=(5.0, 1.0)), r"Correction.clip_cov must be .*ClipCov.ub must be a finite number > lb"),
    (dict(clip_cov=(math.nan, 1.0)), r"Correction.clip_cov must be .*ClipCov.lb must be a finite number"),
    (dict(clip_cov=(1.0,)), "Correction.clip_cov must be a pair of numbers"),
    (dict(clip_cov=(1.0, 2.0, 3.0, 4.0)), r"Correction.clip_cov must be a pair of numbers or \(ratio, lb, ub\)"),
    (dict(clip_cov=(0.1, 1.0, 5.0), clip_cov_ratio=0.2), "sets ratio and Correction.clip_cov_ratio=0.2 sets it too"),
    (dict(clip_cov=(0.0, 1.0, 5.0)), r"Correction.clip_cov_ratio must be in \(0, 1\]"),
    (dict(clip_cov=(1.0, 5.0), clip_cov_ratio=0.0), r"Correction.clip_cov_ratio must be in \(0, 1\]"),
    (dict(clip_cov=(1.0, 5.0), clip_cov_eps=(1.0, 0.2)), r"Correction.clip_cov_eps must be .*ClipCov.eps_lo must be in"),
    (dict(clip_cov=(1.0, 5.0), clip_cov_seed=-1), "Correction.clip_cov_seed must be an integer >= 0"),
    (dict(clip_cov=(1.0, 5.0), clip_cov_seed=1.5), "Correction.clip_cov_seed must be an integer"),
    (dict(clip_cov_seed=3), "clip_cov_seed=3 needs clip_cov"),
    (dict(clip_cov=(1.0, 5.0), kl_cov=(0.1, 1.0)), "exclude each other"),
])
def test_bad_keywords_are_named(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        op.Correction(**kw)


def test_it_needs_proximal_logprobs():
    z, y, lq, _, adv, mask, _ = _batch(0)
    with pytest.raises(ValueError, match="proximal_logprobs go together"):
        op.policy_loss(z, y, lq, adv, correction=op.Correction(clip_cov=(1.0, 5.0)))


def test_from_tree_round_trips():
    for corr in CORRECTIONS:
        assert op.Correction.from_tree(corr.tree).tree == corr.tree
        assert op.Correction.from_tree(corr.tree) == corr
