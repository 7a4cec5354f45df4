"""Vocabulary shards as threads of one process: ``torch.distributed.all_reduce`` (MAX or SUM, in place) among
``world`` threads, one per rank, so that the sharded paths run without a process group."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch


def run_ranks(world: int, rank_main: Callable[[int], object], monkeypatch) -> list:
    """Run ``rank_main(rank)`` for ``rank`` in ``range(world)`` on one thread each, with ``all_reduce`` patched to
    reduce across those threads; return the ranks' results in rank order. The first error a rank raises is
    raised here (the other ranks' barriers are broken so that none hangs)."""
    import torch.distributed as dist

    barrier, local = threading.Barrier(world), threading.local()
    slots: list[torch.Tensor | None] = [None] * world

    def all_reduce(tensor, op=None, group=None, async_op=False):
        slots[local.rank] = tensor.clone()
        barrier.wait()
        stack = torch.stack(slots)
        tensor.copy_(stack.amax(0) if op == dist.ReduceOp.MAX else stack.sum(0))
        barrier.wait()

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    results: list = [None] * world
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        local.rank = rank
        try:
            results[rank] = rank_main(rank)
        except BaseException as err:  # raised below, after every thread has stopped
            errors.append(err)
            barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
