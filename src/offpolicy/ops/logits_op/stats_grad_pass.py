"""The two-pass form of the logits primitive: the statistics of each row and its gradient in one program.

The three-pass path reads ``[N, V]`` logits once in the forward (the statistics) and once more in the backward,
writing the gradient once: ``3 V b`` bytes per row. When the upstream gradient of each row is a closed-form
function of that row's own log-probability at its first id, ``g = coef f(lp - shift)`` with per-row numbers
``coef``, ``shift`` and a rule ``f`` of a small family (:class:`RowRule`), optionally with a head term over the
row's ``K`` candidates whose coefficients depend on the row's normaliser only through the candidates' own
log-probabilities and their sums (``RowRule.head``), the gradient can be written by the program that has just
computed the row's statistics: one read from memory, one re-read that finds the row in L2,
one write (``2 V b``). The caller must know that rule (this module knows nothing of what the rows mean).

:func:`stats_and_grad` returns the same detached outputs as :func:`~offpolicy.ops.sparse_log_softmax` (full
vocabulary) with the gradient ``dz [N, V]`` already written; :func:`attach_gradient` makes a scalar whose gradient
with respect to the logits is that ``dz`` times the scalar's upstream gradient. Only backends with ``two_pass``
(:data:`offpolicy.ops.backend_registry.BACKENDS`: ``triton``) serve it, eagerly, without a vocabulary split.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from offpolicy.ops import library, online_softmax, row_threads, workspace
from offpolicy.ops.backend_registry import Backend
from offpolicy.ops.online_softmax import INF
from offpolicy.ops.row_io import SparseLogSoftmax, row_inputs
from offpolicy.ops.vocab_parallel import gather_local


@dataclass(frozen=True)
class RowRule:
    """The upstream gradient of each row's first-id log-probability ``lp``, in closed form:

        g = coef * f(lp - shift),   f(l) = 1[lo <= l <= hi]                   (with ``band = (lo, hi)``)
                                         * exp(clip(clip(l, -c, c), a, b))     (with ``exp_clip = (c, a, b)``)

    (each factor is 1 when its field is None), and ``g = 0`` where ``lp = -inf`` or the row has no mass.

    With ``head = (ids, lq)`` the row's ``K`` head entries (log-probabilities ``lp_k``) take the upstream gradient
    ``-coef c_k``, ``c_k = q_k f(lp_k - lq_k) - alpha p_k``, ``alpha = rho f(-log rho)``,
    ``rho = max(1 - sum_k q_k, eps) / max(1 - sum_k p_k, eps)`` (:func:`offpolicy.kernels.logsoftmax.row_loss_grad`),
    on every row with ``coef != 0`` and mass.

    Attributes:
        coef: ``[N]`` fp32 (0: the row takes no gradient and is read once).
        shift: ``[N]`` fp32.
        band: inclusive bounds ``(lo, hi)``, ``+-inf`` allowed, or None.
        exp_clip: ``(c, a, b)`` with ``c >= 0``, ``a <= b`` (``+-inf`` allowed), or None.
        head: ``(ids [N, K] int64, lq [N, K] fp32)``, ids unique within a row or ``-1``, or None.
        tail_eps: ``eps`` of ``rho`` (``> 0``).
    """

    coef: Tensor
    shift: Tensor
    band: tuple[float, float] | None = None
    exp_clip: tuple[float, float, float] | None = None
    head: tuple[Tensor, Tensor] | None = None
    tail_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("coef", "shift"):
            x = getattr(self, name)
            if not isinstance(x, Tensor) or x.dim() != 1 or x.dtype != torch.float32:
                raise ValueError(f"RowRule.{name} must be a [N] float32 tensor, got {getattr(x, 'shape', x)!r}")
        if self.coef.shape != self.shift.shape:
            raise ValueError(f"RowRule.coef and shift must have the same shape, got {tuple(self.coef.shape)} and "
                             f"{tuple(self.shift.shape)}")
        if self.band is not None and not (len(self.band) == 2 and self.band[0] <= self.band[1]):
            raise ValueError(f"RowRule.band must be (lo, hi) with lo <= hi, got {self.band!r}")
        if self.exp_clip is not None and not (len(self.exp_clip) == 3 and self.exp_clip[0] >= 0
                                              and not math.isnan(self.exp_clip[0])
                                              and self.exp_clip[1] <= self.exp_clip[2]):
            raise ValueError(f"RowRule.exp_clip must be (c, a, b) with c >= 0 and a <= b, got {self.exp_clip!r}")
        if self.head is not None:
            ids, lq = self.head
            n = self.coef.shape[0]
            if ids.dim() != 2 or ids.shape[0] != n or ids.dtype != torch.int64:
                raise ValueError(f"RowRule.head ids must be [{n}, K] int64, got {tuple(ids.shape)} {ids.dtype}")
            if lq.shape != ids.shape or lq.dtype != torch.float32:
                raise ValueError(f"RowRule.head lq must be {tuple(ids.shape)} float32, got {tuple(lq.shape)} {lq.dtype}")
        if not self.tail_eps > 0:
            raise ValueError(f"RowRule.tail_eps must be > 0, got {self.tail_eps!r}")


def stats_and_grad(logits: Tensor, targets: Tensor, candidate_ids: Tensor | None, temperature: float | Tensor, *,
                   backend: Backend, skip: Tensor | None, rule: RowRule) -> tuple[SparseLogSoftmax, Tensor]:
    """The full-vocabulary log-softmax outputs at ``targets`` and ``candidate_ids`` (detached) and the gradient of
    ``sum_rows g log p(target)`` (plus ``rule``'s head term) with ``g`` from ``rule``, written in the same program
    as each row's statistics.

    Args:
        logits: ``[N, V]`` bf16/fp16/fp32, unit stride in ``V`` (checked by the caller: this is an unchecked entry,
            like :func:`~offpolicy.ops.logits_op.sparse_log_softmax.sparse_log_softmax_unchecked`).
        targets: ``[N]`` int ids in ``[0, V)``; candidate_ids: ``[N, K]`` int, ``-1`` padding, or None.
        temperature: float or ``[N]`` tensor.
        backend: a backend with ``two_pass``.
        skip: ``[N]`` bool rows left out (``-inf`` log-probabilities, ``lse = +inf``, zero gradient, not read).
        rule: the per-row gradient coefficient.

    Returns:
        ``(SparseLogSoftmax, dz [N, V])``: ``target`` / ``candidates`` / ``lse`` / ``entropy`` as the three-pass
        path returns them (detached), ``dz`` in the logits' dtype.
    """
    if not backend.two_pass:
        raise ValueError(f"backend {backend.name!r} has no two-pass kernel (two_pass=False)")
    n = logits.shape[0]
    if rule.coef.shape != (n,):
        raise ValueError(f"rule.coef must be [{n}], got {tuple(rule.coef.shape)}")
    ids, inv_temp = row_inputs(targets, candidate_ids, temperature, n, torch.float32, logits.device)
    dz = workspace.gradient_buffer(logits)
    m, s, t, lse, _g = backend.logits.full_stats_grad(
        logits.detach(), ids[:, 0].contiguous(), inv_temp, skip, rule.coef, rule.shift, dz, band=rule.band,
        exp_clip=rule.exp_clip, head=rule.head, tail_eps=rule.tail_eps)
    _lse, entropy = online_softmax.finish(m, s, t)
    x = gather_local(logits.detach(), ids, inv_temp).masked_fill(ids < 0, -INF)
    logp = x - lse[:, None]
    return SparseLogSoftmax(logp[:, 0], logp[:, 1:], lse, entropy), dz


class _PrecomputedGradient(torch.autograd.Function):
    """``value`` (a scalar), whose gradient with respect to ``source`` is ``grad`` times the upstream gradient."""

    @staticmethod
    def forward(ctx, value: Tensor, source: Tensor, grad: Tensor) -> Tensor:
        ctx.grad = grad
        return value.detach().clone()

    @staticmethod
    def backward(ctx, upstream: Tensor):
        """``dz * upstream``. Like every backward of the ops, it asks once whether it is traced (compiled autograd
        may trace it): traced, the product is formed out of place (no host sync); eagerly, ``dz`` is returned as it
        is when ``upstream`` is 1.0 (one host sync) and rescaled in place otherwise, on CPU inside the
        single-intra-op-thread context of :mod:`offpolicy.ops.row_threads`."""
        dz, ctx.grad = ctx.grad, None  # released, so that autograd may take the buffer as it is
        if dz is None:
            raise RuntimeError("a second backward through a two-pass loss: its gradient was written in the forward "
                               "and handed to the first backward (retain_graph cannot replay it); recompute the loss")
        if library.tracing():
            return None, dz * upstream.to(dz.dtype), None
        with row_threads.single_intra_op() if dz.device.type == "cpu" else contextlib.nullcontext():
            if bool(upstream != 1):  # a scaled loss (gradient accumulation, loss scaling) costs one more pass
                dz.mul_(upstream.to(dz.dtype))
        return None, dz, None


def attach_gradient(value: Tensor, source: Tensor, grad: Tensor) -> Tensor:
    """A scalar equal to ``value`` whose gradient with respect to ``source`` is ``grad`` (``source``'s shape and
    dtype, written by :func:`stats_and_grad`) times its upstream gradient. One backward; the upstream gradient is
    read on the host (1.0, the usual ``loss.backward()``, skips the rescale)."""
    if value.dim() != 0:
        raise ValueError(f"value must be a scalar, got shape {tuple(value.shape)}")
    if grad.shape != source.shape or grad.dtype != source.dtype:
        raise ValueError(f"grad must match source ({tuple(source.shape)} {source.dtype}), got "
                         f"{tuple(grad.shape)} {grad.dtype}")
    return _PrecomputedGradient.apply(value, source, grad)
