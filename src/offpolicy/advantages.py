"""Advantage estimators over groups of samples of the same prompt (docs/spec.md#family).

All take ``rewards [B]`` and ``group_ids [B]`` (the prompt each sample answers; any integers) and return
``[B]`` advantages in the rewards' dtype, at least fp32 (float64 rewards keep float64; the group statistics are
computed in float64 either way). :func:`per_token` broadcasts them onto a flat token batch.
:func:`optimal_token_baseline` is per token, over padded ``[B, T]`` batches (verl's layout).
"""

from __future__ import annotations

import torch
from torch import Tensor

from offpolicy.ops.input_checks import INT_NAMES, INTS


def _group_stats(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    if not isinstance(rewards, Tensor) or not rewards.is_floating_point():
        raise TypeError(f"rewards must be a floating-point torch.Tensor [B], got {_describe(rewards)}")
    _check_ids("group_ids", group_ids, "[B]")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [B], got shape {tuple(rewards.shape)}")
    if group_ids.shape != rewards.shape:
        raise ValueError(f"group_ids must have the shape of rewards [B] = {tuple(rewards.shape)}, "
                         f"got {tuple(group_ids.shape)}")
    if group_ids.device != rewards.device:
        raise ValueError(f"group_ids is on {group_ids.device}, rewards on {rewards.device}")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError(f"rewards must be finite; sample {int((~torch.isfinite(rewards)).nonzero()[0])} is not")
    _, idx = torch.unique(group_ids, return_inverse=True)
    n_groups = int(idx.max()) + 1 if idx.numel() else 0
    r = rewards.to(torch.float64)
    count = torch.zeros(n_groups, dtype=torch.float64, device=r.device).index_add_(0, idx, torch.ones_like(r))
    total = torch.zeros_like(count).index_add_(0, idx, r)
    sq = torch.zeros_like(count).index_add_(0, idx, r * r)
    return idx, count, torch.stack([total, sq])


def _check_ids(name: str, x, shape: str) -> None:
    if not isinstance(x, Tensor) or x.dtype not in INTS:
        raise TypeError(f"{name} must be an integer ({INT_NAMES}) torch.Tensor {shape}, got {_describe(x)}")


def _describe(x) -> str:
    return f"a {x.dtype} tensor" if isinstance(x, Tensor) else type(x).__name__


def _out_dtype(rewards: Tensor) -> torch.dtype:
    return torch.promote_types(rewards.dtype, torch.float32)


def grpo(rewards: Tensor, group_ids: Tensor, normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO: ``(r - mean_group) / (std_group + eps)``; ``normalize_std=False`` leaves the std out (Dr. GRPO).

    The std is the population std of the group (a group of one gets advantage 0).
    """
    idx, count, (total, sq) = _group_stats(rewards, group_ids)
    mean = total / count
    adv = rewards.to(torch.float64) - mean[idx]
    if normalize_std:
        var = (sq / count - mean * mean).clamp_min(0)
        adv = adv / (var.sqrt()[idx] + eps)
    return adv.to(_out_dtype(rewards))


def dr_grpo(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Dr. GRPO (Liu et al. 2025): group-mean baseline without std normalisation; pair it with
    ``aggregation="constant"``."""
    return grpo(rewards, group_ids, normalize_std=False)


def rloo(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """REINFORCE leave-one-out: ``r_i - mean_{j != i} r_j``; a group of one gets 0."""
    idx, count, (total, _) = _group_stats(rewards, group_ids)
    r = rewards.to(torch.float64)
    n = count[idx]
    others = torch.where(n > 1, (total[idx] - r) / (n - 1).clamp_min(1), r)
    return (r - others).to(_out_dtype(rewards))


def per_token(sample_advantages: Tensor, seq_ids: Tensor) -> Tensor:
    """``[N]`` advantages of a flat token batch: token ``t`` gets ``sample_advantages[seq_ids[t]]``.

    ``seq_ids`` is an integer tensor (a float id would be truncated to another sample's index: refused).
    """
    if not isinstance(sample_advantages, Tensor):
        raise TypeError(f"sample_advantages must be a torch.Tensor [B], got {_describe(sample_advantages)}")
    _check_ids("seq_ids", seq_ids, "[N]")
    if seq_ids.numel() and (seq_ids.min() < 0 or seq_ids.max() >= sample_advantages.numel()):
        raise ValueError(f"seq_ids must index into sample_advantages of size {sample_advantages.numel()}")
    return sample_advantages[seq_ids.long()]


def optimal_token_baseline(token_rewards: Tensor, response_mask: Tensor, group_ids: Tensor, logprobs: Tensor,
                           sum_p2: Tensor, is_weights: Tensor | None = None, *, handle_zero_tail: bool = False,
                           eps: float = 1e-8) -> tuple[Tensor, Tensor]:
    """Optimal Token Baseline (verl's ``optimal_token_baseline`` estimator): a per-token baseline weighted by each
    trajectory's cumulative path variance.

    With the return-to-go ``G_t = sum_{j >= t} r_j`` (masked), the per-token variance proxy
    ``w_t = 1 - 2 pi(y_t) + sum_v pi(v)^2`` (``||grad log pi(y_t)||^2`` of the logits; times ``rho_t^2`` given
    ``is_weights``) and ``W_t = sum_{j <= t} w_j`` (masked), the baseline of step ``t`` in a group of samples of
    one prompt is ``B_t = sum_i G_t W_t m_t / (sum_i W_t m_t + eps)``; a group of one gets ``B = 0``. With
    ``handle_zero_tail``, a group's unique longest sample gets ``B = 0`` past the second-longest one's length.

    Args:
        token_rewards: ``[B, T]`` float rewards per token (finite).
        response_mask: ``[B, T]`` 0/1 (bool or float) valid tokens.
        group_ids: ``[B]`` integer prompt ids.
        logprobs: ``[B, T]`` log-probability of each sampled token (verl: the old policy's).
        sum_p2: ``[B, T]`` ``sum_v pi(v)^2`` at each token (``sparse_log_softmax(..., sum_p2=True).sum_p2``).
        is_weights: ``[B, T]`` rollout importance weights ``rho`` or None.
        handle_zero_tail: zero the baseline on the unique longest sample's tail (see above).
        eps: added to the denominator.

    Returns:
        ``(advantages, returns)``, ``[B, T]`` each, ``(G - B) m`` and ``G``, in the rewards' dtype (at least fp32),
        computed in float64.
    """
    if not isinstance(token_rewards, Tensor) or not token_rewards.is_floating_point() or token_rewards.dim() != 2:
        raise TypeError(f"token_rewards must be a floating-point [B, T] torch.Tensor, got {_describe(token_rewards)}")
    shape = tuple(token_rewards.shape)
    for name, x in (("response_mask", response_mask), ("logprobs", logprobs), ("sum_p2", sum_p2),
                    ("is_weights", is_weights)):
        if x is None and name == "is_weights":
            continue
        if not isinstance(x, Tensor) or tuple(x.shape) != shape:
            raise ValueError(f"{name} must be a [B, T] = {shape} tensor, got "
                             f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
    _check_ids("group_ids", group_ids, "[B]")
    if tuple(group_ids.shape) != shape[:1]:
        raise ValueError(f"group_ids must be [B] = {shape[:1]}, got {tuple(group_ids.shape)}")
    if not bool(torch.isfinite(token_rewards).all()):
        raise ValueError("token_rewards must be finite")
    f64 = torch.float64
    mask = response_mask.to(f64)
    returns = (token_rewards.to(f64) * mask).flip(-1).cumsum(-1).flip(-1)
    w = 1.0 - 2.0 * logprobs.to(f64).exp() + sum_p2.to(f64)
    if is_weights is not None:
        w = w * is_weights.to(f64).square()
    cum_w = (w * mask).cumsum(-1)
    _, idx = torch.unique(group_ids, return_inverse=True)
    n_groups = int(idx.max()) + 1 if idx.numel() else 0
    per_group = torch.zeros(n_groups, shape[1], dtype=f64, device=returns.device)
    num = per_group.index_add(0, idx, returns * cum_w * mask)
    den = per_group.index_add(0, idx, cum_w * mask) + eps
    size = torch.zeros(n_groups, dtype=f64, device=returns.device).index_add_(0, idx, torch.ones_like(idx, dtype=f64))
    baseline = torch.where(size[idx, None] > 1, (num / den)[idx], torch.zeros_like(returns))
    if handle_zero_tail:
        baseline = _zero_tail(baseline, mask.sum(-1), idx, size)
    advantages = (returns - baseline) * mask
    out = _out_dtype(token_rewards)
    return advantages.to(out), returns.to(out)


def _zero_tail(baseline: Tensor, lengths: Tensor, idx: Tensor, size: Tensor) -> Tensor:
    """Baseline 0 on the tail of each group's unique longest sample, past the group's second-longest length."""
    baseline = baseline.clone()
    for g in range(size.numel()):
        members = (idx == g).nonzero().view(-1)
        if members.numel() < 2:
            continue
        lens = lengths[members]
        ordered = lens.sort().values
        longest, second = ordered[-1], ordered[-2]
        at_max = (lens == longest).nonzero().view(-1)
        if at_max.numel() == 1 and longest > second:
            baseline[members[at_max[0]], int(second):] = 0.0
    return baseline
