"""The KL-to-reference penalty of :class:`~offpolicy.KLPenalty` (docs/spec.md#kl-penalty), per token.

On tokens drawn from ``pi_old`` (the proximal policy when given, else the sampler), with ``rho = p_ref / p``:

    pen_t = coef * k(rho_t)                      (importance_weighted=False)
    pen_t = coef * (p_t / pi_old_t) * k(rho_t)   (importance_weighted=True; the ratio is differentiable)

The weighted form is DeepSeek-V3.2's unbiased estimate: ``E_old[(p / pi_old) k] = E_p[k]``, and because the ratio
carries the gradient, ``E_old[grad((p / pi_old) k3)] = grad KL(p || p_ref)`` exactly (with ``k3`` alone on
``pi_old``'s tokens the expected gradient is that of neither KL direction). Log-ratios are clamped to
``[-max_log_ratio, max_log_ratio]`` before exponentiation, like every other ratio.
"""

from __future__ import annotations

import torch
from torch import Tensor

from offpolicy.corrections.rules import ESTIMATORS
from offpolicy.corrections.tree import CorrectionTree


def kl_penalty_terms(logp_y: Tensor, reference_logprobs: Tensor, old_logprobs: Tensor, active: Tensor,
                     tree: CorrectionTree) -> tuple[Tensor, Tensor]:
    """``(pen [N], est [N])``: the differentiable per-token penalty (0 off ``active`` and on tokens the trainer
    gives probability 0) and the detached weighted estimate ``(p / pi_old) k`` (or ``k``) it is ``coef`` times.

    Args:
        logp_y: ``[N]`` float ``log p(y_t)``, differentiable.
        reference_logprobs: ``[N]`` float ``log p_ref(y_t)``, detached.
        old_logprobs: ``[N]`` float ``log pi_old(y_t)`` (proximal or sampler), detached.
        active: ``[N]`` bool trained tokens.
    """
    pen = tree.kl_penalty
    zero = torch.zeros_like(logp_y)
    live = active & (logp_y.detach() > float("-inf"))
    lp = torch.where(live, logp_y, zero)
    bound = tree.max_log_ratio
    estimator = ESTIMATORS[pen.estimator]
    raw = ESTIMATORS[estimator.base] if estimator.base is not None else estimator
    est = raw.fast((torch.where(live, reference_logprobs, zero) - lp).clamp(-bound, bound))
    if pen.importance_weighted:
        est = torch.exp((lp - torch.where(live, old_logprobs, zero)).clamp(-bound, bound)) * est
    if estimator.bound is not None:
        # low_var_kl: the (weighted) estimate clamped last, as slime does.
        est = est.clamp(-estimator.bound, estimator.bound)
    est = torch.where(live, est, zero)
    return pen.coef * est, est.detach()
