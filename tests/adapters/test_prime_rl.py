"""offpolicy.adapters.prime_rl: prime-rl's custom-loss contract (``fn(LossInputs, **kwargs) -> LossOutputs``, one
sequence). prime-rl needs Python >= 3.12 and is not on PyPI: these are contract tests on its documented
dataclasses, against the float64 reference."""

from dataclasses import dataclass

import pytest
import torch

import offpolicy as op
from offpolicy.adapters import prime_rl
from offpolicy.reference import reference_policy_loss


@dataclass
class LossInputs:
    """prime-rl's documented ``LossInputs`` (prime_rl/trainer/rl/loss.py)."""

    trainer_logprobs: torch.Tensor
    inference_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor | None
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    loss_weights: torch.Tensor | None = None


def _sequence(seed, n=11, vocab=13):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, vocab, (n,), generator=g)
    lq = torch.log_softmax(logits + 0.5 * torch.randn(n, vocab, generator=g, dtype=torch.float64), -1)
    lq = lq.gather(1, tokens[:, None])[:, 0]
    mask = torch.rand(n, generator=g) > 0.2
    adv = torch.full((n,), 0.7, dtype=torch.float64)
    return logits, tokens, lq, mask, adv


@pytest.mark.parametrize("kwargs, corr", [
    ({}, op.Correction(weights="mis", bounds=(0.5, 5.0))),
    ({"weights": "tis", "bounds": [0.0, 2.0]}, op.Correction(weights="tis", bounds=(0.0, 2.0))),
    ({"weights": "mis", "bounds": [0.5, 2.0], "level": "sequence"},
     op.Correction(weights="mis", bounds=(0.5, 2.0), level="sequence")),
])
def test_sequence_loss_matches_float64_reference(kwargs, corr):
    logits, tokens, lq, mask, adv = _sequence(0)
    leaf = logits.float().requires_grad_(True)
    logp = torch.log_softmax(leaf, -1).gather(1, tokens[:, None])[:, 0]
    weights = torch.linspace(0.5, 1.5, tokens.numel())
    out = prime_rl.policy_loss(LossInputs(logp, lq.float(), None, adv.float(), mask, weights), **kwargs)
    out.loss.backward()
    ref_leaf = logits.clone().requires_grad_(True)
    ref, _, _ = reference_policy_loss(ref_leaf, tokens, lq, adv * weights.double(), None, mask, 1.0, corr,
                                      torch.zeros_like(tokens), aggregation="constant", constant_normalizer=1.0)
    ref.backward()
    assert torch.allclose(out.loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    assert torch.allclose(leaf.grad.double(), ref_leaf.grad, rtol=1e-4, atol=1e-6)
    assert set(out.metrics) >= {"offpolicy/kl_k3", "offpolicy/weight_mean"}
    assert all(v.dim() == 0 for v in out.metrics.values())


def test_unsupported_corrections_are_named():
    logits, tokens, lq, mask, adv = _sequence(1)
    logp = torch.log_softmax(logits.float(), -1).gather(1, tokens[:, None])[:, 0]
    inputs = LossInputs(logp, lq.float(), None, adv.float(), mask)
    for kwargs, message in [({"weights": "mis", "score_centering": True}, "score_centering"),
                            ({"weights": "mis", "batch_normalize": True}, "batch_normalize"),
                            ({"weights": "mis", "ppo_clip": [0.2, 0.2]}, "ppo_clip"),
                            ({"weights": "bogus"}, "weights")]:
        with pytest.raises(ValueError, match=message):
            prime_rl.policy_loss(inputs, **kwargs)
