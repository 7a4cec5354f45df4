"""Candidates (CSR), advantages, metrics against the reference, and the chunked CPU backend's edge cases."""

from __future__ import annotations

import math

import pytest
import torch

import offpolicy as op
from offpolicy.ops import torch_backend
from offpolicy.reference import log_probs, reference_metrics, reference_policy_loss

from support.batches import make_batch


def test_from_csr_round_trip():
    ids = torch.tensor([3, 1, 4, 7, 2])
    lp = torch.log(torch.tensor([0.5, 0.5, 1.0, 0.3, 0.7]))
    offsets = torch.tensor([0, 2, 2, 3, 5])
    c = op.Candidates.from_csr(ids, offsets, lp, "support")
    assert c.ids.tolist() == [[3, 1], [-1, -1], [4, -1], [7, 2]]
    assert torch.equal(c.logprobs[1], torch.full((2,), -math.inf))
    c.validate(10, 4, torch.tensor([1, 0, 4, 2]))
    wide = op.Candidates.from_csr(ids, offsets, lp, "support", width=3)
    assert wide.width == 3
    with pytest.raises(ValueError, match="more than width=1"):
        op.Candidates.from_csr(ids, offsets, lp, width=1)
    with pytest.raises(ValueError, match="start at 0 and end at nnz=5"):
        op.Candidates.from_csr(ids, torch.tensor([0, 2, 4]), lp)
    with pytest.raises(ValueError, match="non-decreasing"):
        op.Candidates.from_csr(ids, torch.tensor([0, 3, 2, 5]), lp)


def test_advantages():
    r = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.5])
    g = torch.tensor([0, 0, 0, 0, 9, 9])
    a = op.advantages.grpo(r, g)
    top = r[:4] - 0.75
    torch.testing.assert_close(a[:4], (top / (top.square().mean().sqrt() + 1e-6)).float())
    assert torch.equal(a[4:], torch.zeros(2))
    torch.testing.assert_close(op.advantages.dr_grpo(r, g)[:4], top)
    loo = op.advantages.rloo(r, g)
    torch.testing.assert_close(loo[0], torch.tensor(1.0 - 2.0 / 3.0))
    torch.testing.assert_close(loo[1], torch.tensor(0.0 - 1.0))
    assert torch.equal(op.advantages.per_token(a, torch.tensor([0, 0, 2])), a[[0, 0, 2]])
    with pytest.raises(ValueError, match="finite"):
        op.advantages.grpo(torch.tensor([float("nan")]), torch.tensor([0]))
    with pytest.raises(ValueError, match="group_ids must have the shape of rewards \\[B\\]"):
        op.advantages.rloo(r, g[:3])


@pytest.mark.parametrize("corr", [op.Correction(), op.Correction(weights="mis", bounds=(0.7, 1.4)),
                                  op.Correction(weights="tis", bounds=1.2)])
def test_metrics_match_reference(corr):
    z, y, lq, cands = make_batch(40, 30, 4, "head", seed=7, mismatch=1.5)
    mask = torch.rand(40, generator=torch.Generator().manual_seed(0)) > 0.3
    adv = torch.randn(40, generator=torch.Generator().manual_seed(1))
    out = op.policy_loss(z, y, lq, adv, cands, mask, correction=corr)
    _, _, w = reference_policy_loss(z, y, lq, adv, cands, mask, correction=corr)
    ref = reference_metrics(z, y, lq, adv, cands, mask, correction=corr)
    assert set(ref) == set(out.metrics)
    for key, val in ref.items():
        assert math.isclose(float(out.metrics[key]), val, rel_tol=1e-9, abs_tol=1e-12), key
    assert float(out.metrics["num_tokens"]) == int(mask.sum())
    assert math.isclose(float(out.metrics["weight_max"]), float(w[mask].max()), rel_tol=1e-12)


