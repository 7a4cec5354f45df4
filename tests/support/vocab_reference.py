"""A float64 reference for the vocabulary backends' contract functions (``full_stats`` / ``row_stats`` and
``full_grad`` / ``row_grad``), hostile inputs, and the tolerance model shared by the Triton kernels' and the native
CPU kernels' tests.

Tolerances (the reference is computed in float64 from the *same stored* logits, so input rounding is shared):
* ``arg_tol = 64 u (1 + max|x|)``, ``u = 2**-24``: the absolute error of an fp32 ``x - lse``: ``x = z * (1/tau)``
  and ``lse`` carry a few roundings of numbers of size ``|x|``, and ``log s`` the relative error of an fp32 sum
  (a block tree plus ``V / BLOCK`` sequential adds, under 50 u at these sizes). It bounds lse, log-probabilities
  and the entropy, and, times ``it * sum|g|`` (which bounds every term of the gradient), the gradient's fp32 math.
* the gradient is then rounded once to the logits' dtype: relative ``2**-24`` (fp32), ``2**-11`` (fp16),
  ``2**-8`` (bf16), plus half fp16's smallest subnormal (``2**-25``) for fp16 underflow.
"""

from __future__ import annotations

import torch

U = 2.0**-24
STORE_RTOL = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
STORE_FLOOR = {torch.float32: 0.0, torch.float16: 2.0**-25, torch.bfloat16: 0.0}
INF = float("inf")


def dname(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def arg_tol(x: torch.Tensor) -> torch.Tensor:
    """``[N]`` float64 absolute tolerance of fp32 ``x - lse`` per row (``x`` float64 ``[N, V]``)."""
    finite = torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x))
    return 64 * U * (1 + finite.amax(dim=1))


def assert_close_inf(got: torch.Tensor, want: torch.Tensor, tol: torch.Tensor, what: str) -> None:
    """Infinite entries equal exactly; finite ones within ``tol`` (broadcast against ``want``)."""
    got, want = got.double(), want.double()
    assert torch.equal(torch.isfinite(got), torch.isfinite(want)), f"{what}: finiteness differs"
    inf = ~torch.isfinite(want)
    assert torch.equal(got[inf], want[inf]), f"{what}: infinite entries differ"
    err = torch.where(inf, torch.zeros_like(got), (got - want).abs())
    tol = torch.broadcast_to(tol, want.shape)
    worst = (err - tol).argmax()
    assert bool((err <= tol).all()), f"{what}: error {err.flatten()[worst]:.3g} > tol {tol.flatten()[worst]:.3g}"


