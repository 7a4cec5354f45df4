"""docs/spec.md#inv-hostile: hostile numerics give finite results that match the float64 reference."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import offpolicy as op
from offpolicy.reference import TAIL_EPS, log_probs, reference_policy_loss, support_mask

from support.batches import make_batch

CORRS = [
    op.Correction(),
    op.Correction(weights="tis", score_centering=True),
    op.Correction(weights="mis", score_centering=True),
    op.Correction(weights="reject", score_centering=True),
]


def _both(z, y, lq, adv, cands, tau, corr, mask=None, dtype=torch.float64):
    z1 = z.to(dtype).clone().detach().requires_grad_()
    out = op.policy_loss(z1, y, lq, adv, cands, mask, tau, corr)
    out.loss.backward()
    z2 = z.to(dtype).double().clone().detach().requires_grad_()  # its own leaf, never z1
    ref, _, _ = reference_policy_loss(z2, y, lq, adv, cands, mask, tau, corr)
    ref.backward()
    return out, z1.grad, ref, z2.grad


def _near_a_bound(z, y, lq, cands, tau, corr, margin: float) -> bool:
    """Whether a log-ratio the weight function sees (the sampled token's, each candidate's under centering, the
    head's tail ratio) lies within ``margin`` of a MIS / rejection bound, where rounding may flip the mask."""
    if corr.weights not in ("mis", "reject"):
        return False
    support = cands.kind == "support"
    lp = log_probs(z, tau, support_mask(cands, z.shape[1]) if support else None)
    log_r = [lp[torch.arange(z.shape[0]), y] - lq.double()]
    if corr.score_centering:
        valid = cands.ids >= 0
        lpc, lqc = lp.gather(1, cands.ids.clamp_min(0)), cands.logprobs.double()
        log_r.append((lpc - lqc)[valid])
        if not support:
            zero = torch.zeros((), dtype=torch.float64)
            p_h = torch.where(valid, lpc.exp(), zero).sum(1)
            q_h = torch.where(valid, lqc.exp(), zero).sum(1)
            log_r.append(-torch.log((1 - q_h).clamp_min(TAIL_EPS) / (1 - p_h).clamp_min(TAIL_EPS)))
    r = torch.cat(log_r)
    r = r[torch.isfinite(r)]
    return any(bool(((r - math.log(b)).abs() < margin).any()) for b in (corr.lower, corr.upper) if b > 0)


@pytest.mark.parametrize("corr", CORRS, ids=lambda c: c.weights)
@pytest.mark.parametrize("kind", ["head", "support"])
def test_neg_inf_logits_and_sampler_zero_candidates(corr, kind):
    """-inf logits outside the record, and head candidates to which the sampler gave probability 0."""
    z, y, lq, cands = make_batch(10, 30, 5, kind, seed=1)
    inside = torch.zeros(10, 31, dtype=torch.bool).scatter_(1, torch.where(cands.ids >= 0, cands.ids, 30), True)
    inside[torch.arange(10), y] = True
    z = torch.where(inside[:, :30], z, torch.where(torch.rand(10, 30) < 0.5, float("-inf"), z))
    if kind == "head":
        lqc = cands.logprobs.clone()
        lqc[:, -1] = float("-inf")  # recorded, but q = 0
        cands = op.Candidates(cands.ids, lqc, "head")
    adv = torch.randn(10)
    out, g, ref, rg = _both(z, y, lq, adv, cands, 1.0, corr)
    assert torch.isfinite(out.loss) and bool(torch.isfinite(g).all())
    torch.testing.assert_close(out.loss.detach(), ref.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(g, rg, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("corr", CORRS, ids=lambda c: c.weights)
def test_underflowing_probabilities(corr):
    """Candidates and sampled tokens whose trainer probability underflows (log p ~ -1e3) stay finite."""
    z, y, lq, cands = make_batch(8, 20, 4, "head", seed=2, scale=300.0, mismatch=0.5)
    out, g, ref, rg = _both(z, y, lq, torch.randn(8), cands, 1.0, corr)
    assert torch.isfinite(out.loss) and bool(torch.isfinite(g).all())
    torch.testing.assert_close(out.loss.detach(), ref.detach(), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(g, rg, rtol=1e-8, atol=1e-10)


@given(st.sampled_from([0.05, 0.1, 1.0, 4.0, 10.0]), st.sampled_from(CORRS), st.sampled_from(["head", "support"]),
       st.integers(0, 10**6))
def test_bf16_extreme_logits_and_temperatures(tau, corr, kind, seed):
    """Logits of +-1e4 in bf16 across temperatures 0.05..10: finite, and equal to the reference on the same
    bf16 values within fp32's resolution.

    The fp32 statistics see ``x = z / tau`` rounded to 2**-24 relative, i.e. an absolute error of up to
    ``eps_x = max|x| 2**-24`` (0.012 at ``|x| = 2e5``), which log-probabilities inherit (twice: ``x`` and ``lse``)
    and probabilities inherit as a relative error. The loss error is therefore bounded by
    ``4 eps_x mean(|A| (|w| + 2))`` (the centering coefficients sum to at most ``|w| + 2`` in absolute value), and
    the gradient's by ``4 eps_x max|A| (max w + 2) / tau`` plus bf16 storage rounding (2**-8 of its max).
    A log-ratio within that error (``4 eps_x``) of a MIS / rejection bound may be masked on one side and not on the
    other, a discontinuity no tolerance covers: such examples are finite-checked only (one had log r = log 5 - 6e-6
    at ``eps_x = 0.006``).
    """
    gen = torch.Generator().manual_seed(seed)
    z, y, lq, cands = make_batch(6, 24, 4, kind, seed=seed)
    z = torch.where(torch.rand(z.shape, generator=gen) < 0.3, torch.sign(z) * 1e4, z)
    z = z.to(torch.bfloat16).double()
    adv = torch.randn(6, generator=gen)
    out, g, ref, rg = _both(z, y, lq, adv, cands, tau, corr, dtype=torch.bfloat16)
    assert torch.isfinite(out.loss) and bool(torch.isfinite(g.float()).all())
    eps_x = float(z.abs().max()) / tau * 2.0**-24 + 1e-7
    assume(not _near_a_bound(z, y, lq, cands, tau, corr, 4 * eps_x))
    w = out.token_weight.double()
    loss_tol = 4 * eps_x * float((adv.abs() * (w.abs() + 2)).mean())
    grad_tol = 4 * eps_x * float(adv.abs().max()) * (float(w.max()) + 2) / tau + 2.0**-8 * float(rg.abs().max())
    assert abs(float(out.loss.detach()) - float(ref.detach())) <= loss_tol + 1e-6
    assert float((g.double() - rg).abs().max()) <= grad_tol + 1e-6


def test_empty_rows_and_empty_batch():
    z, y, lq, cands = make_batch(6, 20, 4, "head", seed=3)
    ids, lqc = cands.ids.clone(), cands.logprobs.clone()
    ids[2], lqc[2] = -1, float("-inf")
    empty = op.Candidates(ids, lqc, "head")
    for corr in CORRS:
        out, g, ref, rg = _both(z, y, lq, torch.randn(6), empty, 1.0, corr)
        torch.testing.assert_close(out.loss.detach(), ref.detach(), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(g, rg, rtol=1e-9, atol=1e-11)
    zero = torch.zeros(0, 20, dtype=torch.float64, requires_grad=True)
    out = op.policy_loss(zero, torch.zeros(0, dtype=torch.long), torch.zeros(0), torch.zeros(0),
                         op.Candidates(torch.zeros(0, 4, dtype=torch.long), torch.zeros(0, 4), "support"),
                         correction=op.Correction(weights="mis", score_centering=True))
    out.loss.backward()
    assert float(out.loss.detach()) == 0.0 and zero.grad.shape == (0, 20)
    assert all(bool(torch.isfinite(v)) for v in out.metrics.values())


def test_fully_masked_batch_is_zero_not_nan():
    z, y, lq, cands = make_batch(5, 20, 4, "support", seed=4)
    zz = z.clone().requires_grad_()
    out = op.policy_loss(zz, y, lq, torch.randn(5), cands, torch.zeros(5, dtype=torch.bool),
                         correction=op.Correction(weights="mis", score_centering=True), seq_ids=torch.arange(5),
                         aggregation="seq_mean_token_mean")
    out.loss.backward()
    assert float(out.loss.detach()) == 0.0 and bool((zz.grad == 0).all())
    assert all(bool(torch.isfinite(v)) for v in out.metrics.values())
