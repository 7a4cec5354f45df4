"""The fused support pass over CSR rows of any width (issue #42, :mod:`offpolicy.ops.support_pass`) against a float64
reference computed another way (a dense membership mask and ``logsumexp`` over the vocabulary), on every CPU backend
and the fused-linear path: ``K = V``, ``K = V - 1``, rows of mixed width (0 .. V ids) in one batch, a token outside
its support, untrained rows, ``-inf`` logits; fp32 and bf16, gradients included, with the tolerance model of
``tests/support/vocab_reference.py``. Then the cost's shape, without timing it: the number of dispatched tensor ops
does not grow with the number of rows (no Python loop over rows) and nothing ``[N, K_max]`` is ever allocated."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import offpolicy as op
from offpolicy.ops import backend_registry, support_pass
from offpolicy.ops.logits_op import cpu_backend, torch_backend
from support.vocab_reference import STORE_FLOOR, STORE_RTOL, arg_tol, assert_close_inf

V = 96
INF = float("inf")
#: row widths of the mixed batch: empty, 1, V, V - 1, and between
MIXED = [1, V, 0, V - 1, 2, V // 2, 7, V, 3, V - 1]
SHAPES = {"full": [V] * 6, "full-1": [V - 1] * 6, "mixed": MIXED}
BACKENDS = ["cpu", "torch"] if cpu_backend.available() else ["torch"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
#: The ``triton`` backend's support kernels (kernels/support_logsoftmax.py) run on a GPU where there is one, else in
#: Triton's interpreter (tests/conftest.py), at a few seconds per case: the mixed batch (widths 0, 1, V - 1, V, an
#: all ``-inf`` row, untrained rows) in every dtype, ``K = V`` and ``K = V - 1`` in fp32.
CUDA = torch.cuda.is_available()
TRITON_CASES = [("triton", "mixed", d) for d in DTYPES] + [("triton", s, torch.float32) for s in ("full", "full-1")]
LOGITS_CASES = [(b, s, d) for b in BACKENDS for s in SHAPES for d in DTYPES] + TRITON_CASES
#: the token-level gradient (no ``g_lp``: the kernel variant without it) on the mixed batch, fp32 and fp16
TOKEN_CASES = [(b, s, d) for b in BACKENDS for s in SHAPES for d in DTYPES] + [
    ("triton", "mixed", torch.float32), ("triton", "mixed", torch.float16)]


def _case_id(case) -> str:
    return "-".join(str(c).removeprefix("torch.") for c in case)


def _device(backend: str) -> torch.device:
    return torch.device("cuda" if backend == "triton" and CUDA else "cpu")


def _store_rtol(backend: str, dtype: torch.dtype) -> float:
    """One rounding of the gradient to ``dtype``; Triton's interpreter truncates fp32 -> bf16 stores instead of
    rounding them (seen with Triton 3.9.0: the rounding tolerance fails there), one bf16 ulp (``2^-7``) there."""
    if backend == "triton" and dtype == torch.bfloat16 and not CUDA:
        return 2.0**-7
    return STORE_RTOL[dtype]


def _batch(widths: list[int], dtype: torch.dtype, seed: int):
    """Logits (``-inf`` scattered, one all ``-inf`` row), tokens, a CSR support per row of the given widths
    (holding the token, except in row 2 where the width allows), untrained rows 1 and (if any) 8, temperatures."""
    gen = torch.Generator().manual_seed(seed)
    n = len(widths)
    z = torch.randn(n, V, generator=gen, dtype=torch.float64) * 3
    z = torch.where(torch.rand(n, V, generator=gen) < 0.1, -INF, z)
    z[min(4, n - 1)] = -INF  # a row without mass
    z = z.to(dtype)
    tokens = torch.randint(0, V, (n,), generator=gen)
    ids = []
    for t, k in enumerate(widths):
        perm = torch.randperm(V, generator=gen)
        perm = torch.cat([tokens[t:t + 1], perm[perm != tokens[t]]])
        row = perm[1:k + 1] if t == 2 and k < V else perm[:k]  # row 2: the token outside (unless K = V)
        ids.append(row[torch.randperm(row.numel(), generator=gen)])
    offsets = torch.tensor([0, *widths]).cumsum(0)
    skip = torch.zeros(n, dtype=torch.bool)
    skip[1] = True
    if n > 8:
        skip[8] = True
    inv_temp = (1.0 / torch.exp(torch.empty(n, dtype=torch.float64).uniform_(-1.5, 1.5, generator=gen))).float()
    return z, tokens, offsets, torch.cat(ids), skip, inv_temp


def _reference(z: torch.Tensor, tokens, offsets, ids, skip, inv_temp):
    """float64 ``(target, lp, lse, entropy)`` by a dense membership mask (not the gather the backends use)."""
    n = z.shape[0]
    x = z.double() * inv_temp.double()[:, None]
    row = torch.repeat_interleave(torch.arange(n), offsets[1:] - offsets[:-1])
    mask = torch.zeros(n, V, dtype=torch.bool)
    mask[row, ids] = True
    mask &= ~skip[:, None]
    xs = torch.where(mask, x, -INF)
    lse = torch.logsumexp(xs, dim=1)
    none = lse == -INF
    lse = torch.where(none, INF, lse)
    safe = torch.where(none, 0.0, lse)
    target = torch.where(none, -INF, x.gather(1, tokens[:, None])[:, 0] - safe)
    lp = torch.where(none[row], -INF, x[row, ids] - safe[row])
    p = torch.where(mask & ~none[:, None], torch.exp(xs - safe[:, None]), 0.0)
    entropy = -torch.where(p > 0, p * (xs - safe[:, None]), 0.0).sum(dim=1)
    return target, lp, lse, entropy, x


def _reference_grad(want, x, tokens, offsets, ids, inv_temp, w_t, w_c):
    """float64 ``d objective / d logits [N, V]`` for the upstream ``w_t``, ``w_c`` (on finite outputs only), formed
    densely: ``inv_temp (scatter(w_c) + w_t e_y - G p^S)``; and the row's bound ``inv_temp (|w_t| + sum |w_c|)``."""
    target, lp, lse, _ = want
    n = x.shape[0]
    row = torch.repeat_interleave(torch.arange(n), offsets[1:] - offsets[:-1])
    gt = torch.where(torch.isfinite(target), w_t, 0.0)
    gc = torch.where(torch.isfinite(lp), w_c, 0.0)
    g_sum = gt + torch.zeros(n, dtype=torch.float64).index_add(0, row, gc)
    dz = torch.zeros(n, V, dtype=torch.float64)
    dz.index_put_((row, ids), gc - g_sum[row] * torch.exp(lp), accumulate=True)
    dz[torch.arange(n), tokens] += gt
    it = inv_temp.double()
    bound = it * (gt.abs() + torch.zeros(n, dtype=torch.float64).index_add(0, row, gc.abs()))
    return dz * it[:, None], bound


