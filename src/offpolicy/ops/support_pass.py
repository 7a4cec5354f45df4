"""The support pass: mask replay over CSR rows of any width, fused, in one autograd node per input kind.

A CSR support record (docs/spec.md#record-memory) gives each row ``t`` its support ``S_t`` (``ids[offsets[t]:
offsets[t + 1]]``, 0 to ``V`` ids). The loss needs ``target[t] = x_t(y_t) - lse_S(t)``, the support-normalised
log-probabilities ``lp[e] = x_t(v_e) - lse_S(t)`` at the ``nnz`` entries, ``lse_S`` and the entropy of ``p^S``,
with ``x = z / tau``. The backward is closed-form,

    dz[t, v] = inv_temp (g_lp[e] [v = v_e in S_t] + g_t [v = y_t] - G_t p^S_t(v) [v in S_t]),
    G_t = g_t + sum_{e in row t} g_lp[e]

so nothing but ``lp`` (``4 nnz`` bytes) is saved (and, for the ``cpu`` backend's wide rows below, a byte mask
and a reference to the logits). Cost, per row of width ``K``:

* logits (:func:`support_log_softmax`): the backend's ``support_stats`` (one gather of the ``K`` logits, passes
  over the gathered copy) and ``support_grad`` (the gradient row zeroed, ``K`` entries written once): ``O(K)``
  work forward, ``O(K)`` plus the zeroing of the ``[N, V]`` gradient backward (which any logits gradient writes),
  whatever ``K`` is: no per-row Python, no ``[N, K_max]`` padding, one gather. The C loops of the ``cpu`` backend
  (:mod:`offpolicy.ops.logits_op.cpu_backend`), the Triton kernels of the ``triton`` backend
  (:mod:`offpolicy.ops.logits_op.triton_backend`, :mod:`offpolicy.kernels.support_logsoftmax`: one program per
  row, an online log-sum-exp over the gathered logits, the gradient row written whole) and the vectorised PyTorch
  ones (:mod:`offpolicy.ops.logits_op.torch_backend`); while ``torch.compile`` traces, the PyTorch ones. On the ``cpu`` backend a *wide* row (``K >= V /
  WIDE_DIVISOR``) also writes a ``V``-byte membership mask in its gather's loop, and when the loss sends no
  gradient to ``lp`` (``g_lp`` None: the token-level losses) its backward is one streaming write of the gradient
  row from the logits and the mask (the dense pass's own bytes: 4 or 2 per id read, one write) instead of reading
  ``12`` bytes per entry (id and ``lp``) and scattering; the logits are then held for the backward, as the dense
  pass holds them. The ``torch`` backend's wide rows (eager) go chunk by chunk of rows over ``V`` instead: a
  membership mask by scatter (kept as ``V`` int8 per wide row), the masked log-sum-exp, and a backward formed
  densely from the held logits and that mask (any ``g_lp``).
* hidden states (:func:`linear_support_log_softmax`): the logits of a chunk of rows, ``h W^T (+ b)``, by one
  matmul (the dense pass's own), then the logits pass above on that chunk; backward, the chunk's ``dz`` by
  ``support_grad`` and ``dh = dz W``, ``dW += dz^T h``: the dense pass's three matmuls and ``O(rows V)`` element-wise
  work, never ``[N, V]`` at once (:data:`CHUNK_BYTES`). Below :data:`SPARSE_DENSITY` (``nnz / (N V)``), the
  entry gather of :mod:`offpolicy.ops.support_entries` (``O(nnz D)``) is cheaper and is used instead (by
  :func:`offpolicy.loss.csr_logprobs.csr_log_probs`).

Rows without mass (skipped, empty support, all ``-inf``) have ``lse = +inf``, ``-inf`` log-probabilities, entropy 0
and take exactly zero gradient; a NaN or ``+inf`` logit in a trained row's support makes its values NaN, which the
loss's boundary refuses.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from offpolicy.ops import library, row_threads, workspace
from offpolicy.ops.backend_registry import Backend
from offpolicy.ops.linear_op.linear_torch_backend import accum_dtype, compute_dtype
from offpolicy.ops.logits_op import torch_backend

__all__ = ["CHUNK_BYTES", "SPARSE_DENSITY", "linear_support_log_softmax", "support_impl", "support_log_softmax"]

#: Bytes of one chunk's fp32 logits block on the fused-linear path (the block and its gradient live at once).
CHUNK_BYTES = 8 << 20
#: Below this density ``nnz / (N V)`` the fused-linear path gathers the entries (``O(nnz D)``) instead.
SPARSE_DENSITY = 1 / 512
INF = float("inf")


def support_impl(backend: Backend, eager: bool):
    """The module running the support pass for ``backend``: its logits module where it has ``support_stats`` and
    the call runs eagerly, else the vectorised PyTorch one (traceable, any device)."""
    mod = backend.logits
    return mod if eager and hasattr(mod, "support_stats") else torch_backend


def _target(z_y: Tensor, inv_temp: Tensor, lse: Tensor) -> Tensor:
    """``x(y) - lse`` in ``inv_temp``'s dtype, ``-inf`` on rows without mass (``lse = +inf``)."""
    none = lse == INF
    return torch.where(none, torch.full_like(lse, -INF), z_y.to(inv_temp.dtype) * inv_temp - lse)


