"""docs/spec.md#invariants invariants as property tests against exact enumeration (float64 throughout).

Drift and unbiasedness are checked by enumerating every sampled token ``y`` of a small vocabulary: one row per
``y`` with identical logits, advantage ``A * q(y)``, and the "constant" aggregation, so the summed row gradient
is exactly ``sum_y q(y) grad loss(y)``. float64 keeps the residual at rounding level: we allow
``1e-9 * sum_y q(y) |grad loss(y)|`` plus ``1e-12 |A| / tau`` for the cases where every term is itself at rounding
level (gradients are at most ``O(|A| / tau)`` per entry).
"""

from __future__ import annotations

import dataclasses


import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import offpolicy as op

MODES = [
    op.Correction(weights="none", score_centering=True),
    op.Correction(weights="tis", score_centering=True),
    op.Correction(weights="tis", bounds=(0.5, 1.5), score_centering=True),
    op.Correction(weights="mis", score_centering=True),
    op.Correction(weights="mis", bounds=(0.8, 1.25), score_centering=True),
    op.Correction(weights="reject", bounds=(0.7, 3.0), score_centering=True),
    op.Correction(weights="mis", kl_rejection=op.KLRejection(0.1, "k3"), score_centering=True),
    op.Correction(weights="mis", batch_normalize=True, score_centering=True),
]


@st.composite
def distributions(draw, min_v=2, max_v=8):
    """Trainer logits ``z [V]``, temperature and a sampler distribution ``q [V]`` (float64)."""
    v = draw(st.integers(min_v, max_v))
    scale = draw(st.sampled_from([0.1, 1.0, 3.0, 8.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(v, generator=gen, dtype=torch.float64) * scale
    tau = draw(st.sampled_from([0.05, 0.3, 1.0, 2.5, 10.0]))
    mismatch = draw(st.sampled_from([0.0, 0.3, 1.0, 3.0]))
    q = torch.softmax(z / tau + torch.randn(v, generator=gen, dtype=torch.float64) * mismatch, 0)
    return z, tau, q


def _enumerate_grad(z, tau, tokens, lq, adv, cands, corr):
    """Summed gradient over rows (one per enumerated token) and the sum of per-row gradient norms."""
    rows = z.expand(len(tokens), -1).clone().requires_grad_()
    out = op.policy_loss(rows, tokens, lq, adv, cands, temperature=tau, correction=corr,
                         aggregation="constant", constant_normalizer=1.0)
    out.loss.backward()
    return rows.grad.sum(0), rows.grad.abs().sum()


def _complete_head(q, v, tokens):
    ids = torch.arange(v).expand(len(tokens), -1).clone()
    return op.Candidates(ids, torch.log(q).expand(len(tokens), -1).clone(), "head")


@given(distributions(), st.sampled_from(MODES), st.floats(-3, 3).filter(lambda a: abs(a) > 1e-3))
def test_zero_drift_complete_head(dist, corr, a):
    """7.1: with H = the vocabulary and a constant advantage, sum_y q(y) grad loss(y) = 0."""
    z, tau, q = dist
    v = z.numel()
    assume(bool((q > 1e-300).all()))
    tokens = torch.arange(v)
    grad, scale = _enumerate_grad(z, tau, tokens, torch.log(q), a * q, _complete_head(q, v, tokens), corr)
    assert float(grad.abs().max()) <= 1e-9 * float(scale) + 1e-12 * abs(a) / tau


@given(distributions(min_v=3), st.sampled_from(MODES), st.data())
def test_zero_drift_support(dist, corr, data):
    """7.1 with a replayed support: q renormalised over S, the trainer renormalised over the same S."""
    z, tau, q = dist
    v = z.numel()
    size = data.draw(st.integers(1, v))
    support = torch.randperm(v, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 999))))[:size]
    qs = q[support] / q[support].sum()
    assume(bool((qs > 1e-300).all()))
    tokens = support
    ids = support.expand(size, -1).clone()
    cands = op.Candidates(ids, torch.log(qs).expand(size, -1).clone(), "support")
    grad, scale = _enumerate_grad(z, tau, tokens, torch.log(qs), 1.7 * qs, cands, corr)
    assert float(grad.abs().max()) <= 1e-9 * float(scale) + 1.7e-12 / tau
    outside = torch.ones(v, dtype=torch.bool)
    outside[support] = False
    assert bool((grad[outside] == 0).all())


