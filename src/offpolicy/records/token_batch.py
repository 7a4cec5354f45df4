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

    def gather_routes(self, ids: Tensor, num_experts: int, weights: Tensor | None = None) -> RoutedExperts:
        """The trainer's routes at the positions that predicted each token, aligned with the sampler's
        ``routes``: ``ids [B, L, layers, K]`` (any integer dtype, e.g. the top-k of each MoE layer's router logits
        over the padded batch) picked at ``(rows, cols - 1)`` like :meth:`gather`, as a dense
        :class:`RoutedExperts` of ``N`` rows (``weights [B, L, layers, K]`` float, optional); compare with
        :func:`~offpolicy.records.routed_experts.route_flips`."""
        if not isinstance(ids, Tensor) or ids.dim() != 4:
            raise ValueError(f"ids must be [B, L, layers, K], got {getattr(ids, 'shape', type(ids))}")
        if weights is not None and (not isinstance(weights, Tensor) or weights.shape != ids.shape):
            raise ValueError(f"weights must have the shape of ids {tuple(ids.shape)}, got "
                             f"{getattr(weights, 'shape', type(weights))}")
        pick = (self.rows.to(ids.device), (self.cols - 1).to(ids.device))
        return RoutedExperts.from_ids(ids[pick], num_experts, weights=None if weights is None else weights[pick])
