"""The native CPU backend (``kernels/vocab_pass_cpu.c`` through :mod:`offpolicy.ops.logits_op.cpu_backend`) against a float64
reference: its two contract functions directly, on hostile logits and odd shapes (``V`` below, at and past the
vector width, so every tail path runs), and end to end through ``sparse_log_softmax``. Also its fallbacks; the build
cache is tested in ``test_cpu_native_build.py``.

Tolerances: :mod:`support.vocab_reference` (the same model as the Triton kernels'): ``arg_tol`` covers the fp32
arithmetic (the C ``2^y`` is within 0.8 ulp, its sums within about 130 ulps), and the gradient is rounded once to
the logits' dtype.
"""

from __future__ import annotations

import math
import platform
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import offpolicy as op
from offpolicy.ops import cpu_native
from offpolicy.ops.logits_op import cpu_backend, logits_naive, torch_backend

from support.vocab_reference import (INF, arg_tol, assert_close_inf, dname, grad_case, grad_tol, hostile_logits,
                                     temperatures)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

pytestmark = pytest.mark.skipif(not cpu_backend.available(), reason="no C compiler: the CPU default is torch")


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("v", [1000, 1031, 2048, 37, 16, 5])
def test_stats_match_float64(dtype, v):
    gen = torch.Generator().manual_seed(v)
    n = 9
    z = hostile_logits(n, v, dtype, gen)
    inv_temp = (1.0 / temperatures(n, gen)).float()
    skip = torch.zeros(n, dtype=torch.bool)
    skip[5] = True
    z[5] = float("nan")  # a skipped row is never read
    m, s, t, _ = cpu_backend.full_stats(z, inv_temp, skip)
    assert m.dtype == s.dtype == t.dtype == torch.float32
    assert m[5] == 0 and s[5] == 0 and t[5] == 0
    assert m[1] == 0 and s[1] == 0 and t[1] == 0  # all -inf
    live = ~skip
    lse_ref, ent_ref, x = logits_naive.full_stats(z[live], inv_temp[live])
    lse, ent = logits_naive.lse_entropy(m[live], s[live], t[live])
    assert_close_inf(lse, lse_ref, arg_tol(x), "lse")
    assert_close_inf(ent, ent_ref, arg_tol(x), "entropy")
    row_max = torch.where(torch.isfinite(x.amax(1)), x.amax(1), 0.0)
    assert_close_inf(m[live].double(), row_max, arg_tol(x), "row max")


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
def test_nan_and_inf_rows_take_the_torch_statistics(dtype):
    """Rows holding NaN or +inf are recomputed by the PyTorch backend: identical statistics there (the loss then
    reports them as errors or the row takes no gradient); the other rows are the C loops' own."""
    gen = torch.Generator().manual_seed(7)
    z = hostile_logits(6, 300, dtype, gen)
    z[0, 17] = float("nan")
    z[2, 5] = INF
    z[4, :] = INF
    inv_temp = torch.full((6,), 1.25)
    got = cpu_backend.full_stats(z, inv_temp, None)
    want = torch_backend.full_stats(z, inv_temp, None)
    for g, w in zip(got[:3], want[:3]):
        assert torch.equal(g[[0, 2, 4]], w[[0, 2, 4]]) or torch.allclose(g[[0, 2, 4]], w[[0, 2, 4]], equal_nan=True)
    assert bool(torch.isnan(got[1][0])) and math.isinf(float(got[1][4]))
    lse_ref, _, x = logits_naive.full_stats(z[[1, 3, 5]], inv_temp[[1, 3, 5]])
    lse, _ = logits_naive.lse_entropy(*(g[[1, 3, 5]] for g in got[:3]))
    assert_close_inf(lse, lse_ref, arg_tol(x), "lse")