def _weights(n: int, nnz: int, seed: int):
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randn(n, generator=gen, dtype=torch.float64), torch.randn(nnz, generator=gen, dtype=torch.float64)


def _objective(target, lp, w_t, w_c):
    """A random linear functional of the finite outputs (the upstream gradient is ``w``)."""
    t = torch.where(torch.isfinite(target.detach()), target, torch.zeros_like(target))
    c = torch.where(torch.isfinite(lp.detach()), lp, torch.zeros_like(lp))
    return (w_t.to(t.dtype) * t).sum() + (w_c.to(c.dtype) * c).sum()


def _check(got, want, x, dtype, what):
    row = torch.repeat_interleave(torch.arange(x.shape[0]), want[-1])
    tol = arg_tol(x)
    target, lp, lse, entropy = got
    assert_close_inf(target, want[0], tol, f"{what}: target")
    assert_close_inf(lp, want[1], tol[row], f"{what}: lp")
    assert_close_inf(lse, want[2], tol, f"{what}: lse")
    assert_close_inf(entropy, want[3], tol, f"{what}: entropy")


@pytest.mark.parametrize(("backend", "shape", "dtype"), LOGITS_CASES, ids=map(_case_id, LOGITS_CASES))
def test_logits_support_pass_matches_reference(shape, dtype, backend):
    widths = SHAPES[shape]
    z, tokens, offsets, ids, skip, inv_temp = _batch(widths, dtype, seed=len(widths) + V)
    dev = _device(backend)
    leaf = z.to(dev).requires_grad_()
    got = support_pass.support_log_softmax(leaf, *(t.to(dev) for t in (tokens, offsets, ids, inv_temp, skip)),
                                           backend=backend_registry.get(backend), eager=True)
    *want, x = _reference(z, tokens, offsets, ids, skip, inv_temp)
    _check([g.detach().cpu() for g in got], [*want, offsets[1:] - offsets[:-1]], x, dtype, f"{backend} {shape}")
    w_t, w_c = _weights(len(widths), ids.numel(), 0)
    _objective(got[0], got[1], w_t.to(dev), w_c.to(dev)).backward()
    assert leaf.grad.dtype == dtype
    want_grad, bound = _reference_grad(want, x, tokens, offsets, ids, inv_temp, w_t, w_c)
    # the fp32 math's error is arg_tol times the row's bound on every term; the stored value is rounded once
    tol = _store_rtol(backend, dtype) * want_grad.abs() + (arg_tol(x) * bound)[:, None] + STORE_FLOOR[dtype]
    err = (leaf.grad.double().cpu() - want_grad).abs()
    assert bool((err <= tol).all()), f"gradient error {float((err - tol).max()):.3g} over the tolerance"
    grad = leaf.grad.cpu()
    assert bool((grad[skip] == 0).all()) and bool((grad[4] == 0).all())  # untrained, no mass: zero


LINEAR_CASES = [(BACKENDS[0], s, d) for s in ("full", "mixed") for d in (torch.float32, torch.bfloat16)] + [
    ("triton", "mixed", torch.float32), ("triton", "mixed", torch.bfloat16)]


