"""CSR candidate records end to end through the loss (docs/spec.md#record-memory).

The CSR path (``op.CSRCandidates``, read at its ``nnz`` entries) is checked against the padded path and against
the float64 reference (``src/offpolicy/reference.py``, fed the padded record: padding is fine there) on rows of
0, 1, 2 and hundreds of ids mixed; bad records raise naming the argument; and the loss's allocations beyond the
logits' gradient are bounded per recorded id at V = 151,936.
"""

from __future__ import annotations

import zlib

import pytest
import torch

import offpolicy as op
from offpolicy.reference import reference_policy_loss
from offpolicy.testing.memory import LiveBytes

N, V = 14, 700
#: Row sizes: empty, single, pairs, a few, hundreds (an empty support row is untrained).
SIZES = [0, 1, 2, 2, 3, 7, 250, 1, 480, 0, 5, 2, 120, 30]
CORRS = [
    op.Correction(),
    op.Correction(weights="tis"),
    op.Correction(weights="mis", bounds=(0.6, 1.6)),
]


def _csr_batch(kind: str, seed: int, sizes=SIZES, v: int = V, dtype=torch.float64):
    """Logits ``[N, V]``, tokens, ``lq``, a CSR record with the given row sizes and its loss mask.

    Head rows hold the sampler's top ids with full-vocabulary log-probabilities; support rows a random support
    holding the sampled token, the sampler's probabilities renormalised over it."""
    n = len(sizes)
    gen = torch.Generator().manual_seed(seed)
    z = (torch.randn(n, v, generator=gen, dtype=torch.float64) * 2).to(dtype)
    q = torch.softmax(z.double() + torch.randn(n, v, generator=gen, dtype=torch.float64), dim=1)
    ids, lqs, y, lq = [], [], torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.float64)
    for t, k in enumerate(sizes):
        if kind == "head":
            y[t] = torch.multinomial(q[t], 1, generator=gen)[0]
            lq[t] = torch.log(q[t, y[t]])
            top = torch.topk(q[t], k)
            ids.append(top.indices)
            lqs.append(torch.log(top.values))
        else:
            s = torch.randperm(v, generator=gen)[:max(k, 1)]
            ps = q[t, s] / q[t, s].sum()
            pick = torch.multinomial(ps, 1, generator=gen)[0]
            y[t], lq[t] = s[pick], torch.log(ps[pick])
            ids.append(s[:k])
            lqs.append(torch.log(ps)[:k])
    offsets = torch.tensor([0, *sizes]).cumsum(0)
    rec = op.CSRCandidates(torch.cat(ids), offsets, torch.cat(lqs).float(), kind)
    mask = torch.tensor([k > 0 for k in sizes]) if kind == "support" else torch.rand(n, generator=gen) > 0.15
    return z, y, lq.float(), rec, mask


def _loss(z, y, lq, rec, mask, corr, adv, tau, **kw):
    leaf = z.clone().detach().requires_grad_()
    out = op.policy_loss(leaf, y, lq, adv, rec, mask, tau, corr, **kw)
    out.loss.backward()
    return out, leaf.grad


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12))


