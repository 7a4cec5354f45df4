"""KL-Cov (docs/spec.md#kl-cov): ``Correction(kl_cov=(ratio, coef))`` takes the unclipped ratio surrogate ``u A`` and
subtracts ``coef |log u|`` on the kept trained tokens with the largest covariance of advantage and log-probability.
Checked against the float64 reference and against a transcription of verl's ``compute_policy_loss_kl_cov``."""

from __future__ import annotations

import math

import pytest
import torch

import offpolicy as op
from offpolicy.reference import reference_policy_loss


def _verl_kl_cov(old_log_prob, log_prob, advantages, response_mask, kl_cov_ratio=0.0002, ppo_kl_coef=1.0):
    """Transcribed from verl (verl/trainer/ppo/core_algos.py, ``compute_policy_loss_kl_cov``), the per-token loss
    matrix before ``agg_loss``: ``[B, T]`` inputs."""
    negative_approx_kl = log_prob - old_log_prob
    abs_kl = negative_approx_kl.abs()
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses_kl = -advantages * ratio + ppo_kl_coef * abs_kl
    pg_losses = pg_losses1
    all_valid = response_mask > 0
    all_valid_idx = torch.nonzero(all_valid.reshape(-1), as_tuple=True)[0]
    all_valid_adv = advantages[all_valid].detach().reshape(-1).cpu()
    all_valid_logp = log_prob[all_valid].detach().reshape(-1).cpu()
    k = min(kl_cov_ratio, len(all_valid_adv))
    if k != 0:
        cov_lst_all = (all_valid_adv - all_valid_adv.mean()) * (all_valid_logp - all_valid_logp.mean())
        k_percent_nums = max(1, int(len(cov_lst_all) * kl_cov_ratio))
        large_cov_idxs = torch.topk(cov_lst_all, k_percent_nums, largest=True).indices
        if len(large_cov_idxs) != 0:
            large_cov_idxs = all_valid_idx[large_cov_idxs]
            rows, cols = large_cov_idxs // advantages.shape[1], large_cov_idxs % advantages.shape[1]
            pg_losses[rows, cols] = pg_losses_kl[rows, cols]
    return pg_losses


def _batch(seed: int, n: int = 48, vocab: int = 9, hostile: bool = False):
    g = torch.Generator().manual_seed(seed)
    z = 2 * torch.randn(n, vocab, generator=g, dtype=torch.float64)
    y = torch.randint(0, vocab, (n,), generator=g)
    lq = torch.log_softmax(z + 0.5 * torch.randn(n, vocab, generator=g, dtype=torch.float64), 1)[torch.arange(n), y]
    prox = (lq + 0.2 * torch.randn(n, generator=g, dtype=torch.float64)).clamp(max=0.0)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.rand(n, generator=g) < 0.9
    if hostile:
        z[2, y[2]] = -math.inf
    return z, y, lq, prox, adv, mask, torch.arange(n) // 6


CORRECTIONS = [
    op.Correction(kl_cov=(0.0002, 1.0)),
    op.Correction(kl_cov=(0.2, 1.0), weights="tis"),
    op.Correction(kl_cov=(0.1, 0.5), weights="mis", veto=0.02, rejected_in_normalizer=False),
]


@pytest.mark.parametrize("corr", CORRECTIONS, ids=lambda c: f"{c.kl_cov}-{c.weights}")
@pytest.mark.parametrize("seed", range(4))
def test_kl_cov_matches_the_reference(corr, seed):
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


@pytest.mark.parametrize("ratio, coef", [(0.0002, 1.0), (0.1, 1.0), (0.25, 2.0)])
@pytest.mark.parametrize("seed", range(3))
def test_kl_cov_is_verl_kl_cov(ratio, coef, seed):
    """verl's per-token loss and gradient on ``[B, T]``, token for token: offpolicy with
    ``proximal_logprobs=old_log_prob`` (the sampler's log-probabilities equal to them, so the weights are 1) and
    ``aggregation="constant", constant_normalizer=1`` (the summed loss matrix)."""
    g = torch.Generator().manual_seed(seed)
    b, t, vocab = 4, 8, 7
    z = torch.randn(b * t, vocab, generator=g, dtype=torch.float64)
    y = torch.randint(0, vocab, (b * t,), generator=g)
    old = (torch.log_softmax(z, 1)[torch.arange(b * t), y]
           + 0.3 * torch.randn(b * t, generator=g, dtype=torch.float64)).clamp(max=0.0)
    adv = torch.randn(b * t, generator=g, dtype=torch.float64)
    mask = torch.rand(b * t, generator=g) < 0.85
    z1, z2 = z.clone().requires_grad_(), z.clone().requires_grad_()
    lp = torch.log_softmax(z2, 1)[torch.arange(b * t), y]
    theirs = _verl_kl_cov(old.view(b, t), lp.view(b, t), adv.view(b, t), mask.view(b, t).double(), ratio, coef)
    (theirs * mask.view(b, t)).sum().backward()
    out = op.policy_loss(z1, y, old, adv, loss_mask=mask, proximal_logprobs=old, aggregation="constant",
                         constant_normalizer=1.0, correction=op.Correction(kl_cov=(ratio, coef)))
    out.loss.backward()
    torch.testing.assert_close(out.token_loss, (theirs * mask.view(b, t)).detach().view(-1), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(z1.grad, z2.grad, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("kw, match", [
    (dict(kl_cov=(0.0, 1.0)), "Correction.kl_cov must be"),
    (dict(kl_cov=(0.1, -1.0)), "Correction.kl_cov must be"),
    (dict(kl_cov=(0.1,)), "Correction.kl_cov must be a pair of numbers"),
    (dict(kl_cov=(0.1, 1.0), topr=(1.0, 1.0)), "exclude each other"),
])
def test_bad_keywords_are_named(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        op.Correction(**kw)


def test_it_needs_proximal_logprobs():
    z, y, lq, _, adv, mask, _ = _batch(0)
    with pytest.raises(ValueError, match="proximal_logprobs go together"):
        op.policy_loss(z, y, lq, adv, correction=op.Correction(kl_cov=(0.1, 1.0)))


def test_from_tree_round_trips():
    for corr in CORRECTIONS:
        assert op.Correction.from_tree(corr.tree).tree == corr.tree