@pytest.mark.parametrize(("backend", "shape", "dtype"), LINEAR_CASES, ids=map(_case_id, LINEAR_CASES))
def test_linear_support_pass_matches_reference(backend, shape, dtype):
    """The fused-linear support pass (the logits of a chunk of rows by one matmul, then the backend's support pass on
    that block: on the ``triton`` backend its kernels) against the float64 reference, values and the gradients of
    hidden, weight and bias."""
    widths = SHAPES[shape]
    n, d = len(widths), 24
    _, tokens, offsets, ids, skip, inv_temp = _batch(widths, torch.float32, seed=7 * n)
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(n, d, generator=gen).to(dtype)
    w = (torch.randn(V, d, generator=gen) * 0.5).to(dtype)
    b = torch.randn(V, generator=gen).to(dtype)
    dev = _device(backend)
    hl, wl, bl = (t.clone().to(dev).requires_grad_() for t in (h, w, b))
    got = support_pass.linear_support_log_softmax(hl, wl, bl, *(t.to(dev) for t in (tokens, offsets, ids, inv_temp,
                                                                                    skip)),
                                                  backend=backend_registry.get(backend), eager=True)
    # the reference reads the logits the path multiplies: bf16 products are rounded to bf16 (materialised logits)
    z = (h.double() @ w.double().T)
    z = (z.to(dtype).double() if dtype == torch.bfloat16 else z) + b.double()
    hr, wr, br = (t.double().requires_grad_() for t in (h, w, b))
    zr = hr @ wr.T + br
    *want, x = _reference(zr, tokens, offsets, ids, skip, inv_temp)
    *want_vals, _ = _reference(z, tokens, offsets, ids, skip, inv_temp)
    _check([g.detach().cpu() for g in got], [v.detach() for v in want_vals] + [offsets[1:] - offsets[:-1]],
           x.detach(), torch.float32, f"linear {backend} {shape}")
    w_t, w_c = _weights(n, ids.numel(), 1)
    _objective(got[0], got[1], w_t.to(dev), w_c.to(dev)).backward()
    _objective(want[0], want[1], w_t, w_c).backward()
    rtol = 1e-4 if dtype == torch.float32 else 0.05
    for mine, ref, name in ((hl.grad, hr.grad, "hidden"), (wl.grad, wr.grad, "weight"), (bl.grad, br.grad, "bias")):
        assert mine.dtype == dtype, name
        scale = float(ref.abs().max()) + 1e-12
        assert float((mine.double().cpu() - ref).abs().max()) <= rtol * scale, name
    assert bool((hl.grad.cpu()[skip] == 0).all())


@pytest.mark.parametrize("backend", [*BACKENDS, "triton"])
def test_policy_loss_routes_wide_supports_through_the_pass(backend, monkeypatch):
    """``op.policy_loss`` with a CSR support record of rows 0 .. V wide equals the padded record's loss and
    gradient (the padded path is independent code), through the fused pass (counted; on the ``triton`` backend,
    through its support kernels, one launch of each)."""
    z, tokens, offsets, ids, _, _ = _batch(MIXED, torch.float32, seed=11)
    z = torch.where(torch.isfinite(z), z, torch.full_like(z, -30.0))
    n = len(MIXED)
    lengths = offsets[1:] - offsets[:-1]
    mask = lengths > 0
    row = torch.repeat_interleave(torch.arange(n), lengths)
    # the token must be in each trained support: rows where it is not are untrained
    inside = torch.zeros(n, dtype=torch.bool).index_put_((row,), ids == tokens[row], accumulate=True)
    mask &= inside
    lq = torch.full((ids.numel(),), 0.0)
    lq = lq - torch.log(lengths.clamp_min(1).float())[row]
    dev = _device(backend)
    z, tokens, mask = z.to(dev), tokens.to(dev), mask.to(dev)
    rec = op.CSRCandidates(ids.to(dev), offsets.to(dev), lq.to(dev), kind="support")
    lq_y = -torch.log(lengths.clamp_min(1).float()).to(dev)
    adv = torch.randn(n, generator=torch.Generator().manual_seed(2)).to(dev)
    corr = op.Correction(weights="mis", bounds=(0.3, 3.0), score_centering=True)
    calls = []
    real = support_pass.support_log_softmax
    monkeypatch.setattr("offpolicy.loss.csr_logprobs.support_log_softmax",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    launches = []
    if backend == "triton":
        from offpolicy.kernels import support_logsoftmax as kernels

        for name in ("support_stats", "support_grad"):
            monkeypatch.setattr(kernels, name, lambda *a, _f=getattr(kernels, name), _n=name, **k:
                                launches.append(_n) or _f(*a, **k))
    a = z.clone().requires_grad_()
    out = op.policy_loss(a, tokens, lq_y, adv, rec, mask, 0.8, corr, backend=backend)
    out.loss.backward()
    assert calls == [1]
    assert launches == (["support_stats", "support_grad"] if backend == "triton" else [])
    b = z.clone().requires_grad_()
    ref = op.policy_loss(b, tokens, lq_y, adv, rec.to_padded(), mask, 0.8, corr, backend=backend)
    ref.loss.backward()
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)


