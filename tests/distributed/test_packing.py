"""Packed sequences (``offpolicy.parallel.packing``) and the single-process side of context parallelism.

The context-parallel splits are checked by reassembly: over all ranks the kept positions are a permutation of the
whole batch, each rank's are in the documented chunk order, and ``policy_loss`` summed over the ranks' shares
(computed here as plain slices, no process group: with whole sequences on every rank the statistics are local)
equals the one-batch loss.
"""

from __future__ import annotations

import pytest
import torch

import offpolicy as op
from offpolicy.parallel.packing import (
    cu_seqlens_from_seq_ids,
    pad_cu_seqlens,
    scatter_to_padded,
    seq_ids_from_cu_seqlens,
    thd_cp_index,
    zigzag_index,
)
from offpolicy.loss.segments import Segments


def test_seq_ids_round_trip():
    cu = torch.tensor([0, 3, 3, 7, 8], dtype=torch.int32)
    ids = seq_ids_from_cu_seqlens(cu)
    assert ids.tolist() == [0, 0, 0, 2, 2, 2, 2, 3]
    assert ids.dtype == torch.int64
    # An empty sequence (id 1) has no token; the inverse needs contiguous ids, so it reports three sequences.
    assert cu_seqlens_from_seq_ids(torch.tensor([0, 0, 1, 1, 1, 2])).tolist() == [0, 2, 5, 6]
    assert seq_ids_from_cu_seqlens(cu, num_tokens=10).tolist()[-2:] == [4, 4]
    assert seq_ids_from_cu_seqlens(torch.tensor([0])).numel() == 0


@pytest.mark.parametrize(
    "cu, match",
    [
        (torch.tensor([1, 3]), "start at 0"),
        (torch.tensor([0, 3, 2]), "non-decreasing"),
        (torch.tensor([0.0, 3.0]), "integer"),
        (torch.zeros(2, 2, dtype=torch.int64), "1-D"),
    ],
)
def test_cu_seqlens_errors(cu, match):
    with pytest.raises((ValueError, TypeError), match=match):
        seq_ids_from_cu_seqlens(cu)


def test_seq_ids_errors():
    with pytest.raises(ValueError, match="shorter"):
        seq_ids_from_cu_seqlens(torch.tensor([0, 4]), num_tokens=3)
    with pytest.raises(ValueError, match="contiguous"):
        cu_seqlens_from_seq_ids(torch.tensor([0, 2, 2]))
    with pytest.raises(ValueError, match="contiguous"):
        cu_seqlens_from_seq_ids(torch.tensor([1, 1]))


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_partitions_the_row(cp):
    s = 2 * cp * 3
    parts = [zigzag_index(s, cp, r) for r in range(cp)]
    assert torch.equal(torch.sort(torch.cat(parts)).values, torch.arange(s))
    c = s // (2 * cp)
    assert parts[0][:c].tolist() == list(range(c))
    assert parts[0][c:].tolist() == list(range(s - c, s))
    with pytest.raises(ValueError, match="multiple"):
        zigzag_index(s + 1, cp, 0)


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_thd_partition_per_sequence(cp):
    cu = torch.tensor([0, 5, 6, 13])
    cu_p = pad_cu_seqlens(cu, 2 * cp)
    assert bool(((cu_p[1:] - cu_p[:-1]) % (2 * cp) == 0).all())
    parts = [thd_cp_index(cu_p, cp, r) for r in range(cp)]
    assert torch.equal(torch.sort(torch.cat(parts)).values, torch.arange(int(cu_p[-1])))
    seq_of = seq_ids_from_cu_seqlens(cu_p)
    for r, idx in enumerate(parts):
        # Two chunks of every sequence, sequence by sequence: chunk r then chunk 2cp - 1 - r.
        assert torch.equal(seq_of[idx], torch.sort(seq_of[idx]).values)
        for i in range(cu_p.numel() - 1):
            lo, length = int(cu_p[i]), int(cu_p[i + 1] - cu_p[i])
            c = length // (2 * cp)
            mine = idx[seq_of[idx] == i].tolist()
            want = list(range(lo + r * c, lo + (r + 1) * c)) + list(range(lo + (2 * cp - 1 - r) * c,
                                                                         lo + (2 * cp - r) * c))
            assert mine == want


