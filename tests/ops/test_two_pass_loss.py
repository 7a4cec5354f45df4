"""``policy_loss`` on the triton backend through the two-pass kernel (statistics and gradient in one program per row)
against the float64 reference (:func:`offpolicy.reference.reference_policy_loss`) and against the three-pass path
(the same call with the two-pass rule turned off), in every token-level mode the kernel serves: weights none / tis /
mis / reject, the four aggregations, no record or a head record of 1 id up to the whole vocabulary, fp32 and fp16
(the interpreter cannot do bf16 arithmetic; with a GPU bf16 is added), hostile rows, masked-everything batches;
score centering over a head record (the head term computed in the same program) in every weight mode, from 1 id to
the whole vocabulary. And that the corrections whose row gradient is no closed form of the row's own
log-probabilities (sequence levels, batch normalisation, rejection rules, ``reject`` without the rejected tokens in
the normaliser, PPO) keep the three-pass path, and that support records (mask replay, with or without centering)
take the support pass, which reads no vocabulary.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

import offpolicy as op
from offpolicy.kernels import logsoftmax as kernels
from offpolicy.loss import logits as loss_logits
from offpolicy.reference import reference_policy_loss

from support.vocab_reference import dname, hostile_logits

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
WEIGHTS = ("none", "tis", "mis", "reject")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant")
#: log-ratio bounds of the default corrections (TIS (0, 2), MIS / reject (0.5, 5)): the sampler's log-probabilities
#: are drawn 0.03 away from them, so fp32 and float64 decide the same side.
EDGES = (math.log(0.5), math.log(2.0), math.log(5.0))
#: gradient tolerance relative to the largest reference element: fp32 arithmetic, then one rounding to the dtype.
GRAD_RTOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _batch(n, v, dtype, seed, *, hostile=False, k=0):
    gen = torch.Generator().manual_seed(seed)
    if hostile:
        z = hostile_logits(n, v, dtype, gen)  # -inf scattered, an all -inf row, a late max, a max of 40
    else:
        z = (torch.randn(n, v, generator=gen, dtype=torch.float64) * 2).to(dtype)
    temp = 0.8
    y = torch.randint(0, v, (n,), generator=gen)
    if hostile:
        finite = torch.isfinite(z.double())
        for i in range(n):  # a finite target where the row has one (row 1 is all -inf: p(y) = 0)
            cols = finite[i].nonzero()[:, 0]
            if cols.numel():
                y[i] = cols[torch.randint(0, cols.numel(), (1,), generator=gen)]
    x = z.double() / temp
    lp = x.gather(1, y[:, None])[:, 0] - torch.logsumexp(x, 1)
    lr = torch.empty(n, dtype=torch.float64).uniform_(-2.0, 2.5, generator=gen)
    lq = torch.where(torch.isfinite(lp), lp - lr, torch.full_like(lp, -3.0)).clamp_max(0.0)
    near = (lp - lq)[:, None].sub(torch.tensor(EDGES, dtype=torch.float64)).abs().min(1).values < 0.03
    lq = torch.where(near, lq - 0.06, lq)
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    adv[0] = 0.0  # no gradient from this token
    mask = torch.rand(n, generator=gen) > 0.25
    seq = torch.sort(torch.randint(0, 4, (n,), generator=gen)).values
    cands = None
    if k:
        ids = torch.stack([torch.randperm(v, generator=gen)[:k] for _ in range(n)])
        ids = torch.where(torch.rand(n, k, generator=gen) < 0.2, -1, ids) if k < v else ids
        lq_c = torch.where(ids >= 0, torch.log_softmax(x, 1).gather(1, ids.clamp_min(0)) - 0.1, -math.inf)
        lq_c = torch.where(ids == y[:, None], lq.clamp_max(0.0)[:, None], lq_c)  # the target's entry is its lq
        cands = op.Candidates(ids, lq_c.float(), "head")
    return z, y, lq.float(), adv.float(), mask, seq, temp, cands


def _run(z, y, lq, adv, mask, seq, temp, cands, corr, agg, *, two_pass: bool, monkeypatch, scale=1.0):
    leaf = z.detach().clone().to(DEVICE).requires_grad_()
    kw = dict(candidates=cands, loss_mask=mask.to(DEVICE), temperature=temp, correction=corr, aggregation=agg,
              seq_ids=seq.to(DEVICE))
    if agg == "constant":
        kw["constant_normalizer"] = 7.0
    with monkeypatch.context() as mp:
        if not two_pass:
            mp.setattr(loss_logits, "_two_pass_rule", lambda *a, **k: None)
        out = op.policy_loss(leaf, y.to(DEVICE), lq.to(DEVICE), adv.to(DEVICE), backend="triton", **kw)
        (out.loss * scale if scale != 1.0 else out.loss).backward()
    return out, leaf.grad


def _spy(monkeypatch):
    calls = []
    real = kernels.row_loss_grad

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(kernels, "row_loss_grad", spy)
    return calls


def _reference(z, y, lq, adv, mask, seq, temp, cands, corr, agg):
    zz = z.double().detach().requires_grad_()
    kw = dict(candidates=cands, loss_mask=mask, temperature=temp, correction=corr, aggregation=agg, seq_ids=seq)
    if agg == "constant":
        kw["constant_normalizer"] = 7.0
    loss, _, w = reference_policy_loss(zz, y, lq.double(), adv.double(), **kw)
    loss.backward()
    return loss.detach(), zz.grad, w


def _assert_grad(got, want, dtype, what):
    scale = float(want.abs().max()) or 1.0
    err = float((got.double().cpu() - want).abs().max())
    assert err <= GRAD_RTOL[dtype] * scale + 1e-30, f"{what}: gradient error {err:.3g} > {GRAD_RTOL[dtype]} x {scale:.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("weights", WEIGHTS)
def test_two_pass_matches_reference_and_three_pass(weights, agg, dtype, monkeypatch):
    z, y, lq, adv, mask, seq, temp, cands = _batch(11, 333, dtype, seed=zlib.crc32(f"{weights}/{agg}".encode()) % 1000)
    corr = op.Correction(weights=weights)
    calls = _spy(monkeypatch)
    two, g2 = _run(z, y, lq, adv, mask, seq, temp, cands, corr, agg, two_pass=True, monkeypatch=monkeypatch)
    assert calls, "the two-pass kernel did not run"
    three, g3 = _run(z, y, lq, adv, mask, seq, temp, cands, corr, agg, two_pass=False, monkeypatch=monkeypatch)
    assert len(calls) == 1
    loss, dz, w = _reference(z, y, lq, adv, mask, seq, temp, cands, corr, agg)
    torch.testing.assert_close(two.loss.detach().cpu().double(), loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(two.token_weight.cpu().double(), w, rtol=1e-5, atol=1e-7)
    _assert_grad(g2, dz, dtype, "two-pass vs float64")
    # against the three-pass path: the same formulas on the same fp32 numbers, so a few ulps per token; the loss is a
    # sum of terms of both signs, so its error is bounded by the terms' magnitudes, not by the (possibly cancelled) sum
    scale = float(three.token_loss.detach().abs().sum())
    torch.testing.assert_close(two.loss, three.loss, rtol=1e-6, atol=1e-6 * scale)
    torch.testing.assert_close(two.token_loss, three.token_loss, rtol=1e-6, atol=1e-9)
    for key in three.metrics:
        torch.testing.assert_close(two.metrics[key], three.metrics[key], rtol=1e-5, atol=1e-7, msg=key)
    _assert_grad(g2, g3.double().cpu(), dtype, "two-pass vs three-pass")


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("weights", WEIGHTS)
def test_hostile_rows(weights, dtype, monkeypatch):
    """-inf scattered, an all -inf trained row (p(y) = 0: weight 0, no gradient), a max arriving late, a logit of 40.
    ``constant`` aggregation keeps the rows independent, so the float64 reference (which has no value for an all
    -inf row) is taken without row 1."""
    z, y, lq, adv, mask, seq, temp, cands = _batch(9, 257, dtype, seed=5, hostile=True)
    mask[1] = True
    corr = op.Correction(weights=weights)
    calls = _spy(monkeypatch)
    two, g2 = _run(z, y, lq, adv, mask, seq, temp, cands, corr, "constant", two_pass=True, monkeypatch=monkeypatch)
    assert calls
    three, g3 = _run(z, y, lq, adv, mask, seq, temp, cands, corr, "constant", two_pass=False,
                     monkeypatch=monkeypatch)
    assert bool((g2[1] == 0).all())
    keep = torch.arange(9) != 1
    loss, dz, _ = _reference(z[keep], y[keep], lq[keep], adv[keep], mask[keep], seq[keep], temp, cands, corr,
                             "constant")
    # |x| reaches 50 here: fp32 log-probabilities carry 64 u (1 + 50) ~ 2e-4 absolute (support.vocab_reference)
    torch.testing.assert_close(two.loss.detach().cpu().double(), loss, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(two.loss, three.loss, rtol=1e-6, atol=0)
    _assert_grad(g2[keep], dz, dtype, "two-pass vs float64")
    _assert_grad(g2, g3.double().cpu(), dtype, "two-pass vs three-pass")


@pytest.mark.parametrize("k", [1, 40, 257], ids=["one_id", "k40", "whole_vocabulary"])
@pytest.mark.parametrize("weights", ("none", "mis"))
def test_head_records_from_one_id_to_the_whole_vocabulary(k, weights, monkeypatch):
    z, y, lq, adv, mask, seq, temp, cands = _batch(8, 257, torch.float32, seed=k, k=k)
    corr = op.Correction(weights=weights)
    calls = _spy(monkeypatch)
    two, g2 = _run(z, y, lq, adv, mask, seq, temp, cands, corr, "token_mean", two_pass=True, monkeypatch=monkeypatch)
    assert calls
    three, g3 = _run(z, y, lq, adv, mask, seq, temp, cands, corr, "token_mean", two_pass=False,
                     monkeypatch=monkeypatch)
    loss, dz, _ = _reference(z, y, lq, adv, mask, seq, temp, cands, corr, "token_mean")
    torch.testing.assert_close(two.loss.detach().cpu().double(), loss, rtol=1e-5, atol=1e-7)
    _assert_grad(g2, dz, torch.float32, "two-pass vs float64")
    _assert_grad(g2, g3.double().cpu(), torch.float32, "two-pass vs three-pass")
    for key in three.metrics:
        torch.testing.assert_close(two.metrics[key], three.metrics[key], rtol=1e-5, atol=1e-7, msg=key)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=dname)
def test_masked_everything_gives_zero_gradient(dtype, monkeypatch):
    z, y, lq, adv, mask, seq, temp, cands = _batch(6, 100, dtype, seed=2)
    mask[:] = False
    calls = _spy(monkeypatch)
    two, g2 = _run(z, y, lq, adv, mask, seq, temp, cands, op.Correction(weights="tis"), "token_mean", two_pass=True,
                   monkeypatch=monkeypatch)
    assert calls and float(two.loss.detach()) == 0.0 and bool((g2 == 0).all())


def test_scaled_loss_and_a_second_backward(monkeypatch):
    """A scaled loss (gradient accumulation) rescales the written gradient; a second backward is refused."""
    z, y, lq, adv, mask, seq, temp, cands = _batch(7, 120, torch.float32, seed=9)
    corr = op.Correction(weights="mis")
    _, g2 = _run(z, y, lq, adv, mask, seq, temp, cands, corr, "token_mean", two_pass=True, monkeypatch=monkeypatch,
                 scale=0.25)
    _, g3 = _run(z, y, lq, adv, mask, seq, temp, cands, corr, "token_mean", two_pass=False, monkeypatch=monkeypatch,
                 scale=0.25)
    _assert_grad(g2, g3.double().cpu(), torch.float32, "scaled")
    leaf = z.detach().clone().to(DEVICE).requires_grad_()
    out = op.policy_loss(leaf, y.to(DEVICE), lq.to(DEVICE), adv.to(DEVICE), backend="triton", correction=corr)
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        out.loss.backward()


@pytest.mark.parametrize("corr,extra", [
    (op.Correction(weights="tis", level="sequence"), {}),
    (op.Correction(weights="mis", level="geometric"), {}),
    (op.Correction(weights="tis", batch_normalize=True), {}),
    (op.Correction(weights="reject", rejected_in_normalizer=False), {}),
    (op.Correction(weights="tis", veto=1e-4), {}),
    (op.Correction(weights="mis", ppo_clip=(0.2, 0.2)), {"proximal": True}),
    (op.Correction(weights="tis"), {"support": True}),
    (op.Correction(weights="mis", score_centering=True), {"support": True}),
    (op.Correction(weights="tis"), {"inplace": True}),
    (op.Correction(weights="tis"), {"no_grad": True}),
], ids=["sequence", "geometric", "batch_normalize", "reject_not_in_normalizer", "veto", "ppo", "support",
        "sc_support", "inplace_grad", "no_grad"])
def test_other_corrections_keep_the_three_pass_path(corr, extra, monkeypatch):
    z, y, lq, adv, mask, seq, temp, cands = _batch(8, 64, torch.float32, seed=4, k=extra.get("k", 0))
    calls = _spy(monkeypatch)
    stats = []
    real = kernels.row_stats
    monkeypatch.setattr(kernels, "row_stats", lambda *a, **k: stats.append(1) or real(*a, **k))
    kw = dict(seq_ids=seq, loss_mask=mask, correction=corr, candidates=cands, backend="triton")
    if extra.get("proximal"):
        kw["proximal_logprobs"] = lq + 0.05
    if extra.get("support"):
        ids = torch.stack([torch.cat([y[i:i + 1], torch.tensor([(int(y[i]) + 1) % 64])]) for i in range(8)])
        kw["candidates"] = op.Candidates(ids, torch.log(torch.full((8, 2), 0.5)), "support")
    leaf = z.clone().requires_grad_(not extra.get("no_grad"))
    out = op.policy_loss(leaf, y, lq, adv, inplace_grad=bool(extra.get("inplace")), **kw)
    if leaf.requires_grad:
        out.loss.backward()
    assert not calls, "the two-pass kernel ran for a correction it does not serve"
    assert stats or extra.get("support"), "the three-pass statistics kernel did not run"


@pytest.mark.parametrize("agg,extra", [("token_mean", {"num_loss_tokens": 50.0}),
                                       ("seq_mean_token_mean", {"num_sequences": 9.0})])
def test_per_row_temperatures_global_normalisers_and_no_validation(agg, extra, monkeypatch):
    """A ``[N]`` temperature tensor, the data-parallel normalisers, ``validate=False``: the same as three passes."""
    z, y, lq, adv, mask, seq, _, cands = _batch(9, 200, torch.float32, seed=21)
    temp = torch.linspace(0.6, 1.4, 9)
    corr = op.Correction(weights="tis", bounds=(0.5, 2.0))
    grads, losses = [], []
    for two_pass in (True, False):
        calls = _spy(monkeypatch)
        leaf = z.detach().clone().to(DEVICE).requires_grad_()
        with monkeypatch.context() as mp:
            if not two_pass:
                mp.setattr(loss_logits, "_two_pass_rule", lambda *a, **k: None)
            out = op.policy_loss(leaf, y.to(DEVICE), lq.to(DEVICE), adv.to(DEVICE), loss_mask=mask.to(DEVICE),
                                 temperature=temp.to(DEVICE), correction=corr, seq_ids=seq.to(DEVICE),
                                 aggregation=agg, backend="triton", validate=False, **extra)
            out.loss.backward()
        assert bool(calls) == two_pass
        grads.append(leaf.grad)
        losses.append(out.loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=0)
    _assert_grad(grads[0], grads[1].double().cpu(), torch.float32, "two-pass vs three-pass")
    z64 = z.double().detach().requires_grad_()
    loss64, _, _ = reference_policy_loss(z64, y, lq.double(), adv.double(), loss_mask=mask, temperature=temp.double(),
                                         correction=corr, seq_ids=seq, aggregation=agg, **extra)
    loss64.backward()
    torch.testing.assert_close(losses[0].cpu().double(), loss64.detach(), rtol=1e-5, atol=1e-7)
    _assert_grad(grads[0], z64.grad, torch.float32, "two-pass vs float64")


def _at_most_one(cands, lq):
    """A head's mass is at most 1: rows over it (the target's lq drawn above its softmax entry) lowered, lq alike."""
    excess = (torch.logsumexp(cands.logprobs.double(), 1) + 0.01).clamp_min(0.0)
    return (op.Candidates(cands.ids, (cands.logprobs.double() - excess[:, None]).float(), "head"),
            (lq.double() - excess).float())


#: Score centering over a head record: (weights, aggregation, K) at V = 97; K = 97 is the whole vocabulary (the
#: head holds all the mass: 1 - P_H floors at eps, rho = (1 - Q_H) / eps).
SC_CASES = [("mis", "token_mean", 40), ("mis", "token_mean", 97), ("none", "seq_mean_token_mean", 1),
            ("tis", "seq_mean_token_sum", 97), ("reject", "constant", 7)]


#: every case in fp32; fp16 (and bf16 on a GPU) on two of them (the interpreter is slow)
SC_RUNS = ([(*case, torch.float32) for case in SC_CASES]
           + [(*SC_CASES[i], dt) for i in (0, 4) for dt in DTYPES if dt != torch.float32])


@pytest.mark.parametrize("weights,agg,k,dtype", SC_RUNS, ids=[f"{w}-{a}-k{k}-{dname(d)}" for w, a, k, d in SC_RUNS])
def test_score_centering_matches_reference_and_three_pass(weights, agg, k, dtype, monkeypatch):
    """The study's configuration (MIS + score centering, token aggregation) and the other modes with centering:
    the head term's gradient written by the two-pass kernel, against float64 and the three-pass path."""
    z, y, lq, adv, mask, seq, temp, cands = _batch(9, 97, dtype, seed=zlib.crc32(f"sc/{weights}/{k}".encode()) % 1000,
                                                   k=k)
    cands, lq = _at_most_one(cands, lq)
    corr = op.Correction(weights=weights, score_centering=True)
    calls = _spy(monkeypatch)
    two, g2 = _run(z, y, lq, adv, mask, seq, temp, cands, corr, agg, two_pass=True, monkeypatch=monkeypatch)
    assert calls, "the two-pass kernel did not run"
    three, g3 = _run(z, y, lq, adv, mask, seq, temp, cands, corr, agg, two_pass=False, monkeypatch=monkeypatch)
    assert len(calls) == 1
    loss, dz, _ = _reference(z, y, lq, adv, mask, seq, temp, cands, corr, agg)
    torch.testing.assert_close(two.loss.detach().cpu().double(), loss, rtol=1e-5, atol=1e-7)
    _assert_grad(g2, dz, dtype, "two-pass vs float64")
    scale = float(three.token_loss.detach().abs().sum())
    torch.testing.assert_close(two.loss, three.loss, rtol=1e-6, atol=1e-6 * scale)
    for key in three.metrics:
        torch.testing.assert_close(two.metrics[key], three.metrics[key], rtol=1e-5, atol=1e-7, msg=key)
    _assert_grad(g2, g3.double().cpu(), dtype, "two-pass vs three-pass")


