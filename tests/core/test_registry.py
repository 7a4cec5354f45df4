"""The correction registry: each entry's fast function against its own float64 reference, the traits the test
kit reads, and that one new entry is all a new weight mode needs (the loss, the reference and the kit pick it up)."""

from __future__ import annotations

import math

import pytest
import torch

import offpolicy as op
from offpolicy.corrections import registry as reg
from offpolicy.corrections.weights import weight_function
from offpolicy.loss.segments import Segments
from offpolicy.reference import f as reference_f
from offpolicy.reference import reference_policy_loss
from offpolicy.testing import every_config

from support.batches import make_batch


def _log_ratios() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    edges = [0.0, math.log(0.5), math.log(2.0), math.log(5.0), -math.inf, math.inf, -30.0, 30.0]
    return torch.cat([torch.tensor(edges, dtype=torch.float64), 3 * torch.randn(200, generator=gen,
                                                                               dtype=torch.float64)])


@pytest.mark.parametrize("name", list(reg.WEIGHT_MODES))
@pytest.mark.parametrize("bounds", ["default", "narrow"])
def test_weight_mode_fast_matches_reference(name, bounds):
    mode = reg.WEIGHT_MODES[name]
    kw = {} if bounds == "default" or not mode.bounded else {"bounds": (0.8, 1.25)}
    corr = op.Correction(weights=name, **kw)
    log_r = _log_ratios()
    fast = weight_function(log_r, corr)
    ref = reference_f(torch.exp(log_r), corr)
    torch.testing.assert_close(fast, ref, rtol=1e-13, atol=0.0)
    assert bool(torch.isfinite(fast).all())


@pytest.mark.parametrize("name", list(reg.WEIGHT_MODES))
def test_weight_mode_traits(name):
    """The traits describe the function: ``masks_outside`` modes are 0 just outside a bound and positive just
    inside; ``ratio_inside`` modes equal r strictly inside; ``default_bounds`` are valid Correction bounds."""
    mode = reg.WEIGHT_MODES[name]
    corr = op.Correction(weights=name)
    if mode.bounded:
        assert (corr.lower, corr.upper) == mode.default_bounds
    if mode.masks_outside:
        lo, hi = math.log(corr.lower), math.log(corr.upper)
        x = torch.tensor([lo - 1e-9, lo + 1e-9, hi - 1e-9, hi + 1e-9], dtype=torch.float64)
        w = weight_function(x, corr)
        assert w[0] == 0 and w[3] == 0 and w[1] > 0 and w[2] > 0
    if mode.ratio_inside:
        mid = math.log(max(corr.lower, 0.25)) / 2 + math.log(corr.upper) / 2
        x = torch.tensor([mid], dtype=torch.float64)
        torch.testing.assert_close(weight_function(x, corr), torch.exp(x))


@pytest.mark.parametrize("name", list(reg.ESTIMATORS))
def test_estimators_match_reference(name):
    est = reg.ESTIMATORS[name]
    lr = _log_ratios().clamp(-20, 20)
    torch.testing.assert_close(est.fast(lr), est.reference(torch.exp(lr)), rtol=1e-9, atol=1e-12)
    if not est.signed:
        assert bool((est.fast(lr) >= 0).all())


@pytest.mark.parametrize("table", ["LEVELS", "KL_LEVELS"])
def test_sequence_reductions_match_reference(table):
    seq = torch.tensor([3, 3, 1, 1, 1, 7, 3, 9])
    active = torch.tensor([True, True, True, False, True, True, True, False])
    seg = Segments.from_ids(seq, active)
    x = torch.randn(8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    for entry in getattr(reg, table).values():
        if not entry.per_sequence:
            continue
        fast = entry.fast(x, seg)
        for i, sid in enumerate(torch.unique(seq).tolist()):
            rows = (seq == sid) & active
            if bool(rows.any()):
                torch.testing.assert_close(fast[i], entry.reference(x[rows]), rtol=1e-13, atol=1e-15)


def test_correction_enumerates_the_registry():
    with pytest.raises(ValueError, match="weights must be one of \\('none', 'tis', 'mis', 'reject'"):
        op.Correction(weights="nope")
    with pytest.raises(ValueError, match="level must be one of"):
        op.Correction(level="nope")
    assert {c.weights for c in every_config()} == set(reg.WEIGHT_MODES)
    corr = op.Correction(weights="mis", veto=0.1, opsm_delta=0.2, kl_rejection=op.KLRejection(1.0, "k2", "seq_max"))
    assert corr.sequence_rules == ("veto", "opsm", "kl") and corr.needs_sequences
    assert op.Correction(ppo_clip=(0.2, 0.2)).surrogate.name == "ppo"


def test_one_entry_adds_a_weight_mode(monkeypatch):
    """A new weight mode is one registry entry: the Correction accepts it, the loss and the reference compute it,
    and the test kit's configuration matrix includes it."""
    entry = reg.WeightMode(
        "sqrt_clip",
        fast=lambda lr, inside, lo, hi: torch.exp(0.5 * lr.clamp(max=math.log(hi))),
        reference=lambda r, inside, lo, hi: torch.sqrt(torch.minimum(r, torch.full_like(r, hi))),
        default_bounds=(0.0, 4.0), scalar_bound=True,
    )
    monkeypatch.setitem(reg.WEIGHT_MODES, entry.name, entry)
    corr = op.Correction(weights="sqrt_clip", score_centering=True)
    z, y, lq, cands = make_batch(10, 30, 5, "head", seed=2, mismatch=1.0)
    adv = torch.randn(10, generator=torch.Generator().manual_seed(2))
    z1 = z.clone().requires_grad_()
    z2 = z.clone().requires_grad_()
    out = op.policy_loss(z1, y, lq, adv, cands, correction=corr)
    ref, _, ref_w = reference_policy_loss(z2, y, lq, adv, cands, correction=corr)
    out.loss.backward()
    ref.backward()
    torch.testing.assert_close(out.token_weight, ref_w, rtol=1e-12, atol=0.0)
    assert abs(out.loss.item() - ref.item()) <= 1e-10 * max(1.0, abs(ref.item()))
    torch.testing.assert_close(z1.grad, z2.grad, rtol=1e-9, atol=1e-11)
    assert "sqrt_clip" in {c.weights for c in every_config()}


def test_batch_normalize_names_a_registry_entry():
    """``batch_normalize`` takes a bool or a normalisation's name; anything else (a string that merely looks
    truthy) is an error, not a silent switch."""
    assert op.Correction(weights="tis", batch_normalize="tokens").batch_normalize == "tokens"
    for bad in ("no", "yes", 1):
        with pytest.raises(ValueError, match="batch_normalize must be a bool or one of"):
            op.Correction(weights="tis", batch_normalize=bad)
