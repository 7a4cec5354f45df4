"""SkyRL (``skyrl`` 0.3.x): offpolicy's loss as a registered SkyRL policy loss.

    from offpolicy.adapters.skyrl import register
    register("offpolicy", op.Correction(weights="mis", bounds=(0.5, 5.0)))   # before SkyRL syncs its registries
    # config: trainer.algorithm.policy_loss_type=offpolicy

SkyRL calls a registered loss as ``fn(log_probs, old_log_probs, advantages, config, loss_mask=None,
rollout_logprobs=None) -> (loss, metrics)`` with ``[B, T]`` tensors and expects the *masked sum*: it has already
scaled the advantages by its ``loss_reduction`` (``apply_loss_reduction_to_advantages_minibatch``). offpolicy's
per-token loss is linear in the advantage, so the sum over tokens with pre-scaled advantages is SkyRL's reduction.
The sampler's log-probabilities arrive as ``rollout_logprobs`` (required); ``old_log_probs`` is the proximal policy
for ``Correction.ppo_clip``. The :class:`~offpolicy.Correction` is looked up by ``config.policy_loss_type``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from offpolicy.corrections.correction import Correction
from offpolicy.loss.logprobs import policy_loss_from_logprobs

_CORRECTIONS: dict[str, Correction] = {}


def register(name: str = "offpolicy", correction: Correction = Correction(weights="mis", bounds=(0.5, 5.0))) -> None:
    """Register ``correction`` as SkyRL policy loss ``name`` (``trainer.algorithm.policy_loss_type=<name>``)."""
    if not isinstance(correction, Correction):
        raise TypeError(f"correction must be an offpolicy.Correction, got {type(correction).__name__}")
    if correction.score_centering:
        raise ValueError("SkyRL passes no candidate record to policy losses: score_centering cannot be applied")
    from skyrl.backends.skyrl_train.utils.ppo_utils import register_policy_loss

    _CORRECTIONS[name] = correction
    register_policy_loss(name)(policy_loss)


def policy_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, config: Any,
                loss_mask: Tensor | None = None, rollout_logprobs: Tensor | None = None) -> tuple[Tensor, dict]:
    """SkyRL's registered-loss signature: ``[B, T]`` tensors; returns ``(masked sum, metrics)``."""
    name = getattr(config, "policy_loss_type", None)
    if name not in _CORRECTIONS:
        raise ValueError(f"config.policy_loss_type={name!r} is not an offpolicy loss; registered: "
                         f"{sorted(_CORRECTIONS)}")
    if rollout_logprobs is None:
        raise ValueError("rollout_logprobs is required (the sampler's log-probs): enable them in SkyRL's generator")
    correction = _CORRECTIONS[name]
    b, t = log_probs.shape
    mask = torch.ones(b, t, dtype=torch.bool, device=log_probs.device) if loss_mask is None else loss_mask.bool()
    out = policy_loss_from_logprobs(
        log_probs.reshape(-1), rollout_logprobs.reshape(-1), advantages.reshape(-1), loss_mask=mask.reshape(-1),
        correction=correction, seq_ids=torch.arange(b, device=log_probs.device)[:, None].expand(b, t).reshape(-1),
        aggregation="constant", constant_normalizer=1.0,
        proximal_logprobs=old_log_probs.reshape(-1) if correction.ppo_clip is not None else None,
    )
    return out.loss, {f"offpolicy/{k}": float(v) for k, v in out.metrics.items()}


__all__ = ["policy_loss", "register"]
