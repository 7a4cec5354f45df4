"""The correction nodes: each node class's fast function against the independent float64 reference
(:mod:`offpolicy.reference`, which shares no code with it), the traits the test kit reads against the spec's
numbers, and what a new weight mode needs (one class, which the keyword constructor, the loss and the kit pick up
through the name -> class map, and its branch in the reference, which refuses a mode it does not know)."""

from __future__ import annotations

import math

import pytest
import torch

import offpolicy as op
from offpolicy.corrections import registry as reg
from offpolicy.corrections.rules import ESTIMATORS, KL_LEVELS
from offpolicy.corrections.weighting import TIS
from offpolicy.corrections.weights import weight_function
from offpolicy.loss.segments import Segments
from offpolicy import reference
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
    cls = reg.WEIGHT_MODES[name]
    kw = {} if bounds == "default" or not cls.bounded else {"bounds": (0.8, 1.25)}
    corr = op.Correction(weights=name, **kw)
    assert isinstance(corr.tree.weighting.mode, cls)
    log_r = _log_ratios()
    fast = weight_function(log_r, corr.tree)
    ref = reference_f(torch.exp(log_r), corr)
    torch.testing.assert_close(fast, ref, rtol=1e-13, atol=0.0)
    assert bool(torch.isfinite(fast).all())


@pytest.mark.parametrize("name", list(reg.WEIGHT_MODES))
def test_weight_mode_traits(name):
    """The traits describe the function: ``masks_outside`` modes are 0 just outside a bound and positive just
    inside; ``ratio_inside`` modes equal r strictly inside; a bounded class's defaults are valid bounds."""
    cls = reg.WEIGHT_MODES[name]
    corr = op.Correction(weights=name)
    if cls.bounded:
        # The spec's defaults (docs/spec.md#weights), as the reference writes them down.
        mode = cls()
        assert (corr.lower, corr.upper) == (mode.lower, mode.upper) == reference.DEFAULT_BOUNDS[name]
    if cls.masks_outside:
        lo, hi = math.log(corr.lower), math.log(corr.upper)
        x = torch.tensor([lo - 1e-9, lo + 1e-9, hi - 1e-9, hi + 1e-9], dtype=torch.float64)
        w = weight_function(x, corr.tree)
        assert w[0] == 0 and w[3] == 0 and w[1] > 0 and w[2] > 0
        assert corr.tree.weighting.mode.jumps()[0].at == (lo, hi)
    else:
        assert corr.tree.weighting.mode.jumps() == ()
    if cls.ratio_inside:
        mid = math.log(max(corr.lower, 0.25)) / 2 + math.log(corr.upper) / 2
        x = torch.tensor([mid], dtype=torch.float64)
        torch.testing.assert_close(weight_function(x, corr.tree), torch.exp(x))


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_estimators_match_reference(name):
    est = ESTIMATORS[name]
    lr = _log_ratios().clamp(-20, 20)
    torch.testing.assert_close(est.fast(lr), reference.kl(torch.exp(lr), name), rtol=1e-9, atol=1e-12)
    if not est.signed:
        assert bool((est.fast(lr) >= 0).all())