def _token_logits(z: Tensor, tokens: Tensor) -> Tensor:
    if z.shape[1] == 0:
        return torch.zeros(tokens.shape, dtype=z.dtype, device=z.device)
    return z.gather(1, tokens[:, None]).squeeze(1)


def _upstream(g_target: Tensor | None, g_lp: Tensor | None, lse: Tensor) -> tuple[Tensor, Tensor | None, Tensor]:
    """``(g_target [N], g_lp [nnz] or None, live [N])``: the gradients in the statistics' dtype (zeros for an output
    that got none) and the rows with mass, the only ones that take a gradient."""
    live = torch.isfinite(lse)
    gt = torch.zeros_like(lse) if g_target is None else g_target.to(lse.dtype)
    return gt, None if g_lp is None else g_lp.to(lse.dtype), live


class _SupportLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, tokens: Tensor, offsets: Tensor, ids: Tensor, inv_temp: Tensor,
                skip: Tensor | None, impl, eager: bool):
        wide = None
        if eager and ctx.needs_input_grad[0] and getattr(impl, "WIDE_DIVISOR", None):
            lp, lse, entropy, wide = impl.support_stats(logits, offsets, ids, inv_temp, skip, keep_wide=True)
        else:
            lp, lse, entropy = impl.support_stats(logits, offsets, ids, inv_temp, skip)
        target = _target(_token_logits(logits, tokens), inv_temp, lse)
        # wide rows stream their gradient from the logits (held, as the dense pass holds them); otherwise the
        # backward needs only lp, and the logits are not held
        ctx.save_for_backward(lp, offsets, ids, tokens, inv_temp, lse, logits if wide is not None else None)
        ctx.wide = wide
        # the gradient's shape, dtype and device, without holding the logits (one element, expanded)
        ctx.like = torch.empty(1, dtype=logits.dtype, device=logits.device).expand(logits.shape)
        ctx.impl, ctx.eager = impl, eager
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(lse, entropy)
        return target, lp, lse, entropy

    @staticmethod
    def backward(ctx, g_target, g_lp, _g_lse, _g_entropy):
        lp, offsets, ids, tokens, inv_temp, lse, logits = ctx.saved_tensors
        like = ctx.like
        eager = ctx.eager and not library.tracing()
        impl = ctx.impl if eager else torch_backend
        with row_threads.single_intra_op() if eager and like.device.type == "cpu" else contextlib.nullcontext():
            gt, gc, live = _upstream(g_target, g_lp, lse)
            out = workspace.gradient_buffer(like) if eager else torch.empty(like.shape, dtype=like.dtype,
                                                                              device=like.device)
            if eager and ctx.wide is not None:
                dz = impl.support_grad(lp, offsets, ids, tokens, inv_temp, gc, gt, live, out, wide=ctx.wide,
                                       logits=logits)
            else:
                dz = impl.support_grad(lp, offsets, ids, tokens, inv_temp, gc, gt, live, out)
        return dz, None, None, None, None, None, None, None