@given(distributions(min_v=3), st.sampled_from(MODES), st.data())
def test_head_tail_model_exact(dist, corr, data):
    """7.2: a top-k head record is exact when the true tail is rho * p (zero drift over the whole vocabulary)."""
    z, tau, q_raw = dist
    v = z.numel()
    k = data.draw(st.integers(1, v - 1))
    p = torch.softmax(z / tau, 0)
    head = torch.topk(q_raw, k).indices
    in_head = torch.zeros(v, dtype=torch.bool)
    in_head[head] = True
    q_head_mass = data.draw(st.floats(0.05, 0.95))
    assume(float(p[~in_head].sum()) > 1e-3)
    q = torch.where(in_head, q_raw / q_raw[head].sum() * q_head_mass, p / p[~in_head].sum() * (1 - q_head_mass))
    assume(bool((q > 1e-300).all()))
    tokens = torch.arange(v)
    cands = op.Candidates(head.expand(v, -1).clone(), torch.log(q[head]).expand(v, -1).clone(), "head")
    grad, scale = _enumerate_grad(z, tau, tokens, torch.log(q), 0.9 * q, cands, corr)
    assert float(grad.abs().max()) <= 1e-8 * float(scale) + 0.9e-12 / tau


@given(distributions(min_v=3), st.sampled_from(MODES), st.data())
def test_head_equals_dense_q_hat_formula(dist, corr, data):
    """7.2: the head-mode gradient equals the dense formula with q_hat = q on H and rho p outside it."""
    z, tau, q = dist
    v = z.numel()
    k = data.draw(st.integers(1, v - 1))
    y = data.draw(st.integers(0, v - 1))
    head = torch.topk(q, k).indices
    zz = z.clone().requires_grad_()
    cands = op.Candidates(head[None], torch.log(q[head])[None], "head")
    adv = torch.tensor([1.3])
    op.policy_loss(zz[None], torch.tensor([y]), torch.log(q[y])[None], adv, cands, temperature=tau,
                   correction=corr, aggregation="constant", constant_normalizer=1.0).loss.backward()
    # Dense: loss = -A (w log p(y) - sum_v sg(q_hat f(p / q_hat)) log p(v)).
    zd = z.clone().requires_grad_()
    logp = torch.log_softmax(zd / tau, 0)
    p = logp.detach().exp()
    in_head = torch.zeros(v, dtype=torch.bool)
    in_head[head] = True
    p_h, q_h = float(p[head].sum()), float(q[head].sum())
    rho = max(1 - q_h, 1e-6) / max(1 - p_h, 1e-6)
    q_hat = torch.where(in_head, q, rho * p)
    assume(bool((q_hat > 1e-300).all()) and bool((p > 1e-300).all()))
    coef = q_hat * op_f(p / q_hat, corr)
    w = op_f(p[y] / q[y], corr)
    if corr.batch_normalize:  # a single token: the batch mean is its own weight
        coef, w = (coef / w, w / w) if float(w) > 0 else (coef, w)
    loss = -adv[0] * (w * logp[y] - (coef * logp).sum())
    loss.backward()
    torch.testing.assert_close(zz.grad, zd.grad, rtol=1e-7, atol=1e-10 * float(zd.grad.abs().max()) + 1e-12 / tau)


def op_f(r, corr):
    from offpolicy.reference import f

    return f(r, corr)


