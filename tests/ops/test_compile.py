"""Both primitives under ``torch.compile(fullgraph=True)`` and their custom ops under ``torch.library.opcheck``,
parametrised over the registered backends.

Without a GPU the Triton backend runs in the interpreter and is compiled with ``aot_eager`` (inductor would only
wrap the same opaque op); the torch backend is compiled with inductor. Each compiled result is compared with an
eager call on fresh leaves.
"""

from __future__ import annotations

import pytest
import torch

import offpolicy as op
import offpolicy.ops as ops
from offpolicy.ops import backend_registry, library

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
BACKENDS = sorted(backend_registry.BACKENDS)


def _compiler(backend: str) -> str:
    return "aot_eager" if backend_registry.get(backend).needs_kernels and not CUDA else "inductor"


def _rows(gen, n, v, k):
    y = torch.randint(0, v, (n,), generator=gen)
    c = torch.where(torch.rand(n, k, generator=gen) < 0.3, -1, torch.randint(0, v, (n, k), generator=gen))
    return y.to(DEVICE), c.to(DEVICE)


@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_custom_ops_opcheck(backend):
    """Schemas (the in-place op declares its mutation), fake kernels, AOT dispatch of the logits op's custom ops."""
    gen = torch.Generator().manual_seed(9)
    z = torch.randn(4, 50, generator=gen).to(DEVICE)
    inv = torch.full((4,), 1.2, device=DEVICE)
    skip = torch.tensor([False, True, False, False], device=DEVICE)
    ids = torch.tensor([[1, 1, -1], [2, 3, 4], [0, 49, 7], [5, 5, 5]], device=DEVICE)
    g = torch.where(ids >= 0, torch.randn(4, 3, generator=gen).to(DEVICE), 0.0)
    lse = torch.logsumexp(z * inv[:, None], 1)
    for custom, args in [
        (library.full_stats, (z, inv, skip, backend)),
        (library.full_grad, (z, ids, inv, lse, g, g.sum(1), backend)),
        (library.full_grad_inplace_, (z.clone(), ids, inv, lse, g, g.sum(1), backend)),
    ]:
        result = torch.library.opcheck(custom, args)
        assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_custom_ops_opcheck(backend, with_bias):
    """The fused-linear op's custom ops: schemas, fake kernels (incl. the empty 'not needed' gradients)."""
    gen = torch.Generator().manual_seed(10)
    n, d, v = 5, 8, 40
    h = torch.randn(n, d, generator=gen).to(DEVICE)
    w = torch.randn(v, d, generator=gen).to(DEVICE)
    b = torch.randn(v, generator=gen).to(DEVICE) if with_bias else None
    ids = torch.tensor([[1, 1, -1], [2, 3, 4], [0, 39, 7], [5, 5, 5], [9, -1, -1]], device=DEVICE)
    inv = torch.full((n,), 0.8, device=DEVICE)
    lse = torch.logsumexp((h @ w.T + (0 if b is None else b)) * inv[:, None], 1)
    dz = torch.where(ids >= 0, torch.randn(n, 3, generator=gen).to(DEVICE), 0.0)
    coef = -dz.sum(1)
    cases = [
        (library.linear_gathered_logits, (h, w, b, ids, 1 << 16, backend)),
        (library.linear_full_stats, (h, w, b, ids, inv, 1 << 16, backend)),
        (library.linear_backward, (h, w, b, ids, dz, inv, lse, coef, 1 << 16, None, True, True, with_bias, backend)),
        (library.linear_backward, (h, w, b, ids, dz, inv, lse, None, 1 << 16, None, True, False, False, backend)),
    ]
    for custom, args in cases:
        result = torch.library.opcheck(custom, args)
        assert set(result.values()) == {"SUCCESS"}, result


def _logits_loss(z, y, c, tau, support, backend):
    out = ops.sparse_log_softmax(z, y, c, tau, support=support, backend=backend)
    return out.target.sum() + torch.where(c >= 0, out.candidates, 0.0).sum(), out.entropy


def _linear_loss(h, w, b, y, c, tau, support, backend):
    out = ops.linear_sparse_log_softmax(h, w, y, c, tau, bias=b, support=support, backend=backend)
    return out.target.sum() + torch.where(c >= 0, out.candidates, 0.0).sum(), out.entropy


