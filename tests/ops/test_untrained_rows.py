"""Rows that take no gradient (skipped, or with zero upstream gradient: untrained padding) get exactly zero
gradient whatever they hold, NaN and inf included, on both primitives and every registered backend; and they do
not disturb the gradient of the other rows (compared with the same call where those rows hold zeros)."""

from __future__ import annotations

import pytest
import torch

from offpolicy.ops import backend_registry, linear_sparse_log_softmax, sparse_log_softmax

N, D, V, K = 6, 8, 40, 4
GARBAGE = {"nan": float("nan"), "+inf": float("inf"), "-inf": -float("inf")}
DEAD = [1, 4]  # row 1 is skipped, row 4 gets zero upstream gradient


def _rows():
    gen = torch.Generator().manual_seed(3)
    y = torch.randint(0, V, (N,), generator=gen)
    c = torch.randint(0, V, (N, K), generator=gen)
    c[:, 0] = y  # every support is non-empty and holds the target
    skip = torch.zeros(N, dtype=torch.bool)
    skip[DEAD[0]] = True
    g_t = torch.randn(N, generator=gen)
    g_c = torch.randn(N, K, generator=gen)
    g_t[DEAD[1]] = 0.0
    g_c[DEAD[1]] = 0.0
    return gen, y, c, skip, g_t, g_c


def _poison(x: torch.Tensor, value: float) -> torch.Tensor:
    x = x.clone()
    x[DEAD[0], 3] = value
    x[DEAD[1], 5] = value
    x[DEAD[1], 0] = value
    return x


@pytest.mark.parametrize("backend", sorted(backend_registry.BACKENDS))
@pytest.mark.parametrize("support", [False, True])
@pytest.mark.parametrize("garbage", sorted(GARBAGE))
def test_logits_dead_rows_get_zero_gradient(backend, support, garbage):
    gen, y, c, skip, g_t, g_c = _rows()
    z = torch.randn(N, V, generator=gen)
    c_ids = torch.cat([c[:, :1], c[:, 1:].clone()], 1)
    c_ids[DEAD[1], 1] = 5  # the poisoned column sits in row 4's support
    c_ids[DEAD[0], 1] = 3
    grads = []
    for zz in (_poison(z, GARBAGE[garbage]), _poison(z, 0.0)):
        leaf = zz.requires_grad_()
        out = sparse_log_softmax(leaf, y, c_ids, 0.8, support=support, skip=skip, backend=backend)
        (g,) = torch.autograd.grad((out.target, out.candidates), leaf, (g_t, g_c))
        grads.append(g)
    dirty, clean = grads
    assert bool((dirty[DEAD] == 0).all()), dirty[DEAD]
    live = [i for i in range(N) if i not in DEAD]
    torch.testing.assert_close(dirty[live], clean[live], rtol=0, atol=0)


@pytest.mark.parametrize("backend", sorted(backend_registry.BACKENDS))
@pytest.mark.parametrize("support", [False, True])
@pytest.mark.parametrize("garbage", sorted(GARBAGE))
def test_linear_dead_rows_get_zero_gradient(backend, support, garbage):
    gen, y, c, skip, g_t, g_c = _rows()
    h = torch.randn(N, D, generator=gen)
    w = torch.randn(V, D, generator=gen) / 2
    b = torch.randn(V, generator=gen)
    grads = []
    for hh in (_poison(h, GARBAGE[garbage]), _poison(h, 0.0)):
        leaves = [x.clone().requires_grad_() for x in (hh, w, b)]
        out = linear_sparse_log_softmax(leaves[0], leaves[1], y, c, 0.8, bias=leaves[2], support=support,
                                        skip=skip, backend=backend)
        grads.append(torch.autograd.grad((out.target, out.candidates), leaves, (g_t, g_c)))
    (dh, dw, db), (dh0, dw0, db0) = grads
    assert bool((dh[DEAD] == 0).all()), dh[DEAD]
    assert bool(torch.isfinite(dw).all()) and bool(torch.isfinite(db).all())
    live = [i for i in range(N) if i not in DEAD]
    torch.testing.assert_close(dh[live], dh0[live], rtol=0, atol=0)
    torch.testing.assert_close(dw, dw0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(db, db0, rtol=1e-6, atol=1e-6)
