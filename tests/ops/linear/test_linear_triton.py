"""The Triton fused-linear kernels beyond the op's contract (which tests/ops/test_linear_backends.py checks on
every backend): bf16 at a realistic size on a GPU, split statistics, the gradient filter, float64 routing.

Without a GPU they run in Triton's interpreter (see conftest.py) with fp32 and fp16 inputs only: the
interpreter's bf16 ``tl.dot`` is wrong (ENVIRONMENT.md), so bf16 is checked on a GPU only. Shapes are tiny (the
interpreter costs milliseconds per program and loop step). Tolerances: those of tests/test_linear_log_softmax.py
(``linear_reference.TOL``); fp32 ``tl.dot`` runs with ``input_precision="tf32x3"`` on a GPU (about fp32's accuracy;
the interpreter multiplies in fp32).
"""

from __future__ import annotations

import pytest
import torch
from support.linear_reference import check_against_reference, grads, make_inputs, probe_loss

from offpolicy.ops import linear_sparse_log_softmax
from offpolicy.ops.linear_op import linear_torch_backend as ltb

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.skipif(DEVICE == "cpu", reason="bf16 tl.dot is wrong in Triton's interpreter; checked on a GPU")
@pytest.mark.parametrize("support", [False, True])
def test_bf16_on_gpu(support):
    h, w, b, y, c, tau = make_inputs(n=300, d=256, v=5000, k=16, dtype=torch.bfloat16, seed=9)
    check_against_reference(h, w, b, y, c, tau, support=support, backend="triton", device=DEVICE,
                            dtype=torch.bfloat16)


def test_split_statistics_merge_to_the_unsplit_ones():
    from offpolicy.kernels import linear_logsoftmax as K

    h, w, b, *_ = make_inputs(n=19, d=24, v=200, seed=3)
    inv = torch.rand(19) + 0.5
    one = K.merge_stats(*K.linear_row_stats(h, w, b, inv, splits=1))
    four = K.merge_stats(*K.linear_row_stats(h, w, b, inv, splits=4))
    ids = torch.zeros(19, 1, dtype=torch.int64)
    ref = ltb.full_stats(h, w, b, ids, inv, 1 << 20)[0][:3]
    for a, r, q in zip(one, four, ref):
        assert torch.allclose(a, r, atol=1e-5, rtol=1e-5) and torch.allclose(a, q, atol=1e-4, rtol=1e-5)


def test_triton_and_torch_backends_agree_and_filter_bound():
    gen = torch.Generator().manual_seed(19)
    n, d, v = 32, 16, 512
    h = torch.randn(n, d, generator=gen) * 4
    w = torch.randn(v, d, generator=gen)
    y = torch.randint(0, v, (n,), generator=gen)
    c = torch.randint(0, v, (n, 4), generator=gen)
    res = {}
    for backend, eps in (("torch", None), ("triton", None), ("triton", 2.0**-12)):
        hl, wl = h.clone().to(DEVICE).requires_grad_(), w.clone().to(DEVICE).requires_grad_()
        out = linear_sparse_log_softmax(hl, wl, y.to(DEVICE), c.to(DEVICE), 1.0, backend=backend, grad_filter=eps)
        g = grads(probe_loss(out.target, out.candidates), [hl, wl])
        res[backend, eps] = [x.detach().cpu() for x in (out.target, *g)]
    for a, r in zip(res["triton", None], res["torch", None]):
        assert float((a - r).abs().max()) <= 1e-4 * float(r.abs().max())
    # Filtering drops entries of dz below eps |coef[n]|: |dX err[n]| <= eps |coef[n]| sum_v |W[v]|.
    gen = torch.Generator().manual_seed(1)
    coef = (torch.randn(n, generator=gen, dtype=torch.float64) + torch.randn(n, 4, generator=gen,
                                                                              dtype=torch.float64).sum(1)).abs()
    bound_h = 2.0**-12 * coef.float()[:, None] * w.abs().sum(0)[None, :] + 1e-5
    bound_w = 2.0**-12 * (coef.float()[:, None] * h.abs()).sum(0)[None, :] + 1e-5
    assert bool(((res["triton", 2.0**-12][1] - res["triton", None][1]).abs() <= bound_h).all())
    assert bool(((res["triton", 2.0**-12][2] - res["triton", None][2]).abs() <= bound_w).all())