def test_long_rows_keep_fp32_accuracy():
    """V = 151936 (Qwen's vocabulary): the blocked sums keep lse and entropy within the same bound."""
    gen = torch.Generator().manual_seed(11)
    z = (torch.randn(3, 151936, generator=gen) * 4).to(torch.bfloat16)
    z[1] = 0.0  # a flat row: s = V exactly in float64, the worst case for a long fp32 sum
    inv_temp = torch.tensor([1.0, 1.0, 1 / 0.6])
    lse_ref, ent_ref, x = logits_naive.full_stats(z, inv_temp)
    lse, ent = logits_naive.lse_entropy(*cpu_backend.full_stats(z, inv_temp, None)[:3])
    assert_close_inf(lse, lse_ref, arg_tol(x), "lse")
    assert_close_inf(ent, ent_ref, arg_tol(x), "entropy")


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("v", [1000, 33])
def test_grad_matches_float64(dtype, inplace, v):
    gen = torch.Generator().manual_seed(2 + v)
    n, m_ids = 9, 70  # more ids than columns at v = 33: repeated ids add up
    z, ids, inv_temp, lse, grad, grad_sum = grad_case(n, v, m_ids, dtype, gen)
    z_ref = z.clone()
    want = logits_naive.full_grad(z_ref, ids, inv_temp, lse, grad, grad_sum)
    out = z if inplace else torch.full_like(z, 7.0)
    got = cpu_backend.full_grad(z, ids, inv_temp, lse, grad, grad_sum, out)
    assert got is out and got.dtype == dtype
    x = z_ref.double() * inv_temp.double()[:, None]
    x = torch.where(torch.isnan(x), torch.zeros_like(x), x)
    assert_close_inf(got, want, grad_tol(want, inv_temp, grad, x, dtype), "dz")
    assert torch.equal(got[6], torch.zeros(v, dtype=dtype))  # G = 0 and no id gradient: NaN logits not read


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
def test_strided_rows(dtype):
    """Row strides wider than V for the logits and the output; nothing outside the view is touched."""
    gen = torch.Generator().manual_seed(3)
    z, ids, inv_temp, lse, grad, grad_sum = grad_case(4, 300, 5, dtype, gen)
    wide = torch.zeros(4, 400, dtype=dtype)
    wide[:, 37:337] = z
    lse_ref, _, x = logits_naive.full_stats(z, inv_temp)
    lse_got, _ = logits_naive.lse_entropy(*cpu_backend.full_stats(wide[:, 37:337], inv_temp, None)[:3])
    assert_close_inf(lse_got, lse_ref, arg_tol(x), "lse")
    out_wide = torch.full((4, 512), 3.0, dtype=dtype)
    got = cpu_backend.full_grad(wide[:, 37:337], ids, inv_temp, lse, grad, grad_sum, out_wide[:, 100:400])
    want = logits_naive.full_grad(z, ids, inv_temp, lse, grad, grad_sum)
    x = torch.where(torch.isnan(x), torch.zeros_like(x), x)
    assert_close_inf(got, want, grad_tol(want, inv_temp, grad, x, dtype), "dz")
    assert bool((out_wide[:, :100] == 3).all()) and bool((out_wide[:, 400:] == 3).all())


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 20),
    v=st.integers(1, 300),
    m_ids=st.integers(1, 80),
    dtype=st.sampled_from(DTYPES),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_shapes(n, v, m_ids, dtype, threads, seed):
    """Odd shapes (V below, at and above the vector width; more ids than columns; more rows than one call takes)
    with one and two row workers, against float64."""
    gen = torch.Generator().manual_seed(seed)
    z, ids, inv_temp, lse, grad, grad_sum = grad_case(n, v, m_ids, dtype, gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        m, s, t, _ = cpu_backend.full_stats(z, inv_temp, None)
        got = cpu_backend.full_grad(z, ids, inv_temp, lse, grad, grad_sum, torch.empty_like(z))
    finally:
        torch.set_num_threads(before)
    live = ~torch.isnan(z).any(dim=1)  # grad_case puts NaN on rows that take no dense gradient
    lse_ref, _, x = logits_naive.full_stats(z[live], inv_temp[live])
    assert_close_inf(logits_naive.lse_entropy(m[live], s[live], t[live])[0], lse_ref, arg_tol(x), "lse")
    want = logits_naive.full_grad(z, ids, inv_temp, lse, grad, grad_sum)
    xg = z.double() * inv_temp.double()[:, None]
    xg = torch.where(torch.isnan(xg), torch.zeros_like(xg), xg)
    assert_close_inf(got, want, grad_tol(want, inv_temp, grad, xg, dtype), "dz")


def test_empty_shapes():
    inv = torch.ones(3)
    m, s, t, _ = cpu_backend.full_stats(torch.empty(3, 0), inv, None)
    assert bool((s == 0).all()) and bool((m == 0).all())
    m, s, t, _ = cpu_backend.full_stats(torch.empty(0, 5), torch.ones(0), None)
    assert m.shape == (0,)
    out = cpu_backend.full_grad(torch.empty(0, 5), torch.empty(0, 2, dtype=torch.int64), torch.ones(0), torch.ones(0),
                                torch.empty(0, 2), torch.ones(0), torch.empty(0, 5))
    assert out.shape == (0, 5)


def test_direct_call_on_strided_logits_reads_them_as_contiguous():
    """The boundaries refuse logits without unit stride along V; a direct call of the backend copies them into its
    layout instead of checking again, so it returns what the contiguous logits give."""
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(4, 10, generator=gen)
    strided = z.t().contiguous().t()
    assert strided.stride(1) != 1
    inv = torch.full((4,), 0.7)
    for a, b in zip(cpu_backend.full_stats(strided, inv, None)[:3], cpu_backend.full_stats(z, inv, None)[:3]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    m, s, t, _ = cpu_backend.full_stats(z, inv, None)
    lse = m + torch.log(s)
    ids = torch.randint(0, 10, (4, 2), generator=gen)
    g = torch.randn(4, 2, generator=gen)
    want = cpu_backend.full_grad(z, ids, inv, lse, g, g.sum(1), torch.empty_like(z))
    got = cpu_backend.full_grad(strided, ids, inv, lse, g, g.sum(1), torch.empty_like(z))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_bad_inputs_raise():
    z = torch.randn(4, 10)
    inv = torch.ones(4)
    with pytest.raises(ValueError, match="fp32/bf16/fp16"):
        cpu_backend.full_stats(z.double(), inv, None)
    ids = torch.zeros(4, 2, dtype=torch.int64)
    g = torch.ones(4, 2)
    with pytest.raises(ValueError, match="out must be"):
        cpu_backend.full_grad(z, ids, inv, inv, g, g.sum(1), torch.empty_like(z, dtype=torch.float16))


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("inplace", [False, True], ids=["grad", "inplace_grad"])
def test_sparse_log_softmax_matches_dense_float64(dtype, inplace):
    """End to end: targets, candidates, lse, entropy and the logits' gradient, per-token temperatures, skipped rows,
    against float64 autograd of the dense log-softmax on the same stored logits."""
    gen = torch.Generator().manual_seed(5)
    n, v, k = 13, 517, 6
    z = (torch.randn(n, v, generator=gen) * 3).to(dtype)
    z[2, :100] = -INF
    y = torch.randint(0, v, (n,), generator=gen)
    cand = torch.randint(0, v, (n, k), generator=gen)
    cand[:, 0] = y
    cand[3, 2:] = -1
    tau = temperatures(n, gen).float()
    skip = torch.zeros(n, dtype=torch.bool)
    skip[[4, 9]] = True
    g_t, g_c = torch.randn(n, generator=gen), torch.randn(n, k, generator=gen)
    leaf = z.clone().requires_grad_()
    zz = leaf.clone() if inplace else leaf
    out = op.sparse_log_softmax(zz, y, cand, tau, skip=skip, inplace_grad=inplace, backend="cpu")
    valid = (cand >= 0) & ~skip[:, None]
    live = ~skip
    ((out.target[live] * g_t[live]).sum() + torch.where(valid, out.candidates * g_c, 0).sum()).backward()
    ref = z.double().requires_grad_()
    lp = torch.log_softmax(ref / tau.double()[:, None], dim=1)
    ((lp[torch.arange(n), y][live] * g_t.double()[live]).sum()
     + torch.where(valid, lp.gather(1, cand.clamp_min(0)) * g_c.double(), 0).sum()).backward()
    x = z.double() / tau.double()[:, None]
    tol = arg_tol(x)[live]
    assert_close_inf(out.target[live].double(), lp[torch.arange(n), y][live].detach(), tol, "target")
    assert_close_inf(out.lse[live].double(), torch.logsumexp(x[live], 1), tol, "lse")
    p = lp.detach().exp()
    ent_ref = -torch.where(p > 0, p * lp.detach(), 0.0).sum(1)
    assert_close_inf(out.entropy[live].double(), ent_ref[live], tol, "entropy")
    grad_in = torch.zeros(n, k + 1, dtype=torch.float64)  # the gradient bound of grad_tol: |g| summed per row
    grad_in[:, 0], grad_in[:, 1:] = torch.where(live, g_t, 0), torch.where(valid, g_c, 0)
    bound = grad_tol(ref.grad, 1 / tau, grad_in, torch.where(torch.isfinite(x), x, 0.0), dtype)
    assert_close_inf(leaf.grad.double(), ref.grad, bound, "dz")
    assert bool((leaf.grad[skip] == 0).all())


def test_default_cpu_backend_agrees_with_torch_backend():
    """The CPU default (this backend) and the chunked PyTorch backend give the same policy loss and gradient on
    bf16 logits, to the bf16 gradient's rounding."""
    gen = torch.Generator().manual_seed(9)
    n, v = 24, 1031
    z = (torch.randn(n, v, generator=gen) * 2).bfloat16()
    y = torch.randint(0, v, (n,), generator=gen)
    q = torch.log_softmax(z.float() + 0.1 * torch.randn(n, v, generator=gen), 1)[torch.arange(n), y]
    adv = torch.randn(n, generator=gen)
    results = []
    for backend in ("cpu", "torch"):
        leaf = z.clone().requires_grad_()
        out = op.policy_loss(leaf, y, q, adv, correction=op.Correction(weights="mis", bounds=(0.5, 2.0)),
                             backend=backend)
        out.loss.backward()
        results.append((out.loss.detach(), leaf.grad.float()))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=2.0**-7, atol=1e-7)


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv(cpu_native.ENV_VAR, "0")
    assert cpu_native.load() is None and cpu_native.unavailable_reason() == "OFFPOLICY_CPU_NATIVE=0"
    with pytest.raises(RuntimeError, match="OFFPOLICY_CPU_NATIVE=0"):
        cpu_backend.full_stats(torch.zeros(2, 3), torch.ones(2), None)


X86_VARIANTS = ["-march=x86-64", "-march=x86-64-v3", "-march=native -mno-avx512bf16"]


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 instruction-set variants")
@pytest.mark.parametrize("flags", X86_VARIANTS)
def test_every_instruction_set_branch(flags, monkeypatch, tmp_path):
    """The source's other branches, built here with other ``-march`` flags: 8 generic lanes with software 16-bit
    conversions (x86-64: SSE2 only), 8 AVX2 lanes with F16C (x86-64-v3), and 16 AVX-512 lanes with the bit-twiddled
    bf16 rounding instead of the AVX512-BF16 instruction. Same checks against float64."""
    monkeypatch.setenv(cpu_native.ARCH_ENV_VAR, flags)
    monkeypatch.setenv(cpu_native.CACHE_ENV_VAR, str(tmp_path))
    monkeypatch.setattr(cpu_native, "_STATE", {})
    assert cpu_backend.available()
    for dtype in DTYPES:
        gen = torch.Generator().manual_seed(21)
        z, ids, inv_temp, lse, grad, grad_sum = grad_case(9, 1031, 40, dtype, gen)
        m, s, t, _ = cpu_backend.full_stats(z, inv_temp, None)
        live = ~torch.isnan(z).any(dim=1)
        lse_ref, ent_ref, x = logits_naive.full_stats(z[live], inv_temp[live])
        lse_got, ent_got = logits_naive.lse_entropy(m[live], s[live], t[live])
        assert_close_inf(lse_got, lse_ref, arg_tol(x), f"{flags} {dtype} lse")
        assert_close_inf(ent_got, ent_ref, arg_tol(x), f"{flags} {dtype} entropy")
        got = cpu_backend.full_grad(z, ids, inv_temp, lse, grad, grad_sum, torch.empty_like(z))
        want = logits_naive.full_grad(z, ids, inv_temp, lse, grad, grad_sum)
        xg = z.double() * inv_temp.double()[:, None]
        xg = torch.where(torch.isnan(xg), torch.zeros_like(xg), xg)
        assert_close_inf(got, want, grad_tol(want, inv_temp, grad, xg, dtype), f"{flags} {dtype} dz")


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
def test_second_backward_through_a_retained_graph(dtype):
    """The backward recomputes from the logits (nothing cached that the first backward consumed): a second backward
    gives the same gradient, and both match float64."""
    gen = torch.Generator().manual_seed(12)
    z = (torch.randn(9, 301, generator=gen) * 2).to(dtype)
    y = torch.randint(0, 301, (9,), generator=gen)
    g_t = torch.randn(9, generator=gen)
    leaf = z.clone().requires_grad_()
    loss = (op.sparse_log_softmax(leaf, y, None, 0.7, backend="cpu").target * g_t).sum()
    loss.backward(retain_graph=True)
    first = leaf.grad.clone()
    leaf.grad = None
    loss.backward()
    assert torch.equal(leaf.grad, first)
    ref = z.double().requires_grad_()
    (torch.log_softmax(ref / 0.7, 1)[torch.arange(9), y] * g_t.double()).sum().backward()
    x = z.double() / 0.7
    bound = grad_tol(ref.grad, torch.full((9,), 1 / 0.7), g_t[:, None], x, dtype)
    assert_close_inf(first.double(), ref.grad, bound, "dz")


def test_block_totals_summed_in_double_at_v_2_20():
    """V = 2^20, a row whose fp32 lane sums are exact: a first block of zeros (1024 terms of 1) and 1023 blocks at
    ``x = -24 ln 2`` (terms of 2^-24, block totals of 2^-14, half an fp32 ulp of the running total 1024). Stated
    bound: ``|lse - lse_ref| <= 1e-5`` (about 170 fp32 ulps of ``s``: at most 128 lane adds and 16 horizontal adds
    per block, and the 0.8-ulp exponential; the double block totals add nothing visible). Block totals summed in
    fp32 would drop or double every block after the first, an error of 1023 * 2^-14 / 1024 = 6.1e-5 in lse."""
    v = 2**20
    z = torch.full((1, v), -24 * math.log(2), dtype=torch.float32)
    z[0, :1024] = 0.0
    inv_temp = torch.ones(1)
    lse_ref, ent_ref, _ = logits_naive.full_stats(z, inv_temp)
    lse, ent = logits_naive.lse_entropy(*cpu_backend.full_stats(z, inv_temp, None)[:3])
    assert_close_inf(lse, lse_ref, torch.tensor([1e-5]), "lse")
    assert_close_inf(ent, ent_ref, torch.tensor([1e-5]), "entropy")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dname)
