"""The CPU backends' edge cases (the chunked PyTorch backend, and the native ``cpu`` backend where the same checks
apply): chunk boundaries, skipped rows, the in-place gradient, the cached exponentials and a second backward, and
16-bit gradients rounded once."""

from __future__ import annotations

import math

import pytest
import torch

import offpolicy as op
from offpolicy.ops.logits_op import cpu_backend, torch_backend
from offpolicy.reference import log_probs

from support.batches import make_batch

CPU_BACKENDS = ["torch"] + (["cpu"] if cpu_backend.available() else [])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("support", [False, True])
def test_chunking_skip_and_inplace(backend, dtype, support, monkeypatch):
    """Tiny chunks (many chunk boundaries), skipped rows, and the in-place gradient all give the same result."""
    monkeypatch.setattr(torch_backend, "CHUNK_BYTES", 3 * 4 * 37)  # 3 rows of 37 fp32 per chunk
    monkeypatch.setattr(cpu_backend, "ROWS_PER_CALL", 3)
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
        out = op.sparse_log_softmax(zz, y, cands.ids, tau, support=support, skip=skip_rows, inplace_grad=inplace,
                                    backend=backend)
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
    out = op.sparse_log_softmax(leaf, y, cands.ids, 0.7, backend="torch")
    loss = (out.target * g_t).sum()
    loss.backward(retain_graph=True)
    first = leaf.grad.clone()
    leaf.grad = None
    loss.backward()
    torch.testing.assert_close(leaf.grad, first, rtol=1e-6, atol=1e-7)
    ref = z.double().requires_grad_()
    (torch.log_softmax(ref / 0.7, 1)[torch.arange(9), y] * g_t.double()).sum().backward()
    torch.testing.assert_close(first.double(), ref.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_gradient_all_rows_live(backend, inplace, dtype, monkeypatch):
    """16-bit logits, every row trained, the target repeated among the candidates: each gradient entry (its two
    terms added in fp32 first) is rounded once to 16 bits, so it lies within half an ulp of float64."""
    monkeypatch.setattr(torch_backend, "CHUNK_BYTES", 4 * 4 * 64)  # several chunks
    monkeypatch.setattr(cpu_backend, "ROWS_PER_CALL", 4)
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
    out = op.sparse_log_softmax(zz, y, ids, tau, inplace_grad=inplace, backend=backend)
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