def test_filter_skips_tiles_in_the_kernel():
    from offpolicy.kernels import linear_logsoftmax as K

    gen = torch.Generator().manual_seed(23)
    n, d, v = 16, 16, 1024
    h = (torch.randn(n, d, generator=gen) * 6).to(DEVICE)
    w = torch.randn(v, d, generator=gen).to(DEVICE)
    inv = torch.ones(n, device=DEVICE)
    m, s, _ = K.merge_stats(*K.linear_row_stats(h, w, None, inv))
    lse = m + s.log()
    rows = torch.arange(n, device=DEVICE)
    dh = torch.zeros(n, d, device=DEVICE)
    coef = torch.ones(n, device=DEVICE)
    assert K.linear_dense_grad(h, w, None, rows, inv, lse, coef, dh, None, None) == 0
    assert K.linear_dense_grad(h, w, None, rows, inv, lse, coef, dh, None, None, eps=2.0**-12) > 0


def test_gpu_tiles_follow_the_device():
    """One 16-bit tile everywhere; fp32 (tf32x3) gets a smaller one on an A100 (mma.sync) or a device with less
    shared memory than the larger needs; a device with less than every tile needs gets the smallest."""
    from offpolicy.kernels import linear_logsoftmax as K

    assert K.gpu_tiles(2, 90, 232_448) == K.gpu_tiles(2, 100, 232_448) == K.gpu_tiles(2, 80, 166_912)
    assert K.gpu_tiles(2, 80, 166_912) == (128, 128, 32, 8, 3)
    assert K.gpu_tiles(4, 90, 232_448) == K.gpu_tiles(4, 100, 232_448) == (64, 64, 32, 8, 2)
    assert K.gpu_tiles(4, 80, 166_912) == K.gpu_tiles(4, 90, 65_536) == (64, 64, 16, 4, 2)
    for itemsize in (2, 4):
        for tile, _, shared in K.GPU_TILES[itemsize]:
            assert K.gpu_tiles(itemsize, 100, shared) in [t for t, *_ in K.GPU_TILES[itemsize]]


def test_zero_coefficient_rows_go_last_and_cost_nothing():
    """The backward takes every row, those with coef = 0 last (a sort, no host sync); a block of them adds nothing,
    and the filtered-tile count stays on the device."""
    from offpolicy.kernels import linear_logsoftmax as K

    coef = torch.tensor([0.0, 2.0, 0.0, -1.0, 3.0, 0.0])
    assert K.rows_by_coef(coef).tolist() == [1, 3, 4, 0, 2, 5]
    gen = torch.Generator().manual_seed(5)
    n, d, v = 40, 16, 256
    h, w = torch.randn(n, d, generator=gen), torch.randn(v, d, generator=gen)
    inv = torch.ones(n)
    m, s, _ = K.merge_stats(*K.linear_row_stats(h, w, None, inv))
    lse = m + s.log()
    coef = torch.zeros(n)
    coef[:5] = torch.randn(5, generator=gen)
    dh_all, dh_some = torch.zeros(n, d), torch.zeros(n, d)
    skipped = K.linear_dense_grad(h, w, None, K.rows_by_coef(coef), inv, lse, coef, dh_all, None, None)
    assert isinstance(skipped, torch.Tensor) and int(skipped) == 0
    K.linear_dense_grad(h, w, None, torch.arange(5), inv, lse, coef, dh_some, None, None)
    torch.testing.assert_close(dh_all, dh_some, rtol=1e-6, atol=1e-6)
    assert float(dh_all[5:].abs().sum()) == 0.0


def test_float64_runs_on_the_torch_backend():
    """The Triton backend declares no float64: the registry sends float64 inputs to the torch backend."""
    h, w, b, y, c, tau = make_inputs(n=3, d=4, v=10, k=2)
    args = (h.double(), w.double(), y, c, tau)
    got = linear_sparse_log_softmax(*args, bias=b.double(), backend="triton")
    want = linear_sparse_log_softmax(*args, bias=b.double(), backend="torch")
    assert got.lse.dtype == torch.float64
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