def test_per_worker_scratch_under_threads(dtype, monkeypatch):
    """16-bit gradients are assembled in an fp32 scratch row per worker: every thread that runs the C gradient
    passes its own row (and keeps it across its chunks), four workers give the serial gradient bit for bit, 20
    times, and the serial one matches float64."""
    gen = torch.Generator().manual_seed(31)
    z, ids, inv_temp, lse, grad, grad_sum = grad_case(256, 4096, 6, dtype, gen)
    lib = cpu_native.load()
    name = f"grad_{'bf16' if dtype == torch.bfloat16 else 'f16'}"
    kernel, rows_of = getattr(lib, name), {}

    def recording(*args):
        rows_of.setdefault(threading.get_ident(), set()).add(args[13])  # the scratch row's address
        return kernel(*args)

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = cpu_backend.full_grad(z, ids, inv_temp, lse, grad, grad_sum, torch.empty_like(z))
        torch.set_num_threads(4)
        monkeypatch.setattr(lib, name, recording)
        threaded = cpu_backend.full_grad(z, ids, inv_temp, lse, grad, grad_sum, torch.empty_like(z))
        monkeypatch.undo()
        differ = sum(not torch.equal(cpu_backend.full_grad(z, ids, inv_temp, lse, grad, grad_sum, torch.empty_like(z)),
                                     serial) for _ in range(20))
    finally:
        torch.set_num_threads(before)
    assert len(rows_of) >= 2 and all(len(r) == 1 for r in rows_of.values()), rows_of
    assert len(set().union(*rows_of.values())) == len(rows_of), f"threads share a scratch row: {rows_of}"
    assert torch.equal(threaded, serial)
    assert differ == 0, f"{differ} of 20 threaded gradients differ from the serial one"
    want = logits_naive.full_grad(z, ids, inv_temp, lse, grad, grad_sum)
    x = z.double() * inv_temp.double()[:, None]
    x = torch.where(torch.isnan(x), torch.zeros_like(x), x)
    assert_close_inf(serial, want, grad_tol(want, inv_temp, grad, x, dtype), "dz")


