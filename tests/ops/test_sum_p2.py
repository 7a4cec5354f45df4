"""``sum_p2=True`` on both primitives: ``sum_v p(v)^2`` per row against the float64 references
(``offpolicy.ops.logits_op.logits_naive.sum_p2``, ``offpolicy.ops.linear_op.linear_naive.sum_p2``), for every backend (Triton in
the interpreter on CPU), odd widths, hostile logits, 16/32-bit inputs, support mode, skipped rows, a vocabulary
split by hand and merged (the online fold and the shard all-reduce), and under ``torch.compile``.

Tolerance: the reference is computed from the same stored logits, so input rounding is shared. ``sum p^2 = q / s^2``
carries the fp32 sums' relative error (the C loops' block sums: about 130 ulps, ``2**-24`` each) three times, plus
twice the relative error of each ``p`` from the fp32 ``x - lse`` (``arg_tol`` of the shared tolerance model):
``|got - want| <= want (2 arg_tol + 3e-5) + 1e-7``, whatever the input dtype.
"""

from __future__ import annotations

import pytest
import torch

from offpolicy.ops import linear_sparse_log_softmax, row_stats, sparse_log_softmax, vocab_parallel
from offpolicy.ops.linear_op import linear_naive
from offpolicy.ops.logits_op import logits_naive
from offpolicy.ops.vocab_parallel import VocabShard
from support.linear_reference import make_inputs
from support.thread_ranks import run_ranks
from support.vocab_reference import STORE_RTOL, arg_tol, distinct_ids, hostile_logits, temperatures