@given(distributions(), st.data())
def test_plain_importance_sampling_is_unbiased(dist, data):
    """7.3: f(r) = r, no bounds, no SC: E_q[grad] = E_p[grad of -A log p]."""
    z, tau, q = dist
    v = z.numel()
    assume(bool((q > 1e-12).all()))
    p = torch.softmax(z / tau, 0)
    assume(float((torch.log(p) - torch.log(q)).abs().max()) < 40)
    adv_of = torch.tensor(data.draw(st.lists(st.floats(-2, 2), min_size=v, max_size=v)), dtype=torch.float64)
    tokens = torch.arange(v)
    is_corr = op.Correction(weights="mis", bounds=(0.0, 1e30), max_log_ratio=40.0)
    g_is, scale = _enumerate_grad(z, tau, tokens, torch.log(q), adv_of * q, None, is_corr)
    g_on, _ = _enumerate_grad(z, tau, tokens, torch.log(p), adv_of * p, None, op.Correction())
    torch.testing.assert_close(g_is, g_on, rtol=1e-8, atol=1e-9 * float(scale) + 1e-300)


@given(st.integers(2, 6), st.integers(8, 20), st.sampled_from(MODES + [op.Correction(weights="tis")]),
       st.floats(-50, 50), st.integers(0, 10**6))
