"""Importance weights and rejections (docs/spec.md#weights, docs/spec.md#family) from log-ratios, by the nodes of a
:class:`~offpolicy.corrections.tree.CorrectionTree`.

Every function takes log-ratios ``log r = log p - lq``; the weight mode clamps them to ``[-max_log_ratio,
max_log_ratio]`` before exponentiating and tests its bounds on the unclamped log-ratio, so ``-inf`` / ``+inf`` fall
outside any finite interval.
"""

from __future__ import annotations

import torch
from torch import Tensor

from offpolicy.corrections.node import Reductions as Segments
from offpolicy.corrections.rules import ESTIMATORS
from offpolicy.corrections.tree import CorrectionTree


def kl_estimate(log_r: Tensor, estimator: str) -> Tensor:
    """Schulman's per-token estimator ``k1 | k2 | k3`` of KL(q || p) from ``log r = log p - lq`` on tokens drawn
    from ``q`` (see :data:`offpolicy.corrections.rules.ESTIMATORS`)."""
    return ESTIMATORS[estimator].value(log_r)


def inside_bounds(log_r: Tensor, tree: CorrectionTree) -> Tensor:
    """``1[L <= r <= U]`` (inclusive) of the weight mode's bounds, evaluated in log space."""
    return tree.weighting.mode.inside(log_r)


def weight_function(log_r: Tensor, tree: CorrectionTree, token_rejection: bool = True) -> Tensor:
    """``f(r)`` of the tree's weight mode at ``r = exp(log_r)``, with the token-level rejection rules folded in
    (unless ``token_rejection=False``).

    ``log_r`` may hold ``+-inf`` (a ratio of 0 or infinity); the result is finite. Same dtype as ``log_r``.
    """
    f = tree.weighting.mode.weight(log_r, tree.max_log_ratio)
    keep = _token_keep(log_r, tree) if token_rejection else None
    return f if keep is None else torch.where(keep, f, torch.zeros_like(f))


def _token_keep(log_r: Tensor, tree: CorrectionTree) -> Tensor | None:
    """``[N]`` bool: tokens every token-level rejection rule keeps, or None without such rules."""
    keep = None
    for rule in tree.token_rules:
        k = rule.token_keep(log_r, tree.max_log_ratio)
        keep = k if keep is None else keep & k
    return keep


def _level_segments(tree: CorrectionTree, seg: Segments | None, turns: Segments | None) -> Segments | None:
    return turns if tree.weighting.level.needs_segments else seg


def bounded_log_ratio(log_r: Tensor, seg: Segments | None, tree: CorrectionTree,
                      turns: Segments | None = None) -> Tensor:
    """``[N]`` the log-ratio the weight function acts on at each token: the token's own, or its sequence's (or
    its turn's, ``turns``: the segments of ``segment_ids``)."""
    return tree.weighting.level.ratio(log_r, _level_segments(tree, seg, turns))


def token_weight(log_r: Tensor, seg: Segments | None, tree: CorrectionTree, turns: Segments | None = None) -> Tensor:
    """``[N]`` ``w = f(r)`` at the ratio of the tree's level. Token-level rejection rules fold into ``f`` at the
    token level; at the sequence levels they zero the rejected tokens' weights (they bound each token's own ratio,
    not the sequence's)."""
    level = tree.weighting.level
    if not level.per_sequence:
        return weight_function(log_r, tree)
    w = weight_function(level.ratio(log_r, _level_segments(tree, seg, turns)), tree, token_rejection=False)
    keep = _token_keep(log_r, tree)
    return w if keep is None else torch.where(keep, w, torch.zeros_like(w))


def token_rejected(log_r: Tensor, tree: CorrectionTree) -> Tensor | None:
    """``[N]`` bool: tokens a token-level rejection rule rejects (their weight is 0), or None without one."""
    keep = _token_keep(log_r, tree)
    return None if keep is None else ~keep


def sequence_drops(
    log_r: Tensor, log_p_ratio: Tensor, advantages: Tensor, seg: Segments | None, tree: CorrectionTree
) -> dict[str, Tensor]:
    """``{rule name: [N] bool}``: the tokens of sequences each sequence rule of the tree drops (veto, OPSM,
    sequence-level KL / ratio rejections).

    ``log_r``: the ratio the weights act on; ``log_p_ratio``: the current policy's ``log p - lq``.
    """
    return {name: seg.broadcast(rule.drop(log_r, log_p_ratio, advantages, seg, tree.max_log_ratio))
            for name, rule in tree.sequence_rules}


def mask_drops(inputs, tree: CorrectionTree) -> dict[str, Tensor]:
    """``{rule name: [N] bool}``: the tokens each mask rule of the tree drops (``inputs``: the
    :class:`~offpolicy.corrections.rules.RuleInputs` of the batch)."""
    return {name: rule.mask_drop(inputs) for name, rule in tree.mask_rules}


def sequence_keep(drops: dict[str, Tensor]) -> Tensor | None:
    """``[N]`` bool: False on tokens any rule of ``drops`` drops; None when no rule is on."""
    if not drops:
        return None
    dropped = torch.zeros_like(next(iter(drops.values())))
    for d in drops.values():
        dropped = dropped | d
    return ~dropped
