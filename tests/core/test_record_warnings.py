"""Records that pass every check but contradict the batch warn, once, naming the cause and the fix (issue 40):

* a support record labelled ``kind="head"``: rows that sum to one over ``K < V`` ids, where the trainer puts
  visibly less mass (the loss would model a tail that the sampler never had);
* a full-vocabulary ``sampler_logprobs`` with a renormalised support record: the sampled token's ``lq`` lies below
  its own entry by ``log P(S)`` (``offpolicy diagnose`` calls it "an lq off its own candidate entry").

Correct batches stay silent: honest head records (also ones whose top ids hold nearly all the mass, and ones that
cover the whole vocabulary), honest support records, bf16 records."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import offpolicy as op
from offpolicy.loss import validation
from offpolicy.loss.validation import RecordWarning

N, V, K = 12, 40, 5


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(validation, "_WARNED", set())


def _batch(seed: int, *, kind: str, peaked: float = 1.0, k: int = K, v: int = V):
    """Logits, the sampler's distribution near them, sampled tokens; the head (top-``k``, full-vocabulary
    log-probabilities) or the support (top-``k`` holding the token, renormalised) record, as ``(z, y, lq_full,
    lq_support, record)``."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(N, v, generator=gen, dtype=torch.float64) * 2 * peaked
    q = torch.softmax(z + 0.1 * torch.randn(N, v, generator=gen, dtype=torch.float64), dim=1)
    top = torch.topk(q, k, dim=1)
    pick = torch.multinomial(top.values, 1, generator=gen)[:, 0]
    y = top.indices.gather(1, pick[:, None])[:, 0]
    lq_full = torch.log(q.gather(1, y[:, None])[:, 0])
    renorm = top.values / top.values.sum(1, keepdim=True)
    lq_support = torch.log(renorm.gather(1, pick[:, None])[:, 0])
    lp = torch.log(top.values if kind == "head" else renorm)
    return z, y, lq_full.float(), lq_support.float(), op.Candidates(top.indices, lp.float(), kind)


def _run(z, y, lq, rec, **kw):
    return op.policy_loss(z, y, lq, torch.linspace(-1, 1, N), rec, correction=op.Correction(weights="tis",
                          score_centering=True), **kw)


def _silent(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecordWarning)
        return fn()


@pytest.mark.parametrize("layout", ["padded", "csr"])
def test_support_record_labelled_head_warns_once(layout):
    z, y, _, lq_support, rec = _batch(1, kind="support")
    head = op.Candidates(rec.ids, rec.logprobs, "head")
    head = op.CSRCandidates.from_padded(head) if layout == "csr" else head
    with pytest.warns(RecordWarning, match=r"kind='head', but every trained row's sampler log-probabilities sum "
                                           r"to 1 over its 5 to 5 ids.*pass kind='support'"):
        _run(z, y, lq_support, head)
    _silent(lambda: _run(z, y, lq_support, head))  # once per process
    # Labelled right, the same record is silent and gives another loss.
    support = op.Candidates(rec.ids, rec.logprobs, "support")
    support = op.CSRCandidates.from_padded(support) if layout == "csr" else support
    assert _silent(lambda: _run(z, y, lq_support, support)).loss.item() != _run(z, y, lq_support, head).loss.item()


@pytest.mark.parametrize("layout", ["padded", "csr"])
def test_full_vocabulary_lq_with_a_support_record_warns_once(layout):
    z, y, lq_full, lq_support, rec = _batch(2, kind="support")
    rec = op.CSRCandidates.from_padded(rec) if layout == "csr" else rec
    gap = float((lq_support - lq_full).min())
    assert gap > 0.01
    with pytest.warns(RecordWarning, match=r"sampler_logprobs: on 12 of 12 trained rows the sampled token's lq lies "
                                           r"below its own entry in the support record.*full-vocabulary.*Pass the "
                                           r"renormalised log-probability"):
        _run(z, y, lq_full, rec)
    _silent(lambda: _run(z, y, lq_full, rec))  # once per process
    _silent(lambda: _run(z, y, lq_support, rec))


def test_lq_off_its_own_head_entry_warns():
    z, y, lq_full, _, rec = _batch(3, kind="head")
    with pytest.warns(RecordWarning, match="an lq off its own candidate entry"):
        _run(z, y, lq_full - 0.3, rec)


@pytest.mark.parametrize("case", ["head", "support", "peaked head", "whole-vocabulary head", "bf16 head",
                                  "untrained rows off", "csr support"])
def test_correct_batches_stay_silent(case):
    if case == "head":
        z, y, lq, _, rec = _batch(4, kind="head")
    elif case == "support":
        z, y, _, lq, rec = _batch(5, kind="support")
    elif case == "csr support":
        z, y, _, lq, rec = _batch(5, kind="support")
        rec = op.CSRCandidates.from_padded(rec)
    elif case == "peaked head":  # the top ids hold all but ~1e-6 of the mass, for sampler and trainer alike
        z, y, lq, _, rec = _batch(6, kind="head", peaked=15.0)
        mass = torch.exp(rec.logprobs.double()).sum(1)
        assert float((1 - mass).abs().max()) < 1e-3
    elif case == "whole-vocabulary head":  # K = V: sums to one honestly, and the trainer's mass is one too
        z, y, lq, _, rec = _batch(7, kind="head", k=8, v=8)
    elif case == "bf16 head":
        z, y, lq, _, rec = _batch(8, kind="head")
        rec = op.Candidates(rec.ids, rec.logprobs.bfloat16(), "head")
    else:  # placeholders on untrained rows are not read
        z, y, lq, _, rec = _batch(9, kind="head")
        lq = lq.clone()
        lq[:3] = -20.0
        _silent(lambda: _run(z, y, lq, rec, loss_mask=torch.arange(N) >= 3))
        return
    _silent(lambda: _run(z, y, lq, rec))


def test_no_check_without_validation():
    z, y, lq_full, _, rec = _batch(2, kind="support")
    _silent(lambda: _run(z, y, lq_full, rec, validate=False))
    assert math.isfinite(_run(z, y, lq_full, rec, validate=False).loss.item())
