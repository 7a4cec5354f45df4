"""Reducing per-token losses to the scalar that is differentiated (docs/spec.md#aggregation).

``token_mean``          sum_t l_t / T            T = trained tokens (or ``num_loss_tokens``, a global count)
``seq_mean_token_mean`` mean_i (sum_{t in i} l_t / |i|)     over sequences (or ``num_sequences``)
``seq_mean_token_sum``  mean_i sum_{t in i} l_t             over sequences (or ``num_sequences``)
``constant``            sum_t l_t / C            C = ``constant_normalizer`` (Dr. GRPO)

With a global normaliser (``num_loss_tokens`` / ``num_sequences`` summed over data-parallel ranks and
micro-batches, and per-sequence token counts that are whole), summing the gradients of every rank and micro-batch
gives the gradient of one big batch.

Context parallelism (``cp_group``, and ``seg`` built over it): each rank returns its share of the loss, the sum of
its tokens' terms over the *global* normalisers (trained tokens and per-sequence counts all-reduced over the
group), so that the shares sum to the whole batch's loss and each token's gradient is the one-batch gradient.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from offpolicy.loss.segments import Segments

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
    cp_group: Any = None,
) -> Tensor:
    """Scalar loss from ``token_loss [N]`` (already 0 on inactive tokens). An empty batch gives 0, not NaN.

    With ``cp_group``, this rank's share of the loss of a batch split over the group (see the module docstring).
    """
    if aggregation == "token_mean":
        if num_loss_tokens is None:
            total_active = active.sum()
            if cp_group is not None:
                import torch.distributed as dist

                dist.all_reduce(total_active, op=dist.ReduceOp.SUM, group=cp_group)
            num_loss_tokens = total_active.clamp_min(1)
        return token_loss.sum() / num_loss_tokens
    if aggregation == "constant":
        return token_loss.sum() / constant_normalizer
    assert seg is not None
    per_seq = seg.partial_sum(token_loss)
    if aggregation == "seq_mean_token_mean":
        per_seq = per_seq / seg.count().to(per_seq.dtype).clamp_min(1)
    denom = seg.has_active().sum().clamp_min(1) if num_sequences is None else num_sequences
    return per_seq.sum() / denom