class _Recorder(TorchDispatchMode):
    """Every dispatched op's name and the shapes of the tensors it returns."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append(str(func))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append((str(func), tuple(t.shape)))
        return out


def _cost_shape(path: str, n: int):
    """Dispatched ops and returned shapes of one forward + backward over ``n`` rows: one row V wide, the others
    3 ids (so ``N K_max = N V`` while ``nnz`` is about ``3 N + V``)."""
    widths = [V] + [3] * (n - 1)
    z, tokens, offsets, ids, skip, inv_temp = _batch(widths, torch.float32, seed=5)
    z = torch.where(torch.isfinite(z), z, torch.zeros_like(z))
    gen = torch.Generator().manual_seed(0)
    h, w = torch.randn(n, 8, generator=gen).requires_grad_(), torch.randn(V, 8, generator=gen).requires_grad_()
    leaf = z.requires_grad_()
    with _Recorder() as rec:
        if path == "linear":
            got = support_pass.linear_support_log_softmax(h, w, None, tokens, offsets, ids, inv_temp, skip,
                                                          backend=backend_registry.get("torch"), eager=True)
        else:
            got = support_pass.support_log_softmax(leaf, tokens, offsets, ids, inv_temp, skip,
                                                   backend=backend_registry.get(path), eager=True)
        _objective(got[0], got[1], torch.ones(n, dtype=torch.float64),
                   torch.ones(ids.numel(), dtype=torch.float64)).backward()
    return rec, ids.numel()


#: ops that only make a view (the native backend hands each worker's share of rows to C as a sliced pointer)
VIEWS = {"slice", "view", "_unsafe_view", "alias", "as_strided", "detach", "select", "expand", "t", "transpose",
         "permute", "squeeze", "unsqueeze", "lift_fresh"}


def _computing(ops: list[str]) -> list[str]:
    return [o for o in ops if o.split(".")[1] not in VIEWS]


@pytest.mark.parametrize("path", [*BACKENDS, "linear"])
def test_cost_shape_no_row_loop_no_padding(path):
    """Without timing: the ops dispatched for 8 rows and for 64 rows are the same list (no Python loop over rows,
    whatever their widths), and no tensor of ``N K_max`` or more elements is allocated besides the ``[N, V]``
    logits-sized gradient (no padding to the widest row); the ``[nnz]`` tensors are the largest others."""
    small, _ = _cost_shape(path, 8)
    big, nnz = _cost_shape(path, 64)
    assert _computing(small.ops) == _computing(big.ops)
    n = 64
    for name, shape in big.shapes:
        if not _computing([name]) or name.split(".")[1].endswith("_"):
            continue  # a view, or an in-place op's result (its input), allocates nothing
        numel = torch.Size(shape).numel()
        if shape in ((n, V), (n, 8), (V, 8)):
            continue  # the logits' gradient; the linear path's logits block and the gradients of hidden and weight
        assert numel < n * V and numel <= max(nnz + 1, 2 * n), shape


def test_cpu_support_pass_refuses_an_id_outside_the_vocabulary():
    if "cpu" not in BACKENDS:
        pytest.skip("the native CPU kernels are not built here")
    z = torch.randn(2, 5)
    offsets = torch.tensor([0, 2, 3])
    ids = torch.tensor([1, 5, 0])
    with pytest.raises(RuntimeError, match="outside \\[0, 5\\)"):
        cpu_backend.support_stats(z, offsets, ids, torch.ones(2), None)
    lp = torch.zeros(3)
    with pytest.raises(RuntimeError, match="outside \\[0, 5\\)"):
        cpu_backend.support_grad(lp, offsets, ids, torch.tensor([0, 0]), torch.ones(2), None, torch.ones(2),
                                 torch.ones(2, dtype=torch.bool), torch.empty(2, 5))


def test_torch_and_cpu_support_pass_agree_with_duplicate_ids():
    """An unvalidated record repeating an id within a row: both backends add the repeats (nothing is lost)."""
    z = torch.randn(2, 6)
    offsets = torch.tensor([0, 3, 5])
    ids = torch.tensor([2, 2, 4, 1, 1])
    tokens = torch.tensor([2, 1])
    lp, lse, ent = torch_backend.support_stats(z, offsets, ids, torch.ones(2), None)
    g = torch_backend.support_grad(lp, offsets, ids, tokens, torch.ones(2), torch.ones(5), torch.ones(2),
                                   torch.ones(2, dtype=torch.bool), torch.empty(2, 6))
    if "cpu" in BACKENDS:
        lp2, lse2, ent2 = cpu_backend.support_stats(z, offsets, ids, torch.ones(2), None)
        g2 = cpu_backend.support_grad(lp2, offsets, ids, tokens, torch.ones(2), torch.ones(5), torch.ones(2),
                                      torch.ones(2, dtype=torch.bool), torch.empty(2, 6))
        torch.testing.assert_close(lp2, lp)
        torch.testing.assert_close(g2, g)
    # row 0: d/dz2 = 2 (two entries) + 1 (token) - G p(2) (two entries of p each), G = 1 + 3
    p = torch.exp(lp)
    torch.testing.assert_close(g[0, 2], 2 + 1 - 4 * (p[0] + p[1]))


@pytest.mark.parametrize("model", ["logits", "hidden"])
def test_policy_loss_with_a_wide_csr_support_allocates_nothing_entry_by_width(model):
    """Through ``op.policy_loss``: with a CSR support record whose rows hold most of the vocabulary, nothing of
    ``nnz x D`` (the entry gather of hidden and weight rows that took seconds, issue #42) nor ``N x K_max`` is
    allocated: the largest tensors are the ``[N, V]`` logits block / gradient, ``[V, D]`` and ``[nnz]``; and no
    entry is sorted (``O(nnz log nnz)``: the old path's duplicate-merging ``unique`` in the backward)."""
    n, d = 16, 8
    widths = [V - 1 - (t % 3) for t in range(n)]
    z, tokens, offsets, ids, _, _ = _batch(widths, torch.float32, seed=9)
    row = torch.repeat_interleave(torch.arange(n), offsets[1:] - offsets[:-1])
    inside = torch.zeros(n, dtype=torch.bool).index_put_((row,), ids == tokens[row], accumulate=True)
    lengths = (offsets[1:] - offsets[:-1]).float()
    rec = op.CSRCandidates(ids, offsets, -torch.log(lengths)[row], kind="support")
    gen = torch.Generator().manual_seed(4)
    h, w = torch.randn(n, d, generator=gen).requires_grad_(), torch.randn(V, d, generator=gen).requires_grad_()
    z = torch.randn(n, V, generator=gen).requires_grad_()
    kw = dict(tokens=tokens, sampler_logprobs=-torch.log(lengths), advantages=torch.randn(n, generator=gen),
              candidates=rec, loss_mask=inside, validate=False)
    with _Recorder() as recd:
        out = op.policy_loss(z, **kw) if model == "logits" else op.policy_loss(hidden=h, weight=w, **kw)
        out.loss.backward()
    nnz = ids.numel()
    assert not [o for o in recd.ops if "sort" in o or "unique" in o]
    for name, shape in recd.shapes:
        if not _computing([name]) or name.split(".")[1].endswith("_") or shape in ((n, V), (V, d), (n, d)):
            continue
        assert torch.Size(shape).numel() <= nnz + n, (name, shape)


@pytest.mark.parametrize("backend", [*BACKENDS, "triton"])
def test_rows_without_mass_take_no_gradient_whatever_arrives(backend):
    """Untrained rows (NaN logits there), empty supports and all ``-inf`` rows: exactly zero gradient even when the
    upstream gradient of their (``-inf``) outputs is nonzero."""
    z, tokens, offsets, ids, skip, inv_temp = _batch(MIXED, torch.float32, seed=21)
    z[1] = float("nan")  # skipped: never read
    dev = _device(backend)
    leaf = z.to(dev).requires_grad_()
    target, lp, lse, _ = support_pass.support_log_softmax(
        leaf, *(t.to(dev) for t in (tokens, offsets, ids, inv_temp, skip)), backend=backend_registry.get(backend),
        eager=True)
    dead = ~torch.isfinite(lse)
    assert bool(dead[1]) and bool(dead[2 + 2]) and bool(dead[8])  # skipped, all -inf, skipped
    (g,) = torch.autograd.grad((target, lp), leaf, (torch.ones_like(target), torch.ones_like(lp)))
    assert bool(torch.isfinite(g).all())
    assert bool((g[dead] == 0).all())
    assert bool((g[~dead] != 0).any())


@pytest.mark.parametrize(("backend", "shape", "dtype"), TOKEN_CASES, ids=map(_case_id, TOKEN_CASES))
def test_token_level_gradient_matches_reference(shape, dtype, backend):
    """The gradient when only ``target`` takes one (``g_lp`` None: the token-level losses), the case in which the
    ``cpu`` backend streams the wide rows' gradient (``K >= V / WIDE_DIVISOR``) from the logits and a byte mask:
    against the float64 reference at ``K = V``, ``V - 1`` and mixed widths (empty, 1-id, untrained, all ``-inf``)."""
    widths = SHAPES[shape]
    z, tokens, offsets, ids, skip, inv_temp = _batch(widths, dtype, seed=3 * len(widths) + 1)
    dev = _device(backend)
    leaf = z.to(dev).requires_grad_()
    got = support_pass.support_log_softmax(leaf, *(t.to(dev) for t in (tokens, offsets, ids, inv_temp, skip)),
                                           backend=backend_registry.get(backend), eager=True)
    *want, x = _reference(z, tokens, offsets, ids, skip, inv_temp)
    w_t, _ = _weights(len(widths), ids.numel(), 2)
    t = torch.where(torch.isfinite(got[0].detach()), got[0], torch.zeros_like(got[0]))
    (w_t.to(device=dev, dtype=t.dtype) * t).sum().backward()
    want_grad, bound = _reference_grad(want, x, tokens, offsets, ids, inv_temp, w_t,
                                       torch.zeros(ids.numel(), dtype=torch.float64))
    tol = _store_rtol(backend, dtype) * want_grad.abs() + (arg_tol(x) * bound)[:, None] + STORE_FLOOR[dtype]
    grad = leaf.grad.cpu()
    err = (grad.double() - want_grad).abs()
    assert bool((err <= tol).all()), f"gradient error {float((err - tol).max()):.3g} over the tolerance"
    assert bool((grad[skip] == 0).all()) and bool((grad[4] == 0).all())


@pytest.mark.skipif("cpu" not in BACKENDS, reason="the native CPU kernels are not built here")
def test_cpu_wide_rows_keep_a_mask_and_their_backward_reads_no_ids():
    """The cost shape of a wide row on the ``cpu`` backend, without timing it: the forward keeps a ``V``-byte
    membership mask for exactly the rows of ``K >= V / WIDE_DIVISOR`` ids (not the narrow, skipped or
    id-repeating ones), and the backward of those rows reads no id: with every id replaced by one outside the
    vocabulary it still writes the same gradient (an entry-path row would refuse it), to the last bit."""
    widths = [V, V - 1, V // cpu_backend.WIDE_DIVISOR, V // cpu_backend.WIDE_DIVISOR - 1, 1, 0, V, V]
    z, tokens, offsets, ids, skip, inv_temp = _batch(widths, torch.float32, seed=31)
    z = torch.where(torch.isfinite(z), z, torch.full_like(z, -20.0))
    ids[offsets[7] + 1] = ids[offsets[7]]  # row 7 repeats an id: the entry path
    lp, lse, _, wide = cpu_backend.support_stats(z, offsets, ids, inv_temp, skip, keep_wide=True)
    assert wide.slot.tolist() == [0, -1, 1, -1, -1, -1, 2, -1]  # row 1 is skipped
    for r in (0, 2, 6):
        member = torch.zeros(V, dtype=torch.uint8)
        member[ids[offsets[r]:offsets[r + 1]]] = 1
        assert torch.equal(wide.mask[wide.slot[r]], member)
    live = torch.isfinite(lse)
    gt = torch.randn(len(widths), generator=torch.Generator().manual_seed(1))
    args = (tokens, inv_temp, None, gt, live)
    entries = cpu_backend.support_grad(lp, offsets, ids, *args, torch.empty_like(z))
    streamed = cpu_backend.support_grad(lp, offsets, ids, *args, torch.empty_like(z), wide=wide, logits=z)
    assert torch.equal(streamed, entries)
    only_wide = live & (wide.slot >= 0)
    garbage = torch.full_like(ids, V + 5)
    got = cpu_backend.support_grad(lp, offsets, garbage, *args[:3], gt, only_wide, torch.empty_like(z), wide=wide,
                                   logits=z)
    assert torch.equal(got[only_wide], entries[only_wide]) and bool((got[~only_wide] == 0).all())
    with pytest.raises(RuntimeError, match="outside"):  # the entry path does read them
        cpu_backend.support_grad(lp, offsets, garbage, *args[:3], gt, only_wide, torch.empty_like(z))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_wide_rows_ignore_non_finite_logits_outside_their_support(backend, bad):
    """A row of ``V - 1`` ids whose one id outside the support holds NaN or ``+inf``: the streamed backward reads
    that logit (the entry path never did) but it must not leak: the gradient there is exactly 0 and the rest is the
    reference's."""
    z, tokens, offsets, ids, skip, inv_temp = _batch([V - 1] * 4, torch.float32, seed=41)
    skip[:] = False
    z = torch.where(torch.isfinite(z), z, torch.full_like(z, -20.0))
    row = torch.repeat_interleave(torch.arange(4), offsets[1:] - offsets[:-1])
    member = torch.zeros(4, V, dtype=torch.bool)
    member[row, ids] = True
    outside = (~member).nonzero()
    z[outside[:, 0], outside[:, 1]] = bad
    leaf = z.clone().requires_grad_()
    target, *_ = support_pass.support_log_softmax(leaf, tokens, offsets, ids, inv_temp, skip,
                                                  backend=backend_registry.get(backend), eager=True)
    live = torch.isfinite(target.detach())
    target[live].sum().backward()
    assert bool(torch.isfinite(leaf.grad).all()) and bool((leaf.grad[~member] == 0).all())
    *want, x = _reference(torch.where(member, z, 0.0), tokens, offsets, ids, skip, inv_temp)
    want_grad, _ = _reference_grad(want, x, tokens, offsets, ids, inv_temp, live.double(),
                                   torch.zeros(ids.numel(), dtype=torch.float64))
    torch.testing.assert_close(leaf.grad.double(), want_grad, rtol=1e-5, atol=1e-6)


def _hostile_outside(z: torch.Tensor, tokens, offsets, ids) -> tuple[torch.Tensor, torch.Tensor]:
    """``z`` with NaN at every id outside the support of rows ``3 mod 4``, ``+inf`` outside the other rows ``5 mod
    6`` and ``-inf`` outside the rest (the token's own logit excepted), and the ``[N, V]`` bool membership mask."""
    n = z.shape[0]
    row = torch.repeat_interleave(torch.arange(n), offsets[1:] - offsets[:-1])
    member = torch.zeros(n, V, dtype=torch.bool)
    member[row, ids] = True
    outside = ~member
    outside[torch.arange(n), tokens] = False
    where = outside.nonzero()
    r = where[:, 0]
    bad = torch.where(r % 4 == 3, float("nan"), torch.where(r % 6 == 5, INF, -INF)).to(z.dtype)
    z = z.clone()
    z[where[:, 0], where[:, 1]] = bad
    return z, member


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_torch_wide_rows_chunked_match_the_float64_reference(shape, dtype, monkeypatch):
    """The ``torch`` backend's wide rows (``K >= V / WIDE_DIVISOR``: a bool mask by scatter, masked log-sum-exp over
    ``V``, the dense gradient expression), with :data:`torch_backend.WIDE_BYTES` cut to 3 rows per chunk so that
    chunks split the batch (and, in the mixed batch, hold non-adjacent wide rows, the narrow ones taking the entry
    path): values against the float64 reference (``lp`` also against :func:`offpolicy.reference.log_probs`), the
    gradient of ``target`` and ``lp`` together against the float64 closed form, with ``-inf`` (kept on the wide
    path) or NaN / ``+inf`` (such a row is sent to the entry path) at every id outside the supports, which must not
    leak (zero gradient there, finite everywhere)."""
    from offpolicy import reference

    monkeypatch.setattr(torch_backend, "WIDE_BYTES", 3 * V * 9)
    assert torch_backend._wide_step(V, torch.float32) == 3
    widths = SHAPES[shape]
    z, tokens, offsets, ids, skip, inv_temp = _batch(widths, dtype, seed=5 * len(widths) + 3)
    z, member = _hostile_outside(z, tokens, offsets, ids)
    *_, wide = torch_backend.support_stats(z, offsets, ids, inv_temp, skip, keep_wide=True)
    lengths = offsets[1:] - offsets[:-1]
    nan_or_inf = (torch.isnan(z) | (z == INF)).any(dim=1)
    assert wide.rows.tolist() == [r for r, k in enumerate(widths) if 2 * k >= V and not skip[r] and not nan_or_inf[r]]
    assert wide.rows.numel() >= 2
    leaf = z.clone().requires_grad_()
    got = support_pass.support_log_softmax(leaf, tokens, offsets, ids, inv_temp, skip,
                                           backend=backend_registry.get("torch"), eager=True)
    *want, x = _reference(z, tokens, offsets, ids, skip, inv_temp)
    _check([g.detach() for g in got], [*want, lengths], x, dtype, f"torch wide {shape}")
    # the library's own float64 reference of log p^S, on the rows with mass
    row = torch.repeat_interleave(torch.arange(len(widths)), lengths)
    live = torch.isfinite(want[2])
    ref_lp = reference.log_probs(torch.where(member, z.double(), 0.0), 1 / inv_temp.double(), member)[row, ids]
    on = live[row]
    torch.testing.assert_close(got[1].detach().double()[on], ref_lp[on], rtol=0, atol=float(arg_tol(x).max()))
    w_t, w_c = _weights(len(widths), ids.numel(), 3)
    _objective(got[0], got[1], w_t, w_c).backward()
    assert leaf.grad.dtype == dtype and bool(torch.isfinite(leaf.grad).all())
    off_support = ~member
    off_support[torch.arange(len(widths)), tokens] = False
    assert bool((leaf.grad[off_support] == 0).all())
    want_grad, bound = _reference_grad(want, x, tokens, offsets, ids, inv_temp, w_t, w_c)
    tol = STORE_RTOL[dtype] * want_grad.abs() + (arg_tol(x) * bound)[:, None] + STORE_FLOOR[dtype]
    err = (leaf.grad.double() - want_grad).abs()
    assert bool((err <= tol).all()), f"gradient error {float((err - tol).max()):.3g} over the tolerance"


def test_torch_wide_row_with_a_repeated_id_takes_the_entry_path():
    """An unvalidated record repeating an id within a wide row: that row leaves the wide set and its values and
    gradient are the entry path's (the repeats added), the other wide rows unchanged."""
    z, tokens, offsets, ids, _, inv_temp = _batch([V, V - 1, V // 2, 3], torch.float32, seed=51)
    z = torch.where(torch.isfinite(z), z, torch.full_like(z, -20.0))
    ids[offsets[1] + 1] = ids[offsets[1]]  # row 1 repeats an id
    lp, lse, ent, wide = torch_backend.support_stats(z, offsets, ids, inv_temp, None, keep_wide=True)
    assert wide.rows.tolist() == [0, 2]
    e_lp, e_lse, e_ent = torch_backend._gather_stats(z, offsets, ids, inv_temp, None)
    torch.testing.assert_close(lp, e_lp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, e_lse)
    torch.testing.assert_close(ent, e_ent, rtol=1e-6, atol=1e-6)
    args = (tokens, inv_temp, torch.randn(ids.numel()), torch.randn(4), torch.isfinite(lse))
    got = torch_backend.support_grad(lp, offsets, ids, *args, torch.empty_like(z), wide=wide, logits=z)
    ref = torch_backend.support_grad(e_lp, offsets, ids, *args, torch.empty_like(z))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(got[1], ref[1])


def test_torch_wide_rows_cost_shape(monkeypatch):
    """Without timing: with every row wide, the ``torch`` backend's forward runs no segment reduction over the
    entries (the entry path's), the backward neither an accumulating scatter nor an ``exp`` of the entries, and
    every ``[rows, V]`` temporary holds at most one chunk's rows (:data:`torch_backend.WIDE_BYTES`), whatever N:
    no ``[N, V]`` fp32 temporary besides the gradient itself."""
    monkeypatch.setattr(torch_backend, "WIDE_BYTES", 4 * V * 9)
    n = 16
    z, tokens, offsets, ids, _, inv_temp = _batch([V, V - 1, V // 2 + 5, V - 3] * 4, torch.bfloat16, seed=61)
    leaf = z.clone().requires_grad_()
    with _Recorder() as fwd:
        target, *_ = support_pass.support_log_softmax(leaf, tokens, offsets, ids, inv_temp, None,
                                                      backend=backend_registry.get("torch"), eager=True)
    t = torch.where(torch.isfinite(target.detach()), target, torch.zeros_like(target))
    with _Recorder() as bwd:
        t.sum().backward()
    assert not [o for o in fwd.ops if "segment_reduce" in o]
    nnz = ids.numel()
    for name, shape in bwd.shapes:
        op_name = name.split(".")[1]
        big = torch.Size(shape).numel() >= nnz // 2
        assert not (op_name in ("index_put_", "index_put", "scatter_add_", "scatter_add") and big), (name, shape)
        assert not (op_name.startswith("exp") and len(shape) == 1 and big), (name, shape)
    for name, shape in fwd.shapes + bwd.shapes:
        if len(shape) == 2 and shape[1] == V and shape != (n, V):
            assert shape[0] <= 4, (name, shape)
        if shape == (n, V):  # only the gradient (and views): no [N, V] copy, exponential or mask
            assert name.split(".")[1] in VIEWS | {"empty", "zeros", "zero_", "copy_"}, name


def _kernels():
    from offpolicy.kernels import support_logsoftmax

    return support_logsoftmax


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_triton_support_kernels_over_many_blocks_match_reference(dtype):
    """The Triton support kernels with 16 ids per step, so a wide row takes six steps: the online max moves in every
    step of rows whose ids come in increasing logit order, in none of rows whose max comes first; values, and the
    gradient of both outputs (into a NaN-filled buffer: every element must be written) against the float64
    reference."""
    kern = _kernels()
    widths = [V, V - 1, 17, 16, 1, 0, V, 33, V // 2]
    z, tokens, offsets, ids, skip, inv_temp = _batch(widths, dtype, seed=71)
    skip[:] = False
    skip[3] = True
    for r, order in ((0, 1), (1, -1), (6, 1), (7, 1)):  # ids by increasing (decreasing) logit: the max moves late
        seg = ids[offsets[r]:offsets[r + 1]]
        ids[offsets[r]:offsets[r + 1]] = seg[torch.argsort(order * z[r, seg].float().nan_to_num(neginf=-1e30))]
    dev = _device("triton")
    args = [t.to(dev) for t in (offsets, ids)]
    lp, lse, entropy = kern.support_stats(z.to(dev), *args, inv_temp.to(dev), skip.to(dev), block=16)
    want_t, want_lp, want_lse, want_ent, x = _reference(z, tokens, offsets, ids, skip, inv_temp)
    lengths = offsets[1:] - offsets[:-1]
    tol = arg_tol(x)
    row = torch.repeat_interleave(torch.arange(len(widths)), lengths)
    assert_close_inf(lp.cpu(), want_lp, tol[row], "lp")
    assert_close_inf(lse.cpu(), want_lse, tol, "lse")
    assert_close_inf(entropy.cpu(), want_ent, tol, "entropy")
    w_t, w_c = _weights(len(widths), ids.numel(), 5)
    gt = torch.where(torch.isfinite(want_t), w_t, 0.0)
    gc = torch.where(torch.isfinite(want_lp), w_c, 0.0)
    live = torch.isfinite(want_lse)
    out = torch.full(z.shape, float("nan"), dtype=dtype, device=dev)
    got = kern.support_grad(lp, *args, tokens.to(dev), inv_temp.to(dev), gc.float().to(dev), gt.float().to(dev),
                            live.to(dev), out, block=16).cpu()
    want_grad, bound = _reference_grad((want_t, want_lp, want_lse, None), x, tokens, offsets, ids, inv_temp, w_t, w_c)
    tol = _store_rtol("triton", dtype) * want_grad.abs() + (arg_tol(x) * bound)[:, None] + STORE_FLOOR[dtype]
    assert bool(torch.isfinite(got).all())
    err = (got.double() - want_grad).abs()
    assert bool((err <= tol).all()), f"gradient error {float((err - tol).max()):.3g} over the tolerance"
    assert bool((got[~live] == 0).all())


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy arithmetic on inf and NaN
def test_triton_support_kernels_on_hostile_rows():
    """NaN or ``+inf`` in a support, an id outside ``[0, V)`` (never read), ``z / tau`` overflowing: that row's
    ``lse``, entropy and log-probabilities are NaN (as the ``torch`` backend's, where it can take the row) and the
    other rows are untouched; NaN logits outside every support never leak; offsets outside ``[0, nnz]`` or
    decreasing are clamped (empty rows, nothing read or written outside the buffers). The backward over the rows
    with mass writes exactly zero on the others and outside the supports."""
    kern = _kernels()
    widths = [5, 5, 5, 5, 5, 5, V - 1]
    z, tokens, offsets, ids, _, inv_temp = _batch(widths, torch.float32, seed=81)
    z = torch.where(torch.isfinite(z), z, torch.full_like(z, -20.0))
    row = torch.repeat_interleave(torch.arange(len(widths)), offsets[1:] - offsets[:-1])
    member = torch.zeros(len(widths), V, dtype=torch.bool)
    member[row, ids] = True
    z = torch.where(member, z, float("nan"))  # outside every support
    z[0, ids[offsets[0] + 2]] = float("nan")
    z[1, ids[offsets[1]]] = float("inf")
    z[2, ids[offsets[2] + 4]] = 3e38
    inv_temp[2] = 10.0  # z / tau overflows
    dev = _device("triton")
    bad_ids = ids.clone()
    bad_ids[offsets[3] + 1] = V + 3
    bad_ids[offsets[4] + 3] = -2
    lp, lse, ent = (t.cpu() for t in kern.support_stats(z.to(dev), offsets.to(dev), bad_ids.to(dev),
                                                          inv_temp.to(dev)))
    nan_rows = torch.tensor([True, True, True, True, True, False, False])
    assert bool(torch.isnan(lse[nan_rows]).all()) and bool(torch.isnan(ent[nan_rows]).all())
    assert bool(torch.isnan(lp[nan_rows[row]]).all()) and bool(torch.isfinite(lp[~nan_rows[row]]).all())
    t_lp, t_lse, t_ent = torch_backend.support_stats(z, offsets, ids, inv_temp, None)
    assert bool(torch.isnan(t_lse[:3]).all())  # the torch backend agrees on the rows it can take
    keep = ~nan_rows
    torch.testing.assert_close(lse[keep], t_lse[keep], rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(ent[keep], t_ent[keep], rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(lp[keep[row]], t_lp[keep[row]], rtol=1e-6, atol=1e-5)
    live = torch.isfinite(lse)
    out = torch.full(z.shape, float("nan"), device=dev)
    g = kern.support_grad(lp.to(dev), offsets.to(dev), bad_ids.to(dev), tokens.to(dev), inv_temp.to(dev),
                          torch.ones(ids.numel(), device=dev), torch.ones(len(widths), device=dev), live.to(dev),
                          out).cpu()
    assert bool(torch.isfinite(g).all()) and bool((g[~live] == 0).all())
    off = ~member
    off[torch.arange(len(widths)), tokens] = False
    assert bool((g[off] == 0).all()) and bool((g[live] != 0).any())
    # offsets past nnz, decreasing, negative: clamped to [0, nnz], such rows empty
    wild = torch.tensor([0, 5, -4, 3, 10**6, 2, 40, 10**9])
    lp_w, lse_w, _ = kern.support_stats(z.to(dev), wild.to(dev), ids.to(dev), inv_temp.to(dev))
    assert lp_w.shape == ids.shape and bool((lse_w.cpu()[[1, 4]] == INF).all())  # 5 -> -4, and 10**6 -> 2


def test_triton_support_kernels_with_no_entries():
    """A record with no entries at all (nnz = 0): every row without mass, and a gradient buffer full of NaN comes back
    all zeros (each row zeroed, no token term on a row without mass)."""
    kern = _kernels()
    dev = _device("triton")
    z = torch.randn(3, 8, device=dev)
    offsets, ids = torch.zeros(4, dtype=torch.int64, device=dev), torch.empty(0, dtype=torch.int64, device=dev)
    lp, lse, ent = kern.support_stats(z, offsets, ids, torch.ones(3, device=dev))
    assert lp.shape == (0,) and bool((lse == INF).all()) and bool((ent == 0).all())
    out = torch.full((3, 8), float("nan"), device=dev)
    g = kern.support_grad(lp, offsets, ids, torch.tensor([1, 2, 3], device=dev), torch.ones(3, device=dev), None,
                          torch.ones(3, device=dev), torch.isfinite(lse), out)
    assert bool((g == 0).all())
