"""Float64 dense reference and random inputs for the fused linear log-softmax tests.

The reference builds the logits densely in float64 from ``hidden`` and ``weight``, takes ``log_softmax`` (over the
vocabulary, or over each row's candidate support) and gathers; gradients come from autograd through it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from offpolicy.ops import linear_sparse_log_softmax

from support.vocab_reference import distinct_ids

INF = float("inf")


def make_inputs(n=23, d=16, v=197, k=6, dtype=torch.float32, seed=0, scale=1.0, bias=True, pad_frac=0.2,
                per_token_temp=True):
    """Random ``hidden [N, D]``, ``weight [V, D]``, ``bias [V]``, targets, candidates (distinct within a row,
    padding ``-1``), temperature."""
    gen = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, d, generator=gen) * scale).to(dtype)
    w = (torch.randn(v, d, generator=gen) / d**0.25).to(dtype)
    b = (torch.randn(v, generator=gen)).to(dtype) if bias else None
    y = torch.randint(0, v, (n,), generator=gen)
    c = distinct_ids(n, v, k, gen, pad_frac)
    if n > 2 and k > 1:
        c[1] = -1  # an empty candidate row
        if not bool((c[2] == y[2]).any()):
            c[2, 0] = y[2]  # the target inside its candidates (once: a support holds each id once)
    tau = (0.3 + 2.0 * torch.rand(n, generator=gen)) if per_token_temp else 0.7
    return h, w, b, y, c, tau


def dense_reference(h, w, b, y, c, tau, *, support=False, skip=None):
    """float64 ``(target, candidates, lse, entropy)`` and the float64 leaves ``(h, w, b)`` they depend on."""
    hd = h.detach().double().requires_grad_()
    wd = w.detach().double().requires_grad_()
    bd = None if b is None else b.detach().double().requires_grad_()
    n = hd.shape[0]
    c = torch.empty(n, 0, dtype=torch.int64) if c is None else c.long()
    inv = 1.0 / (tau.double() if isinstance(tau, Tensor) else torch.full((n,), float(tau), dtype=torch.float64))
    z = hd @ wd.T
    if bd is not None:
        z = z + bd
    x = z * inv[:, None]
    ids = torch.cat([y.long()[:, None], c], dim=1)
    xi = x.gather(1, ids.clamp_min(0))
    if support:
        xc = xi[:, 1:].masked_fill(c < 0, -INF)
        has = torch.isfinite(xc).any(dim=1) if xc.shape[1] else torch.zeros(n, dtype=torch.bool)
        lse = torch.full((n,), INF, dtype=torch.float64)
        ent = torch.zeros(n, dtype=torch.float64)
        if bool(has.any()):
            rows = xc[has]
            lse_h = torch.logsumexp(rows, dim=1)
            lse = lse.masked_scatter(has, lse_h)
            lp = rows - lse_h[:, None]
            pr = lp.exp()
            ent = ent.masked_scatter(has, -torch.where(pr > 0, pr * lp, torch.zeros_like(pr)).sum(1).detach())
    else:
        lse = torch.logsumexp(x, dim=1)
        lp = torch.log_softmax(x, dim=1)
        pr = lp.exp()
        ent = -torch.where(pr > 0, pr * lp, torch.zeros_like(pr)).sum(1).detach()
        has = torch.isfinite(lse)
        lse = torch.where(has, lse, torch.full_like(lse, INF))
    if skip is not None:
        lse = lse.masked_fill(skip, INF)
        ent = ent.masked_fill(skip, 0.0)
    logp = torch.where(torch.isfinite(lse)[:, None], xi - torch.where(torch.isfinite(lse), lse, 0.0)[:, None], -INF)
    logp = logp.masked_fill(ids < 0, -INF)
    return (logp[:, 0], logp[:, 1:], lse.detach(), ent), (hd, wd, bd)


def probe_weights(n: int, k: int, seed: int = 1) -> tuple[Tensor, Tensor]:
    """The float64 weights ``[N]`` and ``[N, K]`` that :func:`probe_loss` puts on the outputs."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen, dtype=torch.float64), torch.randn(n, k, generator=gen, dtype=torch.float64)


def probe_loss(target: Tensor, cands: Tensor, seed: int = 1) -> Tensor:
    """A random linear functional of the finite outputs (so every finite entry gets a distinct gradient)."""
    gy, gc = probe_weights(target.shape[0], cands.shape[1], seed)
    gy, gc = gy.to(target.device), gc.to(target.device)
    t = torch.where(torch.isfinite(target), target, torch.zeros_like(target)).double()
    k = torch.where(torch.isfinite(cands), cands, torch.zeros_like(cands)).double()
    return (gy * t).sum() + (gc * k).sum()


def grads(loss: Tensor, leaves) -> list[Tensor | None]:
    present = [x for x in leaves if x is not None]
    got = iter(torch.autograd.grad(loss, present, allow_unused=True))
    return [None if x is None else next(got) for x in leaves]


