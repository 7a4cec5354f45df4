"""NeMo-RL's sequence log-probability error mask (docs/spec.md#seq-logprob-error): ``Correction(seq_logprob_error=t)``
drops a sequence whose ``mean_t exp(|log r_t|)`` over its trained tokens exceeds ``t``. Checked against the float64
reference and against a transcription of NeMo-RL's ``compute_and_apply_seq_logprob_error_masking``."""

from __future__ import annotations

import math

import pytest
import torch

import offpolicy as op
from offpolicy.reference import reference_metrics
from support.agreement import assert_matches_reference


def _nemo_rl_sample_mask(token_mask, sample_mask, prev_logprobs, generation_logprobs, threshold):
    """Transcribed from NeMo-RL (nemo_rl/algorithms/grpo.py, ``compute_and_apply_seq_logprob_error_masking``), on
    ``[B, T]`` rows already shifted (its ``[:, 1:]``): the per-sequence multiplicative probability error and the
    sample mask it leaves (kept iff the error is ``<= threshold``)."""
    lp_error = torch.abs(generation_logprobs - prev_logprobs)
    mask = token_mask * sample_mask.unsqueeze(-1)
    seq_mult_prob_error = (torch.exp(lp_error * mask) * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
    return (seq_mult_prob_error <= threshold).float() * sample_mask


def _batch(seed: int, b: int = 6, t: int = 7, vocab: int = 9, spread: float = 0.6):
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
    op.Correction(seq_logprob_error=1.5),
    op.Correction(seq_logprob_error=1.2, weights="tis"),
    op.Correction(seq_logprob_error=1.3, ppo_clip=(0.2, 0.2), weights="mis", rejected_in_normalizer=False),
]


@pytest.mark.parametrize("corr", CORRECTIONS, ids=lambda c: f"{c.seq_logprob_error:g}-{c.surrogate.name}")
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("seed", range(4))
def test_seq_logprob_error_matches_the_reference(corr, aggregation, seed):
    z, y, lq, prox, adv, mask, seq, _, _ = _batch(seed)
    kw = dict(loss_mask=mask, correction=corr, seq_ids=seq,
              proximal_logprobs=prox if corr.tree.surrogate.needs_proximal else None)
    out = assert_matches_reference(z, y, lq, adv, aggregation=aggregation, **kw)
    ref = reference_metrics(z, y, lq, adv, **kw)
    key = "rejected_frac/seq_logprob_error"
    assert math.isclose(float(out.metrics[key]), ref[key], abs_tol=1e-14)


@pytest.mark.parametrize("threshold", [1.05, 1.3, 2.0])
@pytest.mark.parametrize("seed", range(3))
def test_it_keeps_the_sequences_nemo_rl_keeps(threshold, seed):
    """NeMo-RL's ``generation_logprobs`` are offpolicy's ``sampler_logprobs`` and its ``prev_logprobs`` the
    proximal policy's: the sequences offpolicy drops are those whose sample mask NeMo-RL zeroes."""
    z, y, lq, prox, adv, mask, seq, b, t = _batch(seed)
    kept = _nemo_rl_sample_mask(mask.view(b, t).double(), torch.ones(b, dtype=torch.float64), prox.view(b, t),
                                lq.view(b, t), threshold)
    out = op.policy_loss(z, y, lq, torch.ones_like(adv), loss_mask=mask, seq_ids=seq, proximal_logprobs=prox,
                         correction=op.Correction(seq_logprob_error=threshold, ppo_clip=(0.2, 0.2)))
    has_tokens = mask.view(b, t).any(1)
    ours = (out.token_loss.view(b, t) != 0).any(1)
    assert (ours == (kept.bool() & has_tokens)).all()


def test_bad_threshold_is_named():
    with pytest.raises(ValueError, match="Correction.seq_logprob_error must be a finite number >= 1"):
        op.Correction(seq_logprob_error=0.5)
    with pytest.raises(ValueError, match="needs seq_ids"):
        z, y, lq, _, adv, _, _, _, _ = _batch(0)
        op.policy_loss(z, y, lq, adv, correction=op.Correction(seq_logprob_error=1.5))


def test_from_tree_round_trips():
    for corr in CORRECTIONS:
        assert op.Correction.from_tree(corr.tree) == corr