def test_group_and_staleness_metrics():
    z, y, lq, cands = make_batch(40, 30, 4, "head", seed=8, mismatch=2.0)
    groups = torch.arange(40) % 3
    versions = torch.tensor([5, 4, 3, 5] * 10)
    seq = torch.arange(40) // 4
    out = op.policy_loss(z, y, lq, torch.randn(40), cands, groups=groups, versions=versions, seq_ids=seq)
    m = out.metrics
    shares = [float(m[f"group/{g}/share_tokens"]) for g in range(3)]
    assert math.isclose(sum(shares), 1.0) and math.isclose(shares[0], 14 / 40)
    extreme = [float(m[f"group/{g}/share_extreme"]) for g in range(3)]
    assert float(m["extreme_ratio_frac"]) > 0 and math.isclose(sum(extreme), 1.0)
    # Every sequence (4 consecutive tokens) holds a token of each of the 3 groups: each group touches all 10.
    assert [float(m[f"group/{g}/share_samples"]) for g in range(3)] == [1.0, 1.0, 1.0]
    for g in range(3):
        sel = groups == g
        k3 = (torch.expm1(out.log_ratio[sel]) - out.log_ratio[sel]).mean()
        assert math.isclose(float(m[f"group/{g}/kl_k3"]), float(k3), rel_tol=1e-9)
    assert math.isclose(float(m["staleness/0/share_tokens"]), 0.5)
    assert math.isclose(float(m["staleness/2/share_tokens"]), 0.25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("support", [False, True])
def test_chunking_skip_and_inplace(dtype, support, monkeypatch):
    """Tiny chunks (many chunk boundaries), skipped rows, and the in-place gradient all give the same result."""
    monkeypatch.setattr(torch_backend, "CHUNK_BYTES", 3 * 4 * 37)  # 3 rows of 37 fp32 per chunk
    z, y, _, cands = make_batch(11, 37, 5, "support" if support else "head", seed=4)
    z = z.to(dtype)
    skip = torch.zeros(11, dtype=torch.bool)
    skip[[0, 4, 5, 10]] = True
    g_t, g_c = torch.randn(11, dtype=torch.float64), torch.randn(11, 5, dtype=torch.float64)
    g_t[skip], g_c[skip] = 0, 0
    valid = cands.ids >= 0
    tau = torch.linspace(0.5, 2.0, 11)

    def run(inplace, skip_rows):
        leaf = z.clone().requires_grad_()
        zz = leaf.clone() if inplace else leaf  # in-place needs a non-leaf buffer it may overwrite
        out = op.sparse_log_softmax(zz, y, cands.ids, tau, support=support, skip=skip_rows, inplace_grad=inplace)
        loss = (out.target.double() * g_t).sum() + torch.where(valid, out.candidates.double() * g_c, 0).sum()
        loss.backward()
        return out, leaf.grad

    base, g0 = run(False, None)
    skipped, g1 = run(False, skip)
    inplace, g2 = run(True, skip)
    live = ~skip
    torch.testing.assert_close(skipped.target[live], base.target[live])
    torch.testing.assert_close(skipped.entropy[live], base.entropy[live])
    assert bool(torch.isinf(skipped.lse[skip]).all()) and bool((skipped.target[skip] == -math.inf).all())
    torch.testing.assert_close(g1, g0)
    torch.testing.assert_close(g2, g1)
    assert bool((g1[skip] == 0).all())
    # Against the float64 reference, on the same (rounded) logits.
    ref_lp = log_probs(z.double(), tau.double(), op.reference.support_mask(cands, 37) if support else None)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype != torch.float64 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(base.target.double(), ref_lp[torch.arange(11), y], **tol)


def test_cached_exponentials_and_retained_graph():
    """CPU fp32/fp64 logits: the backward rescales the forward's cached exp(x - m); a second backward through a
    retained graph recomputes from the logits. Both equal the bf16-free recompute path (here: the fp32 logits
    under the library path, forced with inplace_grad on a copy) to rounding."""
    z, y, _, cands = make_batch(9, 50, 4, "head", seed=6)
    z = z.float()
    g_t = torch.randn(9)
    leaf = z.clone().requires_grad_()
    out = op.sparse_log_softmax(leaf, y, cands.ids, 0.7)
    loss = (out.target * g_t).sum()
    loss.backward(retain_graph=True)
    first = leaf.grad.clone()
    leaf.grad = None
    loss.backward()
    torch.testing.assert_close(leaf.grad, first, rtol=1e-6, atol=1e-7)
    ref = z.double().requires_grad_()
    (torch.log_softmax(ref / 0.7, 1)[torch.arange(9), y] * g_t.double()).sum().backward()
    torch.testing.assert_close(first.double(), ref.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_gradient_all_rows_live(inplace, dtype, monkeypatch):
    """16-bit logits, every row trained, the target repeated among the candidates: each gradient entry (its two
    terms added in fp32 first) is rounded once to 16 bits, so it lies within half an ulp of float64."""
    monkeypatch.setattr(torch_backend, "CHUNK_BYTES", 4 * 4 * 64)  # several chunks
    z, y, _, cands = make_batch(10, 64, 6, "head", seed=8, empty_row=None)
    ids = cands.ids.clone()
    ids[:, 0] = y  # the sampled token is also a candidate: its two gradient terms must add before rounding
    ids[:, 1:] = torch.where(ids[:, 1:] == y[:, None], (y[:, None] + 1) % 64, ids[:, 1:])
    z = z.to(dtype)
    gen = torch.Generator().manual_seed(3)
    g_t, g_c = torch.randn(10, generator=gen), torch.randn(10, 6, generator=gen)
    tau = torch.linspace(0.6, 1.5, 10)
    leaf = z.clone().requires_grad_()
    zz = leaf.clone() if inplace else leaf
    out = op.sparse_log_softmax(zz, y, ids, tau, inplace_grad=inplace)
    ((out.target * g_t).sum() + (out.candidates * g_c).sum()).backward()
    ref = z.double().requires_grad_()
    lp = log_probs(ref, tau.double())
    ((lp[torch.arange(10), y] * g_t.double()).sum() + (lp.gather(1, ids) * g_c.double()).sum()).backward()
    # One rounding: within half an ulp of the exact value (|x| in [2**(e-1), 2**e) has ulp 2**(e-1-mantissa bits)),
    # plus the fp32 arithmetic's own error, relative to the terms that cancel at an id (g and G p, both at most
    # the row's largest entry): 1e-6 of the row's largest gradient.
    bits = 7 if dtype == torch.bfloat16 else 10
    _, e = torch.frexp(ref.grad)
    half_ulp = torch.ldexp(torch.ones_like(ref.grad), e - 2 - bits).clamp_min(torch.finfo(dtype).smallest_normal
                                                                          * 2.0**-bits / 2)  # subnormal spacing
    err = (leaf.grad.double() - ref.grad).abs()
    fp32_err = 1e-6 * ref.grad.abs().amax(dim=1, keepdim=True)
    assert bool((err <= half_ulp + fp32_err).all()), float((err / half_ulp).max())


@pytest.mark.parametrize("weights", ["mis", "reject"])
@pytest.mark.parametrize("bounds", [(1.0, 2.0), (0.5, 1.0)])
def test_ratio_bounds_are_inclusive(weights, bounds):
    """``log r = 0`` exactly at a bound ``L = 1`` or ``U = 1`` is kept (weight 1), in the fast path and the
    reference alike; just outside the bound it is masked."""
    from offpolicy.reference import f as reference_f

    lq = torch.tensor([-1.25, -0.5, -2.0], dtype=torch.float64)
    corr = op.Correction(weights=weights, bounds=bounds)
    outside = -1e-12 if bounds[0] == 1.0 else 1e-12
    logp = lq + torch.tensor([0.0, 0.0, outside], dtype=torch.float64)
    out = op.policy_loss_from_logprobs(logp, lq, torch.ones(3, dtype=torch.float64), correction=corr)
    assert out.token_weight.tolist() == [1.0, 1.0, 0.0]
    assert reference_f(torch.exp(logp - lq), corr).tolist() == [1.0, 1.0, 0.0]