def support_log_softmax(logits: Tensor, tokens: Tensor, offsets: Tensor, ids: Tensor, inv_temp: Tensor,
                        skip: Tensor | None, *, backend: Backend, eager: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(target [N], lp [nnz], lse [N], entropy [N])`` of the support pass over logits (see the module docstring).

    Args:
        logits: ``[N, V]`` float, unit stride along ``V`` (the boundary checked it).
        tokens: ``[N]`` int64 sampled ids; offsets: ``[N + 1]`` int64; ids: ``[nnz]`` int64 (validated).
        inv_temp: ``[N]`` fp32 (float64 for float64 logits); skip: ``[N]`` bool untrained rows, or None.
        backend: the resolved backend; eager: False while ``torch.compile`` traces.

    ``target`` and ``lp`` are differentiable (one ``[N, V]`` gradient for both), in ``inv_temp``'s dtype.
    """
    return _SupportLogSoftmax.apply(logits, tokens, offsets, ids, inv_temp, skip, support_impl(backend, eager), eager)


def _chunks(n: int, v: int):
    step = max(1, CHUNK_BYTES // max(1, 4 * v))
    return ((lo, min(n, lo + step)) for lo in range(0, n, step))


def _block(h: Tensor, w_c: Tensor, bias: Tensor | None, acc: torch.dtype) -> Tensor:
    """``h W^T (+ b)``: the product in the compute dtype (bf16 stays bf16, as materialised logits would be; with a
    bias, fp32), the bias added in the accumulation dtype."""
    z = torch.mm(h.to(w_c.dtype), w_c.T)
    return z if bias is None else z.to(acc) + bias.to(acc)


def _slice(offsets: Tensor, ids: Tensor, lo: int, hi: int, bounds: list[int]) -> tuple[Tensor, Tensor, int, int]:
    e0, e1 = bounds[lo], bounds[hi]
    return offsets[lo:hi + 1] - e0, ids[e0:e1], e0, e1


class _LinearSupportLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, tokens: Tensor, offsets: Tensor,
                ids: Tensor, inv_temp: Tensor, skip: Tensor | None, impl):
        n, v = hidden.shape[0], weight.shape[0]
        acc = accum_dtype(hidden.dtype)
        w_c = weight.to(compute_dtype(weight.dtype, weight.device))
        lp = torch.empty(ids.shape, dtype=acc, device=hidden.device)
        lse = torch.full((n,), INF, dtype=acc, device=hidden.device)
        entropy = torch.zeros(n, dtype=acc, device=hidden.device)
        target = torch.full((n,), -INF, dtype=acc, device=hidden.device)
        bounds = offsets.tolist()
        for lo, hi in _chunks(n, v):
            off_c, ids_c, e0, e1 = _slice(offsets, ids, lo, hi, bounds)
            z = _block(hidden[lo:hi], w_c, bias, acc)
            sk = None if skip is None else skip[lo:hi]
            lp[e0:e1], lse[lo:hi], entropy[lo:hi] = impl.support_stats(z, off_c, ids_c, inv_temp[lo:hi], sk)
            target[lo:hi] = _target(_token_logits(z, tokens[lo:hi]), inv_temp[lo:hi], lse[lo:hi])
        ctx.save_for_backward(hidden, weight, bias, tokens, offsets, ids, inv_temp, lp, lse)
        ctx.impl = impl
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(lse, entropy)
        return target, lp, lse, entropy

    @staticmethod
    def backward(ctx, g_target, g_lp, _g_lse, _g_entropy):
        hidden, weight, bias, tokens, offsets, ids, inv_temp, lp, lse = ctx.saved_tensors
        impl = ctx.impl if not library.tracing() else torch_backend
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        n, v = hidden.shape[0], weight.shape[0]
        acc = lse.dtype
        cd = compute_dtype(weight.dtype, weight.device)
        w_c = weight.to(cd)
        gt, gc, live = _upstream(g_target, g_lp, lse)
        dh = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_h else None
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        db = torch.zeros(v, dtype=acc, device=weight.device) if need_b and bias is not None else None
        bounds = offsets.tolist()
        buf = None
        for lo, hi in _chunks(n, v):
            if not bool(live[lo:hi].any()):
                continue
            off_c, ids_c, e0, e1 = _slice(offsets, ids, lo, hi, bounds)
            if buf is None:
                buf = torch.empty(min(n, hi - lo), v, dtype=acc, device=hidden.device)
            dz = impl.support_grad(lp[e0:e1], off_c, ids_c, tokens[lo:hi], inv_temp[lo:hi],
                                   None if gc is None else gc[e0:e1], gt[lo:hi], live[lo:hi], buf[:hi - lo])
            dz_c = dz if cd == acc else dz.to(cd)
            if dh is not None:
                dh[lo:hi] = torch.mm(dz_c, w_c).to(acc)
            if dw is not None:
                h_c = hidden[lo:hi].to(cd)
                if cd == acc:
                    dw.addmm_(dz_c.T, h_c)
                else:
                    dw += torch.mm(dz_c.T, h_c).to(acc)
            if db is not None:
                db += dz.sum(dim=0)
        return (None if dh is None else dh.to(hidden.dtype), None if dw is None else dw.to(weight.dtype),
                None if db is None else db.to(bias.dtype), None, None, None, None, None, None)


def linear_support_log_softmax(hidden: Tensor, weight: Tensor, bias: Tensor | None, tokens: Tensor, offsets: Tensor,
                               ids: Tensor, inv_temp: Tensor, skip: Tensor | None, *, backend: Backend,
                               eager: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The fused-linear twin of :func:`support_log_softmax`: ``hidden [N, D]``, ``weight [V, D]``, ``bias [V]`` or
    None in place of the logits; gradients for each input (``dh`` and ``dW`` accumulated in fp32, float64 for
    float64 inputs)."""
    return _LinearSupportLogSoftmax.apply(hidden, weight, bias, tokens, offsets, ids, inv_temp, skip,
                                          support_impl(backend, eager))
