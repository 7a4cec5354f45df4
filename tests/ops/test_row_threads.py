"""The CPU backend's row-parallel loops: with two workers the logits primitive gives bit-for-bit the results of
one (each row is computed by the same ops whoever computes it), inside autograd and with skipped rows."""

from __future__ import annotations

import pytest
import torch

from offpolicy.ops import row_threads, sparse_log_softmax

from support.vocab_reference import distinct_ids


def test_for_chunks_visits_every_chunk_once():
    seen = []
    torch.set_num_threads(2)
    try:
        row_threads.for_chunks(23, 4, lambda lo, hi: seen.append((lo, hi)))
    finally:
        torch.set_num_threads(1)
    assert sorted(seen) == [(lo, min(23, lo + 4)) for lo in range(0, 23, 4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("support", [False, True])
def test_two_workers_match_one(monkeypatch, dtype, support):
    from offpolicy.ops.logits_op import torch_backend

    monkeypatch.setattr(torch_backend, "CHUNK_BYTES", 3 * 4 * 301)  # 3 rows per chunk: many chunks
    gen = torch.Generator().manual_seed(4)
    z = (torch.randn(37, 301, generator=gen) * 3).to(dtype)
    z[5, 7] = -float("inf")
    y = torch.randint(0, 301, (37,), generator=gen)
    c = distinct_ids(37, 301, 6, gen, pad_frac=0.2)
    skip = torch.rand(37, generator=gen) < 0.2
    tau = torch.linspace(0.5, 1.5, 37)
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            leaf = z.clone().requires_grad_()
            out = sparse_log_softmax(leaf, y, c, tau, support=support, skip=skip, backend="torch")
            (out.target.sum() + torch.where(c >= 0, out.candidates, 0.0).sum()).backward()
        finally:
            torch.set_num_threads(1)
        results.append([out.target, out.candidates, out.lse, out.entropy, leaf.grad])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_policy_loss_keeps_the_callers_thread_count():
    """``op.policy_loss`` on CPU logits runs its small ops with one intra-op thread and the vocabulary passes with
    workers; the caller's thread count is back afterwards, also when the call raises (a bad input)."""
    import offpolicy as op

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gen = torch.Generator().manual_seed(0)
        logits = torch.randn(12, 40, generator=gen, requires_grad=True)
        tokens = torch.randint(0, 40, (12,), generator=gen)
        lq = torch.log_softmax(torch.randn(12, 40, generator=gen), 1)[torch.arange(12), tokens]
        out = op.policy_loss(logits, tokens, lq, torch.randn(12, generator=gen))
        assert torch.get_num_threads() == 2
        out.loss.backward()
        assert logits.grad is not None and bool(torch.isfinite(logits.grad).all())
        with pytest.raises(ValueError, match="tokens"):
            op.policy_loss(logits, tokens + 40, lq, torch.randn(12))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
