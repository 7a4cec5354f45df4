"""The record of per-row vocabulary statistics (``offpolicy.ops.row_stats``), through the one statistic that
exists only there: ``varentropy`` (no native kernel accumulates it; the torch backend's pass does, and the ``cpu``
and ``triton`` backends hand the call to it). Against the float64 reference
``offpolicy.ops.logits_op.logits_naive.varentropy`` (``sum p (log p + H)^2`` from ``log_softmax``, two passes): the
logits and fused-linear primitives, hostile logits, skipped rows, support mode, a vocabulary split by hand and
folded by the declared rescale rule and the shard all-reduce (``torch.compile``: ``tests/ops/test_sum_p2.py``). Then, for every declared
statistic at once: a float64 reference exists, the declared rescale rule folds blocks exactly (float64), and the
support form equals the full form when the support is the whole vocabulary.

Tolerance of fp32 ``varentropy = u / s - (t / s)^2`` (``E2 = E_p[(x - m)^2]``, ``arg_tol`` the absolute error of
an fp32 ``x - m``): the fp32 sums' relative error (a few hundred ulps, ``< 2e-5``) on ``u / s`` and twice on
``(t / s)^2 <= E2`` gives ``1e-4 E2``; an error ``eps`` in each ``x - m`` moves the variance by at most
``2 eps sqrt(E2) + eps^2`` and, through ``p``, by a relative ``2 eps`` of ``E2``.
"""

from __future__ import annotations

import pytest
import torch

from offpolicy.ops import backend_registry, linear_sparse_log_softmax, row_stats, sparse_log_softmax
from offpolicy.ops.logits_op import logits_naive
from offpolicy.ops.vocab_parallel import VocabShard
from support.linear_reference import make_inputs
from support.thread_ranks import run_ranks
from support.vocab_reference import arg_tol, distinct_ids, hostile_logits, temperatures

INF = float("inf")
#: The float64 reference of each declared statistic, over the full vocabulary of ``softmax(z * inv_temp)``.
REFERENCE = {"sum_p2": logits_naive.sum_p2, "varentropy": logits_naive.varentropy}


def _check(got: torch.Tensor, x: torch.Tensor, what: str) -> None:
    """``got [N]`` fp32 varentropy of ``softmax(x)`` (``x`` float64 ``[N, V]``, ``-inf`` allowed)."""
    want = logits_naive.varentropy(x, torch.ones(x.shape[0], dtype=torch.float64))
    live = torch.logsumexp(x, dim=1) > -INF
    xs = torch.where(live[:, None], x, torch.zeros_like(x))
    p = torch.softmax(xs, dim=1)
    xm = torch.where(p > 0, xs - xs.amax(dim=1, keepdim=True), torch.zeros_like(xs))
    e2 = (p * xm * xm).sum(dim=1)
    eps = arg_tol(x)
    tol = e2 * (1e-4 + 2 * eps) + 2 * eps * e2.sqrt() + eps * eps + 1e-6
    assert got.dtype == torch.float32 and got.shape == want.shape, what
    err = (got.double() - want).abs()
    assert bool((err <= tol).all()), f"{what}: error {float((err - tol).max()):.3g} over tolerance"


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_logits_varentropy_matches_float64(backend, dtype):
    gen = torch.Generator().manual_seed(21)
    n, v = 6, 777
    z = hostile_logits(n, v, dtype, gen)
    z[4] = torch.linspace(-1e4, 1e4, v, dtype=torch.float64).to(dtype)  # a 1e4 spread: one-hot, variance ~0
    z[0, :] = 2.5  # uniform: variance exactly 0
    tau = temperatures(n, gen).float()
    skip = torch.zeros(n, dtype=torch.bool)
    skip[5] = True
    y = torch.randint(0, v, (n,), generator=gen)
    out = sparse_log_softmax(z, y, temperature=tau, skip=skip, backend=backend, stats={"varentropy", "sum_p2"})
    assert list(out.stats) == ["sum_p2", "varentropy"]  # declared order, whatever order asked
    got = out.stats["varentropy"]
    x = z.double() / tau.double()[:, None]
    x[5] = -INF  # skipped: reported as a row without mass
    _check(got, x, f"{backend} {dtype}")
    assert got[1] == 0 and got[5] == 0 and not got.requires_grad
    # the extra statistic changes nothing else
    plain = sparse_log_softmax(z, y, temperature=tau, skip=skip, backend="torch")
    assert torch.equal(plain.lse, out.lse) and torch.equal(plain.target, out.target) and plain.stats is None


def test_support_varentropy_is_over_the_renormalised_support():
    gen = torch.Generator().manual_seed(22)
    n, v, k = 7, 300, 9
    z = torch.randn(n, v, generator=gen) * 4
    c = distinct_ids(n, v, k, gen, pad_frac=0.3)
    c[0] = -1  # an empty support: 0
    y = torch.randint(0, v, (n,), generator=gen)
    out = sparse_log_softmax(z, y, c, temperature=0.6, support=True, backend="torch", stats=("varentropy",))
    xs = (z.double() / 0.6).gather(1, c.clamp_min(0)).masked_fill(c < 0, -INF)
    _check(out.stats["varentropy"], xs, "support")
    assert out.stats["varentropy"][0] == 0


