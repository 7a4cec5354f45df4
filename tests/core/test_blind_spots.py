"""Planted changes the suite did not notice (issue 40), one test per class; each has its mutant in
tools/mutants.toml (the "records and validation (issue 40)" block at its end).

* Rejection bands are inclusive at both ends (docs/spec.md#kl-rejection): a statistic exactly at ``upper`` (or at a
  two-sided band's ends) is kept, through the nodes and through the loss against the float64 reference.
* A weight mode's ``masks_outside`` trait says what its function does: zero just outside a bound. The test kit's
  margins read it (``jumps``), so ``Reject`` losing it would silently drop the kit's care at its bounds.
* CSR validation on untrained rows: what the loss reads on every row (ids in ``[0, V)``, no duplicate, no NaN or
  ``+inf`` log-probability) is refused on any row; what only a trained row's value depends on (log-probabilities
  above 0, support sums, the sampled token inside its support, head mass) is tolerated on untrained rows (post-EOS
  padding holds placeholders), and the loss is then that of the same batch with the row cleaned.
"""

from __future__ import annotations

import math

import pytest
import torch

import offpolicy as op
from offpolicy.corrections import registry as reg
from offpolicy.corrections.rules import KLRejection, RatioRejection
from offpolicy.corrections.weights import weight_function


def _t(*xs):
    return torch.tensor(xs, dtype=torch.float64)


def test_ratio_rejection_band_is_inclusive_at_both_ends():
    node = RatioRejection(0.5, 2.0)
    lo, hi = node.log_band
    keep = node.token_keep(_t(lo, hi, math.nextafter(hi, math.inf), math.nextafter(lo, -math.inf)), 20.0)
    assert keep.tolist() == [True, True, False, False]


@pytest.mark.parametrize("threshold,inside,outside", [
    (0.5, [-0.5, 0.0], [math.nextafter(-0.5, -math.inf)]),  # k1 = -log r <= 0.5: kept at exactly 0.5
    ((-0.25, 0.5), [-0.5, 0.25], [math.nextafter(-0.5, -math.inf), math.nextafter(0.25, math.inf)]),
])
def test_kl_rejection_band_is_inclusive_at_both_ends(threshold, inside, outside):
    node = KLRejection(threshold, estimator="k1")
    assert node.token_keep(_t(*inside), 20.0).tolist() == [True] * len(inside)
    assert node.token_keep(_t(*outside), 20.0).tolist() == [False] * len(outside)


@pytest.mark.parametrize("corr,kept", [
    (op.Correction(rejections=(RatioRejection(0.5, 2.0),)), [True, True, False, True, False]),
    (op.Correction(kl_rejection=KLRejection(math.log(2.0), estimator="k1")), [True, True, True, True, False]),
], ids=["ratio", "kl"])
def test_rejection_at_the_band_edge_through_the_loss(corr, kept):
    """Ratios of exactly 2 and 1/2 (log r = +-log 2 exactly in float64) are kept by the band ``[1/2, 2]``, and
    ``k1 = -log r`` exactly at its threshold ``log 2`` by the KL rejection; ratios just beyond are rejected. A
    token is kept iff the loss has a gradient at it."""
    l2 = math.log(2.0)
    lq = torch.full((5,), -l2, dtype=torch.float64)
    lp = _t(0.0, -l2, 1e-12, -2 * l2, -2 * l2 - 1e-9)
    assert (lp - lq)[[0, 3]].tolist() == [l2, -l2]  # the edges are hit exactly
    leaf = lp.clone().requires_grad_()
    op.policy_loss_from_logprobs(leaf, lq, _t(1.0, -0.5, 2.0, 0.75, 1.5), correction=corr).loss.backward()
    assert (leaf.grad != 0).tolist() == kept


@pytest.mark.parametrize("name", list(reg.WEIGHT_MODES))
def test_masks_outside_trait_matches_the_function(name):
    """A bounded mode whose weight is 0 just beyond its upper bound masks outside its band: it says so
    (``masks_outside``) and reports its bounds as jumps, which the test kit's margins read."""
    cls = reg.WEIGHT_MODES[name]
    if not cls.bounded:
        assert not cls.masks_outside and op.Correction(weights=name).tree.weighting.mode.jumps() == ()
        return
    corr = op.Correction(weights=name)
    hi = math.log(corr.upper)
    zero_beyond = bool(weight_function(_t(hi + 1e-9), corr.tree)[0] == 0)
    assert cls.masks_outside == zero_beyond, (name, cls.masks_outside, zero_beyond)
    jumps = corr.tree.weighting.mode.jumps()
    assert (jumps != ()) == zero_beyond
    assert name != "reject" or (cls.masks_outside and jumps[0].at == (math.log(corr.lower), hi))


