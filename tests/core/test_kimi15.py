"""Kimi k1.5's surrogate (docs/spec.md#kimi15): ``Correction(kimi15=tau)`` takes ``A log p - tau/2 (log p -
log pi_old)^2``. Checked against the float64 reference and against a transcription of ROLL's
``_compute_kimi15_loss`` (``pg_variant="kimi15"``)."""

from __future__ import annotations

import math

import pytest
import torch

import offpolicy as op
from support.agreement import assert_matches_reference


def _roll_kimi15_loss(log_probs, old_log_probs, advantages, tau=0.1):
    """Transcribed from ROLL (roll/pipeline/rlvr/actor_pg_worker.py, ``_compute_kimi15_loss``): the per-token
    ``-A log p + tau/2 (log p - old)^2``."""
    return -advantages * log_probs + tau * 0.5 * (log_probs - old_log_probs).pow(2)


def _batch(seed: int, n: int = 30, vocab: int = 8, hostile: bool = False):
    g = torch.Generator().manual_seed(seed)
    z = 2 * torch.randn(n, vocab, generator=g, dtype=torch.float64)
    y = torch.randint(0, vocab, (n,), generator=g)
    lq = torch.log_softmax(z + 0.5 * torch.randn(n, vocab, generator=g, dtype=torch.float64), 1)[torch.arange(n), y]
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.rand(n, generator=g) < 0.9
    if hostile:
        z[1, y[1]] = -math.inf
    return z, y, lq, adv, mask


CORRECTIONS = [op.Correction(kimi15=0.1), op.Correction(kimi15=1.0, weights="tis"),
               op.Correction(kimi15=0.0, weights="mis", veto=0.05, rejected_in_normalizer=False)]


@pytest.mark.parametrize("corr", CORRECTIONS, ids=lambda c: f"{c.kimi15:g}-{c.weights}")
@pytest.mark.parametrize("proximal", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_kimi15_matches_the_reference(corr, proximal, seed):
    z, y, lq, adv, mask = _batch(seed, hostile=seed == 3)
    g = torch.Generator().manual_seed(50 + seed)
    prox = (lq + 0.3 * torch.randn(lq.shape, generator=g, dtype=torch.float64)).clamp(max=0.0) if proximal else None
    kw = dict(loss_mask=mask, correction=corr, seq_ids=torch.arange(lq.shape[0]) // 5, proximal_logprobs=prox)
    assert_matches_reference(z, y, lq, adv, **kw)


@pytest.mark.parametrize("tau", [0.1, 0.7])
@pytest.mark.parametrize("seed", range(3))
def test_kimi15_is_roll_kimi15(tau, seed):
    """ROLL's per-token loss and gradient, token for token, with ``proximal_logprobs=old`` (the sampler's equal to
    it, so the weights are 1) and ``aggregation="constant", constant_normalizer=1``. ROLL's penalty acts on tokens
    with ``A = 0`` too, offpolicy's surrogate only on trained tokens with ``A != 0``: the advantages here are
    nonzero."""
    z, y, _, adv, mask = _batch(seed)
    n = z.shape[0]
    g = torch.Generator().manual_seed(seed)
    old = (torch.log_softmax(z, 1)[torch.arange(n), y] + 0.4 * torch.randn(n, generator=g,
                                                                           dtype=torch.float64)).clamp(max=0.0)
    z1, z2 = z.clone().requires_grad_(), z.clone().requires_grad_()
    lp = torch.log_softmax(z2, 1)[torch.arange(n), y]
    theirs = _roll_kimi15_loss(lp, old, adv, tau) * mask
    theirs.sum().backward()
    out = op.policy_loss(z1, y, old, adv, loss_mask=mask, proximal_logprobs=old, aggregation="constant",
                         constant_normalizer=1.0, correction=op.Correction(kimi15=tau))
    out.loss.backward()
    torch.testing.assert_close(out.token_loss, theirs.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(z1.grad, z2.grad, rtol=1e-10, atol=1e-13)


def test_bad_tau_is_named():
    with pytest.raises(ValueError, match="Correction.kimi15 must be a finite number >= 0"):
        op.Correction(kimi15=-0.1)
    with pytest.raises(ValueError, match="exclude each other"):
        op.Correction(kimi15=0.1, topr=(1.0, 1.0))
