"""TOPR, tapered off-policy REINFORCE (docs/spec.md#topr): ``Correction(topr=(w_pos, w_neg))`` takes
``w_pos A log p`` where ``A >= 0`` and ``w_neg sg(clamp(u, 0, 1)) A log p`` where ``A < 0``, ``u = p / pi_old``
(the proximal policy, or the sampler without one). Checked against the float64 reference and against a
transcription of ROLL's ``_compute_topr_loss`` (``pg_variant="topr"``)."""

from __future__ import annotations

import math

import pytest
import torch

import offpolicy as op
from support.agreement import assert_matches_reference


def _roll_topr_loss(ratio, log_probs, advantages, scores, positive_weight=1.0, negative_weight=1.0):
    """Transcribed from ROLL (roll/pipeline/rlvr/actor_pg_worker.py, ``_compute_topr_loss``): sequences whose score is
    positive take the SFT-like ``-A log p``, the others ``-clamp(ratio, 0, 1).detach() A log p``, each weighted.
    ``ratio``, ``log_probs``, ``advantages``: ``[B, T]``; ``scores``: ``[B]``."""
    positive_mask = (scores > 0).float()
    negative_mask = (scores <= 0).float()
    positive_token_mask = positive_mask.unsqueeze(-1).expand_as(log_probs)
    negative_token_mask = negative_mask.unsqueeze(-1).expand_as(log_probs)
    positive_loss = -advantages * log_probs * positive_token_mask
    clipped_ratio = torch.clamp(ratio, min=0.0, max=1.0).detach()
    negative_loss = -clipped_ratio * advantages * log_probs * negative_token_mask
    return positive_weight * positive_loss + negative_weight * negative_loss


def _batch(seed: int, n: int = 30, vocab: int = 8, hostile: bool = False):
    g = torch.Generator().manual_seed(seed)
    z = 2 * torch.randn(n, vocab, generator=g, dtype=torch.float64)
    y = torch.randint(0, vocab, (n,), generator=g)
    lq = torch.log_softmax(z + 0.7 * torch.randn(n, vocab, generator=g, dtype=torch.float64), 1)[torch.arange(n), y]
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    adv[::7] = 0.0
    mask = torch.rand(n, generator=g) < 0.9
    if hostile:
        z[1, y[1]] = -math.inf
    return z, y, lq, adv, mask


CORRECTIONS = [
    op.Correction(topr=(1.0, 1.0)),
    op.Correction(topr=(0.5, 2.0), weights="tis", bounds=2.0),
    op.Correction(topr=(1.0, 1.0), weights="mis", veto=0.05, rejected_in_normalizer=False),
    op.Correction(topr=(1.0, 0.0)),
]


@pytest.mark.parametrize("corr", CORRECTIONS, ids=lambda c: f"{c.topr}-{c.weights}")
@pytest.mark.parametrize("proximal", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_topr_matches_the_reference(corr, proximal, seed):
    z, y, lq, adv, mask = _batch(seed, hostile=seed == 3)
    g = torch.Generator().manual_seed(100 + seed)
    prox = (lq + 0.3 * torch.randn(lq.shape, generator=g, dtype=torch.float64)).clamp(max=0.0) if proximal else None
    seq = torch.arange(lq.shape[0]) // 4
    kw = dict(loss_mask=mask, correction=corr, seq_ids=seq, proximal_logprobs=prox)
    assert_matches_reference(z, y, lq, adv, **kw)


@pytest.mark.parametrize("weights", [(1.0, 1.0), (0.7, 1.3)])
@pytest.mark.parametrize("seed", range(3))
def test_topr_is_roll_topr(weights, seed):
    """ROLL's loss and gradient, token for token, on ``[B, T]`` sequences whose advantage is the sequence's score
    (TOPR's ``R(tau)``, the sign test ROLL makes on the episode score), ``ratio = p / old``; offpolicy with
    ``proximal_logprobs=old`` and ``aggregation="constant", constant_normalizer=1`` (ROLL's per-token loss summed)."""
    g = torch.Generator().manual_seed(seed)
    b, t, vocab = 4, 6, 7
    z = torch.randn(b * t, vocab, generator=g, dtype=torch.float64)
    y = torch.randint(0, vocab, (b * t,), generator=g)
    old = (torch.log_softmax(z, 1)[torch.arange(b * t), y]
           + 0.5 * torch.randn(b * t, generator=g, dtype=torch.float64)).clamp(max=0.0)
    scores = torch.tensor([1.0, -1.0, 0.5, -0.25], dtype=torch.float64)
    adv = scores.repeat_interleave(t)
    z1, z2 = z.clone().requires_grad_(), z.clone().requires_grad_()
    lp = torch.log_softmax(z2, 1)[torch.arange(b * t), y]
    theirs = _roll_topr_loss(torch.exp(lp - old).view(b, t), lp.view(b, t), adv.view(b, t), scores, *weights)
    theirs.sum().backward()
    out = op.policy_loss(z1, y, old, adv, proximal_logprobs=old, aggregation="constant", constant_normalizer=1.0,
                         correction=op.Correction(topr=weights))
    out.loss.backward()
    torch.testing.assert_close(out.token_loss, theirs.detach().view(-1), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(z1.grad, z2.grad, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("kw, match", [
    (dict(topr=(1.0,)), "Correction.topr must be a pair of numbers"),
    (dict(topr=(-1.0, 1.0)), "Correction.topr must be"),
    (dict(topr=(1.0, 1.0), ppo_clip=(0.2, 0.2)), "Correction.ppo_clip and topr exclude each other"),
    (dict(topr=(1.0, 1.0), score_centering=True), "score_centering=True cannot be combined"),
])
def test_bad_keywords_are_named(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        op.Correction(**kw)


def test_from_tree_round_trips():
    for corr in CORRECTIONS:
        assert op.Correction.from_tree(corr.tree).tree == corr.tree
