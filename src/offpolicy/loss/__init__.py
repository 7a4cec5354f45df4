"""The loss math: the public entry points (:func:`policy_loss` on logits or hidden states,
:func:`policy_loss_from_logprobs` on per-token log-probabilities) and the ``O(N K)`` stages they run (boundary
validation, sequence segments, score centering, aggregation, metrics)."""

from offpolicy.loss.logits import policy_loss
from offpolicy.loss.logprobs import PolicyLossOutput, policy_loss_from_logprobs

__all__ = ["PolicyLossOutput", "policy_loss", "policy_loss_from_logprobs"]
