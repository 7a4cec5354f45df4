"""Version-interpolated proximal log-probabilities for decoupled PPO (docs/spec.md#decoupled-ppo), after AReaL
PR #600: instead of a forward pass of the proximal policy, interpolate between the behaviour and the current
log-probabilities by how far each token's version lies from the proximal version ``current_version - 1``."""

from __future__ import annotations

import torch
from torch import Tensor


def interpolated_proximal_logprobs(behaviour_logprobs: Tensor, logprobs: Tensor, versions: Tensor,
                                   current_version: int, method: str = "loglinear") -> Tensor:
    """``[N]`` detached ``log pi_prox(y_t)``, for ``proximal_logprobs=``.

    With ``v_t`` the token's version, ``v`` the trainer's and the proximal version ``v - 1``:
    ``alpha_t = clamp((v - 1 - v_t) / (v - v_t), 0, 1)`` (0 where ``v_t >= v`` or ``v_t < 0``, AReaL's prompt
    tokens), then ``"loglinear"``: ``lq + alpha (log p - lq)``; ``"linear"``: ``log((1 - alpha) q + alpha p)``
    (in log space, without AReaL's ``+1e-10``).

    Args:
        behaviour_logprobs: ``[N]`` float ``lq``, the sampler's log-probabilities.
        logprobs: ``[N]`` float ``log p``, the current policy's (same dtype and device).
        versions: ``[N]`` int policy version each token was sampled under.
        current_version: the trainer's version ``v``.
        method: ``"loglinear"`` or ``"linear"``.
    """
    if method not in ("loglinear", "linear"):
        raise ValueError(f"method must be 'loglinear' or 'linear', got {method!r}")
    if isinstance(current_version, bool) or not isinstance(current_version, int):
        raise TypeError(f"current_version must be an int, got {current_version!r}")
    for name, x in (("behaviour_logprobs", behaviour_logprobs), ("logprobs", logprobs), ("versions", versions)):
        if not isinstance(x, Tensor) or x.dim() != 1 or x.shape != behaviour_logprobs.shape:
            raise ValueError(f"{name} must be a [N] tensor like behaviour_logprobs "
                             f"{list(getattr(behaviour_logprobs, 'shape', []))}, got {getattr(x, 'shape', type(x))}")
    if versions.is_floating_point():
        raise TypeError(f"versions must be an integer tensor, got {versions.dtype}")
    lq, lp = behaviour_logprobs.detach(), logprobs.detach().to(behaviour_logprobs.dtype)
    v = versions.to(lq.dtype)
    gap = current_version - v
    alpha = torch.where((gap > 0) & (versions >= 0), (gap - 1) / gap.clamp_min(1), torch.zeros_like(v))
    alpha = alpha.clamp(0.0, 1.0)
    if method == "loglinear":
        return lq + alpha * (lp - lq)
    # log((1 - a) e^lq + a e^lp) without leaving log space; a weight of 0 contributes exactly nothing.
    lo = torch.where(alpha < 1, torch.log1p(-alpha) + lq, torch.full_like(lq, float("-inf")))
    hi = torch.where(alpha > 0, torch.log(alpha) + lp, torch.full_like(lq, float("-inf")))
    return torch.logaddexp(lo, hi)
