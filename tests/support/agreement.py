"""One agreement check shared by the correction tests: ``op.policy_loss`` against the float64 reference
(:func:`offpolicy.reference.reference_policy_loss`, which shares no code with it) on one float64 batch."""

from __future__ import annotations

import torch

import offpolicy as op
from offpolicy.reference import reference_policy_loss


def assert_matches_reference(z: torch.Tensor, y: torch.Tensor, lq: torch.Tensor, adv: torch.Tensor, **kw):
    """Token weights, token losses and the loss to 1e-12 (relative), the logits' gradient to 1e-10, for logits
    ``z`` ``[N, V]`` float64, targets ``y`` ``[N]``, sampler log-probs ``lq`` ``[N]`` and advantages ``adv`` ``[N]``;
    ``kw`` goes to both unchanged. Returns the library's output (for checks of its metrics)."""
    z1, z2 = z.clone().requires_grad_(), z.clone().requires_grad_()
    out = op.policy_loss(z1, y, lq, adv, **kw)
    loss, token_loss, w = reference_policy_loss(z2, y, lq, adv, **kw)
    out.loss.backward()
    loss.backward()
    torch.testing.assert_close(out.token_weight, w, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(out.token_loss, token_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(out.loss.detach(), loss.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(z1.grad, z2.grad, rtol=1e-10, atol=1e-13)
    return out
