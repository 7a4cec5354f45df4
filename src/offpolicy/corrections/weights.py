"""Importance weights and rejections (docs/spec.md#weights, docs/spec.md#family), computed from log-ratios by
the entries of :mod:`offpolicy.corrections.registry`.

Every function takes log-ratios ``log r = log p - lq`` and clamps them to ``[-max_log_ratio, max_log_ratio]``
before exponentiating; bounds are tested on the unclamped log-ratio, so ``-inf`` / ``+inf`` fall outside any
finite interval.
"""

from __future__ import annotations

import torch
from torch import Tensor

from offpolicy.corrections.correction import Correction
from offpolicy.corrections.registry import (ESTIMATORS, LEVELS, REJECTION_KINDS, SEQUENCE_RULES, WEIGHT_MODES,
                                            log_bound)
from offpolicy.loss.segments import Segments


def kl_estimate(log_r: Tensor, estimator: str) -> Tensor:
    """Schulman's per-token estimator ``k1 | k2 | k3`` of KL(q || p) from ``log r = log p - lq`` on tokens drawn
    from ``q`` (see :data:`offpolicy.corrections.registry.ESTIMATORS`)."""
    return ESTIMATORS[estimator].fast(log_r)


def inside_bounds(log_r: Tensor, corr: Correction) -> Tensor:
    """``1[L <= r <= U]`` (inclusive), evaluated in log space."""
    return (log_r >= log_bound(corr.lower)) & (log_r <= log_bound(corr.upper))


def weight_function(log_r: Tensor, corr: Correction, token_rejection: bool = True) -> Tensor:
    """``f(r)`` of the correction's weight mode at ``r = exp(log_r)``, with the token-level rejection rules
    (``kl_rejection``, ``rejections``) folded in (unless ``token_rejection=False``).

    ``log_r`` may hold ``+-inf`` (a ratio of 0 or infinity); the result is finite. Same dtype as ``log_r``.
    """
    lr = log_r.clamp(-corr.max_log_ratio, corr.max_log_ratio)
    f = WEIGHT_MODES[corr.weights].fast(lr, inside_bounds(log_r, corr), corr.lower, corr.upper)
    if token_rejection:
        keep = _token_keep(log_r, corr)
        if keep is not None:
            f = torch.where(keep, f, torch.zeros_like(f))
    return f


def _token_keep(log_r: Tensor, corr: Correction) -> Tensor | None:
    """``[N]`` bool: tokens every token-level rejection rule keeps, or None without such rules."""
    keep = None
    for rule in corr.token_rejection_rules():
        k = REJECTION_KINDS[rule.kind].token_keep(log_r, rule, corr)
        keep = k if keep is None else keep & k
    return keep


def bounded_log_ratio(log_r: Tensor, seg: Segments | None, corr: Correction) -> Tensor:
    """``[N]`` the log-ratio the weight function acts on at each token: the token's own, or its sequence's
    (``level="sequence"``: ``sum_t log r_t``; ``"geometric"``: ``mean_t log r_t`` over trained tokens)."""
    level = LEVELS[corr.level]
    return log_r if not level.per_sequence else seg.broadcast(level.fast(log_r, seg))


def token_weight(log_r: Tensor, seg: Segments | None, corr: Correction) -> Tensor:
    """``[N]`` ``w = f(r)`` at the ratio of the correction's level. Token-level rejection rules fold into ``f``
    at the token level; at the sequence levels they zero the rejected tokens' weights (they bound each token's
    own ratio, not the sequence's)."""
    level = LEVELS[corr.level]
    if not level.per_sequence:
        return weight_function(log_r, corr)
    w = seg.broadcast(weight_function(level.fast(log_r, seg), corr, token_rejection=False))
    keep = _token_keep(log_r, corr)
    return w if keep is None else torch.where(keep, w, torch.zeros_like(w))


def token_rejected(log_r: Tensor, corr: Correction) -> Tensor | None:
    """``[N]`` bool: tokens a token-level rejection rule rejects (their weight is 0), or None without one."""
    keep = _token_keep(log_r, corr)
    return None if keep is None else ~keep


def sequence_drops(
    log_r: Tensor, log_p_ratio: Tensor, advantages: Tensor, seg: Segments | None, corr: Correction
) -> dict[str, Tensor]:
    """``{rule name: [N] bool}``: the tokens of sequences each rule of
    :data:`~offpolicy.corrections.registry.SEQUENCE_RULES` the correction switches on drops (veto, sequence KL
    rejection, OPSM).

    ``log_r``: the ratio the weights act on; ``log_p_ratio``: the current policy's ``log p - lq``.
    """
    rules = [rule for rule in SEQUENCE_RULES.values() if rule.applies(corr)]
    drops = {rule.name: seg.broadcast(rule.fast(log_r, log_p_ratio, advantages, seg, corr)) for rule in rules}
    for name, rule in corr.rejection_rules:
        kind = REJECTION_KINDS[rule.kind]
        if kind.per_sequence(rule):
            drops[name] = seg.broadcast(kind.sequence_drop(log_r, seg, rule, corr))
    return drops


def sequence_keep(drops: dict[str, Tensor]) -> Tensor | None:
    """``[N]`` bool: False on tokens any rule of ``drops`` drops; None when no rule is on."""
    if not drops:
        return None
    dropped = torch.zeros_like(next(iter(drops.values())))
    for d in drops.values():
        dropped = dropped | d
    return ~dropped
