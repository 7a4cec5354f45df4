"""offpolicy: stable RL on samples drawn by other numerics than the trainer's.

    import offpolicy as op
    out = op.policy_loss(logits, tokens, sampler_logprobs, advantages,
                         candidates=op.Candidates(ids, logprobs, kind="support"),
                         correction=op.Correction(weights="mis", bounds=(0.5, 5.0), score_centering=True))
    out.loss.backward()

The definitions and contracts are in docs/spec.md; the layers in docs/architecture.md.
"""

from offpolicy import advantages, presets
from offpolicy.corrections import Correction, KLPenalty, KLRejection, RatioRejection, TrustRegion
from offpolicy.loss import PolicyLossOutput, policy_loss, policy_loss_from_logprobs
from offpolicy.loss.proximal import interpolated_proximal_logprobs
from offpolicy.loss.route_metrics import route_agreement
from offpolicy.records import Candidates, CSRCandidates, RoutedExperts, TokenBatch, route_flips
from offpolicy.ops import SparseLogSoftmax, sparse_log_softmax

__version__ = "0.1.0"

__all__ = [
    "Candidates",
    "CSRCandidates",
    "Correction",
    "KLPenalty",
    "KLRejection",
    "RatioRejection",
    "TrustRegion",
    "PolicyLossOutput",
    "RoutedExperts",
    "SparseLogSoftmax",
    "TokenBatch",
    "advantages",
    "interpolated_proximal_logprobs",
    "policy_loss",
    "policy_loss_from_logprobs",
    "presets",
    "route_agreement",
    "route_flips",
    "sparse_log_softmax",
]
