"""Packed sequences: from Megatron-style ``cu_seqlens`` to the per-token ``seq_ids`` that :func:`policy_loss`
takes, and the context-parallel splits of a packed batch.

A packed micro-batch concatenates sequences along one token axis; ``cu_seqlens [S + 1]`` holds the cumulative
lengths (``cu_seqlens[0] = 0``, sequence ``i`` owns tokens ``[cu_seqlens[i], cu_seqlens[i + 1])``), as in
Megatron's ``PackedSeqParams`` and FlashAttention's varlen API. The sequence id of a token is its sequence's
index ``i``, which is the same on every context-parallel rank: pass the split ids with ``cp_group=`` to
:func:`offpolicy.policy_loss` and the sequence-level quantities are reduced over the group (docs/spec.md#aggregation,
docs/spec.md#inv-sharding).

Context-parallel splits (causal load balance, as Megatron does it): a sequence is cut into ``2 * cp`` equal chunks
and rank ``r`` keeps chunks ``r`` and ``2 cp - 1 - r``.

* ``bshd`` layout (Megatron's ``get_batch_on_this_cp_rank``): the whole ``[b, s]`` row is cut, whatever sequences it
  packs; :func:`zigzag_index` gives the kept positions.
* ``thd`` layout (Transformer Engine's ``thd_get_partitioned_indices``): each packed sequence is cut on its own;
  its padded length (``cu_seqlens_padded``) must be a multiple of ``2 * cp``; :func:`thd_cp_index` gives the kept
  positions.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _check_cu_seqlens(cu_seqlens: Tensor, name: str = "cu_seqlens") -> Tensor:
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"{name} must be a 1-D tensor of S + 1 >= 1 offsets, got {getattr(cu_seqlens, 'shape', None)}")
    if cu_seqlens.is_floating_point() or cu_seqlens.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {cu_seqlens.dtype}")
    cu = cu_seqlens.to(torch.int64)
    if int(cu[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {int(cu[0])}")
    if bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing")
    return cu


def seq_ids_from_cu_seqlens(cu_seqlens: Tensor, num_tokens: int | None = None) -> Tensor:
    """``[T]`` int64 sequence index of each packed token.

    Args:
        cu_seqlens: ``[S + 1]`` int cumulative sequence lengths (``cu_seqlens[-1] = T``).
        num_tokens: the packed length ``T`` if the batch carries trailing padding past ``cu_seqlens[-1]``; those
            tokens get the id ``S`` (one extra sequence: keep them out with the loss mask).
    """
    cu = _check_cu_seqlens(cu_seqlens)
    total = int(cu[-1])
    t = total if num_tokens is None else num_tokens
    if t < total:
        raise ValueError(f"num_tokens={t} is shorter than the packed length cu_seqlens[-1]={total}")
    lens = cu[1:] - cu[:-1]
    ids = torch.repeat_interleave(torch.arange(lens.numel(), device=cu.device), lens)
    if t > total:
        ids = torch.cat([ids, torch.full((t - total,), lens.numel(), dtype=torch.int64, device=cu.device)])
    return ids


def cu_seqlens_from_seq_ids(seq_ids: Tensor) -> Tensor:
    """Inverse of :func:`seq_ids_from_cu_seqlens` for contiguous, sorted ids ``0, 0, 1, 1, 1, 2, ...``."""
    if seq_ids.dim() != 1 or seq_ids.is_floating_point():
        raise ValueError("seq_ids must be a 1-D integer tensor")
    if seq_ids.numel() == 0:
        return torch.zeros(1, dtype=torch.int64, device=seq_ids.device)
    ids = seq_ids.to(torch.int64)
    step = ids[1:] - ids[:-1]
    if int(ids[0]) != 0 or bool(((step < 0) | (step > 1)).any()):
        raise ValueError("seq_ids must be sorted and contiguous from 0 (0, 0, 1, 2, 2, ...)")
    lens = torch.bincount(ids)
    return torch.cat([torch.zeros(1, dtype=torch.int64, device=ids.device), lens.cumsum(0)])


def zigzag_index(seq_len: int, cp_size: int, cp_rank: int, device: torch.device | None = None) -> Tensor:
    """``[seq_len / cp]`` positions of a ``bshd`` row kept by context-parallel rank ``cp_rank``.

    The row is cut into ``2 cp`` chunks; the rank keeps chunks ``cp_rank`` and ``2 cp - 1 - cp_rank``, in that order
    (Megatron's ``get_batch_on_this_cp_rank``).
    """
    _check_cp(cp_size, cp_rank)
    if seq_len % (2 * cp_size):
        raise ValueError(f"seq_len={seq_len} must be a multiple of 2 * cp_size = {2 * cp_size}")
    c = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * c, (cp_rank + 1) * c, device=device)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * c, (2 * cp_size - cp_rank) * c, device=device)
    return torch.cat([first, second])


def thd_cp_index(cu_seqlens_padded: Tensor, cp_size: int, cp_rank: int) -> Tensor:
    """Positions of a packed (``thd``) batch kept by context-parallel rank ``cp_rank``.

    Each sequence ``i`` (padded length ``L_i``, a multiple of ``2 cp``) is cut into ``2 cp`` chunks of ``L_i / 2cp``;
    the rank keeps chunks ``cp_rank`` and ``2 cp - 1 - cp_rank`` of every sequence, sequence by sequence (the
    partition Transformer Engine's ``thd_get_partitioned_indices`` defines).
    """
    _check_cp(cp_size, cp_rank)
    cu = _check_cu_seqlens(cu_seqlens_padded, "cu_seqlens_padded")
    lens = cu[1:] - cu[:-1]
    if bool((lens % (2 * cp_size) != 0).any()):
        bad = int(lens[lens % (2 * cp_size) != 0][0])
        raise ValueError(f"cu_seqlens_padded: sequence length {bad} is not a multiple of 2 * cp_size = {2 * cp_size}")
    chunk = lens // (2 * cp_size)
    starts = torch.stack([cu[:-1] + cp_rank * chunk, cu[:-1] + (2 * cp_size - 1 - cp_rank) * chunk], dim=1)
    sizes = chunk.repeat_interleave(2)
    starts = starts.reshape(-1)
    offsets = torch.arange(int(sizes.sum()), device=cu.device) - torch.repeat_interleave(
        sizes.cumsum(0) - sizes, sizes
    )
    return torch.repeat_interleave(starts, sizes) + offsets


def pad_cu_seqlens(cu_seqlens: Tensor, multiple: int) -> Tensor:
    """``cu_seqlens_padded``: every sequence's length rounded up to a multiple of ``multiple`` (``2 cp`` for thd)."""
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    cu = _check_cu_seqlens(cu_seqlens)
    lens = cu[1:] - cu[:-1]
    padded = (lens + multiple - 1) // multiple * multiple
    return torch.cat([cu.new_zeros(1), padded.cumsum(0)])


def scatter_to_padded(x: Tensor, cu_seqlens: Tensor, cu_seqlens_padded: Tensor, fill=0) -> Tensor:
    """Place packed per-token ``x [T, ...]`` into the padded layout ``[T_padded, ...]`` (padding = ``fill``)."""
    cu = _check_cu_seqlens(cu_seqlens)
    cp = _check_cu_seqlens(cu_seqlens_padded, "cu_seqlens_padded")
    if cu.numel() != cp.numel():
        raise ValueError("cu_seqlens and cu_seqlens_padded must describe the same number of sequences")
    lens = cu[1:] - cu[:-1]
    if bool((cp[1:] - cp[:-1] < lens).any()):
        raise ValueError("cu_seqlens_padded: a padded sequence is shorter than the sequence")
    if x.shape[0] != int(cu[-1]):
        raise ValueError(f"x must hold cu_seqlens[-1] = {int(cu[-1])} tokens, got {x.shape[0]}")
    out = x.new_full((int(cp[-1]), *x.shape[1:]), fill)
    dest = torch.repeat_interleave(cp[:-1] - cu[:-1], lens) + torch.arange(int(cu[-1]), device=x.device)
    out[dest] = x
    return out


def _check_cp(cp_size: int, cp_rank: int) -> None:
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"need cp_size >= 1 and 0 <= cp_rank < cp_size, got cp_size={cp_size}, cp_rank={cp_rank}")
