"""offpolicy: stable RL on samples drawn by other numerics than the trainer's.

    import offpolicy as op
    out = op.policy_loss(logits, tokens, sampler_logprobs, advantages,
                         candidates=op.Candidates(ids, logprobs, kind="support"),
                         correction=op.Correction(weights="mis", bounds=(0.5, 5.0), score_centering=True))
    out.loss.backward()

See SPEC.md-derived docs in docs/ for the math.
"""

from offpolicy import advantages
from offpolicy.candidates import Candidates
from offpolicy.correction import Correction, KLRejection
from offpolicy.logprob_loss import PolicyLossOutput, policy_loss_from_logprobs
from offpolicy.loss import policy_loss
from offpolicy.ops import SparseLogSoftmax, sparse_log_softmax

__version__ = "0.1.0"

__all__ = [
    "Candidates",
    "Correction",
    "KLRejection",
    "PolicyLossOutput",
    "SparseLogSoftmax",
    "advantages",
    "policy_loss",
    "policy_loss_from_logprobs",
    "sparse_log_softmax",
]