def hostile_logits(n: int, v: int, dtype: torch.dtype, gen: torch.Generator, device: str | torch.device = "cpu"
                   ) -> torch.Tensor:
    """``[n, v]`` logits with -inf scattered, one all -inf row, one -inf prefix (the max arrives late) and
    one row whose max sits in the last column."""
    z = torch.randn(n, v, generator=gen, dtype=torch.float64) * 3
    z = torch.where(torch.rand(n, v, generator=gen) < 0.2, -INF, z)
    if n > 1:
        z[1] = -INF
    if n > 2:
        z[2, : (3 * v) // 4] = -INF
    if n > 3:
        z[3, -1] = 40.0
    return z.to(dtype).to(device)


def temperatures(n: int, gen: torch.Generator) -> torch.Tensor:
    """``[n]`` temperatures spread log-uniformly over [0.05, 10]."""
    return torch.exp(torch.empty(n, dtype=torch.float64).uniform_(-3.0, 2.3, generator=gen))


def lse_entropy(m: torch.Tensor, s: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``(lse, entropy)`` from a backend's row statistics ``(m, s, t)`` (``lse = +inf``, entropy 0 where
    ``s = 0``: a row without mass), on the CPU."""
    m, s, t = m.cpu().double(), s.cpu().double(), t.cpu().double()
    has = s > 0
    safe = torch.where(has, s, 1.0)
    return torch.where(has, m + torch.log(safe), INF), torch.where(has, torch.log(safe) - t / safe, 0.0)


def ref_stats(z: torch.Tensor, inv_temp: torch.Tensor):
    """float64 lse (``+inf`` for rows without mass) and entropy of ``softmax(z * inv_temp)``, and ``x``."""
    x = z.double() * inv_temp.double()[:, None]
    lse = torch.logsumexp(x, dim=1)
    dead = lse == -INF
    logp = torch.log_softmax(torch.where(dead[:, None], torch.zeros_like(x), x), dim=1)
    p = torch.exp(logp)
    ent = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(dim=1)
    return torch.where(dead, INF, lse), torch.where(dead, 0.0, ent), x


def ref_grad(z, ids, inv_temp, lse, grad, grad_sum):
    """float64 ``inv_temp * (scatter_add(grad at ids) - G exp(x - lse))`` (no dense part if ``lse = +inf`` or G = 0)."""
    n, v = z.shape
    x = z.double() * inv_temp.double()[:, None]
    p = torch.exp(x - lse.double()[:, None])
    no_dense = torch.isinf(lse.double()) | (grad_sum == 0)  # the kernel skips these reads (NaN logits there)
    p = torch.where(no_dense[:, None], torch.zeros_like(p), p)
    sc = torch.zeros(n, v + 1, dtype=torch.float64)
    sc.scatter_add_(1, torch.where(ids >= 0, ids, v), grad.double())
    return inv_temp.double()[:, None] * (sc[:, :v] - grad_sum.double()[:, None] * p)


def grad_tol(dz_ref, inv_temp, grad, x, dtype):
    """Elementwise tolerance of the stored gradient (see the module docstring)."""
    bound = inv_temp.double().abs() * grad.double().abs().sum(dim=1)  # bounds every term of the row
    return (STORE_RTOL[dtype] * dz_ref.abs() + (arg_tol(x) * bound)[:, None] + STORE_FLOOR[dtype])


def grad_case(n, v, m_ids, dtype, gen, k_pad=0.2, device="cpu"):
    z = hostile_logits(n, v, dtype, gen, device)
    inv_temp = (1.0 / temperatures(n, gen)).float()
    ids = torch.randint(0, v, (n, m_ids), generator=gen)
    ids = torch.where(torch.rand(n, m_ids, generator=gen) < k_pad, -1, ids)
    if m_ids > 2:
        ids[:, 1] = ids[:, 0]  # the target among the candidates
        ids[0, 2:] = ids[0, 2]  # one id repeated across the row
    grad = torch.where(ids >= 0, torch.randn(n, m_ids, generator=gen), 0.0).float()
    lse, _, _ = ref_stats(z.cpu(), inv_temp)
    lse = lse.float()
    grad_sum = grad.sum(dim=1)
    if n > 4:
        lse[4] = INF  # a row without mass: its logits are not read
        z[4] = float("nan")
    if n > 6:
        grad[6] = 0.0  # G = 0 and no id gradient: zero row, logits not read
        grad_sum[6] = 0.0
        z[6] = float("nan")
    if n > 7 and m_ids >= 2:
        grad[7, :2] = torch.tensor([1.5, -1.5])  # G = 0 but id gradients: ids only
        grad[7, 2:] = 0.0
        grad_sum[7] = 0.0
    return z, ids.to(device), inv_temp.to(device), lse.to(device), grad.to(device), grad_sum.to(device)


def distinct_ids(n: int, v: int, k: int, gen: torch.Generator, pad_frac: float = 0.0) -> torch.Tensor:
    """``[n, k]`` int64 candidate ids, distinct within each row (a valid support record), a ``pad_frac`` share
    of them ``-1`` padding (and every column beyond ``v``)."""
    ids = torch.full((n, k), -1, dtype=torch.int64)
    for row in ids:
        perm = torch.randperm(v, generator=gen)[:k]
        row[: perm.numel()] = perm
    return ids.masked_fill(torch.rand(n, k, generator=gen) < pad_frac, -1)


def ref_sum_p2(z: torch.Tensor, inv_temp: torch.Tensor) -> torch.Tensor:
    """float64 ``sum_v p(v)^2`` of ``softmax(z * inv_temp)`` per row (0 for rows without mass), on the CPU:
    ``p`` from ``exp(x - logsumexp(x))`` squared and summed directly (no running statistics)."""
    x = z.cpu().double() * inv_temp.cpu().double()[:, None]
    lse = torch.logsumexp(x, dim=1)
    dead = lse == -INF
    p = torch.exp(x - torch.where(dead, 0.0, lse)[:, None])
    return torch.where(dead, 0.0, (p**2).sum(dim=1))
