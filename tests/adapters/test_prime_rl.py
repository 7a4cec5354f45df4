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


# ---- guards (offpolicy.adapters.guard) ----

def _guarded(monkeypatch, lq, logp, mask):
    import warnings
    from offpolicy.adapters.guard import Guard, GuardWarning
    monkeypatch.setattr(prime_rl, "GUARD", Guard([]))
    adv = torch.ones_like(logp)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = [prime_rl.policy_loss(LossInputs(logp, lq, None, adv, mask)) for _ in range(3)]
    return [str(w.message) for w in caught if issubclass(w.category, GuardWarning)], out[0].metrics


def _filtered_sequence(seed, n=64, vocab=50, top_p=0.9, stale=0.0):
    """Trainer log p (full vocabulary) and the sampler's lq (top_p-renormalised, or stale by ``stale`` noise) of
    tokens the sampler drew."""
    g = torch.Generator().manual_seed(seed)
    z = 2.0 * torch.randn(n, vocab, generator=g, dtype=torch.float64)
    zq = z + stale * torch.randn(n, vocab, generator=g, dtype=torch.float64)
    p = torch.softmax(zq, -1)
    sp, order = p.sort(-1, descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool).scatter(1, order, (sp.cumsum(-1) - sp) < top_p)
    lq_all = torch.log_softmax(zq.masked_fill(~keep, float("-inf")), -1)
    tokens = torch.multinomial(lq_all.exp(), 1, generator=g)
    lq = lq_all.gather(1, tokens)[:, 0].float()
    logp = torch.log_softmax(z, -1).gather(1, tokens)[:, 0].float()
    return lq, logp, torch.ones(n, dtype=torch.bool)


def test_guard_warns_once_on_a_filter_the_loss_cannot_replay(monkeypatch):
    """top_p = 0.9 sampling against the trainer's full vocabulary: lq - log p = -log P(S_t) > 0 on every token;
    warned once with the measurement and the fix, and in the metrics."""
    messages, metrics = _guarded(monkeypatch, *_filtered_sequence(0))
    assert len(messages) == 1 and "[narrower_sampler]" in messages[0] and "Fix: sample with top_p=1" in messages[0]
    assert "lq > log p on 100.0%" in messages[0]
    assert float(metrics["offpolicy/guard/narrower_sampler"]) == 1.0


@pytest.mark.parametrize("stale", [0.0, 0.3])
def test_guard_stays_silent_on_an_unfiltered_fresh_or_stale_sampler(monkeypatch, stale):
    messages, metrics = _guarded(monkeypatch, *_filtered_sequence(1, top_p=1.0 + 1e-9, stale=stale))
    assert messages == [] and not any(k.startswith("offpolicy/guard/") for k in metrics)


def test_guard_on_inference_logprobs_that_are_not_log_probs(monkeypatch):
    lq, logp, mask = _filtered_sequence(2, top_p=1.0 + 1e-9)
    messages, metrics = _guarded(monkeypatch, torch.zeros_like(lq), logp, mask)
    assert len(messages) == 1 and "[sampler_logprobs_zero]" in messages[0]
    with pytest.raises(ValueError, match=r"inference_logprobs must be the sampler's log-probabilities"):
        _guarded(monkeypatch, lq.exp(), logp, mask)
