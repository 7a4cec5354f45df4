"""Random inputs and the comparison with the float64 reference for the fused linear log-softmax tests.

The reference is the op's own :mod:`offpolicy.ops.linear_op.linear_naive`: the logits built densely in float64 from
``hidden`` and ``weight``, ``log_softmax`` (over the vocabulary, or over each row's candidate support) and a gather;
gradients come from autograd through it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from offpolicy.ops import linear_sparse_log_softmax
from offpolicy.ops.linear_op import linear_naive

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
    """Run the fused op on ``device`` and compare values and gradients with the float64 reference
    (:func:`offpolicy.ops.linear_op.linear_naive.linear_sparse_log_softmax`; see TOL)."""
    vtol, gtol = TOL[dtype]
    dev = torch.device(device)
    hl, wl, bl = leaves(*(None if x is None else x.to(dev) for x in (h, w, b)))
    mv = [None if x is None else x.to(dev) for x in (y, c, tau if isinstance(tau, Tensor) else None, skip)]
    out = linear_sparse_log_softmax(hl, wl, mv[0], mv[1], tau if mv[2] is None else mv[2], bias=bl, support=support,
                                    skip=mv[3], chunk_bytes=chunk_bytes, backend=backend, grad_filter=grad_filter)
    out = type(out)(*(None if x is None else x.cpu() for x in out))
    (rt, rc, rlse, rent), ref_leaves = linear_naive.linear_sparse_log_softmax(h, w, b, y, c, tau, support=support,
                                                                              skip=skip)
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
