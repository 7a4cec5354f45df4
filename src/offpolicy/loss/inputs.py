"""The small typed records the loss passes around internally, built once at the public boundary
(:func:`offpolicy.policy_loss`, :func:`offpolicy.policy_loss_from_logprobs`) from their keyword arguments."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor


@dataclass(frozen=True)
class TokenData:
    """The per-token data of a batch besides the trainer's log-probabilities.

    Attributes:
        sampler_logprobs: ``[N]`` float ``lq_t``.
        advantages: ``[N]`` float.
        loss_mask: ``[N]`` bool (or 0/1) trained tokens, or None (all).
        seq_ids: ``[N]`` int sequence of each token, or None.
        groups: ``[N]`` int sampler group, or None.
        versions: ``[N]`` int policy version, or None.
        proximal_logprobs: ``[N]`` float ``log pi_prox(y_t)`` (decoupled PPO), or None.
        current_version: the trainer's version for staleness metrics, or None (the newest).
        reference_logprobs: ``[N]`` float ``log p_ref(y_t)`` of the reference model (``Correction.kl_penalty``),
            or None.
        segment_ids: ``[N]`` int turn of each token within its sequence (``Correction(level="segment")``), or None.
        route_flips: ``[N]`` int, the MoE layers where the sampler's top-k expert set differs from the trainer's
            (``RouteFlipRejection``), or None.
    """

    sampler_logprobs: Tensor
    advantages: Tensor
    loss_mask: Tensor | None = None
    seq_ids: Tensor | None = None
    groups: Tensor | None = None
    versions: Tensor | None = None
    proximal_logprobs: Tensor | None = None
    current_version: int | None = None
    reference_logprobs: Tensor | None = None
    segment_ids: Tensor | None = None
    route_flips: Tensor | None = None


@dataclass(frozen=True)
class Aggregation:
    """How the per-token losses reduce to the scalar (docs/spec.md#aggregation).

    Attributes:
        name: ``"token_mean" | "seq_mean_token_mean" | "seq_mean_token_sum" | "constant"``.
        num_loss_tokens: global token count for ``token_mean``, or None (this batch's trained tokens).
        num_sequences: global sequence count for the sequence aggregations, or None.
        constant_normalizer: the divisor of ``constant``.
    """

    name: str = "token_mean"
    num_loss_tokens: float | Tensor | None = None
    num_sequences: float | Tensor | None = None
    constant_normalizer: float | None = None


@dataclass(frozen=True)
class Parallelism:
    """Process groups the batch is split over.

    Attributes:
        tp_group: group over which the vocabulary is split, or None; ``vocab_start`` is this rank's first id.
        cp_group: group over which each sequence's tokens are split (context parallelism), or None.
    """

    tp_group: Any = None
    vocab_start: int = 0
    cp_group: Any = None