# --- CSR validation on untrained rows ----------------------------------------------------------------------------

N, V = 4, 30


def _support_batch():
    """Four support rows of two ids each (the sampled token and the next id), renormalised: 1/2 each; row 2 is
    untrained."""
    gen = torch.Generator().manual_seed(5)
    z = torch.randn(N, V, generator=gen, dtype=torch.float64)
    y = torch.tensor([3, 7, 11, 20])
    ids = torch.stack([y, y + 1], 1).reshape(-1)
    half = math.log(0.5)
    lp = torch.full((2 * N,), half)
    mask = torch.tensor([True, True, False, True])
    return z, y, torch.full((N,), half), ids, lp, mask


def _loss(ids, lp, kind="support"):
    z, y, lq, _, _, mask = _support_batch()
    rec = op.CSRCandidates(ids, torch.arange(0, 2 * N + 1, 2), lp, kind)
    corr = op.Correction(weights="mis", score_centering=True)
    return op.policy_loss(z, y, lq, torch.tensor([1.0, -1.0, 2.0, 0.5]), rec, mask, correction=corr).loss


def _untrained(field, values):
    """The batch's ids and log-probabilities with row 2's two entries (positions 4, 5) replaced."""
    _, _, _, ids, lp, _ = _support_batch()
    x = (ids if field == "ids" else lp).clone()
    x[4:6] = torch.tensor(values, dtype=x.dtype)
    return (x, lp) if field == "ids" else (ids, x)


@pytest.mark.parametrize("field,values,match", [
    ("ids", [V + 3, 12], f"id {V + 3} is out of range for vocabulary size {V}"),
    ("ids", [-2, 12], "id -2 is negative"),
    ("ids", [11, 11], "duplicate id within row 2"),
    ("logprobs", [float("nan"), -0.7], "NaN"),
    ("logprobs", [float("inf"), -0.7], r"\+inf"),
])
def test_csr_junk_the_loss_reads_is_refused_on_untrained_rows(field, values, match):
    with pytest.raises(ValueError, match=match):
        _loss(*_untrained(field, values))


@pytest.mark.parametrize("field,values", [
    ("logprobs", [0.5, 0.5]),            # above 0, and the row sums to e (not renormalised)
    ("logprobs", [-5.0, -6.0]),          # the row sums to 0.009
    ("ids", [12, 13]),                   # the sampled token (11) outside the row's support
])
def test_csr_junk_only_a_trained_row_needs_is_tolerated_on_untrained_rows(field, values):
    """Post-EOS placeholders: validation passes, and the loss is the clean batch's (the row is not trained)."""
    _, _, _, ids, lp, _ = _support_batch()
    assert _loss(*_untrained(field, values)).item() == pytest.approx(_loss(ids, lp).item(), rel=1e-12, abs=1e-15)


def test_csr_head_mass_above_one_is_tolerated_on_untrained_rows_only():
    _, _, _, ids, lp, _ = _support_batch()
    heavy = lp.clone()
    heavy[4:6] = -0.1  # mass 1.8 > 1
    clean = _loss(ids, lp, "head").item()
    assert _loss(ids, heavy, "head").item() == pytest.approx(clean, rel=1e-12, abs=1e-15)
    heavy_trained = lp.clone()
    heavy_trained[0:2] = -0.1
    with pytest.raises(ValueError, match="kind='head' row 0 has sampler mass"):
        _loss(ids, heavy_trained, "head")


@pytest.mark.parametrize("layout", ["padded", "csr"])
def test_bf16_head_holding_the_whole_vocabulary_is_accepted(layout):
    """Found by the CSR fuzz (issue 40): a bf16 head record over the whole vocabulary rounds its mass above
    ``1 + 1e-3`` honestly (bf16 rounds each log-probability by up to ``|l| 2^-8``); head rows get the support rows'
    dtype-aware tolerance, and a head row truly above one is still refused."""
    q = torch.tensor([0.1463, 0.0518, 0.364, 0.0425, 0.2706, 0.1247], dtype=torch.float64)
    q = q / q.sum()
    lp = torch.log(q).bfloat16()
    assert float(torch.exp(lp.double()).sum()) > 1.002
    ids = torch.arange(6)[None]
    y = torch.tensor([2])

    def loss(logprobs):
        rec = op.Candidates(ids, logprobs[None], "head")
        rec = op.CSRCandidates.from_padded(rec) if layout == "csr" else rec
        return op.policy_loss(torch.log(q)[None].float(), y, torch.log(q[2:3]).float(), torch.ones(1), rec)

    assert math.isfinite(loss(lp).loss.item())
    with pytest.raises(ValueError, match="kind='head' row 0 has sampler mass"):
        loss((torch.log(q) + 0.05).bfloat16())