@pytest.mark.parametrize("kind", ["head", "support"])
@pytest.mark.parametrize("sc", [False, True])
@pytest.mark.parametrize("corr", CORRS, ids=["none", "tis", "mis"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_csr_loss_matches_padded_and_reference(kind, sc, corr, dtype):
    seed = zlib.crc32(repr((kind, sc, corr, dtype)).encode())
    z, y, lq, rec, mask = _csr_batch(kind, seed, dtype=dtype)
    corr = op.Correction(weights=corr.weights, bounds=corr.bounds, score_centering=sc)
    gen = torch.Generator().manual_seed(seed + 1)
    adv, tau = torch.randn(N, generator=gen), torch.rand(N, generator=gen, dtype=torch.float64) + 0.5
    out, g = _loss(z, y, lq, rec, mask, corr, adv, tau)
    assert g.dtype == dtype and g.layout == torch.strided
    pad, g_pad = _loss(z, y, lq, rec.to_padded(), mask, corr, adv, tau)
    z64 = z.double().clone().requires_grad_()
    ref, ref_tl, _ = reference_policy_loss(z64, y, lq, adv, rec.to_padded(), mask, tau, corr)
    ref.backward()
    # float64: the CSR sums differ from the padded ones only in association; fp32: statistics in fp32.
    tol_pad, tol_loss, tol_grad = (1e-12, 1e-12, 1e-10) if dtype == torch.float64 else (2e-6, 2e-5, 2e-5)
    assert abs(out.loss.item() - pad.loss.item()) <= tol_pad * max(1.0, abs(pad.loss.item()))
    assert _rel(g, g_pad) <= tol_pad * 10
    assert abs(out.loss.item() - ref.item()) <= tol_loss * max(1.0, abs(ref.item()))
    torch.testing.assert_close(out.token_loss.double(), ref_tl, rtol=tol_loss, atol=tol_loss)
    assert _rel(g, z64.grad) <= tol_grad
    for key, val in pad.metrics.items():
        assert abs(float(out.metrics[key]) - float(val)) <= 1e-5 * max(1.0, abs(float(val))), key


@pytest.mark.parametrize("kind", ["head", "support"])
def test_csr_from_logprobs_matches_padded(kind):
    z, y, lq, rec, mask = _csr_batch(kind, 5)
    corr = op.Correction(weights="mis", score_centering=True)
    adv = torch.randn(N, generator=torch.Generator().manual_seed(6))
    pad = rec.to_padded()
    outs = []
    for r in (rec, pad):
        zz = z.clone().requires_grad_()
        logp = torch.log_softmax(zz, dim=1)
        if kind == "support":
            # Mask replay: renormalise over each row's support (the caller's log-softmax does the masking).
            keep = torch.zeros_like(logp, dtype=torch.bool).scatter_(1, pad.ids.clamp_min(0), pad.ids >= 0)
            logp = torch.log_softmax(zz.masked_fill(~keep, -float("inf")), dim=1)
            logp = torch.where(mask[:, None], logp, torch.zeros_like(logp))
        cand = logp[r.row_index(), r.ids] if r is rec else logp.gather(1, pad.ids.clamp_min(0))
        out = op.policy_loss_from_logprobs(logp.gather(1, y[:, None])[:, 0], lq, adv, r, cand, mask, corr)
        out.loss.backward()
        outs.append((out, zz.grad))
    (a, ga), (b, gb) = outs
    assert abs(a.loss.item() - b.loss.item()) <= 1e-12 * max(1.0, abs(b.loss.item()))
    assert _rel(ga, gb) <= 1e-11
    assert float(a.metrics["support_size"]) == float(b.metrics["support_size"])


@pytest.mark.parametrize("kind", ["head", "support"])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-11), (torch.float32, 2e-5)])
def test_csr_hidden_state_input_matches_padded(kind, dtype, tol):
    z, y, lq, rec, mask = _csr_batch(kind, 11, sizes=SIZES[:9], v=600)
    n, d = z.shape[0], 24
    gen = torch.Generator().manual_seed(12)
    h, w, b = (torch.randn(n, d, generator=gen, dtype=dtype), torch.randn(600, d, generator=gen, dtype=dtype) * 0.3,
               torch.randn(600, generator=gen, dtype=dtype))
    corr = op.Correction(weights="tis", score_centering=True)
    adv = torch.randn(n, generator=gen)
    grads = []
    for r in (rec, rec.to_padded()):
        leaves = [t.clone().requires_grad_() for t in (h, w, b)]
        out = op.policy_loss(None, y, lq, adv, r, mask, 0.8, corr, hidden=leaves[0], weight=leaves[1],
                             bias=leaves[2])
        out.loss.backward()
        grads.append([out.loss.detach()[None]] + [t.grad for t in leaves])
    for got, want in zip(*grads):
        assert got.layout == torch.strided
        assert _rel(got, want) <= tol


def test_hostile_rows():
    """A row the trainer gives probability 0 at its sampled token (a -inf logit) and huge logits keep the
    padded path's values, with finite gradients."""
    z, y, lq, rec, mask = _csr_batch("head", 21)
    z = z.clone()
    z[2, y[2]] = -float("inf")
    z[6] *= 40.0
    corr = op.Correction(weights="mis", score_centering=True)
    adv = torch.randn(N, generator=torch.Generator().manual_seed(22))
    out, g = _loss(z, y, lq, rec, torch.ones(N, dtype=torch.bool), corr, adv, 1.0)
    pad, g_pad = _loss(z, y, lq, rec.to_padded(), torch.ones(N, dtype=torch.bool), corr, adv, 1.0)
    assert bool(torch.isfinite(g).all())
    assert abs(out.loss.item() - pad.loss.item()) <= 1e-12 * max(1.0, abs(pad.loss.item()))
    assert _rel(g, g_pad) <= 1e-11
    assert float(out.metrics["zero_prob_frac"]) > 0


