"""A CSR candidate record under Megatron context parallelism (2 gloo ranks, megatron-core's own split):
``split_csr_for_context_parallel`` keeps, on each CP rank, the rows of exactly the tokens that megatron-core's
``get_batch_on_this_cp_rank`` keeps (``bshd``) and that the ``thd`` split keeps, with their entries and rebuilt
offsets; each equals the padded record split then converted. The CP loss and gradient on the CSR split equal the
padded split's, and the ranks' loss sums add up to the single-process loss (docs/distributed.md)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

import offpolicy as op  # noqa: E402
from offpolicy.adapters.megatron import (make_loss_func, split_csr_for_context_parallel,  # noqa: E402
                                         split_for_context_parallel)
from offpolicy.parallel.packing import zigzag_index  # noqa: E402
from support.distributed_harness import run_distributed  # noqa: E402

B, S, V = 2, 16, 40
#: thd layout of each row: three packed sequences padded to multiples of 2 * cp = 4
CU_PADDED = torch.tensor([0, 4, 12, 16])
CORR = op.Correction(weights="mis", bounds=(0.5, 5.0), score_centering=True)


def _case():
    """A ``[B, S]`` micro-batch and a support record over its ``B S`` tokens (rows of 0 to 30 ids; an empty row is
    an untrained token), identical on every rank; float64 logits ``[B, S, V]``."""
    gen = torch.Generator().manual_seed(11)
    z = torch.randn(B, S, V, generator=gen, dtype=torch.float64) * 2
    sizes = torch.randint(0, 31, (B * S,), generator=gen)
    sizes[[3, 17]] = 0
    ids, lps, labels, lq = [], [], torch.zeros(B * S, dtype=torch.int64), torch.zeros(B * S, dtype=torch.float64)
    for t, k in enumerate(sizes.tolist()):
        sup = torch.randperm(V, generator=gen)[:k]
        lp = torch.log_softmax(torch.randn(k, generator=gen, dtype=torch.float64), 0)
        if k:
            labels[t], lq[t] = sup[0], lp[0]
        ids.append(sup)
        lps.append(lp)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])
    rec = op.CSRCandidates(torch.cat(ids), offsets, torch.cat(lps), "support")
    batch = {"labels": labels.view(B, S), "sampler_logprobs": lq.view(B, S),
             "advantages": torch.randn(B, S, generator=gen, dtype=torch.float64), "loss_mask": (sizes > 0).view(B, S)}
    return z, batch, rec


def _padded_batch(batch, rec):
    pad = rec.to_padded()
    return {**batch, "candidate_ids": pad.ids.view(B, S, -1), "candidate_logprobs": pad.logprobs.view(B, S, -1)}


def _from_split(split: dict) -> op.CSRCandidates:
    k = split["candidate_ids"].shape[-1]
    return op.CSRCandidates.from_padded(op.Candidates(split["candidate_ids"].reshape(-1, k),
                                                      split["candidate_logprobs"].reshape(-1, k), "support"))


def _same(a: op.CSRCandidates, b: op.CSRCandidates, what: str) -> None:
    for name in ("ids", "offsets", "logprobs"):
        assert torch.equal(getattr(a, name).to(getattr(b, name).dtype), getattr(b, name)), (what, name)


def _loss(batch, z, **kw):
    leaf = z.clone().requires_grad_(True)
    loss, count, _ = make_loss_func(batch, correction=CORR, use_parallel_state=False, reduce_metrics=False,
                                    **kw)(leaf)
    loss.backward()
    return loss.detach(), count, leaf.grad


def _worker(rank: int, world: int) -> str:
    import torch.distributed as dist
    from megatron.core.utils import get_batch_on_this_cp_rank

    torch.set_num_threads(1)
    group = dist.group.WORLD
    z, batch, rec = _case()
    dense = {**_padded_batch(batch, rec), "row": torch.arange(B * S).view(B, S)}
    # bshd: megatron-core's split of the padded record and of the token index
    theirs = get_batch_on_this_cp_rank({k: v.clone() for k, v in dense.items()}, cp_group=group)
    mine = split_csr_for_context_parallel(rec, B, S, world, rank)
    assert mine.num_rows == B * S // world
    _same(mine, _from_split(theirs), "bshd vs get_batch_on_this_cp_rank")
    _same(mine, rec.take_rows(theirs["row"].reshape(-1)), "bshd rows")
    # thd: the padded record split by the same index, then converted
    thd = split_csr_for_context_parallel(rec, B, S, world, rank, CU_PADDED)
    _same(thd, _from_split(split_for_context_parallel(dense, world, rank, CU_PADDED)), "thd vs padded split")
    # the CP loss on this rank's share: CSR split against padded split, and the ranks' sum against one process
    local = split_for_context_parallel(batch, world, rank)
    z_local = z.index_select(1, zigzag_index(S, world, rank)).contiguous()
    got = _loss(local, z_local, csr_candidates=mine, cp_group=group)
    want = _loss(split_for_context_parallel(_padded_batch(batch, rec), world, rank), z_local, candidate_kind="support",
                 cp_group=group)
    assert abs(float(got[0] - want[0])) <= 1e-12 * max(1.0, abs(float(want[0]))), (float(got[0]), float(want[0]))
    assert int(got[1]) == int(want[1])
    torch.testing.assert_close(got[2], want[2], rtol=1e-10, atol=1e-13)
    total = got[0].clone()
    dist.all_reduce(total, group=group)
    single = _loss(batch, z, csr_candidates=rec)[0]
    assert abs(float(total - single)) <= 1e-10 * max(1.0, abs(float(single))), (float(total), float(single))
    return "ok"


def test_csr_record_split_for_context_parallel_matches_megatron():
    assert run_distributed(_worker, 2) == ["ok", "ok"]


def test_csr_split_checks_its_arguments():
    _, _, rec = _case()
    with pytest.raises(ValueError, match=r"b \* s = 2 \* 8 = 16 rows"):
        split_csr_for_context_parallel(rec, B, 8, 2, 0)
    with pytest.raises(TypeError, match="CSRCandidates"):
        split_csr_for_context_parallel(rec.to_padded(), B, S, 2, 0)
    with pytest.raises(ValueError, match="multiple of 2 \\* cp_size"):
        split_csr_for_context_parallel(rec.take_rows(torch.arange(B * 6)), B, 6, 2, 0)
    assert split_csr_for_context_parallel(rec, B, S, 1, 0) is rec