@pytest.mark.parametrize("table", ["LEVELS", "KL_LEVELS"])
def test_sequence_reductions_match_reference(table):
    seq = torch.tensor([3, 3, 1, 1, 1, 7, 3, 9])
    active = torch.tensor([True, True, True, False, True, True, True, False])
    seg = Segments.from_ids(seq, active)
    x = torch.randn(8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ref = reference.sequence_log_ratio if table == "LEVELS" else reference.kl_statistic
    if table == "LEVELS":
        entries = [(name, cls().reduce) for name, cls in reg.LEVELS.items() if cls.per_sequence]
    else:
        entries = [(name, fn) for name, fn in KL_LEVELS.items() if fn is not None]
    assert len(entries) >= 2
    for name, fast_of in entries:
        fast = fast_of(x, seg)
        for i, sid in enumerate(torch.unique(seq).tolist()):
            rows = (seq == sid) & active
            if bool(rows.any()):
                torch.testing.assert_close(fast[i], ref(x[rows], name), rtol=1e-13, atol=1e-15)


def test_correction_enumerates_the_classes():
    with pytest.raises(ValueError, match="weights must be one of \\('none', 'tis', 'mis', 'reject'"):
        op.Correction(weights="nope")
    with pytest.raises(ValueError, match="level must be one of"):
        op.Correction(level="nope")
    assert {c.weights for c in every_config()} == set(reg.WEIGHT_MODES)
    corr = op.Correction(weights="mis", veto=0.1, opsm_delta=0.2, kl_rejection=op.KLRejection(1.0, "k2", "seq_max"))
    assert corr.sequence_rules == ("veto", "opsm", "kl") and corr.needs_sequences
    assert [type(r).__name__ for r in corr.tree.rejections] == ["Veto", "OPSM", "KLRejection"]
    assert op.Correction(ppo_clip=(0.2, 0.2)).surrogate.name == "ppo"
    assert isinstance(op.Correction(ppo_clip=(0.2, 0.2)).tree.surrogate, op.corrections.PPO)


class SqrtClip(TIS):
    """A new weight mode for the test: ``sqrt(min(r, C))``, default ``C = 4``."""

    name = "sqrt_clip"
    ratio_inside = False

    def __init__(self, lower: float = 0.0, upper: float = 4.0) -> None:
        super().__init__(lower, upper)

    def fast(self, lr, inside):
        return torch.exp(0.5 * lr.clamp(max=math.log(self.upper)))


def test_one_class_adds_a_weight_mode(monkeypatch):
    """A new weight mode is one class for the fast path: named in the keyword map, the Correction accepts it, the
    loss computes it (here against the formula written in the test) and the test kit's configuration matrix
    includes it. The reference does not read the classes: it refuses the mode until its own branch is written."""
    monkeypatch.setitem(reg.WEIGHT_MODES, SqrtClip.name, SqrtClip)
    corr = op.Correction(weights="sqrt_clip")
    assert corr.tree.weighting.mode == SqrtClip(0.0, 4.0)
    z, y, lq, _ = make_batch(10, 30, 5, "head", seed=2, mismatch=1.0)
    adv = torch.randn(10, generator=torch.Generator().manual_seed(2))
    z1 = z.clone().requires_grad_()
    out = op.policy_loss(z1, y, lq, adv, correction=corr)
    logp_y = torch.log_softmax(z.double(), 1)[torch.arange(10), y]
    expected = torch.sqrt(torch.exp(logp_y - lq.double()).clamp(max=4.0))
    torch.testing.assert_close(out.token_weight.double(), expected, rtol=1e-12, atol=0.0)
    assert "sqrt_clip" in {c.weights for c in every_config()}
    with pytest.raises(ValueError, match="weights='sqrt_clip' is not implemented here"):
        reference_policy_loss(z.clone().requires_grad_(), y, lq, adv, correction=corr)


def test_the_reference_reads_fields_not_the_nodes():
    """The reference takes a plain mapping of the Correction's fields as well as the object, resolves defaults
    itself, and refuses a field it does not implement rather than ignoring it."""
    z, y, lq, _ = make_batch(10, 30, 5, "head", seed=4, mismatch=1.0)
    adv = torch.randn(10, generator=torch.Generator().manual_seed(4))
    seq = torch.arange(10) // 3
    corr = op.Correction(weights="mis", veto=0.2, rejections=(op.RatioRejection(0.3, 3.0, "geometric"),))
    plain = {"weights": "mis", "veto": 0.2,
             "rejections": [{"kind": "ratio", "lower": 0.3, "upper": 3.0, "level": "geometric"}]}
    a = reference_policy_loss(z, y, lq, adv, correction=corr, seq_ids=seq)
    b = reference_policy_loss(z, y, lq, adv, correction=plain, seq_ids=seq)
    for x, x2 in zip(a, b):
        torch.testing.assert_close(x, x2, rtol=0.0, atol=0.0)
    with pytest.raises(ValueError, match="does not implement"):
        reference_policy_loss(z, y, lq, adv, correction={"weights": "mis", "new_switch": 1.0})
    with pytest.raises(ValueError, match="needs seq_ids"):
        reference_policy_loss(z, y, lq, adv, correction={"weights": "mis", "veto": 0.2})


def test_batch_normalize_names_a_class():
    """``batch_normalize`` takes a bool or a normalisation's name; anything else (a string that merely looks
    truthy) is an error, not a silent switch."""
    assert op.Correction(weights="tis", batch_normalize="tokens").batch_normalize == "tokens"
    assert type(op.Correction(weights="tis", batch_normalize=True).tree.normalisation).__name__ == "TokenMean"
    assert type(op.Correction(weights="tis", batch_normalize="sequences").tree.normalisation).__name__ == "SequenceMean"
    for bad in ("no", "yes", 1):
        with pytest.raises(ValueError, match="batch_normalize must be a bool or one of"):
            op.Correction(weights="tis", batch_normalize=bad)