#: (value tolerance relative to 1 + max|x|, gradient tolerance relative to the largest entry); see the module
#: docstring of tests/test_linear_log_softmax.py for the derivation.
TOL = {torch.float32: (2e-5, 1e-4), torch.float16: (2e-5, 1e-3), torch.bfloat16: (2.0**-7, 2e-2)}


def leaves(h, w, b):
    return [h.clone().requires_grad_(), w.clone().requires_grad_(), None if b is None else b.clone().requires_grad_()]


def check_against_reference(h, w, b, y, c, tau, *, support, skip=None, chunk_bytes=None, dtype=torch.float32,
                            backend=None, device="cpu", grad_filter=None):
    """Run the fused op on ``device`` and compare values and gradients with :func:`dense_reference` (see TOL)."""
    vtol, gtol = TOL[dtype]
    dev = torch.device(device)
    hl, wl, bl = leaves(*(None if x is None else x.to(dev) for x in (h, w, b)))
    mv = [None if x is None else x.to(dev) for x in (y, c, tau if isinstance(tau, Tensor) else None, skip)]
    out = linear_sparse_log_softmax(hl, wl, mv[0], mv[1], tau if mv[2] is None else mv[2], bias=bl, support=support,
                                    skip=mv[3], chunk_bytes=chunk_bytes, backend=backend, grad_filter=grad_filter)
    out = type(out)(*(None if x is None else x.cpu() for x in out))
    (rt, rc, rlse, rent), ref_leaves = dense_reference(h, w, b, y, c, tau, support=support, skip=skip)
    for got in out[:4]:  # sum_p2 is None here (tests/ops/test_sum_p2.py checks it)
        assert got.dtype == torch.float32
    scale = 1.0 + float(torch.nan_to_num(rlse, posinf=0.0).abs().max()) if rlse.numel() else 1.0
    for got, ref in ((out.target, rt), (out.candidates, rc), (out.lse, rlse), (out.entropy, rent)):
        ref = ref.detach()
        assert torch.equal(torch.isfinite(got), torch.isfinite(ref)), "finite pattern differs"
        assert torch.equal(got == -float("inf"), ref == -float("inf"))
        fin = torch.isfinite(ref)
        if bool(fin.any()):
            err = float((got.detach().double()[fin] - ref[fin]).abs().max())
            assert err <= vtol * scale, f"value error {err} > {vtol * scale}"
    got_g = [None if g is None else g.cpu() for g in grads(probe_loss(out.target, out.candidates), [hl, wl, bl])]
    ref_g = grads(probe_loss(rt, rc), list(ref_leaves))
    gy, gc = probe_weights(rt.shape[0], rc.shape[1])
    inv = 1.0 / (tau.double() if isinstance(tau, Tensor) else torch.tensor(float(tau), dtype=torch.float64))
    term = float(((gy.abs() + gc.abs().sum(1)) * inv).max()) if gy.numel() else 0.0
    term *= max(1.0, float(h.abs().max()) if h.numel() else 0.0, float(w.abs().max()) if w.numel() else 0.0)
    for name, g, r in zip(("dX", "dW", "dbias"), got_g, ref_g):
        if r is None:
            assert g is None or b is None
            continue
        assert g.dtype == {"dX": h.dtype, "dW": w.dtype, "dbias": None if b is None else b.dtype}[name]
        assert g.shape == r.shape
        if r.numel() == 0:
            continue
        # Floor: where the exact gradient cancels (V = 1, repeated ids) rounding leaves residues of the terms
        # that cancel, each of size up to term = max_n(sum_j |g_nj| / tau_n) * max(|h|, |W|, 1).
        top = float(r.abs().max())
        err = float((g.double() - r).abs().max())
        assert err <= gtol * max(top, 1e-2 * term), f"{name} error {err} vs largest entry {top}"
    return out


def dense_sum_p2(h, w, b, y, c, tau, *, support=False, skip=None) -> Tensor:
    """float64 ``sum_v p(v)^2`` per row of ``softmax((h W^T + b) / tau)`` (full vocabulary), or with ``support``
    of the distribution renormalised over the row's candidates (``-1`` padding left out); 0 on skipped rows and
    rows without mass. Written out directly from the logits, sharing nothing with the statistics under test."""
    n = h.shape[0]
    inv = 1.0 / (tau.double() if isinstance(tau, Tensor) else torch.full((n,), float(tau), dtype=torch.float64))
    z = h.detach().double() @ w.detach().double().T
    if b is not None:
        z = z + b.detach().double()
    x = z * inv[:, None]
    if support:
        c = c.long()
        x = x.gather(1, c.clamp_min(0)).masked_fill(c < 0, -INF)
    out = torch.zeros(n, dtype=torch.float64)
    for i in range(n):
        row = x[i][x[i] > -INF]
        if row.numel() and not (skip is not None and bool(skip[i])):
            p = torch.softmax(row, dim=0)
            out[i] = (p * p).sum()
    return out
