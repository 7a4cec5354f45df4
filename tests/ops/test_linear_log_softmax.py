"""The fused linear log-softmax (torch backend) against a float64 dense reference built from hidden and weight.

Tolerances (errors relative to the scale of the quantity compared):
* fp32 inputs: logits are D-term fp32 dot products (relative error ~ sqrt(D) * 6e-8) and the log-softmax
  subtracts numbers of size ``|x|``; values agree to ``2e-5 * (1 + max|x|)``, gradients to ``1e-4`` of their largest
  entry (the recompute and the chunk-wise fp32 accumulation add a few roundings per entry).
* fp16 inputs (upcast to fp32 on CPU): values as fp32, against the reference on the fp16-rounded inputs; the
  gradients are returned in fp16 (relative rounding 2^-11 = 4.9e-4), so they agree to ``1e-3`` of their largest entry.
* bf16 inputs: the matmul output is rounded to bf16 (relative 2^-9, as materialised bf16 logits are) and the
  backward's ``dz`` enters the matmuls in bf16 (relative 2^-9); values agree to ``2^-7 * (1 + max|x|)``, gradients
  to ``2e-2`` of their largest entry.
* float64 inputs: ``torch.autograd.gradcheck`` on the autograd functions themselves.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from support.linear_reference import check_against_reference, grads, leaves, make_inputs, probe_loss
from support.thread_ranks import run_ranks

from offpolicy.ops import VocabShard, linear_sparse_log_softmax, sparse_log_softmax
from offpolicy.ops.linear_op import linear_torch_backend as ltb

@pytest.mark.parametrize("support", [False, True])
@pytest.mark.parametrize("chunk_bytes", [None, 1 << 14])
@pytest.mark.parametrize("per_token_temp", [False, True])
def test_matches_dense_reference_fp32(support, chunk_bytes, per_token_temp):
    h, w, b, y, c, tau = make_inputs(per_token_temp=per_token_temp)
    check_against_reference(h, w, b, y, c, tau, support=support, chunk_bytes=chunk_bytes)


@pytest.mark.parametrize("support", [False, True])
def test_skipped_rows_and_duplicates(support):
    h, w, b, y, c, tau = make_inputs(n=17, v=157, k=5, seed=3)
    c[4, 1] = c[4, 0] = 9  # a duplicated candidate id: fine for a head, refused for a support (counted twice)
    skip = torch.zeros(17, dtype=torch.bool)
    skip[[0, 5, 16]] = True
    if support:
        with pytest.raises(ValueError, match="candidate_ids: row 4 holds an id twice"):
            linear_sparse_log_softmax(h, w, y, c, tau, bias=b, support=True, skip=skip)
        c[4, 1] = 10
    out = check_against_reference(h, w, b, y, c, tau, support=support, skip=skip, chunk_bytes=1 << 14)
    assert bool((out.lse[skip] == float("inf")).all()) and bool((out.entropy[skip] == 0).all())


@given(
    n=st.integers(1, 12),
    d=st.integers(1, 20),
    v=st.integers(1, 90),
    k=st.integers(0, 6),
    support=st.booleans(),
    seed=st.integers(0, 2**16),
    budget=st.sampled_from([1 << 10, 1 << 13, 1 << 20]),
)
def test_property_random_shapes(n, d, v, k, support, seed, budget):
    h, w, b, y, c, tau = make_inputs(n=n, d=d, v=v, k=k, seed=seed, pad_frac=0.3)
    check_against_reference(h, w, b, y, c if k or support else None, tau, support=support, chunk_bytes=budget)


@pytest.mark.parametrize("support", [False, True])
def test_same_as_logits_path_on_materialised_logits(support):
    h, w, b, y, c, tau = make_inputs(n=15, v=120, seed=11)
    hl, wl, bl = leaves(h, w, b)
    fused = linear_sparse_log_softmax(hl, wl, y, c, tau, bias=bl, support=support)
    h2, w2, b2 = leaves(h, w, b)
    dense = sparse_log_softmax(h2 @ w2.T + b2, y, c, tau, support=support)
    for a, r in zip(fused[:4], dense[:4]):  # sum_p2 (None here) has its own tests
        assert torch.allclose(a, r, atol=1e-5, rtol=0, equal_nan=False) or torch.equal(a, r)
    g1 = grads(probe_loss(fused.target, fused.candidates), [hl, wl, bl])
    g2 = grads(probe_loss(dense.target, dense.candidates), [h2, w2, b2])
    for a, r in zip(g1, g2):
        assert float((a - r).abs().max()) <= 1e-4 * float(r.abs().max())


@pytest.mark.parametrize("support", [False, True])
def test_gradcheck_float64(support):
    h, w, b, y, c, tau = make_inputs(n=5, d=4, v=11, k=3, seed=13)
    hd, wd, bd = (t.double().requires_grad_() for t in (h, w, b))

    def f(hh, ww, bb):
        out = linear_sparse_log_softmax(hh, ww, y, c, tau, bias=bb, support=support, chunk_bytes=256)
        return torch.nan_to_num(out.target, neginf=0.0), torch.nan_to_num(out.candidates, neginf=0.0)

    assert torch.autograd.gradcheck(f, (hd, wd, bd), eps=1e-6, atol=1e-7)


def test_support_mode_touches_only_support_rows():
    # Zero gradient outside the support; invariant to any change of the weight rows outside it.
    h, w, b, y, c, tau = make_inputs(n=8, v=300, k=4, seed=17, pad_frac=0.0)
    hl, wl, bl = leaves(h, w, b)
    out = linear_sparse_log_softmax(hl, wl, y, c, tau, bias=bl, support=True)
    _, gw, gb = grads(probe_loss(out.target, out.candidates), [hl, wl, bl])
    used = torch.zeros(300, dtype=torch.bool)
    used[torch.cat([y, c.reshape(-1)])] = True
    assert bool((gw[~used] == 0).all()) and bool((gb[~used] == 0).all()) and bool((gw[used] != 0).any())
    w2, b2 = w.clone(), b.clone()
    w2[~used] = 1e4
    b2[~used] = -3.0
    out2 = linear_sparse_log_softmax(h, w2, y, c, tau, bias=b2, support=True)
    assert torch.equal(out.candidates.detach(), out2.candidates) and torch.equal(out.target.detach(), out2.target)


def test_grad_filter_off_is_exact_and_bound_holds():
    # Peaked rows (a few dominant logits), so that most blocks of p are negligible.
    gen = torch.Generator().manual_seed(19)
    n, d, v = 64, 16, 2048
    h = torch.randn(n, d, generator=gen) * 4
    w = torch.randn(v, d, generator=gen)
    y = torch.randint(0, v, (n,), generator=gen)
    c = torch.randint(0, v, (n, 4), generator=gen)
    results = {}
    for eps in (None, 0.0, 2.0**-12):
        hl, wl = h.clone().requires_grad_(), w.clone().requires_grad_()
        out = linear_sparse_log_softmax(hl, wl, y, c, 1.0, chunk_bytes=1 << 16, grad_filter=eps)
        results[eps] = grads(probe_loss(out.target, out.candidates), [hl, wl])
    assert all(torch.equal(a, r) for a, r in zip(results[0.0], results[None]))
    # Each dropped entry of dz is below eps |coef[n]|, so |dX err[n]| <= eps |coef[n]| sum_v |W[v]| and
    # |dW err[v]| <= eps sum_n |coef[n]| |h[n]|.
    out = linear_sparse_log_softmax(h, w, y, c, 1.0)
    gen = torch.Generator().manual_seed(1)
    gy = torch.randn(n, generator=gen, dtype=torch.float64)
    gc = torch.randn(n, 4, generator=gen, dtype=torch.float64)
    coef = (gy + gc.sum(1)).abs().float()
    bound_h = 2.0**-12 * coef[:, None] * w.abs().sum(0)[None, :] + 1e-5
    bound_w = 2.0**-12 * (coef[:, None] * h.abs()).sum(0)[None, :] + 1e-5
    err_h = (results[2.0**-12][0] - results[None][0]).abs()
    err_w = (results[2.0**-12][1] - results[None][1]).abs()
    assert bool((err_h <= bound_h).all()) and bool((err_w <= bound_w).all())
    assert float(out.lse.max()) > 0


def test_backend_counts_filtered_blocks():
    gen = torch.Generator().manual_seed(23)
    n, d, v = 32, 8, 4096
    h = torch.randn(n, d, generator=gen) * 6
    w = torch.randn(v, d, generator=gen)
    ids = torch.randint(0, v, (n, 2), generator=gen)
    inv = torch.ones(n)
    (m, s, _, _), _ = ltb.full_stats(h, w, None, ids, inv, 1 << 14)
    lse = m + s.log()
    coef = torch.ones(n)
    dz_ids = torch.zeros(n, 2)
    _, _, _, none_skipped = ltb.backward(h, w, None, ids, dz_ids, inv, lse, coef, chunk_bytes=1 << 14)
    _, _, _, skipped = ltb.backward(h, w, None, ids, dz_ids, inv, lse, coef, chunk_bytes=1 << 14, grad_filter=2.0**-12)
    assert none_skipped == 0 and skipped > 0


@pytest.mark.parametrize("support", [False, True])
def test_vocab_shards_in_process(monkeypatch, support):
    """Three vocabulary shards (threads) give the unsharded outputs; dW concatenates, dX sums over shards."""
    h, w, b, y, c, tau = make_inputs(n=13, v=150, k=5, seed=29)
    bounds = [0, 40, 95, 150]

    def rank_main(rank):
        lo, hi = bounds[rank], bounds[rank + 1]
        hl, wl, bl = leaves(h, w[lo:hi], b[lo:hi])
        out = linear_sparse_log_softmax(hl, wl, y, c, tau, bias=bl, support=support,
                                        shard=VocabShard(None, lo), chunk_bytes=1 << 13)
        return out, grads(probe_loss(out.target, out.candidates), [hl, wl, bl])

    results = run_ranks(3, rank_main, monkeypatch)
    hl, wl, bl = leaves(h, w, b)
    full = linear_sparse_log_softmax(hl, wl, y, c, tau, bias=bl, support=support)
    g_full = grads(probe_loss(full.target, full.candidates), [hl, wl, bl])
    for out, _ in results:
        for a, r in zip(out[:4], full[:4]):  # sum_p2 (None here) has its own tests
            assert torch.allclose(a, r.detach(), atol=1e-5, rtol=0)
    dh = sum(g[0] for _, g in results)
    dw = torch.cat([g[1] for _, g in results])
    db = torch.cat([g[2] for _, g in results])
    for a, r in zip((dh, dw, db), g_full):
        assert float((a - r).abs().max()) <= 1e-4 * float(r.abs().max())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(hidden=torch.zeros(3)), "hidden"),
        (dict(weight=torch.zeros(5, 7)), "weight"),
        (dict(weight=torch.zeros(11, 4, dtype=torch.float16)), "weight"),
        (dict(bias=torch.zeros(3)), "bias"),
        (dict(targets=torch.zeros(3)), "targets"),
        (dict(candidate_ids=torch.zeros(2, 2, dtype=torch.int64)), "candidate_ids"),
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=torch.tensor([1.0, -1.0, 1.0])), "temperature"),
        (dict(skip=torch.zeros(3)), "skip"),
        (dict(chunk_bytes=0), "chunk_bytes"),
        (dict(grad_filter=1.5), "grad_filter"),
        (dict(targets=torch.tensor([0, 11, 1])), "out of range for V=11"),
        (dict(backend="cuda"), "backend"),
    ],
)
def test_bad_input_raises(kwargs, match):
    args = dict(hidden=torch.zeros(3, 4), weight=torch.zeros(11, 4), targets=torch.zeros(3, dtype=torch.int64),
                candidate_ids=None, temperature=1.0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        linear_sparse_log_softmax(**args)


def test_plan_respects_budget():
    for v, d, budget in ((151936, 2048, 128 << 20), (32768, 4096, 16 << 20), (50, 8, 1 << 10)):
        rows, cols = ltb.plan(4096, v, d, budget)
        assert 1 <= rows <= 4096 and 1 <= cols <= v
        if cols > 64:
            assert 2 * cols * d * 4 + 3 * 4 * rows * cols <= budget