def test_all_rows_masked_and_single_token():
    z, y, lq, rec, _ = _csr_batch("support", 31, sizes=[3])
    out, g = _loss(z, y, lq, rec, torch.zeros(1, dtype=torch.bool), op.Correction(score_centering=True),
                   torch.ones(1), 1.0)
    assert out.loss.item() == 0.0 and bool((g == 0).all())
    out, g = _loss(z, y, lq, rec, None, op.Correction(score_centering=True), torch.ones(1), 1.0)
    pad, g_pad = _loss(z, y, lq, rec.to_padded(), None, op.Correction(score_centering=True), torch.ones(1), 1.0)
    assert abs(out.loss.item() - pad.loss.item()) <= 1e-12 and _rel(g, g_pad) <= 1e-12


def test_round_trip_through_padded():
    _, _, _, rec, _ = _csr_batch("head", 41)
    back = op.CSRCandidates.from_padded(rec.to_padded())
    assert torch.equal(back.ids, rec.ids) and torch.equal(back.offsets, rec.offsets)
    assert torch.equal(back.logprobs, rec.logprobs) and back.kind == rec.kind
    assert torch.equal(rec.lengths, torch.tensor(SIZES))


def _bad(kind="support", **change):
    z, y, lq, rec, mask = _csr_batch(kind, 51, sizes=[2, 3, 1, 4], v=50)
    fields = dict(ids=rec.ids, offsets=rec.offsets, logprobs=rec.logprobs, kind=rec.kind)
    fields.update(change)
    return z, y, lq, fields, mask


@pytest.mark.parametrize("change,match", [
    (dict(offsets=torch.tensor([1, 2, 5, 6, 10])), "candidates.offsets must start at 0 and end at nnz"),
    (dict(offsets=torch.tensor([0, 2, 5, 6, 9])), "candidates.offsets must start at 0 and end at nnz = 10"),
    (dict(offsets=torch.tensor([0, 4, 3, 6, 10])), r"non-decreasing; offsets\[2\] < offsets\[1\]"),
    (dict(offsets=torch.tensor([0, 5, 10])), "expected 4 rows"),
    (dict(ids=torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 50])), "id 50 is out of range for vocabulary size 50"),
    (dict(ids=torch.tensor([0, 1, 2, 3, -1, 5, 6, 7, 8, 9])), "id -1 is negative"),
    (dict(logprobs=torch.full((10,), float("nan"))), "candidates.logprobs: NaN"),
    (dict(logprobs=torch.full((10,), -0.1)), "row 0 sums to"),
])
def test_bad_csr_record_raises_naming_the_field(change, match):
    """Bad offsets are refused where the record is built (issue 40), the other values at the loss's boundary."""
    z, y, lq, fields, mask = _bad(**change)
    with pytest.raises(ValueError, match=match):
        op.policy_loss(z, y, lq, torch.ones(4), op.CSRCandidates(**fields), mask)


def test_duplicate_and_outside_support_and_empty_trained_row():
    z, y, lq, fields, mask = _bad()
    ids = fields["ids"].clone()
    ids[3] = ids[2]  # row 1 holds positions 2..4
    with pytest.raises(ValueError, match="duplicate id within row 1"):
        op.policy_loss(z, y, lq, torch.ones(4), op.CSRCandidates(**{**fields, "ids": ids}), mask)
    y2 = y.clone()
    y2[3] = int(torch.tensor([v for v in range(50) if v not in fields["ids"][6:10].tolist()][0]))
    with pytest.raises(ValueError, match="sampled token of row 3"):
        op.policy_loss(z, y2, lq, torch.ones(4), op.CSRCandidates(**fields), mask)
    z, y, lq, rec, _ = _csr_batch("support", 52, sizes=[2, 0, 1], v=50)
    with pytest.raises(ValueError, match="kind='support' row 1 is empty but its token is trained"):
        op.policy_loss(z, y, lq, torch.ones(3), rec)