BACKENDS = ["torch", "cpu", "triton"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _check(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, what: str) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape, what
    tol = want * (2 * arg_tol(x) + 3e-5) + 1e-7
    err = (got.double() - want).abs()
    assert bool((err <= tol).all()), f"{what}: error {float((err - tol).max()):.3g} over tolerance"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("v", [1, 7, 1000, 1500])
def test_logits_sum_p2_matches_float64(backend, dtype, v):
    gen = torch.Generator().manual_seed(v)
    n = 6
    z = hostile_logits(n, v, dtype, gen)
    if v > 1:
        z[4] = (torch.linspace(-1e4, 1e4, v, dtype=torch.float64)).to(dtype)  # a 1e4 spread
    tau = temperatures(n, gen).float()
    skip = torch.zeros(n, dtype=torch.bool)
    skip[5] = True
    y = torch.randint(0, v, (n,), generator=gen)
    out = sparse_log_softmax(z, y, temperature=tau, skip=skip, backend=backend, sum_p2=True)
    want = logits_naive.sum_p2(z, 1.0 / tau.double())
    want[5] = 0.0
    _check(out.sum_p2, want, z.double() / tau.double()[:, None], f"{backend} {dtype} V={v}")
    assert out.sum_p2[1] == 0  # the all -inf row has no mass
    # the default call leaves it out and returns the same other statistics
    plain = sparse_log_softmax(z, y, temperature=tau, skip=skip, backend=backend)
    assert plain.sum_p2 is None
    assert torch.equal(plain.lse, out.lse) and torch.equal(plain.entropy, out.entropy)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sum_p2_is_detached_and_the_flag_checked(backend):
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(4, 50, generator=gen).requires_grad_()
    y = torch.randint(0, 50, (4,), generator=gen)
    out = sparse_log_softmax(z, y, backend=backend, sum_p2=True)
    assert out.target.requires_grad and not out.sum_p2.requires_grad
    out.target.sum().backward()
    eager = sparse_log_softmax(z.detach().clone().requires_grad_(), y, backend=backend)
    assert z.grad is not None and bool(torch.isfinite(z.grad).all()) and eager.sum_p2 is None
    with pytest.raises(ValueError, match="sum_p2: expected True or False"):
        sparse_log_softmax(z, y, backend=backend, sum_p2=1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_support_sum_p2_is_over_the_renormalised_support(backend):
    gen = torch.Generator().manual_seed(11)
    n, v, k = 7, 300, 9
    z = torch.randn(n, v, generator=gen, dtype=torch.float64).float() * 4
    c = distinct_ids(n, v, k, gen, pad_frac=0.3)
    c[0] = -1  # an empty support: sum_p2 = 0
    y = torch.randint(0, v, (n,), generator=gen)
    out = sparse_log_softmax(z, y, c, temperature=0.6, support=True, backend=backend, sum_p2=True)
    xs = (z.double() / 0.6).gather(1, c.clamp_min(0)).masked_fill(c < 0, -float("inf"))
    want = logits_naive.sum_p2(xs, torch.ones(n, dtype=torch.float64))
    _check(out.sum_p2, want, xs, f"support {backend}")
    assert out.sum_p2[0] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_vocabulary_split_by_hand_and_merged(backend):
    """Each slice's backend statistics folded with ``row_stats.merge`` (``q`` scaled by ``exp(2 (m - M))``)."""
    from offpolicy.ops import backend_registry

    gen = torch.Generator().manual_seed(5)
    n, v = 5, 601
    z = hostile_logits(n, v, torch.float32, gen)
    it = (1.0 / temperatures(n, gen)).float()
    mod = backend_registry.get(backend).logits
    acc = None
    for lo, hi in ((0, 200), (200, 201), (201, 601)):
        part = mod.full_stats(z[:, lo:hi].contiguous(), it, None, extras=("sum_p2",))
        acc = part if acc is None else row_stats.merge(acc, part)
    got = row_stats.finish(acc)[2]["sum_p2"]
    _check(got, logits_naive.sum_p2(z, it.double()), z.double() * it.double()[:, None], f"merged {backend}")


@pytest.mark.parametrize("primitive", ["logits", "linear"])
def test_shard_all_reduce_merges_sum_p2(primitive, monkeypatch):
    """``combine_shards`` through both primitives, the vocabulary split over three 'ranks' (threads)."""
    world = 3
    h, w, b, y, c, tau = make_inputs(n=6, d=8, v=301, k=4, seed=2)
    z = h @ w.T + b
    bounds = [0, 100, 101, 301]

    def rank_main(r):
        lo, hi = bounds[r], bounds[r + 1]
        shard = VocabShard(group=None, start=lo)
        if primitive == "logits":
            out = sparse_log_softmax(z[:, lo:hi].contiguous(), y, c, tau, shard=shard, backend="torch",
                                     sum_p2=True, validate=False)
        else:
            out = linear_sparse_log_softmax(h, w[lo:hi], y, c, tau, bias=b[lo:hi], shard=shard, backend="torch",
                                            sum_p2=True, validate=False)
        return out.sum_p2

    results = run_ranks(world, rank_main, monkeypatch)
    want = linear_naive.sum_p2(h, w, b, y, c, tau)
    x = (z.double() / tau.double()[:, None])
    for r in range(world):
        _check(results[r], want, x, f"{primitive} rank {r}")
    assert vocab_parallel.combine_shards is not None


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("support", [False, True], ids=["full", "support"])
def test_linear_sum_p2_matches_float64(backend, dtype, support):
    if backend == "triton" and dtype == torch.bfloat16 and not torch.cuda.is_available():
        pytest.skip("bf16 tl.dot is wrong in Triton's CPU interpreter (m, s, t too, without sum_p2): GPU only")
    h, w, b, y, c, tau = make_inputs(n=9, d=16, v=1031 if backend == "torch" else 97, k=5, dtype=dtype, seed=4)
    skip = torch.zeros(9, dtype=torch.bool)
    skip[3] = True
    out = linear_sparse_log_softmax(h, w, y, c, tau, bias=b, support=support, skip=skip, backend=backend,
                                    chunk_bytes=1 << 14, sum_p2=True)
    want = linear_naive.sum_p2(h, w, b, y, c, tau, support=support, skip=skip)
    z = h.double() @ w.double().T + b.double()
    x = z / (tau.double() if isinstance(tau, torch.Tensor) else tau)[:, None]
    # a 16-bit matmul may round each logit to its dtype (the CPU torch backend's bf16/fp16 mm): x moves by
    # |x| STORE_RTOL, each p by that relatively, p^2 twice that; doubled for margin
    slack = 4 * STORE_RTOL[dtype] * (1 + x.abs().amax(dim=1)) if dtype != torch.float32 else 0.0
    tol = want * (2 * arg_tol(x) + 3e-5 + slack) + 1e-7
    assert bool(((out.sum_p2.double() - want).abs() <= tol).all()), f"{backend} {dtype} support={support}"
    assert out.sum_p2[3] == 0 and not out.sum_p2.requires_grad
    assert linear_sparse_log_softmax(h, w, y, c, tau, bias=b, support=support, backend=backend).sum_p2 is None


@pytest.mark.parametrize("primitive", ["logits", "linear"])
def test_sum_p2_under_torch_compile(primitive):
    h, w, b, y, c, tau = make_inputs(n=5, d=8, v=131, k=4, seed=6)
    z = (h @ w.T + b).contiguous()

    # with a second extra (no native kernel has it): the custom ops carry the names as one string and the
    # accumulators as one [E, N] tensor
    def call(h, w, b, z):
        if primitive == "logits":
            return sparse_log_softmax(z, y, c, tau, backend="torch", sum_p2=True, stats=("varentropy",),
                                      validate=False)
        return linear_sparse_log_softmax(h, w, y, c, tau, bias=b, backend="torch", sum_p2=True,
                                         stats=("varentropy",), validate=False)

    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
    got = compiled(h, w, b, z)
    want = call(h, w, b, z)
    torch.testing.assert_close(got.sum_p2, want.sum_p2, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got.stats["varentropy"], want.stats["varentropy"], rtol=1e-6, atol=1e-7)
    _check(got.sum_p2, linear_naive.sum_p2(h, w, b, y, c, tau), z.double() / tau.double()[:, None], "compiled")


@pytest.mark.parametrize("kernel", ["logits", "linear"])
def test_triton_online_rescale_over_many_tiles(kernel):
    """Small tiles, so the running max moves between tiles and ``q`` is rescaled by ``exp(2 (m - m'))``."""
    gen = torch.Generator().manual_seed(8)
    if kernel == "logits":
        from offpolicy.kernels import logsoftmax

        z = hostile_logits(4, 300, torch.float32, gen)
        z[0] = torch.linspace(-20, 20, 300)  # the max arrives in the last tile
        it = torch.full((4,), 1.3)
        m, s, t, q = logsoftmax.row_stats(z, it, block=16, sum_p2=True)
        want, x = logits_naive.sum_p2(z, it.double()), z.double() * 1.3
    else:
        from offpolicy.kernels import linear_logsoftmax

        h, w, b, y, c, tau = make_inputs(n=4, d=16, v=200, k=2, seed=9, scale=3.0)
        it = 1.0 / tau.float()
        m, s, t, q = linear_logsoftmax.merge_stats(*linear_logsoftmax.linear_row_stats(
            h, w, b, it, splits=3, tiles=(16, 16, 16, 1, 1), sum_p2=True))
        want = linear_naive.sum_p2(h, w, b, y, c, tau)
        x = (h.double() @ w.double().T + b.double()) * it.double()[:, None]
    got = row_stats.finish(row_stats.RowStats(m, s, t, {"sum_p2": q}))[2]["sum_p2"]
    _check(got, want, x, f"triton {kernel} tiles")