def test_support_invariances(n, v, corr, shift, seed):
    """7.4: zero gradient outside S; invariant to logits outside S and to a constant shift."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(n, v, generator=gen, dtype=torch.float64) * 2
    k = 4
    ids = torch.stack([torch.randperm(v, generator=gen)[:k] for _ in range(n)])
    lqc = torch.log_softmax(torch.randn(n, k, generator=gen, dtype=torch.float64), 1)
    pick = torch.randint(0, k, (n,), generator=gen)
    y, lq = ids.gather(1, pick[:, None])[:, 0], lqc.gather(1, pick[:, None])[:, 0]
    cands = op.Candidates(ids, lqc, "support")
    adv = torch.randn(n, generator=gen, dtype=torch.float64)

    def run(logits):
        zz = logits.clone().requires_grad_()
        out = op.policy_loss(zz, y, lq, adv, cands, correction=corr)
        out.loss.backward()
        return out.loss.detach(), zz.grad

    loss0, g0 = run(z)
    inside = torch.zeros(n, v, dtype=torch.bool).scatter_(1, ids, True)
    assert bool((g0[~inside] == 0).all())
    noise = torch.randn(n, v, generator=gen, dtype=torch.float64) * 30
    loss1, g1 = run(torch.where(inside, z, noise))
    loss2, g2 = run(z + shift)
    torch.testing.assert_close(loss1, loss0, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g1, g0, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(loss2, loss0, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(g2, g0, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("support", [False, True])
@pytest.mark.parametrize("per_token_tau", [False, True])
def test_gradcheck_primitive(support, per_token_tau):
    """7.5: the primitive's closed-form backward agrees with finite differences (gradcheck, float64).

    The loss itself holds stop-gradients (``sg(w)``, ``sg(c)``), so finite differences of the loss value are not
    its gradient; its gradient is checked against autograd through the dense reference in
    test_loss_reference.py, and here against gradcheck for plain REINFORCE, which has no stop-gradient.
    """
    from support.batches import make_batch

    z, y, _, cands = make_batch(5, 9, 4, "support" if support else "head", seed=2, empty_row=None)
    cands.ids[1, 2:] = -1
    tau = torch.tensor([0.5, 1.0, 2.0, 0.7, 1.3], dtype=torch.float64) if per_token_tau else 0.8
    valid = cands.ids >= 0

    def fn(logits):
        out = op.sparse_log_softmax(logits, y, cands.ids, tau, support=support)
        return out.target, torch.where(valid, out.candidates, torch.zeros_like(out.candidates))

    # nondet_tol: on CPU the first backward rescales the forward's cached exponentials and a repeated backward
    # (gradcheck runs several through one graph) recomputes them from the logits; both are exact to rounding.
    assert torch.autograd.gradcheck(fn, (z.clone().requires_grad_(),), eps=1e-6, atol=1e-7, nondet_tol=1e-12)


@pytest.mark.parametrize("kind", ["head", "support", None])
def test_gradcheck_plain_reinforce(kind):
    from support.batches import make_batch

    z, y, lq, cands = make_batch(5, 9, 4, kind or "head", seed=3, empty_row=None)
    adv = torch.randn(5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def fn(logits):
        return op.policy_loss(logits, y, lq.double(), adv, cands if kind else None, temperature=0.6).loss

    assert torch.autograd.gradcheck(fn, (z.clone().requires_grad_(),), eps=1e-6, atol=1e-7, nondet_tol=1e-12)


@given(st.integers(1, 8), st.integers(3, 30), st.sampled_from(["head", "support", None]),
       st.sampled_from(MODES + [op.Correction()]), st.integers(0, 10**6))
def test_masked_tokens_and_padding_contribute_nothing(n, v, kind, corr, seed):
    """7.6: untrained tokens and -1 padding change nothing; a fully masked batch gives 0, not NaN."""
    from support.batches import make_batch

    z, y, lq, cands = make_batch(n, v, min(3, v), kind or "head", seed=seed, empty_row=None)
    cands = cands if kind else None
    if kind is None and corr.score_centering:
        corr = dataclasses.replace(corr, score_centering=False)  # centering needs a record (it raises without one)
    gen = torch.Generator().manual_seed(seed)
    adv = torch.randn(n, generator=gen)
    mask = torch.rand(n, generator=gen) > 0.4

    def run(logits, lq_, adv_, cands_, mask_):
        zz = logits.clone().requires_grad_()
        out = op.policy_loss(zz, y, lq_, adv_, cands_, mask_, correction=corr)
        out.loss.backward()
        return out.loss.detach(), zz.grad

    loss0, g0 = run(z, lq, adv, cands, mask)
    # Scramble everything on untrained rows: logits, sampler log-probs, advantages.
    z2 = torch.where(mask[:, None], z, torch.randn(z.shape, generator=gen, dtype=torch.float64) * 50)
    lq2 = torch.where(mask, lq, torch.full_like(lq, float("nan")))
    adv2 = torch.where(mask, adv, torch.full_like(adv, 1e6))
    loss1, g1 = run(z2, lq2, adv2, cands, mask)
    torch.testing.assert_close(loss1, loss0, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g1[mask], g0[mask], rtol=1e-12, atol=1e-14)
    assert bool((g1[~mask] == 0).all())
    if cands is not None:  # extra padding columns change nothing
        padded = op.Candidates(torch.cat([cands.ids, torch.full((n, 2), -1)], 1),
                               torch.cat([cands.logprobs, torch.full((n, 2), float("-inf"))], 1), cands.kind)
        loss2, g2 = run(z, lq, adv, padded, mask)
        torch.testing.assert_close(loss2, loss0, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(g2, g0, rtol=1e-12, atol=1e-14)
    loss3, g3 = run(z, lq, adv, cands, torch.zeros(n, dtype=torch.bool))
    assert float(loss3) == 0.0 and bool((g3 == 0).all())


def test_drift_is_nonzero_without_centering():
    """Control for 7.1: the enumeration detects the drift of uncentered weights (the test can fail)."""
    z = torch.tensor([2.0, 0.0, -1.0, 0.5], dtype=torch.float64)
    q = torch.softmax(torch.tensor([0.0, 1.0, 0.0, -2.0], dtype=torch.float64), 0)
    tokens = torch.arange(4)
    for corr in (op.Correction(), op.Correction(weights="mis", bounds=(0.1, 4.0))):
        grad, scale = _enumerate_grad(z, 1.0, tokens, torch.log(q), q, _complete_head(q, 4, tokens), corr)
        assert float(grad.abs().max()) > 1e-3 * float(scale)
