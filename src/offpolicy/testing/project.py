"""Adapters from concrete loss implementations to the kit's signature (:data:`~offpolicy.testing.LossFn`)."""

from __future__ import annotations

import torch
from torch import Tensor

from offpolicy.records.candidates import Candidates
from offpolicy.testing.config import LossConfig


def project_loss(config: LossConfig):
    """The project's own :func:`offpolicy.policy_loss` under ``config``, as a :data:`LossFn`.

    ``policy_loss`` returns a scalar ``loss`` (differentiable) and a detached ``token_loss [N]``. With
    ``aggregation="constant"`` and normaliser 1 the scalar is the sum of the per-token losses, so the adapter
    returns ``token_loss`` with ``loss - loss.detach()`` (zero in value) added to its first entry: the values are
    the per-token losses and the gradient of their sum is the gradient of ``loss``, which is what the kit uses.
    With ``config.aggregation`` set it returns the aggregated ``loss`` itself.
    """
    from offpolicy.loss.logits import policy_loss

    corr = config.correction

    def offpolicy_policy_loss(logits: Tensor, tokens: Tensor, sampler_logprobs: Tensor,
                              candidates: Candidates | None, advantages: Tensor, temperature: float,
                              loss_mask: Tensor | None = None, seq_ids: Tensor | None = None,
                              proximal_logprobs: Tensor | None = None, versions: Tensor | None = None,
                              current_version: int | None = None, route_flips: Tensor | None = None) -> Tensor:
        kw = dict(candidates=candidates, loss_mask=loss_mask, temperature=temperature, correction=corr,
                  seq_ids=seq_ids, proximal_logprobs=proximal_logprobs, versions=versions,
                  current_version=current_version, route_flips=route_flips)
        if config.aggregation is not None:
            return policy_loss(logits, tokens, sampler_logprobs, advantages, aggregation=config.aggregation,
                               constant_normalizer=config.constant_normalizer, **kw).loss
        out = policy_loss(logits, tokens, sampler_logprobs, advantages, aggregation="constant",
                          constant_normalizer=1.0, **kw)
        token_loss = out.token_loss.to(out.loss.dtype)
        first = (torch.arange(token_loss.shape[0], device=token_loss.device) == 0).to(token_loss.dtype)
        return token_loss + (out.loss - out.loss.detach()) * first

    offpolicy_policy_loss.offpolicy_config = config
    return offpolicy_policy_loss
