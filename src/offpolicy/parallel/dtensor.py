"""Vocabulary-sharded ``DTensor`` logits: the layout of ``loss_parallel`` trainers (torchtitan-style tensor
parallelism, whose output layer returns logits ``Shard(-1)`` over the tensor-parallel mesh dimension).

:func:`offpolicy.policy_loss` accepts such logits directly: the device mesh names the vocabulary shards, so the
caller passes neither ``tp_group`` nor ``vocab_start``. The loss runs on the local shard (``to_local()``, which is
differentiable: the gradient comes back as a ``DTensor`` with the logits' placements). Sharded equals unsharded:
docs/spec.md#inv-sharding.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import Tensor


def vocab_shard_of(logits: Tensor | None, tp_group: Any, vocab_start: int) -> tuple[Tensor | None, Any, int]:
    """``(local logits [N, V_local], tensor-parallel group, first vocabulary id)`` for vocabulary-sharded DTensor
    logits ``[N, V]``; any other input is returned unchanged."""
    # A DTensor exists only once its module is imported: looking it up there keeps ``import offpolicy`` from
    # importing torch.distributed.tensor (0.4 s) for users who never shard.
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    if dtensor is None or not isinstance(logits, dtensor):
        return logits, tp_group, vocab_start
    if tp_group is not None or vocab_start != 0:
        raise ValueError("logits is a DTensor: its device mesh gives the vocabulary shards; pass neither tp_group "
                         "nor vocab_start")
    if logits.dim() != 2:
        raise ValueError(f"logits: expected a [N, V] DTensor, got shape {tuple(logits.shape)}")
    placements = logits.placements
    sharded = [i for i, p in enumerate(placements) if p.is_shard()]
    vocab_sharded = len(sharded) == 1 and placements[sharded[0]].dim in (1, -1)
    if not vocab_sharded or any(not (p.is_shard() or p.is_replicate()) for p in placements):
        raise ValueError("logits: a DTensor must be sharded over the vocabulary (Shard(1) on one mesh dimension, "
                         f"Replicate on the others), got placements {placements}")
    mesh_dim = sharded[0]
    mesh = logits.device_mesh
    size, rank, vocab = mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim), logits.shape[1]
    # Shard(d) splits like torch.chunk: ceil(V / size) columns per rank, fewer (possibly none) on the last ones.
    chunk = -(-vocab // size)
    start = min(rank * chunk, vocab)
    local = logits.to_local()
    if local.shape[1] != min(chunk, vocab - start):
        raise ValueError(f"logits: the local shard has {local.shape[1]} columns where an even Shard(1) split of "
                         f"{vocab} over {size} ranks gives {min(chunk, vocab - start)} (uneven DTensor shards are "
                         "not supported)")
    return local, mesh.get_group(mesh_dim), start