def test_vocabulary_split_by_hand_folds_by_the_declared_rule():
    """Three slices' torch-backend records folded with ``row_stats.merge`` (``u`` moved by ``a (u + 2 d t + d^2 s)``),
    the max arriving in each slice in turn."""
    gen = torch.Generator().manual_seed(23)
    n, v = 5, 601
    z = hostile_logits(n, v, torch.float32, gen)
    z[0, :300] += 30.0  # the max in the first slice
    it = (1.0 / temperatures(n, gen)).float()
    mod = backend_registry.get("torch").logits
    acc = None
    for lo, hi in ((0, 200), (200, 201), (201, 601)):
        part = mod.full_stats(z[:, lo:hi].contiguous(), it, None, extras=("varentropy",))
        acc = part if acc is None else row_stats.merge(acc, part)
    _check(row_stats.finish(acc)[2]["varentropy"], z.double() * it.double()[:, None], "merged")


@pytest.mark.parametrize("primitive", ["logits", "linear"])
def test_shard_all_reduce_merges_every_extra(primitive, monkeypatch):
    """``combine_shards`` through both primitives, the vocabulary over three 'ranks' (threads), both extras."""
    world = 3
    h, w, b, y, c, tau = make_inputs(n=6, d=8, v=301, k=4, seed=24, scale=2.0)
    z = h @ w.T + b
    bounds = [0, 100, 101, 301]

    def rank_main(r):
        lo, hi = bounds[r], bounds[r + 1]
        shard = VocabShard(group=None, start=lo)
        asked = ("varentropy", "sum_p2")
        if primitive == "logits":
            out = sparse_log_softmax(z[:, lo:hi].contiguous(), y, c, tau, shard=shard, backend="torch", stats=asked,
                                     validate=False)
        else:
            out = linear_sparse_log_softmax(h, w[lo:hi], y, c, tau, bias=b[lo:hi], shard=shard, backend="torch",
                                            stats=asked, validate=False)
        return out.stats

    results = run_ranks(world, rank_main, monkeypatch)
    x = z.double() / tau.double()[:, None]
    want_p2 = logits_naive.sum_p2(x, torch.ones(6, dtype=torch.float64))
    for r in range(world):
        _check(results[r]["varentropy"], x, f"{primitive} rank {r}")
        assert bool(((results[r]["sum_p2"].double() - want_p2).abs() <= 1e-5 * want_p2 + 1e-7).all())


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("support", [False, True], ids=["full", "support"])
def test_linear_varentropy_matches_float64(backend, support):
    h, w, b, y, c, tau = make_inputs(n=9, d=16, v=1031, k=5, seed=25, scale=2.0)
    skip = torch.zeros(9, dtype=torch.bool)
    skip[3] = True
    out = linear_sparse_log_softmax(h, w, y, c, tau, bias=b, support=support, skip=skip, backend=backend,
                                    chunk_bytes=1 << 14, stats=("varentropy",))
    x = (h.double() @ w.double().T + b.double()) / tau.double()[:, None]
    if support:
        x = x.gather(1, c.clamp_min(0)).masked_fill(c < 0, -INF)
    x[3] = -INF
    _check(out.stats["varentropy"], x, f"linear {backend} support={support}")


def test_stats_argument_is_checked_at_the_boundary():
    z = torch.randn(3, 20)
    y = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="stats: unknown statistic 'sum_p3'"):
        sparse_log_softmax(z, y, stats=("sum_p3",))
    with pytest.raises(ValueError, match="stats: expected a tuple, list or set"):
        sparse_log_softmax(z, y, stats="varentropy")  # a bare string would ask for its letters
    with pytest.raises(ValueError, match="stats: unknown statistic"):
        linear_sparse_log_softmax(z, torch.randn(7, 20), y, stats=[None])
    both = sparse_log_softmax(z, y, sum_p2=True, stats=["sum_p2"])
    assert list(both.stats) == ["sum_p2"] and torch.equal(both.sum_p2, both.stats["sum_p2"])


# Every declared statistic, whatever it is: the checks a new one gets without a line of test code.


def test_every_statistic_has_a_float64_reference():
    assert set(REFERENCE) == set(row_stats.STATISTICS)


@pytest.mark.parametrize("name", list(row_stats.STATISTICS))
def test_declared_rules_fold_blocks_and_agree_with_the_support_form(name):
    """float64: blocks of columns with their own references folded by ``merge`` (the declared ``rescale``) equal
    the whole row's ``finish``, the float64 reference, and the ``support`` form over the whole vocabulary."""
    gen = torch.Generator().manual_seed(27)
    x = torch.randn(4, 50, generator=gen, dtype=torch.float64) * 3
    x[1, 10:] = -INF
    x[2, :20] += 9.0  # the max in the first block

    def record(cols: torch.Tensor) -> row_stats.RowStats:
        m = cols.amax(dim=1)
        m = torch.where(torch.isfinite(m), m, 0.0)  # a block without mass: reference 0, as the backends
        xm = cols - m[:, None]
        e = torch.exp(xm)
        return row_stats.of_block(m, e, xm, (e * torch.where(e > 0, xm, 0.0)).sum(dim=1), (name,))

    folded = row_stats.merge(row_stats.merge(record(x[:, :20]), record(x[:, 20:21])), record(x[:, 21:]))
    lse, _, values = row_stats.finish(folded)
    want = REFERENCE[name](x, torch.ones(4, dtype=torch.float64))
    torch.testing.assert_close(values[name], want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(row_stats.support((name,), x, lse)[name], want, rtol=1e-12, atol=1e-14)
