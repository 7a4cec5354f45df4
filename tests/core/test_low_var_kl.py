"""slime's / verl's ``low_var_kl`` KL estimator (docs/spec.md#kl-penalty): ``KLPenalty(coef, "low_var_kl")`` is ``k3``
clamped to ``[-10, 10]``, the clamp applied after the importance weight as slime does. Checked against the float64
reference and against a transcription of slime's ``compute_approx_kl``."""

from __future__ import annotations

import pytest
import torch

import offpolicy as op
from offpolicy.reference import reference_policy_loss


def _slime_compute_approx_kl(log_probs, log_probs_base, kl_loss_type, importance_ratio=None):
    """Transcribed from slime (slime/utils/ppo_utils.py, ``compute_approx_kl``): k3 for ``"k3"`` and
    ``"low_var_kl"``, times the importance ratio when given, and for ``"low_var_kl"`` clamped to [-10, 10] last
    (slime casts the log-probabilities to float32 first; the test stays in float64)."""
    log_ratio = log_probs - log_probs_base
    log_ratio = -log_ratio
    kl = log_ratio.exp() - 1 - log_ratio
    if importance_ratio is not None:
        kl = importance_ratio * kl
    if kl_loss_type == "low_var_kl":
        kl = torch.clamp(kl, min=-10, max=10)
    return kl


def _batch(seed: int, n: int = 40, vocab: int = 8):
    g = torch.Generator().manual_seed(seed)
    z = 2 * torch.randn(n, vocab, generator=g, dtype=torch.float64)
    y = torch.randint(0, vocab, (n,), generator=g)
    lp = torch.log_softmax(z, 1)[torch.arange(n), y]
    lq = (lp + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)).clamp(max=0.0)
    # A reference model far from the policy on some tokens: k3 = e^x - 1 - x passes 10 at x of about 2.6.
    ref = (lp + 4.0 * torch.randn(n, generator=g, dtype=torch.float64)).clamp(max=0.0)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.rand(n, generator=g) < 0.9
    return z, y, lq, ref, adv, mask


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_low_var_kl_matches_the_reference(weighted, seed):
    z, y, lq, ref, adv, mask = _batch(seed)
    kw = dict(loss_mask=mask, reference_logprobs=ref,
              correction=op.Correction(weights="tis", kl_penalty=op.KLPenalty(0.3, "low_var_kl", weighted)))
    z1, z2 = z.clone().requires_grad_(), z.clone().requires_grad_()
    out = op.policy_loss(z1, y, lq, adv, **kw)
    loss, token_loss, _ = reference_policy_loss(z2, y, lq, adv, **kw)
    out.loss.backward()
    loss.backward()
    torch.testing.assert_close(out.token_loss, token_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(out.loss.detach(), loss.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(z1.grad, z2.grad, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_low_var_kl_is_slime_low_var_kl(weighted, seed):
    """The penalty term alone (zero advantages), summed: slime's ``compute_approx_kl(log_probs, ref_log_probs,
    "low_var_kl", importance_ratio=exp(log_probs - old))`` times the coefficient, value and gradient; the clamp is
    reached on some tokens (their gradient is 0 there, as slime's)."""
    z, y, lq, ref, _, mask = _batch(seed)
    coef = 0.5
    z1, z2 = z.clone().requires_grad_(), z.clone().requires_grad_()
    lp = torch.log_softmax(z2, 1)[torch.arange(z.shape[0]), y]
    ratio = torch.exp(lp - lq) if weighted else None
    theirs = coef * _slime_compute_approx_kl(lp, ref, "low_var_kl", ratio)
    assert (theirs.detach().abs() >= 10 * coef).any(), "the clamp is not exercised"
    (theirs * mask).sum().backward()
    out = op.policy_loss(z1, y, lq, torch.zeros_like(lq), loss_mask=mask, reference_logprobs=ref,
                         aggregation="constant", constant_normalizer=1.0,
                         correction=op.Correction(kl_penalty=op.KLPenalty(coef, "low_var_kl", weighted)))
    out.loss.backward()
    torch.testing.assert_close(out.token_loss, (theirs * mask).detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(z1.grad, z2.grad, rtol=1e-10, atol=1e-13)


def test_low_var_kl_as_a_rejection_estimator():
    """The estimator is one entry of the shared table: a ``KLRejection`` can use it too (threshold in its range)."""
    z, y, lq, ref, adv, mask = _batch(0)
    corr = op.Correction(weights="tis", rejections=(op.KLRejection(0.05, "low_var_kl"),))
    z1, z2 = z.clone().requires_grad_(), z.clone().requires_grad_()
    out = op.policy_loss(z1, y, lq, adv, loss_mask=mask, correction=corr)
    loss, _, w = reference_policy_loss(z2, y, lq, adv, loss_mask=mask, correction=corr)
    torch.testing.assert_close(out.token_weight, w, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(out.loss.detach(), loss.detach(), rtol=1e-12, atol=1e-14)
