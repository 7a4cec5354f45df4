"""Reducing per-token losses to the scalar that is differentiated (SPEC section 5, aggregation).

``token_mean``          sum_t l_t / T            T = trained tokens (or ``num_loss_tokens``, a global count)
``seq_mean_token_mean`` mean_i (sum_{t in i} l_t / |i|)     over sequences (or ``num_sequences``)
``seq_mean_token_sum``  mean_i sum_{t in i} l_t             over sequences (or ``num_sequences``)
``constant``            sum_t l_t / C            C = ``constant_normalizer`` (Dr. GRPO)

With a global normaliser (``num_loss_tokens`` / ``num_sequences`` summed over data-parallel ranks and
micro-batches, and per-sequence token counts that are whole), summing the gradients of every rank and micro-batch
gives the gradient of one big batch.
"""

from __future__ import annotations

from torch import Tensor

from offpolicy.segments import Segments

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant")
SEQUENCE_AGGREGATIONS = ("seq_mean_token_mean", "seq_mean_token_sum")


def aggregate(
    token_loss: Tensor,
    active: Tensor,
    aggregation: str,
    seg: Segments | None,
    num_loss_tokens: float | Tensor | None,
    num_sequences: float | Tensor | None,
    constant_normalizer: float | None,
) -> Tensor:
    """Scalar loss from ``token_loss [N]`` (already 0 on inactive tokens). An empty batch gives 0, not NaN."""
    total_active = active.sum()
    if aggregation == "token_mean":
        denom = total_active.clamp_min(1) if num_loss_tokens is None else num_loss_tokens
        return token_loss.sum() / denom
    if aggregation == "constant":
        return token_loss.sum() / constant_normalizer
    assert seg is not None
    per_seq = seg.sum(token_loss)
    if aggregation == "seq_mean_token_mean":
        per_seq = per_seq / seg.count().to(per_seq.dtype).clamp_min(1)
    denom = seg.has_active().sum().clamp_min(1) if num_sequences is None else num_sequences
    return per_seq.sum() / denom
