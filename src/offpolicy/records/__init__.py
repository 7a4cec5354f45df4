"""The records a sampler hands to the loss: :class:`Candidates` (the head or the realised support of each
position; :class:`CSRCandidates` the same without padding), :class:`TokenBatch` (a rollout flattened over its sampled tokens)
and :class:`RoutedExperts` (a mixture-of-experts sampler's expert ids per token, layer and slot)."""

from offpolicy.records.candidates import Candidates
from offpolicy.records.csr_candidates import CSRCandidates
from offpolicy.records.routed_experts import RoutedExperts, route_flips
from offpolicy.records.token_batch import TokenBatch

__all__ = ["CSRCandidates", "Candidates", "RoutedExperts", "TokenBatch", "route_flips"]