@pytest.mark.parametrize("weights,k", [("none", 300), ("mis", 600)], ids=["none-k300", "mis-whole_vocabulary"])
def test_score_centering_head_wider_than_one_sweep_step(weights, k, monkeypatch):
    """Heads of more than the kernel's 256 entries per step (``_HEAD_CHUNK``): the three sweeps loop. (With
    ``none``, ``alpha = rho`` reads every entry's mass; MIS's ``alpha`` is 1 wherever ``1 / rho`` is in its band.)"""
    assert kernels._HEAD_CHUNK < k
    z, y, lq, adv, mask, seq, temp, cands = _batch(5, 600, torch.float32, seed=k, k=k)
    cands, lq = _at_most_one(cands, lq)
    corr = op.Correction(weights=weights, score_centering=True)
    calls = _spy(monkeypatch)
    two, g2 = _run(z, y, lq, adv, mask, seq, temp, cands, corr, "token_mean", two_pass=True, monkeypatch=monkeypatch)
    assert calls
    three, g3 = _run(z, y, lq, adv, mask, seq, temp, cands, corr, "token_mean", two_pass=False,
                     monkeypatch=monkeypatch)
    loss, dz, _ = _reference(z, y, lq, adv, mask, seq, temp, cands, corr, "token_mean")
    torch.testing.assert_close(two.loss.detach().cpu().double(), loss, rtol=1e-5, atol=1e-7)
    _assert_grad(g2, dz, torch.float32, "two-pass vs float64")
    _assert_grad(g2, g3.double().cpu(), torch.float32, "two-pass vs three-pass")


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=dname)
def test_score_centering_hostile_rows(dtype, monkeypatch):
    """Hostile logits under MIS + centering: -inf scattered (head entries with p = 0 contribute 0), a trained row of
    all -inf (no mass: no gradient), a sampled token with a -inf logit in a row with mass (w = 0: the head term
    alone), a max of 40, the target outside the head; then a masked-everything batch (zero loss, zero gradient)."""
    n, v, k = 9, 257, 24
    z, y, lq, adv, mask, seq, temp, _ = _batch(n, v, dtype, seed=11, hostile=True)
    gen = torch.Generator().manual_seed(12)
    mask[1] = mask[2] = True
    adv[1:3] = 1.0
    z[2, int(y[2])] = -math.inf  # p(y) = 0 in a row with mass
    x = z.double() / temp
    ids = torch.stack([torch.randperm(v, generator=gen)[:k] for _ in range(n)])
    ids[3] = torch.where(ids[3] == y[3], (y[3] + 1) % v, ids[3])  # row 3: the target is no head id
    ids[4, 0] = y[4]
    lq_c = (torch.log_softmax(torch.where(torch.isfinite(x), x, -30.0), 1).gather(1, ids)
            + 0.5 * torch.randn(n, k, generator=gen, dtype=torch.float64))  # q far enough from p: c is not ~0
    fin = [c for c in torch.isfinite(x[2]).nonzero()[:, 0].tolist() if c != int(y[2])][:k]
    ids[2, :len(fin)] = torch.tensor(fin)  # row 2's head: its finite columns at p / q = e (m = p, c = (1 - alpha) p)
    lq_c[2] = torch.log_softmax(x[2], 0)[ids[2]].clamp_min(-30.0) - 1.0
    cands, lq = _at_most_one(op.Candidates(ids, lq_c.float(), "head"), lq)
    lq_c = cands.logprobs
    corr = op.Correction(weights="mis", score_centering=True)
    calls = _spy(monkeypatch)
    two, g2 = _run(z, y, lq, adv, mask, seq, temp, cands, corr, "constant", two_pass=True, monkeypatch=monkeypatch)
    assert calls
    three, g3 = _run(z, y, lq, adv, mask, seq, temp, cands, corr, "constant", two_pass=False,
                     monkeypatch=monkeypatch)
    assert bool((g2[1] == 0).all()) and float(g2[2].abs().max()) > 0
    keep = torch.arange(n) != 1
    sub = op.Candidates(ids[keep], lq_c[keep].float(), "head")
    loss, dz, _ = _reference(z[keep], y[keep], lq[keep], adv[keep], mask[keep], seq[keep], temp, sub, corr,
                             "constant")
    torch.testing.assert_close(two.loss.detach().cpu().double(), loss, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(two.loss, three.loss, rtol=1e-6, atol=0)
    _assert_grad(g2[keep], dz, dtype, "two-pass vs float64")
    _assert_grad(g2, g3.double().cpu(), dtype, "two-pass vs three-pass")
    mask[:] = False
    two, g2 = _run(z, y, lq, adv, mask, seq, temp, cands, corr, "token_mean", two_pass=True, monkeypatch=monkeypatch)
    assert float(two.loss.detach()) == 0.0 and bool((g2 == 0).all())


@pytest.mark.parametrize("k", [1, 13, 61], ids=["one_id", "k13", "whole_vocabulary"])
def test_mis_centering_with_top_p_replay_reads_no_vocabulary(k, monkeypatch):
    """MIS + centering + a support record (top-p mask replay, the study's arm), supports of 1 id up to the whole
    vocabulary: neither the two-pass kernel nor any vocabulary pass runs (the support's normaliser is a gather of
    its ids), the gradient is 0 outside the support and matches float64."""
    n, v = 6, 61
    z, y, lq, adv, mask, seq, temp, _ = _batch(n, v, torch.float32, seed=30 + k)
    gen = torch.Generator().manual_seed(k)
    ids = torch.stack([torch.cat([y[i:i + 1], torch.randperm(v, generator=gen)]).unique(sorted=False)[:k]
                       if k < v else torch.randperm(v, generator=gen) for i in range(n)])
    ids = torch.stack([torch.cat([y[i:i + 1], ids[i][ids[i] != y[i]]])[:k] for i in range(n)])
    x = z.double() / temp
    lq_s = torch.log_softmax(x.gather(1, ids) + 0.3 * torch.randn(n, k, generator=gen, dtype=torch.float64), 1)
    cands = op.Candidates(ids, lq_s.float(), "support")
    lq = lq_s[:, 0].float()  # the sampled token's support-renormalised log-probability
    corr = op.Correction(weights="mis", score_centering=True)
    calls = _spy(monkeypatch)
    reads = []
    for name in ("row_stats", "row_grad"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, real=real, **kw: reads.append(1) or real(*a, **kw))
    two, g = _run(z, y, lq, adv, mask, seq, temp, cands, corr, "token_mean", two_pass=True, monkeypatch=monkeypatch)
    assert not calls and not reads, "a vocabulary pass ran for a support record"
    outside = torch.ones(n, v, dtype=torch.bool).scatter_(1, ids, False)
    assert bool((g[outside] == 0).all())
    loss, dz, _ = _reference(z, y, lq, adv, mask, seq, temp, cands, corr, "token_mean")
    torch.testing.assert_close(two.loss.detach().cpu().double(), loss, rtol=1e-5, atol=1e-7)
    _assert_grad(g, dz, torch.float32, "support pass vs float64")