@pytest.mark.parametrize("case", ["short scratch row", "column past V", "negative column"])
def test_grad_kernel_refuses_out_of_bounds_writes(case):
    """The C gradient checks its scratch row's size and every column before writing anything (return codes 1, 2)."""
    lib = cpu_native.load()
    n, v, m_ids = 3, 100, 2
    z = torch.randn(n, v).bfloat16()
    out = torch.full((n, v), 5.0, dtype=torch.bfloat16)
    rows = torch.arange(n, dtype=torch.int64)
    shift, a, c = torch.zeros(n), torch.ones(n), torch.ones(n)
    cols = torch.zeros(n, m_ids, dtype=torch.int64)
    g = torch.ones(n, m_ids)
    scratch = torch.empty(v, dtype=torch.float32)
    size, want = scratch.numel() * 4, 0
    if case == "short scratch row":
        size, want = 4 * v - 1, 1
    elif case == "column past V":
        cols[2, 1], want = v, 2
    else:
        cols[1, 0], want = -1, 2
    status = lib.grad_bf16(z.data_ptr(), v * 2, out.data_ptr(), v * 2, v, rows.data_ptr(), n, shift.data_ptr(),
                           a.data_ptr(), c.data_ptr(), cols.data_ptr(), g.data_ptr(), m_ids, scratch.data_ptr(), size)
    assert status == want
    assert bool((out == 5).all())  # nothing written
