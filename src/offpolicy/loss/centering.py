"""Score-centering coefficients (docs/spec.md#score-centering).

At each position the update subtracts the sampler-expected *weighted* score,
``sum_v q(v) f(p(v)/q(v)) grad log p(v)``, so that a constant advantage produces no expected update. Over the
recorded candidates ``H`` this is ``sum_{v in H} c(v) grad log p(v)`` with

    m(v)  = q(v) f(p(v) / q(v))
    alpha = rho f(1 / rho)          (the unrecorded tail, modelled as q_hat = rho p outside H)
    c(v)  = m(v) - alpha p(v)

Why the tail collapses onto the head: outside ``H``, ``q_hat(v) f(p(v)/q_hat(v)) = rho f(1/rho) p(v) =
alpha p(v)``, and ``sum_{all v} p(v) grad log p(v) = grad sum_v p(v) = 0``, so
``sum_{v not in H} alpha p(v) grad log p(v) = -sum_{v in H} alpha p(v) grad log p(v)``.
``rho = (1 - Q_H) / (1 - P_H)`` makes ``q_hat`` a distribution; both masses are floored at ``eps = 1e-6``.

Support records: the tail is empty, ``p = p^S``, ``rho = 1`` and ``alpha = f(1)``. The ``-alpha p^S`` term then
has zero gradient (``sum_{v in S} p^S(v) grad log p^S(v) = 0``) but is kept, not dropped: it adds
``-A f(1) H(p^S)`` to the loss value, which is the value the research code reports (its estimator forms
``m - alpha p`` for every record), so loss curves compare across trainers (docs/spec.md#score-centering).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from offpolicy.corrections.tree import CorrectionTree
from offpolicy.corrections.weights import weight_function
from offpolicy.loss.entry_rows import EntryRows

TAIL_EPS = 1e-6


class Centering(NamedTuple):
    """Coefficients and diagnostics, all detached.

    Attributes:
        coef: ``[N, K]`` ``c(v)``, 0 at padding (``[nnz]`` for a CSR record).
        p_head: ``[N]`` ``P_H``, trainer mass on the candidates.
        q_head: ``[N]`` ``Q_H``, sampler mass on the candidates.
        rho: ``[N]`` tail ratio (1 for support records).
        abs_coef_sum: ``[N]`` ``sum_v |c(v)|`` over the row's candidates.
    """

    coef: Tensor
    p_head: Tensor
    q_head: Tensor
    rho: Tensor
    abs_coef_sum: Tensor


def tail_ratio(p_head: Tensor, q_head: Tensor) -> Tensor:
    """``rho = (1 - Q_H) / (1 - P_H)``, both masses floored at :data:`TAIL_EPS`; ``[N]`` from the ``[N]`` head
    masses (any float dtype; the pipeline passes float64, where the cancellation near 1 keeps its accuracy)."""
    return (1.0 - q_head).clamp_min(TAIL_EPS) / (1.0 - p_head).clamp_min(TAIL_EPS)


def centering_coefficients(
    cand_logp: Tensor, cand_lq: Tensor, valid: Tensor, support: bool, tree: CorrectionTree,
    rows: EntryRows | None = None,
) -> Centering:
    """Compute ``c(v)`` for every candidate.

    Args:
        cand_logp: ``[N, K]`` trainer log-probabilities of the candidates (full or support-normalised), detached
            (``[nnz]`` for a CSR record, and likewise the next two).
        cand_lq: ``[N, K]`` sampler log-probabilities, ``-inf`` at padding.
        valid: ``[N, K]`` bool, real entries.
        support: the record is a support (mask replay) rather than a head.
        tree: the correction's nodes, whose ``f`` defines ``m`` and ``alpha``.
        rows: where each row's entries lie (:class:`~offpolicy.loss.entry_rows.EntryRows`); None: padded.
    """
    rows = EntryRows(None, cand_logp.shape[0]) if rows is None else rows
    zero = torch.zeros_like(cand_logp)
    p = torch.where(valid, torch.exp(cand_logp), zero)
    q = torch.where(valid, torch.exp(cand_lq.to(cand_logp.dtype)), zero)
    # m(v) = q f(p/q); where q = 0 the sampler puts no mass on v and m = 0 whatever f(inf) is.
    m = torch.where(q > 0, q * weight_function(cand_logp - cand_lq.to(cand_logp.dtype), tree), zero)
    # The tail masses 1 - P_H and 1 - Q_H cancel catastrophically when the head holds nearly all the mass: they
    # are formed in float64 (O(N K) work) so that rho keeps its accuracy down to the eps floor.
    p_head, q_head = rows.sum(p.double()), rows.sum(q.double())
    if support:
        rho = torch.ones_like(p_head)
    else:
        rho = tail_ratio(p_head, q_head)
    alpha = (rho * weight_function(-torch.log(rho), tree)).to(p.dtype)
    p_head, q_head, rho = p_head.to(p.dtype), q_head.to(p.dtype), rho.to(p.dtype)
    coef = torch.where(valid, m - rows.spread(alpha) * p, zero)
    return Centering(coef, p_head, q_head, rho, rows.sum(coef.abs()))
