"""op.policy_loss(hidden=, weight=, bias=) gives the loss, metrics and gradients of the logits path on
``hidden @ weight.T + bias``, for every record kind and correction mode.

Tolerance: both paths compute in fp32 from the same fp32 inputs; they differ only in how the logits' dot products
and the chunked reductions are ordered (relative ~1e-6 on logits of size ~10), so losses agree to 1e-5 and
gradients to 1e-4 of their largest entry.
"""

from __future__ import annotations

import pytest
import torch

import offpolicy as op

CORRECTIONS = {
    "none": op.Correction(),
    "tis": op.Correction(weights="tis"),
    "mis_sc": op.Correction(weights="mis", bounds=(0.5, 5.0), score_centering=True),
}


def _batch(kind: str | None, n=24, d=12, v=90, k=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=gen)
    w = torch.randn(v, d, generator=gen) / 2
    b = torch.randn(v, generator=gen)
    ids = torch.stack([torch.randperm(v, generator=gen)[:k] for _ in range(n)])
    width = torch.randint(1, k + 1, (n,), generator=gen)
    ids = torch.where(torch.arange(k)[None, :] < width[:, None], ids, torch.full_like(ids, -1))
    tokens = ids[:, 0].clone()
    lp = torch.log_softmax(torch.randn(n, k, generator=gen).masked_fill(ids < 0, -float("inf")), 1)
    if kind == "head":
        lp = lp - 0.5
        lp = lp.masked_fill(ids < 0, -float("inf"))
        tokens[::3] = torch.randint(0, v, (len(tokens[::3]),), generator=gen)  # sampled outside the head
    lq = lp[:, 0].clone() if kind == "support" else torch.log(torch.rand(n, generator=gen)) - 1.0
    cands = None if kind is None else op.Candidates(ids, lp, kind)
    adv = torch.randn(n, generator=gen)
    mask = torch.rand(n, generator=gen) > 0.2
    tau = 0.5 + torch.rand(n, generator=gen)
    return h, w, b, tokens, lq, adv, cands, mask, tau


# Score centering needs a candidate record, so (no record, mis_sc) is not a valid combination.
CASES = [(kind, corr) for kind in ("head", "support", None) for corr in sorted(CORRECTIONS)
         if not (kind is None and CORRECTIONS[corr].score_centering)]


@pytest.mark.parametrize("kind, corr", CASES)
def test_hidden_path_equals_logits_path(kind, corr):
    h, w, b, tokens, lq, adv, cands, mask, tau = _batch(kind)
    h1, w1, b1 = (x.clone().requires_grad_() for x in (h, w, b))
    fused = op.policy_loss(hidden=h1, weight=w1, bias=b1, tokens=tokens, sampler_logprobs=lq, advantages=adv,
                           candidates=cands, loss_mask=mask, temperature=tau, correction=CORRECTIONS[corr])
    h2, w2, b2 = (x.clone().requires_grad_() for x in (h, w, b))
    dense = op.policy_loss(h2 @ w2.T + b2, tokens, lq, adv, cands, loss_mask=mask, temperature=tau,
                           correction=CORRECTIONS[corr])
    f_loss, d_loss = float(fused.loss.detach()), float(dense.loss.detach())
    assert abs(f_loss - d_loss) <= 1e-5 * max(1.0, abs(d_loss))
    assert torch.allclose(fused.token_loss, dense.token_loss, atol=1e-5, rtol=1e-5)
    for key, val in dense.metrics.items():
        got = fused.metrics[key]
        assert torch.allclose(got, val, atol=1e-5, rtol=1e-4, equal_nan=True), key
    g1 = torch.autograd.grad(fused.loss, [h1, w1, b1])
    g2 = torch.autograd.grad(dense.loss, [h2, w2, b2])
    for a, r in zip(g1, g2):
        assert float((a - r).abs().max()) <= 1e-4 * max(float(r.abs().max()), 1e-6)