def test_thd_errors():
    with pytest.raises(ValueError, match="multiple of 2"):
        thd_cp_index(torch.tensor([0, 4, 7]), 2, 0)
    with pytest.raises(ValueError, match="cp_rank"):
        thd_cp_index(torch.tensor([0, 4]), 2, 2)
    with pytest.raises(ValueError, match="multiple"):
        pad_cu_seqlens(torch.tensor([0, 4]), 0)


def test_pad_cu_seqlens_keeps_multiples_and_empty_sequences():
    """Lengths already a multiple stay as they are (no extra block), empty sequences stay empty."""
    assert pad_cu_seqlens(torch.tensor([0, 4, 4, 9]), 4).tolist() == [0, 4, 4, 12]
    assert pad_cu_seqlens(torch.tensor([0, 1, 8]), 1).tolist() == [0, 1, 8]
    assert pad_cu_seqlens(torch.tensor([0]), 4).tolist() == [0]


def test_scatter_to_padded():
    cu = torch.tensor([0, 2, 5])
    cu_p = pad_cu_seqlens(cu, 4)
    x = torch.arange(5.0) + 1
    out = scatter_to_padded(x, cu, cu_p)
    assert out.tolist() == [1, 2, 0, 0, 3, 4, 5, 0]
    ids = scatter_to_padded(torch.arange(5)[:, None].expand(5, 2), cu, cu_p, fill=-1)
    assert ids[:, 0].tolist() == [0, 1, -1, -1, 2, 3, 4, -1]
    with pytest.raises(ValueError, match="tokens"):
        scatter_to_padded(x[:4], cu, cu_p)


def test_segments_without_group_unchanged():
    """``partial_sum`` equals ``sum`` without a group, and the group-less path needs no distributed init."""
    ids = torch.tensor([7, 7, 2, 9, 2])
    active = torch.tensor([True, False, True, True, True])
    x = torch.tensor([1.0, 5.0, 2.0, 3.0, 4.0], requires_grad=True)
    seg = Segments.from_ids(ids, active)
    assert seg.num == 3 and seg.group is None
    assert seg.partial_sum(x).tolist() == [6.0, 1.0, 3.0]
    assert seg.sum(x.detach()).tolist() == [6.0, 1.0, 3.0]
    assert seg.partial_sum(x).requires_grad
    assert seg.local() == seg


@pytest.mark.parametrize("layout", ["bshd", "thd"])
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_sum"])
def test_packed_loss_shares_sum_to_the_batch_loss(layout, agg):
    """With ``num_loss_tokens`` / ``num_sequences`` fixed, the shares of any split add up to the one-batch loss.

    Token-level weights and these two aggregations need no per-sequence statistic, so no group is needed here;
    the distributed tests cover the sequence-level ones (sequence weights, OPSM, ``seq_mean_token_mean``).
    """
    gen = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 4, 12, 16])
    cp = 2
    n, v = int(cu[-1]), 11
    z = torch.randn(n, v, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, v, (n,), generator=gen)
    lq = torch.log_softmax(z + 0.5 * torch.randn(n, v, generator=gen, dtype=torch.float64), 1)[
        torch.arange(n), tokens].float()
    adv = torch.randn(n, generator=gen)
    seq = seq_ids_from_cu_seqlens(cu)
    corr = op.Correction(weights="mis", score_centering=False)
    kw = dict(correction=corr, aggregation=agg, num_loss_tokens=n, num_sequences=3)
    zf = z.clone().requires_grad_(True)
    want = op.policy_loss(zf, tokens, lq, adv, seq_ids=seq, **kw)
    want.loss.backward()
    parts = ([zigzag_index(n, cp, r) for r in range(cp)] if layout == "bshd"
             else [thd_cp_index(cu, cp, r) for r in range(cp)])
    total = 0.0
    grad = torch.zeros_like(z)
    for idx in parts:
        zr = z[idx].clone().requires_grad_(True)
        out = op.policy_loss(zr, tokens[idx], lq[idx], adv[idx], seq_ids=seq[idx], **kw)
        out.loss.backward()
        total += float(out.loss.detach())
        grad[idx] = zr.grad
    assert abs(total - float(want.loss.detach())) < 1e-12
    assert torch.allclose(grad, zf.grad, rtol=1e-12, atol=1e-14)
