"""The logits op's contract on every registered backend: :func:`offpolicy.ops.sparse_log_softmax` against its
float64 reference :func:`offpolicy.ops.logits_op.logits_naive.sparse_log_softmax`, outputs and gradient.

Without a GPU the ``triton`` backend runs in Triton's interpreter (conftest.py) on fp32 and fp16 (its bf16 is
checked on a GPU). Tolerances: the model of ``tests/support/vocab_reference.py``, computed from the same stored
logits: values within ``arg_tol = 64 u (1 + max|x|)`` (``u = 2^-24``), the entropy within ``arg_tol (1 + H)``, the
gradient within its fp32 math error plus one rounding to the logits' dtype (``2^-24`` fp32, ``2^-11`` fp16,
``2^-8`` bf16). Infinite entries (padding, rows without mass) must match exactly, and rows without mass or skipped
take exactly zero gradient.
"""

from __future__ import annotations

import pytest
import torch

from offpolicy.ops import backend_registry, sparse_log_softmax
from offpolicy.ops.logits_op import logits_naive

from support.vocab_reference import arg_tol, assert_close_inf, dname, grad_tol, op_case, temperatures

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
BACKENDS = sorted(backend_registry.BACKENDS)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _runs(backend: str, dtype: torch.dtype) -> bool:
    """Whether ``backend`` runs ``dtype`` here: ``cpu`` needs CPU tensors; the interpreter's bf16 is off."""
    if backend == "cpu":
        return DEVICE.type == "cpu"
    return not (backend == "triton" and dtype == torch.bfloat16 and not CUDA)


def _check(backend, z, y, cands, tau64, tau, support, skip, w_t, w_c, inplace=False):
    """Run the op and its naive reference on the same stored logits; compare outputs and the gradient."""
    leaf = z.to(DEVICE).requires_grad_()
    logits = leaf * 1  # a non-leaf, as model logits are (in-place gradients land in it)
    out = sparse_log_softmax(logits, y.to(DEVICE), None if cands is None else cands.to(DEVICE), tau,
                             support=support, skip=None if skip is None else skip.to(DEVICE), inplace_grad=inplace,
                             backend=backend)
    k = 0 if cands is None else cands.shape[1]
    (g,) = torch.autograd.grad((out.target, out.candidates), leaf, (w_t.float().to(DEVICE),
                                                                    w_c.float().to(DEVICE)))
    zr = z.double().requires_grad_()
    target, cand, lse, ent = logits_naive.sparse_log_softmax(zr, y, cands, tau64, support, skip)
    assert out.candidates.shape == (z.shape[0], k)
    if target.requires_grad or cand.requires_grad:
        (gr,) = torch.autograd.grad((target, cand), zr, (w_t, w_c), allow_unused=True)
        gr = torch.zeros_like(zr) if gr is None else gr
    else:
        gr = torch.zeros_like(zr)
    x = z.double() / tau64[:, None]
    tol = arg_tol(x)
    assert_close_inf(out.lse.cpu(), lse, tol, "lse")
    assert_close_inf(out.entropy.cpu(), ent, tol * (1 + ent.abs()), "entropy")
    assert_close_inf(out.target.detach().cpu(), target.detach(), tol, "target")
    assert_close_inf(out.candidates.detach().cpu(), cand.detach(), tol[:, None], "candidates")
    bound_g = torch.cat([w_t[:, None], w_c], 1)
    assert_close_inf(g.cpu(), gr, grad_tol(gr, 1 / tau64, bound_g, x, z.dtype), "gradient")
    dead = torch.isinf(lse)  # skipped rows and rows without mass: exactly zero gradient
    assert bool((g.cpu()[dead] == 0).all())
    if inplace:
        assert torch.equal(logits.detach(), g)  # the gradient was written into the logits
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("support", [False, True], ids=["full", "support"])
@pytest.mark.parametrize("inplace", [False, True], ids=["grad", "inplace_grad"])
def test_matches_naive(backend, dtype, support, inplace):
    """A hostile batch (extreme logits, an all ``-inf`` row, a late max, an empty candidate row, a skipped row,
    per-row temperatures from 0.05 to 10) at ``V = 777``."""
    if not _runs(backend, dtype):
        pytest.skip(f"{backend} does not run {dname(dtype)} here")
    gen = torch.Generator().manual_seed(5)
    z, y, cands, skip, w_t, w_c = op_case(8, 777, 6, dtype, gen)
    tau64 = temperatures(8, gen)
    _check(backend, z, y, cands, tau64, tau64.float().to(DEVICE), support, skip, w_t, w_c, inplace)


# (N, V, K, what): a single row and entry, no candidates, every row skipped, every row all -inf, two columns
ODD = [(1, 1, 1, "single"), (3, 2, 0, "no_candidates"), (2, 5, 3, "all_skipped"), (4, 3, 2, "all_masked"),
       (5, 33, 4, "scalar_tau")]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("support", [False, True], ids=["full", "support"])
@pytest.mark.parametrize(("n", "v", "k", "what"), ODD, ids=[c[3] for c in ODD])
def test_odd_shapes_and_masked_rows(backend, support, n, v, k, what):
    if not _runs(backend, torch.float32):
        pytest.skip(f"{backend} does not run here")
    gen = torch.Generator().manual_seed(11)
    z = torch.randn(n, v, generator=gen, dtype=torch.float64).float() * 4
    if what == "all_masked":
        z[:] = -float("inf")
    y = torch.randint(0, v, (n,), generator=gen)
    cands = torch.stack([torch.randperm(v, generator=gen)[:k] for _ in range(n)]) if k else None
    if cands is not None and cands.shape[1] < k:
        cands = torch.cat([cands, torch.full((n, k - cands.shape[1]), -1)], dim=1)
    if support and cands is None:
        cands = torch.empty(n, 0, dtype=torch.int64)  # an empty support on every row
    skip = torch.ones(n, dtype=torch.bool) if what == "all_skipped" else None
    tau64 = torch.full((n,), 0.7, dtype=torch.float64)
    kk = 0 if cands is None else cands.shape[1]
    w_t = torch.randn(n, generator=gen, dtype=torch.float64)
    w_c = torch.randn(n, kk, generator=gen, dtype=torch.float64)
    if cands is not None:
        w_c = torch.where(cands >= 0, w_c, 0.0)
    out = _check(backend, z, y, cands, tau64, 0.7 if what == "scalar_tau" or n < 3 else tau64.float().to(DEVICE),
                 support, skip, w_t, w_c)
    if what in ("all_skipped", "all_masked"):
        assert bool((out.lse == float("inf")).all()) and bool((out.target == -float("inf")).all())