@pytest.mark.parametrize("backend", BACKENDS)
def test_compile_fullgraph_sparse_log_softmax(backend):
    """The logits primitive traces without graph breaks (full and support mode) and matches eager."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(7)
    z = torch.randn(6, 300, generator=gen).to(DEVICE)
    y, c = _rows(gen, 6, 300, 4)
    tau = torch.linspace(0.5, 2.0, 6, device=DEVICE)
    fn = torch.compile(_logits_loss, fullgraph=True, backend=_compiler(backend))
    for support in (False, True):
        got_z, want_z = z.clone().requires_grad_(), z.clone().requires_grad_()
        loss, ent = fn(got_z, y, c, tau, support, backend)
        loss.backward()
        want, want_ent = _logits_loss(want_z, y, c, tau, support, backend)
        want.backward()
        torch.testing.assert_close(loss, want)
        torch.testing.assert_close(ent, want_ent)
        torch.testing.assert_close(got_z.grad, want_z.grad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compile_fullgraph_linear_sparse_log_softmax(backend):
    """The fused-linear primitive traces without graph breaks (full and support mode) and matches eager in the
    gradients of hidden, weight and bias."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(11)
    n, d, v = 6, 16, 90
    h = torch.randn(n, d, generator=gen).to(DEVICE)
    w = (torch.randn(v, d, generator=gen) / 2).to(DEVICE)
    b = torch.randn(v, generator=gen).to(DEVICE)
    y, c = _rows(gen, n, v, 4)
    tau = torch.linspace(0.5, 2.0, n, device=DEVICE)
    fn = torch.compile(_linear_loss, fullgraph=True, backend=_compiler(backend))
    for support in (False, True):
        got = [x.clone().requires_grad_() for x in (h, w, b)]
        want = [x.clone().requires_grad_() for x in (h, w, b)]
        loss, ent = fn(*got, y, c, tau, support, backend)
        loss.backward()
        want_loss, want_ent = _linear_loss(*want, y, c, tau, support, backend)
        want_loss.backward()
        torch.testing.assert_close(loss, want_loss)
        torch.testing.assert_close(ent, want_ent)
        for a, e in zip(got, want):
            torch.testing.assert_close(a.grad, e.grad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compile_fullgraph_policy_loss(backend):
    """``op.policy_loss`` (head candidates, MIS + score centering) under ``torch.compile(fullgraph=True)`` with
    aot_eager: tracing, fake kernels and the joint graph, without inductor's codegen."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(8)
    n, v, k = 8, 64, 4
    z = torch.randn(n, v, generator=gen).to(DEVICE)
    y = torch.randint(0, v, (n,), generator=gen).to(DEVICE)
    lq = (torch.log_softmax(torch.randn(n, v, generator=gen), 1).gather(1, y.cpu()[:, None])[:, 0]).to(DEVICE)
    adv = torch.randn(n, generator=gen).to(DEVICE)
    ids = torch.stack([torch.randperm(v, generator=gen)[:k] for _ in range(n)]).to(DEVICE)
    cands = op.Candidates(ids, torch.full((n, k), -3.0, device=DEVICE), "head")
    corr = op.Correction(weights="mis", bounds=(0.5, 5.0), score_centering=True)

    def loss_fn(z):
        return op.policy_loss(z, y, lq, adv, cands, temperature=0.9, correction=corr, backend=backend).loss

    got_z, want_z = z.clone().requires_grad_(), z.clone().requires_grad_()
    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    got = compiled(got_z)
    got.backward()
    want = loss_fn(want_z)
    want.backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_z.grad, want_z.grad)
    # Issue 40: the padded record's checks run in the full graph too (same shapes: no recompile).
    for bad, match in ((v + 3, f"id {v + 3} is out of range"), (-5, "padding must be -1")):
        cands.ids[2, 1] = bad
        with pytest.raises(ValueError, match=match):
            compiled(z)
    cands.ids[2, 1] = cands.ids[2, 0]
    with pytest.raises(ValueError, match="duplicate id within row 2"):
        compiled(z)


def test_compiled_policy_loss_checks_records_with_default_arguments():
    """Issue 40: under ``torch.compile`` with default arguments (inductor, ``validate=True``) the loss skipped every
    record check: a CSR id of -5 and a duplicate id in every row ran, an id of V + 3 ended in an inductor bounds
    assert, offsets that go up and down corrupted the heap. The checks run in the graph (the custom op
    ``offpolicy::check_records``) and raise the eager call's errors; a good record gives the eager loss. One
    compiled function (the record is built inside it) serves every case, so it compiles once."""
    torch._dynamo.reset()
    n, v = 6, 20
    z = torch.randn(n, v, generator=torch.Generator().manual_seed(3))
    y = torch.arange(n) % v
    half = float(torch.log(torch.tensor(0.5)))
    lq, adv = torch.full((n,), half), torch.linspace(-1.0, 1.0, n)
    ids = torch.stack([y, (y + 1) % v], 1).reshape(-1)  # support {y, y + 1}, renormalised: 1/2 each
    off = torch.arange(0, 2 * n + 1, 2)
    lp = torch.full((2 * n,), half)

    def loss(z, y, ids, off):
        return op.policy_loss(z, y, lq, adv, op.CSRCandidates(ids, off, lp, "support")).loss

    compiled = torch.compile(loss)
    torch.testing.assert_close(compiled(z, y, ids, off), loss(z, y, ids, off))

    def changed(x, i, val):
        x = x.clone()
        x[i] = val
        return x

    dup = ids.clone()
    dup[1::2] = ids[0::2]
    cases = [
        ((y, changed(ids, 1, -5), off), "candidates.ids: id -5 is negative"),
        ((y, changed(ids, 1, v + 3), off), f"candidates.ids: id {v + 3} is out of range for vocabulary size {v}"),
        ((y, dup, off), "candidates.ids: duplicate id within row 0"),
        ((y, ids, changed(off, 2, 2**40)), r"candidates.offsets must be non-decreasing; offsets\[3\] < offsets\[2\]"),
        ((changed(y, 0, v + 3), ids, off), f"tokens: id {v + 3} is out of range for vocabulary size {v}"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            loss(z, *args)  # eager: the same error
        with pytest.raises(ValueError, match=match):
            compiled(z, *args)
