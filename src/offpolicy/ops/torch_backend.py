"""Chunked PyTorch backend for the vocabulary pass: the CPU path, and the fallback wherever Triton is absent.

Rows are processed in chunks whose fp32 working set stays near ``CHUNK_BYTES`` (cache-sized), so the only
``[N, V]`` allocation is the gradient itself; bf16/fp16 logits are upcast one chunk at a time.

Both functions follow the backend contract of :mod:`offpolicy.ops.backends`.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: fp32 bytes of one chunk's working buffer. Two such buffers live at once.
CHUNK_BYTES = 4 << 20


def _row_chunks(n: int, v: int) -> range:
    rows = max(1, CHUNK_BYTES // max(1, 4 * v))
    return range(0, n, rows)


def full_stats(logits: Tensor, inv_temp: Tensor, skip: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row online-softmax statistics of ``x = logits * inv_temp`` over the whole (local) vocabulary.

    Args:
        logits: ``[N, V]`` bf16/fp16/fp32, unit stride along ``V``.
        inv_temp: ``[N]`` fp32, ``1 / tau``.
        skip: ``[N]`` bool or None; skipped rows are not read and report ``s = 0``.

    Returns (in ``inv_temp``'s dtype: fp32, or float64 for float64 logits):
        ``m [N]`` (row max, 0 where the row is all ``-inf`` or skipped), ``s [N] = sum exp(x - m)``,
        ``t [N] = sum exp(x - m) * (x - m)`` (so that entropy ``= log s - t / s``), all fp32.
    """
    n, v = logits.shape
    m = torch.zeros(n, dtype=inv_temp.dtype, device=logits.device)
    s = torch.zeros_like(m)
    t = torch.zeros_like(m)
    if n == 0 or v == 0:
        return m, s, t
    step = _row_chunks(n, v).step
    x_buf = torch.empty(min(step, n), v, dtype=inv_temp.dtype, device=logits.device)
    e_buf = torch.empty_like(x_buf)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        x, e = x_buf[: hi - lo], e_buf[: hi - lo]
        torch.mul(logits[lo:hi], inv_temp[lo:hi, None], out=x)
        mx = x.amax(dim=1)
        mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
        x.sub_(mx[:, None])  # x - m <= 0, or -inf
        torch.exp(x, out=e)
        x.clamp_(min=torch.finfo(x.dtype).min)  # -inf * 0 would be NaN in the entropy dot product; finfo.min * 0 = 0
        m[lo:hi] = mx
        s[lo:hi] = e.sum(dim=1)
        t[lo:hi] = torch.linalg.vecdot(e, x)
    if skip is not None:
        s.masked_fill_(skip, 0.0)
        t.masked_fill_(skip, 0.0)
        m.masked_fill_(skip, 0.0)
    return m, s, t


def full_grad(
    logits: Tensor,
    ids: Tensor,
    inv_temp: Tensor,
    lse: Tensor,
    grad: Tensor,
    grad_sum: Tensor,
    out: Tensor,
) -> Tensor:
    """Write ``dz = inv_temp * (scatter(grad at ids) - grad_sum * exp(x - lse))`` into ``out``.

    Args:
        logits: ``[N, V]``; ``x = logits * inv_temp``.
        ids: ``[N, M]`` int64 local column ids, ``-1`` where the entry is padding or owned by another shard.
        inv_temp: ``[N]`` fp32.
        lse: ``[N]`` fp32 normaliser of ``x``; ``+inf`` marks a row with no mass (its ``p`` is 0).
        grad: ``[N, M]`` fp32 upstream gradient of the gathered log-probabilities (0 at padding).
        grad_sum: ``[N]`` fp32 ``sum`` of the row's gradient over *all* its entries (all shards).
        out: ``[N, V]`` output in the logits' dtype; may be ``logits`` itself (in-place gradient).
    """
    n, v = logits.shape
    if n == 0 or v == 0:
        return out
    step = _row_chunks(n, v).step
    buf = torch.empty(min(step, n), v, dtype=inv_temp.dtype, device=logits.device)
    coef = -(grad_sum * inv_temp)
    g_scaled = torch.where(ids >= 0, grad * inv_temp[:, None], torch.zeros_like(grad))
    cols = ids.clamp_min(0)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        x = buf[: hi - lo]
        torch.mul(logits[lo:hi], inv_temp[lo:hi, None], out=x)
        x.sub_(lse[lo:hi, None])
        x.exp_()  # p; exactly 0 on rows whose lse is +inf
        x.mul_(coef[lo:hi, None])  # -G p / tau
        x.scatter_add_(1, cols[lo:hi], g_scaled[lo:hi])
        out[lo:hi].copy_(x)
    return out
