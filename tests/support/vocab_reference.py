"""Hostile inputs for the vocabulary backends' contract functions (``full_stats`` / ``row_stats`` and
``full_grad`` / ``row_grad``) and the tolerance model shared by the Triton kernels' and the native CPU kernels'
tests. The float64 reference itself is the op's own :mod:`offpolicy.ops.logits_op.logits_naive`.

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

from offpolicy.ops.logits_op import logits_naive

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
    if not want.numel():
        return
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
    lse, _, _ = logits_naive.full_stats(z.cpu(), inv_temp)
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


def op_case(n, v, k, dtype, gen):
    """One hostile batch for the op: :func:`hostile_logits` with row 0 spanning ``[-1e4, 1e4]``, candidates holding
    the target (but in row 2), padding, an empty candidate row (3), a skipped row (5); float64 upstream weights
    ``w_t [N]``, ``w_c [N, K]`` for the gradient. Needs ``n >= 6``."""
    z = hostile_logits(n, v, dtype, gen)
    z[0] = torch.linspace(-1e4, 1e4, v).to(dtype)  # extreme logits
    y = torch.randint(0, v, (n,), generator=gen)
    cands = torch.stack([torch.randperm(v, generator=gen)[:k] for _ in range(n)])
    cands[:, 0] = y  # target among candidates (a repeated id in the kernel's scatter)
    cands[2, 0] = (y[2] + 1) % v  # ... except in row 2
    cands = torch.where(torch.rand(n, k, generator=gen) < 0.25, -1, cands)
    cands[3] = -1  # an empty candidate row
    skip = torch.zeros(n, dtype=torch.bool)
    skip[5] = True
    w_t = torch.randn(n, generator=gen, dtype=torch.float64)
    w_c = torch.where(cands >= 0, torch.randn(n, k, generator=gen, dtype=torch.float64), 0.0)
    return z, y, cands, skip, w_t, w_c
