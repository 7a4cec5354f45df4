"""CSR records under a vocabulary split (2 gloo ranks): each rank gathers the entries it owns, one SUM all-reduce
assembles them, and the loss and every rank's gradient equal the single-process padded path's
(docs/spec.md#record-memory)."""

from __future__ import annotations

import pytest
import torch

import offpolicy as op
from support.distributed_harness import run_distributed

N, V, D = 10, 50, 12
SIZES = [0, 1, 2, 30, 5, 1, 44, 3, 2, 9]
CASES = [(kind, model) for kind in ("head", "support") for model in ("logits", "hidden")]


def _case(kind: str):
    gen = torch.Generator().manual_seed(17 if kind == "head" else 18)
    z = torch.randn(N, V, generator=gen, dtype=torch.float64) * 2
    h = torch.randn(N, D, generator=gen, dtype=torch.float64)
    w = torch.randn(V, D, generator=gen, dtype=torch.float64) * 0.4
    ids, lqs, y = [], [], torch.empty(N, dtype=torch.int64)
    for t, k in enumerate(SIZES):
        s = torch.randperm(V, generator=gen)[:max(k, 1)]
        y[t] = s[0]
        lq = torch.log_softmax(torch.randn(max(k, 1), generator=gen, dtype=torch.float64), 0)
        ids.append(s[:k])
        lqs.append((lq if kind == "support" else lq - 1.0)[:k])
    rec = op.CSRCandidates(torch.cat(ids), torch.tensor([0, *SIZES]).cumsum(0), torch.cat(lqs), kind)
    mask = torch.tensor([k > 0 for k in SIZES]) if kind == "support" else torch.ones(N, dtype=torch.bool)
    lq = torch.full((N,), -2.0, dtype=torch.float64)
    adv = torch.randn(N, generator=gen, dtype=torch.float64)
    return z, h, w, y, lq, adv, rec, mask


CORR = op.Correction(weights="mis", bounds=(0.3, 3.0), score_centering=True)


def _run(kind, model, rec, cols=slice(None), group=None, start=0):
    z, h, w, y, lq, adv, _, mask = _case(kind)
    if model == "logits":
        leaf = z[:, cols].clone().requires_grad_()
        out = op.policy_loss(leaf, y, lq, adv, rec, mask, 0.9, CORR, tp_group=group, vocab_start=start)
        out.loss.backward()
        return out.loss.item(), [leaf.grad]
    hh, ww = h.clone().requires_grad_(), w[cols].clone().requires_grad_()
    out = op.policy_loss(None, y, lq, adv, rec, mask, 0.9, CORR, tp_group=group, vocab_start=start, hidden=hh,
                         weight=ww)
    out.loss.backward()
    return out.loss.item(), [hh.grad, ww.grad]


def _worker(rank, world):
    import torch.distributed as dist

    half = V // world
    cols = slice(rank * half, (rank + 1) * half)
    out = {}
    for case in CASES:
        loss, grads = _run(*case, _case(case[0])[6], cols, dist.group.WORLD, rank * half)
        out[case] = (loss, [g.tolist() for g in grads])  # plain lists: tensors would travel as shared memory
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_worker, 2)


@pytest.mark.parametrize("kind,model", CASES)
def test_csr_under_a_vocabulary_split_equals_padded(ranks, kind, model):
    rec = _case(kind)[6]
    want_loss, want_grads = _run(kind, model, rec.to_padded())
    half = V // 2
    for rank, res in enumerate(ranks):
        loss, grads = res[(kind, model)]
        grads = [torch.tensor(g, dtype=torch.float64) for g in grads]
        assert abs(loss - want_loss) <= 1e-12 * max(1.0, abs(want_loss))
        if model == "logits":
            torch.testing.assert_close(grads[0], want_grads[0][:, rank * half:(rank + 1) * half],
                                       rtol=1e-10, atol=1e-12)
        else:
            torch.testing.assert_close(grads[1], want_grads[1][rank * half:(rank + 1) * half], rtol=1e-10, atol=1e-12)
    if model == "hidden":
        # Each rank's dh is its shard's part; the parts sum to the whole.
        dh = sum(torch.tensor(r[(kind, model)][1][0], dtype=torch.float64) for r in ranks)
        torch.testing.assert_close(dh, want_grads[0], rtol=1e-10, atol=1e-12)