@pytest.mark.parametrize("path", ["bitmap", "bitmap-chunked", "sort"])
def test_validate_duplicate_and_token_checks_agree_on_both_paths(path, monkeypatch):
    """The duplicate-id and token-in-support checks of ``CSRCandidates.validate`` by the row bitmap (dense records;
    also in chunks of 3 rows) and by the sort (sparse ones) give the same verdicts: a valid record with rows of
    0, 1, V - 1 and V ids passes; an id repeated in the last row, and a token outside row 2's support, raise
    naming the row."""
    from offpolicy.records import csr_candidates as cc

    monkeypatch.setattr(cc, "DENSE_CHECK_RATIO", 0 if path == "sort" else 10 ** 9)
    if path == "bitmap-chunked":
        monkeypatch.setattr(cc, "CHECK_CHUNK_BYTES", 3 * 50)
    sizes = [2, 0, 49, 1, 50, 3, 50]
    z, y, lq, rec, mask = _csr_batch("support", 81, sizes=sizes, v=50)
    rec.validate(50, len(sizes), y, mask)
    ids = rec.ids.clone()
    ids[-1] = ids[-2]
    with pytest.raises(ValueError, match="duplicate id within row 6"):
        op.CSRCandidates(ids, rec.offsets, rec.logprobs, "support").validate(50, len(sizes), y, mask)
    y2 = y.clone()
    row2 = set(rec.ids[2:51].tolist())
    y2[2] = next(v for v in range(50) if v not in row2)
    with pytest.raises(ValueError, match="sampled token of row 2"):
        rec.validate(50, len(sizes), y2, mask)


@pytest.mark.parametrize("make,exc,match", [
    (lambda r: op.CSRCandidates(r.ids[:, None], r.offsets, r.logprobs), ValueError, "CSRCandidates.ids must be 1-D"),
    (lambda r: op.CSRCandidates(r.ids.float(), r.offsets, r.logprobs), TypeError, "ids must be int32 or int64"),
    (lambda r: op.CSRCandidates(r.ids, r.offsets.float(), r.logprobs), TypeError, "offsets must be int32"),
    (lambda r: op.CSRCandidates(r.ids, r.offsets, r.logprobs[1:]), ValueError, "logprobs must have the shape"),
    (lambda r: op.CSRCandidates(r.ids, r.offsets[:0], r.logprobs), ValueError, "offsets must hold N \\+ 1"),
    (lambda r: op.CSRCandidates(r.ids, r.offsets, r.logprobs, "top"), ValueError, "kind must be one of"),
])
def test_bad_csr_construction(make, exc, match):
    _, _, _, rec, _ = _csr_batch("head", 61, sizes=[2, 1])
    with pytest.raises(exc, match=match):
        make(rec)


def test_candidate_logprobs_shape_for_csr():
    z, y, lq, rec, mask = _csr_batch("head", 71, sizes=[2, 3])
    lp = torch.log_softmax(z, 1)
    with pytest.raises(ValueError, match=r"candidate_logprobs must be \[nnz\] = \[5\]"):
        op.policy_loss_from_logprobs(lp.gather(1, y[:, None])[:, 0], lq, torch.ones(2), rec,
                                     lp.gather(1, rec.to_padded().ids.clamp_min(0)), correction=op.Correction(score_centering=True))


#: docs/spec.md#record-memory: the CSR loss allocates at most this many bytes per recorded id (plus per row)
#: beyond the logits' gradient, over forward and backward.
BYTES_PER_ID, BYTES_PER_ROW = 64, 1024


@pytest.mark.parametrize("kind", ["head", "support"])
def test_csr_memory_bound_at_a_real_vocabulary(kind, monkeypatch):
    monkeypatch.setenv("OFFPOLICY_REUSE_GRAD", "0")  # a fresh gradient buffer, counted like any allocation
    v, n = 151_936, 64
    gen = torch.Generator().manual_seed(81)
    sizes = torch.randint(2, 40, (n,), generator=gen)
    sizes[::16] = 3000
    sizes[5] = 300
    z, y, lq, rec, _ = _csr_batch(kind, 82, sizes=sizes.tolist(), v=v, dtype=torch.float32)
    mask = torch.ones(n, dtype=torch.bool)
    corr = op.Correction(weights="mis", score_centering=True)
    adv = torch.randn(n, generator=gen)
    peaks = {}
    for name, r in (("csr", rec), ("padded", rec.to_padded())):
        leaf = z.clone().requires_grad_()
        meter = LiveBytes()
        with meter:
            op.policy_loss(leaf, y, lq, adv, r, mask, 1.0, corr).loss.backward()
        peaks[name] = meter.peak - leaf.numel() * 4  # beyond the gradient itself
        del leaf
    bound = BYTES_PER_ID * rec.nnz + BYTES_PER_ROW * n
    padded_record = n * int(sizes.max()) * 12
    assert peaks["csr"] <= bound, (peaks, rec.nnz)
    # Below the padded record itself (12 bytes per [N, K_max] slot) and far below the padded path's loss.
    assert peaks["csr"] * 2 < padded_record < peaks["padded"], (peaks, padded_record)
    assert peaks["csr"] * 6 < peaks["padded"], peaks


