"""The records a sampler hands to the loss: :class:`Candidates` (the head or the realised support of each
position) and :class:`TokenBatch` (a rollout flattened over its sampled tokens)."""

from offpolicy.records.candidates import Candidates
from offpolicy.records.token_batch import TokenBatch

__all__ = ["Candidates", "TokenBatch"]
