"""``TokenBatch``: a rollout flattened over its sampled positions, the record that samplers (the reference
sampler, the SGLang and vLLM adapters) hand to :func:`offpolicy.policy_loss`."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from offpolicy.records.candidates import Candidates
from offpolicy.records.csr_candidates import CSRCandidates
from offpolicy.records.routed_experts import RoutedExperts


@dataclass(frozen=True)
class TokenBatch:
    """A rollout flattened over its sampled positions (``N`` of them), ready for ``op.policy_loss``.

    Attributes:
        tokens: ``[N]`` int64 sampled ids.
        sampler_logprobs: ``[N]`` fp32, ``lq_t`` (after temperature, renormalised over the support when
            filtered).
        candidates: the :class:`Candidates` record ``[N, K]``, its unpadded :class:`CSRCandidates` form
            (``ids [nnz]``, ``offsets [N + 1]``), or ``None``.
        loss_mask: ``[N]`` bool, True on trained tokens.
        seq_ids: ``[N]`` int64, the rollout row of each token.
        versions: ``[N]`` int64 policy version that sampled each token.
        rows, cols: ``[N]`` int64 position of each token in ``Rollout.sequences``.
        temperature: ``[N]`` fp32 sampling temperature of each token.
        routes: the sampler's :class:`RoutedExperts` (``N`` token rows, row ``t`` the routing of the position
            that predicted token ``t``, the one :meth:`gather` reads), or ``None`` (docs/routing.md).
    """

    tokens: Tensor
    sampler_logprobs: Tensor
    candidates: Candidates | CSRCandidates | None
    loss_mask: Tensor
    seq_ids: Tensor
    versions: Tensor
    rows: Tensor
    cols: Tensor
    temperature: Tensor
    routes: RoutedExperts | None = None

    def __post_init__(self) -> None:
        if self.routes is not None:
            if not isinstance(self.routes, RoutedExperts):
                raise TypeError(f"TokenBatch.routes must be an offpolicy.RoutedExperts, got {type(self.routes).__name__}")
            self.routes.check_aligned(self.tokens.shape[0])

    def gather(self, logits: Tensor) -> Tensor:
        """Pick the trainer logits that predicted each token: ``logits[rows, cols - 1]``, ``[B, L, V] -> [N, V]``."""
        if logits.dim() != 3:
            raise ValueError(f"logits must be [B, L, V], got shape {tuple(logits.shape)}")
        return logits[self.rows, self.cols - 1]