def test_take_rows_and_cat():
    _, _, _, rec, _ = _csr_batch("head", 91, sizes=[3, 0, 2, 5])
    pad = rec.to_padded()
    idx = torch.tensor([3, 0, 0, 1])
    got = rec.take_rows(idx).to_padded(width=pad.width)
    assert torch.equal(got.ids, pad.ids[idx]) and torch.equal(got.logprobs, pad.logprobs[idx])
    both = op.CSRCandidates.cat([rec, rec.take_rows(torch.tensor([2]))])
    assert torch.equal(both.lengths, torch.tensor([3, 0, 2, 5, 2]))
    assert torch.equal(both.ids[-2:], rec.ids[3:5])
    with pytest.raises(ValueError, match="records of different kinds"):
        op.CSRCandidates.cat([rec, op.CSRCandidates(rec.ids, rec.offsets, rec.logprobs, "support")])


def test_csr_inplace_grad_and_non_contiguous_logits():
    z, y, lq, rec, mask = _csr_batch("head", 92, dtype=torch.float32)
    corr = op.Correction(weights="mis", score_centering=True)
    adv = torch.randn(N, generator=torch.Generator().manual_seed(93))
    want, g_want = _loss(z, y, lq, rec.to_padded(), mask, corr, adv, 1.0)
    leaf = z.clone().requires_grad_()
    buf = leaf * 1.0  # a non-leaf the backward may overwrite
    op.policy_loss(buf, y, lq, adv, rec, mask, 1.0, corr, inplace_grad=True).loss.backward()
    assert _rel(leaf.grad, g_want) <= 2e-6
    wide = torch.cat([z, torch.randn(N, 3, dtype=z.dtype)], dim=1).requires_grad_()
    out = op.policy_loss(wide[:, :V], y, lq, adv, rec, mask, 1.0, corr)
    out.loss.backward()
    assert abs(out.loss.item() - want.loss.item()) <= 1e-6 and _rel(wide.grad[:, :V], g_want) <= 2e-6
    assert bool((wide.grad[:, V:] == 0).all())


@pytest.mark.parametrize("kind", ["head", "support"])
def test_csr_bf16_logits_match_padded(kind):
    """bf16 logits: statistics in fp32 on both paths; the CSR gradient rounds each entry once more (the entries'
    part is added into the bf16 gradient), within bf16's resolution."""
    z, y, lq, rec, mask = _csr_batch(kind, 101, dtype=torch.bfloat16)
    corr = op.Correction(weights="mis", score_centering=True)
    adv = torch.randn(N, generator=torch.Generator().manual_seed(102))
    out, g = _loss(z, y, lq, rec, mask, corr, adv, 0.9)
    pad, g_pad = _loss(z, y, lq, rec.to_padded(), mask, corr, adv, 0.9)
    assert g.dtype == torch.bfloat16
    assert abs(out.loss.item() - pad.loss.item()) <= 1e-5 * max(1.0, abs(pad.loss.item()))
    assert _rel(g, g_pad) <= 1e-2


@pytest.mark.parametrize("kind", ["head", "support"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_csr_broken_logit_in_a_trained_row_raises(kind, bad):
    z, y, lq, rec, mask = _csr_batch(kind, 111)
    z = z.clone()
    z[3, rec.ids[int(rec.offsets[3])]] = bad  # an entry of row 3's record (trained, 2 ids)
    with pytest.raises(ValueError, match="logits: NaN or \\+inf in row 3"):
        op.policy_loss(z, y, lq, torch.ones(N), rec, mask)
    z[3] = 1e38  # finite, but z / tau overflows fp32
    with pytest.raises(ValueError, match="overflows"):
        op.policy_loss(z.float(), y, lq, torch.ones(N), rec, mask, temperature=0.01)
