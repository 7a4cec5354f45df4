"""The records a sampler hands to the loss: :class:`Candidates` (the head or the realised support of each
position; :class:`CSRCandidates` the same without padding) and :class:`TokenBatch` (a rollout flattened over its sampled tokens)."""

from offpolicy.records.candidates import Candidates
from offpolicy.records.csr_candidates import CSRCandidates
from offpolicy.records.token_batch import TokenBatch

__all__ = ["CSRCandidates", "Candidates", "TokenBatch"]
