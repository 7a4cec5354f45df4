"""The Triton vocabulary kernels against a float64 dense reference, directly and through ``sparse_log_softmax``.

Without a GPU the kernels run in Triton's interpreter (``conftest.py``) on fp32 and fp16 logits (the interpreter
mishandles bf16 arithmetic); with a GPU the same tests run compiled on it, bf16 added.

Tolerances: :mod:`support.vocab_reference`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import offpolicy.ops as ops
from offpolicy.kernels import logsoftmax as kernels
from offpolicy.ops.logits_op import logits_naive

from support.vocab_reference import (arg_tol, assert_close_inf, dname, grad_case, grad_tol, hostile_logits, op_case,
                                     temperatures)

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
REPO = Path(__file__).resolve().parents[3]


# ---------------------------------------------------------------- forward statistics kernel


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("block", [64, None], ids=["block64", "default"])
def test_row_stats_match_float64(dtype, block):
    gen = torch.Generator().manual_seed(0)
    n, v = 9, 1000  # 1000 is no multiple of 64: a partial last block
    z = hostile_logits(n, v, dtype, gen, DEVICE)
    inv_temp = (1.0 / temperatures(n, gen)).float().to(DEVICE)
    skip = torch.zeros(n, dtype=torch.bool, device=DEVICE)
    skip[5] = True
    z[5] = float("nan")  # a skipped row is never read: NaN there must not show
    z[7, 3] = float("nan")  # a NaN logit in a read row must show (the caller turns it into an error)
    m, s, t = kernels.row_stats(z, inv_temp, skip, block=block)
    assert m.dtype == s.dtype == t.dtype == torch.float32
    assert m[5] == 0 and s[5] == 0 and t[5] == 0
    assert m[1] == 0 and s[1] == 0 and t[1] == 0  # all -inf
    assert bool(torch.isnan(s[7]))
    live = ~skip.cpu()
    live[7] = False
    lse_ref, ent_ref, x = logits_naive.full_stats(z.cpu()[live], inv_temp.cpu()[live])
    m, s, t = m.cpu()[live], s.cpu()[live], t.cpu()[live]
    lse, ent = logits_naive.lse_entropy(m, s, t)
    tol = arg_tol(x)
    assert_close_inf(lse, lse_ref, tol, "lse")
    assert_close_inf(ent, ent_ref, tol, "entropy")
    row_max = torch.where(torch.isfinite(x.amax(1)), x.amax(1), 0.0)
    assert_close_inf(m.double(), row_max, tol, "row max")


def test_row_stats_strided_rows_and_no_skip():
    """A row stride wider than V (a slice of a wider buffer) and ``skip=None``."""
    gen = torch.Generator().manual_seed(1)
    wide = hostile_logits(5, 700, torch.float32, gen, DEVICE)
    z = wide[:, 50:550]
    inv_temp = torch.full((5,), 1 / 0.7, device=DEVICE)
    m, s, t = kernels.row_stats(z, inv_temp, None, block=128)
    lse_ref, ent_ref, x = logits_naive.full_stats(z.cpu(), inv_temp.cpu())
    lse, ent = logits_naive.lse_entropy(m, s, t)
    assert_close_inf(lse, lse_ref, arg_tol(x), "lse")
    assert_close_inf(ent, ent_ref, arg_tol(x), "entropy")


# ---------------------------------------------------------------- backward kernel


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("block", [64, None], ids=["block64", "default"])
def test_row_grad_matches_float64(dtype, inplace, block):
    gen = torch.Generator().manual_seed(2)
    n, v, m_ids = 9, 1000, 70  # 70 ids: two chunks of the exact scatter and several comparison steps
    z, ids, inv_temp, lse, grad, grad_sum = grad_case(n, v, m_ids, dtype, gen, device=DEVICE)
    z_ref = z.cpu().clone()
    want = logits_naive.full_grad(z_ref, ids.cpu(), inv_temp.cpu(), lse.cpu(), grad.cpu(), grad_sum.cpu())
    out = z if inplace else torch.full_like(z, 7.0)
    got = kernels.row_grad(z, ids, inv_temp, lse, grad, grad_sum, out, block=block)
    assert got is out and got.dtype == dtype
    x = z_ref.double() * inv_temp.cpu().double()[:, None]
    x = torch.where(torch.isnan(x), torch.zeros_like(x), x)
    assert_close_inf(got.cpu(), want, grad_tol(want, inv_temp.cpu(), grad.cpu(), x, dtype), "dz")
    assert torch.equal(got[6].cpu(), torch.zeros(v, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
def test_row_grad_strided_out_and_logits(dtype):
    """Row strides wider than V for both the logits and the output."""
    gen = torch.Generator().manual_seed(3)
    z, ids, inv_temp, lse, grad, grad_sum = grad_case(4, 300, 5, dtype, gen, device=DEVICE)
    wide = torch.zeros(4, 400, dtype=dtype, device=DEVICE)
    wide[:, 37:337] = z
    out_wide = torch.full((4, 512), 3.0, dtype=dtype, device=DEVICE)
    got = kernels.row_grad(wide[:, 37:337], ids, inv_temp, lse, grad, grad_sum, out_wide[:, 100:400], block=128)
    want = logits_naive.full_grad(z.cpu(), ids.cpu(), inv_temp.cpu(), lse.cpu(), grad.cpu(), grad_sum.cpu())
    x = z.cpu().double() * inv_temp.cpu().double()[:, None]
    assert_close_inf(got.cpu(), want, grad_tol(want, inv_temp.cpu(), grad.cpu(), x, dtype), "dz")
    assert bool((out_wide[:, :100] == 3).all()) and bool((out_wide[:, 400:] == 3).all())


@settings(max_examples=25)
@given(
    n=st.integers(1, 4),
    v=st.integers(1, 300),
    m_ids=st.integers(1, 80),
    block=st.sampled_from([16, 32, 256]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_kernels_random_shapes(n, v, m_ids, block, dtype, seed):
    """Odd shapes (V below, at and above the block; more ids than columns) against float64."""
    gen = torch.Generator().manual_seed(seed)
    z, ids, inv_temp, lse, grad, grad_sum = grad_case(n, v, m_ids, dtype, gen, device=DEVICE)
    m, s, t = kernels.row_stats(z, inv_temp, None, block=block)
    lse_ref, _, x = logits_naive.full_stats(z.cpu(), inv_temp.cpu())
    assert_close_inf(logits_naive.lse_entropy(m, s, t)[0], lse_ref, arg_tol(x), "lse")
    got = kernels.row_grad(z, ids, inv_temp, lse, grad, grad_sum, torch.empty_like(z), block=block)
    want = logits_naive.full_grad(z.cpu(), ids.cpu(), inv_temp.cpu(), lse.cpu(), grad.cpu(), grad_sum.cpu())
    xg = torch.where(torch.isnan(x), torch.zeros_like(x), x)
    assert_close_inf(got.cpu(), want, grad_tol(want, inv_temp.cpu(), grad.cpu(), xg, dtype), "dz")


def test_empty_shapes():
    inv = torch.ones(0, device=DEVICE)
    m, s, t = kernels.row_stats(torch.empty(0, 5, device=DEVICE), inv)
    assert m.shape == s.shape == t.shape == (0,)
    m, s, t = kernels.row_stats(torch.empty(3, 0, device=DEVICE), torch.ones(3, device=DEVICE))
    assert bool((s == 0).all()) and bool((m == 0).all())
    out = kernels.row_grad(torch.empty(0, 5, device=DEVICE), torch.empty(0, 2, dtype=torch.int64, device=DEVICE),
                           inv, inv, torch.empty(0, 2, device=DEVICE), inv, torch.empty(0, 5, device=DEVICE))
    assert out.shape == (0, 5)


def test_64bit_row_offsets():
    """Row offsets past 2**31 elements: a 3-row view with a 2**30 + 64 row stride over a lazily allocated
    buffer (about 6 GiB of address space, only the touched pages are backed on the CPU)."""
    stride, v = 2**30 + 64, 256
    base = torch.empty(2 * stride + v, dtype=torch.float16, device=DEVICE)
    z = base.as_strided((3, v), (stride, 1))
    gen = torch.Generator().manual_seed(4)
    src = torch.randn(3, v, generator=gen).to(torch.float16)
    z.copy_(src.to(DEVICE))
    inv_temp = torch.full((3,), 1.3, device=DEVICE)
    assert kernels._needs_int64(3, z)
    m, s, t = kernels.row_stats(z, inv_temp)
    lse_ref, _, x = logits_naive.full_stats(src, inv_temp.cpu())
    lse = m.cpu().double() + torch.log(s.cpu().double())
    assert_close_inf(lse, lse_ref, arg_tol(x), "lse")
    ids = torch.tensor([[3, 3, -1], [0, 255, 7], [9, 1, 2]], device=DEVICE)
    grad = torch.where(ids >= 0, torch.randn(3, 3, generator=gen).to(DEVICE), 0.0)
    lse32 = lse_ref.float().to(DEVICE)
    kernels.row_grad(z, ids, inv_temp, lse32, grad, grad.sum(1), z)  # in place, through the same view
    want = logits_naive.full_grad(src, ids.cpu(), inv_temp.cpu(), lse32.cpu(), grad.cpu(), grad.sum(1).cpu())
    assert_close_inf(z.cpu(), want, grad_tol(want, inv_temp.cpu(), grad.cpu(), x, torch.float16), "dz")


def test_bad_inputs_raise():
    z = torch.randn(4, 10, device=DEVICE)
    inv = torch.ones(4, device=DEVICE)
    with pytest.raises(ValueError, match="unit stride"):
        kernels.row_stats(z.t().contiguous().t(), inv)
    with pytest.raises(ValueError, match="inv_temp"):
        kernels.row_stats(z, inv.double())
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        kernels.row_stats(z.to(torch.int32), inv)
    ids = torch.zeros(4, 2, dtype=torch.int64, device=DEVICE)
    g = torch.zeros(4, 2, device=DEVICE)
    with pytest.raises(ValueError, match="ids"):
        kernels.row_grad(z, ids.int(), inv, inv, g, inv, torch.empty_like(z))
    with pytest.raises(ValueError, match="out"):
        kernels.row_grad(z, ids, inv, inv, g, inv, torch.empty_like(z, dtype=torch.float16))
    with pytest.raises(ValueError, match="block"):
        kernels.row_stats(z, inv, block=48)


# ---------------------------------------------------------------- through sparse_log_softmax


def test_triton_and_torch_backends_agree():
    """Same inputs through both backends: outputs and gradients equal to fp32 rounding."""
    gen = torch.Generator().manual_seed(6)
    z, y, cands, skip, w_t, w_c = op_case(8, 500, 5, torch.float32, gen)
    res = {}
    for name in ("torch", "triton"):
        leaf = z.to(DEVICE).requires_grad_()
        out = ops.sparse_log_softmax(leaf, y.to(DEVICE), cands.to(DEVICE), 1.3, skip=skip.to(DEVICE), backend=name)
        (g,) = torch.autograd.grad((out.target, out.candidates), leaf, (w_t.float().to(DEVICE),
                                                                        w_c.float().to(DEVICE)))
        res[name] = [t.detach().cpu() for t in (out.target, out.candidates, out.lse, out.entropy, g)]
    for a, b in zip(res["torch"], res["triton"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_dispatch_env_var_routes_to_kernels(monkeypatch):
    """``OFFPOLICY_BACKEND=triton`` (and CUDA tensors by default) reach the kernels."""
    calls = []
    stats, grad = kernels.row_stats, kernels.row_grad
    monkeypatch.setattr(kernels, "row_stats", lambda *a, **k: calls.append("stats") or stats(*a, **k))
    monkeypatch.setattr(kernels, "row_grad", lambda *a, **k: calls.append("grad") or grad(*a, **k))
    z = torch.randn(3, 40, device=DEVICE, requires_grad=True)
    y = torch.tensor([1, 2, 3], device=DEVICE)
    if not CUDA:
        monkeypatch.setenv("OFFPOLICY_BACKEND", "triton")
    ops.sparse_log_softmax(z, y).target.sum().backward()
    assert calls == ["stats", "grad"]
    monkeypatch.setenv("OFFPOLICY_BACKEND", "torch")
    ops.sparse_log_softmax(z, y).target.sum().backward()
    assert calls == ["stats", "grad"]


def test_float64_logits_use_the_torch_path():
    """The Triton backend declares no float64: the registry runs float64 logits on the torch backend."""
    z = torch.randn(3, 40, dtype=torch.float64, device=DEVICE)
    y = torch.tensor([1, 2, 3], device=DEVICE)
    out = ops.sparse_log_softmax(z, y, backend="triton")
    assert out.lse.dtype == torch.float64
    torch.testing.assert_close(out.lse, torch.logsumexp(z, 1))


@settings(max_examples=30)
@given(st.integers(0, 4), st.integers(0, 12), st.integers(1, 9), st.integers(0, 2**31 - 1))
def test_unique_ids_sum_the_grads_of_equal_ids(n, m, v, seed):
    """The O(M log M) de-duplication: per row each id in [0, v) once with the sum of its grads, then -1 / 0."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(-2, v + 2, (n, m), generator=gen)
    grad = torch.randn(n, m, generator=gen)
    got_ids, got_g = kernels.unique_ids(ids, grad, v)
    assert got_ids.shape == ids.shape and got_g.shape == grad.shape
    for r in range(n):
        want: dict[int, float] = {}
        for i, g in zip(ids[r].tolist(), grad[r].tolist()):
            if 0 <= i < v:
                want[i] = want.get(i, 0.0) + g
        got = {int(i): float(g) for i, g in zip(got_ids[r], got_g[r]) if i >= 0}
        assert got.keys() == want.keys() and len(got) == int((got_ids[r] >= 0).sum())
        for i, g in want.items():
            assert abs(got[i] - g) <= 1e-5 * (1 + abs(g))
        assert float(got_g[r][got_ids[r] < 0].abs().sum()) == 0.0


# ---------------------------------------------------------------- GPU build and benchmark script


def test_gpu_bench_dry_run(tmp_path):
    """The GPU benchmark script runs end to end at tiny shapes in the interpreter (so it cannot rot)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_bench.py"), "--dry-run", "--out", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (js,) = tmp_path.glob("*.json")
    (csv,) = tmp_path.glob("*.csv")
    data = json.loads(js.read_text())
    assert {"device", "versions", "date", "copy_gbps", "rows"} <= set(data)
    methods = {r["method"] for r in data["rows"]}
    assert {"offpolicy", "torch_eager_dense"} <= methods
    ours = [r for r in data["rows"] if r["method"] == "offpolicy" and r["status"] == "ok"]
    assert {r["mode"] for r in ours} == {"head", "support"} and all(r["ms"] > 0 for r in ours)
    assert csv.read_text().count("\n") == len(data["rows"]) + 1
