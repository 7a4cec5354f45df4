"""Advantage estimators over groups of samples of the same prompt (docs/spec.md#family).

All take ``rewards [B]`` and ``group_ids [B]`` (the prompt each sample answers; any integers) and return
``[B]`` advantages in the rewards' dtype, at least fp32 (float64 rewards keep float64; the group statistics are
computed in float64 either way). :func:`per_token` broadcasts them onto a flat token batch.
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
