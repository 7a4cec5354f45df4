"""op.TrustRegion (docs/spec.md#trust-region) against the float64 reference's own block, hostile values and bad
input.

Tolerances: float64 logits run the fast path in float64; loss to 1e-12 and gradient to 1e-10 relative (summation
order only), weights exactly where the reference's mask and the fast mask agree (asserted: the same tokens masked), the
masked fraction exactly and the penalty metric to 1e-12.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

import offpolicy as op
from offpolicy.corrections.trust_region import binary_kl
from offpolicy.reference import reference_metrics, reference_policy_loss

N, V = 24, 7
TR = op.TrustRegion
CASES = {
    "dppo_tv": (op.Correction(trust_region=TR(0.05, 0.08)), False),
    "dppo_tv_decoupled_tis": (op.Correction(weights="tis", bounds=3.0, trust_region=TR(0.05, 0.08)), True),
    "dppo_kl": (op.Correction(trust_region=TR(0.01, 0.02, divergence="binary_kl")), False),
    "dppo_kl_cispo": (op.Correction(cispo=(0.0, 2.0), trust_region=TR(0.01, 0.02, divergence="binary_kl")), True),
    "prime_default": (op.Correction(trust_region=TR(0.05, 0.05, penalty=0.01)), False),
    "ipo": (op.Correction(trust_region=TR(0.05, 0.05, sign="none", penalty=0.1)), False),
    "kpop_weights_ppo": (op.Correction(ppo_clip=(0.2, 0.3), rejected_in_normalizer=False,
                                       trust_region=TR(0.02, 0.02, "binary_kl_max", sign="none", on="weights")),
                         True),
    "roll_token": (op.Correction(ppo_clip=(0.2, 0.2), trust_region=TR(0.05, 0.1, sign="none", on="weights")), True),
    "roll_sequence": (op.Correction(ppo_clip=(0.2, 0.2), trust_region=TR(0.4, 0.4, sign="none", level="sequence",
                                                                         on="weights")), True),
    "roll_geometric": (op.Correction(weights="mis", bounds=(0.2, 5.0), rejected_in_normalizer=False,
                                     trust_region=TR(0.02, 0.06, sign="none", level="geometric", on="weights")),
                       False),
    "update_with_ppo": (op.Correction(ppo_clip=(0.2, 0.2), trust_region=TR(0.05, 0.05, penalty=0.05)), True),
    # AReaL's sequence-level KPop: the sum / mean / max of D = max of both binary KLs over a sequence's tokens.
    "kpop_sequence_sum": (op.Correction(ppo_clip=(0.2, 0.2), rejected_in_normalizer=False,
                                        trust_region=TR(0.8, 0.8, "binary_kl_max", sign="none", level="sequence",
                                                        on="weights")), True),
    "kpop_sequence_mean": (op.Correction(ppo_clip=(0.2, 0.2), trust_region=TR(
        0.2, 0.2, "binary_kl_max", sign="none", level="geometric", on="weights")), True),
    "kpop_sequence_max": (op.Correction(ppo_clip=(0.2, 0.2), rejected_in_normalizer=False, trust_region=TR(
        0.4, 0.4, "binary_kl_max", sign="none", level="sequence_max", on="weights")), True),
    "tv_sequence_max_update": (op.Correction(trust_region=TR(0.1, 0.3, sign="none", level="sequence_max")), False),
}
AGGS = ["token_mean", "seq_mean_token_mean"]


def _batch(seed: int, n: int = N, drift: float = 1.0, step: float = 0.8):
    """Peaked logits (so that probabilities, not only ratios, move), a sampler ``drift`` away and a proximal
    policy ``step`` away from the trainer; five sequences, a few untrained tokens."""
    g = torch.Generator().manual_seed(seed)
    z = 3.0 * torch.randn(n, V, generator=g, dtype=torch.float64)
    y = torch.multinomial(torch.softmax(z, -1), 1, generator=g)[:, 0]
    zq = z + drift * torch.randn(n, V, generator=g, dtype=torch.float64)
    zp = z + step * torch.randn(n, V, generator=g, dtype=torch.float64)
    rows = torch.arange(n)
    lq = torch.log_softmax(zq, -1)[rows, y]
    prox = torch.log_softmax(zp, -1)[rows, y]
    seq = torch.randint(0, 5, (n,), generator=g).sort().values
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.rand(n, generator=g) > 0.15
    return z, y, lq, prox, adv, mask, seq


def _run(z, y, lq, prox, adv, mask, seq, corr, decoupled, agg):
    kw = dict(seq_ids=seq, aggregation=agg, proximal_logprobs=prox if decoupled else None)
    z1, z2 = z.clone().requires_grad_(), z.clone().requires_grad_()
    out = op.policy_loss(z1, y, lq, adv, None, mask, 1.0, corr, **kw)
    ref, _, ref_w = reference_policy_loss(z2, y, lq, adv, None, mask, 1.0, corr, **kw)
    out.loss.backward()
    ref.backward()
    metrics = reference_metrics(z.detach(), y, lq, adv, None, mask, 1.0, corr, seq_ids=seq,
                                proximal_logprobs=kw["proximal_logprobs"])
    return out, z1.grad, ref, ref_w, z2.grad, metrics


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("agg", AGGS)
def test_matches_reference_float64(name, agg):
    corr, decoupled = CASES[name]
    x = _batch(zlib.crc32(f"{name}/{agg}".encode()))
    out, g, ref, ref_w, g_ref, metrics = _run(*x, corr, decoupled, agg)
    frac = float(out.metrics["trust_region_masked_frac"])
    assert 0.0 < frac < 1.0, f"{name}: the trust region must bite on some tokens and not all (frac={frac})"
    assert frac == metrics["trust_region_masked_frac"]
    assert torch.equal(out.token_weight == 0, ref_w == 0)
    assert torch.allclose(out.token_weight, ref_w, rtol=1e-12, atol=0)
    l_fast, l_ref = float(out.loss.detach()), float(ref.detach())
    assert abs(l_fast - l_ref) <= 1e-12 * max(abs(l_ref), 1e-12)
    assert _rel(g, g_ref) < 1e-10
    if corr.trust_region.penalty:
        assert math.isclose(float(out.metrics["trust_region_penalty"]), metrics["trust_region_penalty"],
                            rel_tol=1e-12)


def test_surrogate_selection():
    assert op.Correction(trust_region=TR(0.2, 0.2)).surrogate.name == "trust_region"
    assert op.Correction(trust_region=TR(0.2, 0.2, on="weights")).surrogate.name == "score_function"
    assert op.Correction(cispo=(0, 5), trust_region=TR(0.2, 0.2)).surrogate.name == "cispo"
    assert op.Correction(ppo_clip=(0.2, 0.2), trust_region=TR(0.2, 0.2)).surrogate.name == "ppo"


def test_binary_kl_matches_its_formula_and_its_limits():
    a = torch.tensor([0.3, 0.9, 1e-9, 0.5, 0.0, 1.0, 0.4, 0.7], dtype=torch.float64)
    b = torch.tensor([0.6, 0.2, 0.3, 0.5, 0.4, 0.3, 1.0, 0.0], dtype=torch.float64)
    got = binary_kl(a.log(), b.log())
    for ai, bi, k in zip(a.tolist(), b.tolist(), got.tolist()):
        head = 0.0 if ai == 0 else (math.inf if bi == 0 else ai * math.log(ai / bi))
        tail = 0.0 if ai == 1 else (math.inf if bi == 1 else (1 - ai) * math.log((1 - ai) / (1 - bi)))
        want = head + tail
        assert (k == want) if math.isinf(want) else math.isclose(k, want, rel_tol=1e-12, abs_tol=1e-300)


@pytest.mark.parametrize("divergence", ["difference", "binary_kl", "binary_kl_max"])
def test_hostile_values_stay_finite(divergence):
    """Near-certain tokens (p = 1 - 1e-12), probabilities of e-40, a sampler at log q = -60 (ratio beyond the
    clamp), a single token and an all-masked batch."""
    lp = torch.tensor([-1e-12, -40.0, -0.5, -3.0, -1e-6], dtype=torch.float64, requires_grad=True)
    lq = torch.tensor([-0.7, -60.0, -1e-12, -1.0, -30.0], dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0, 0.5, -1.0, 3.0], dtype=torch.float64)
    corr = op.Correction(trust_region=TR(0.01, 0.01, divergence=divergence, penalty=0.1))
    out = op.policy_loss_from_logprobs(lp, lq, adv, correction=corr)
    out.loss.backward()
    assert math.isfinite(float(out.loss.detach())) and bool(torch.isfinite(lp.grad).all())
    one = op.policy_loss_from_logprobs(lp[:1].detach(), lq[:1], adv[:1], correction=corr)
    assert math.isfinite(float(one.loss))
    none = torch.zeros(5, dtype=torch.bool)
    lp2 = lp.detach().clone().requires_grad_()
    empty = op.policy_loss_from_logprobs(lp2, lq, adv, loss_mask=none, correction=corr)
    empty.loss.backward()
    assert float(empty.loss.detach()) == 0.0 and bool((lp2.grad == 0).all())
    assert float(empty.metrics["trust_region_masked_frac"]) == 0.0


@pytest.mark.parametrize("level", ["sequence", "geometric", "sequence_max"])
def test_sequence_levels_hostile_values(level):
    """KPop per sequence: a near-certain token and a sampler at log q = -60 (divergences of about 1e1), a
    single-token sequence, a sequence without trained tokens (untrained tokens take no part) and an all-masked
    batch."""
    lp = torch.tensor([-1e-12, -40.0, -0.5, -3.0, -1e-6, -0.2], dtype=torch.float64, requires_grad=True)
    lq = torch.tensor([-0.7, -60.0, -0.52, -1e-12, -30.0, -1e-12], dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0, 0.5, -1.0, 3.0, 1.0], dtype=torch.float64)
    seq = torch.tensor([0, 0, 1, 1, 2, 3])
    mask = torch.tensor([True, True, True, False, True, False])
    corr = op.Correction(trust_region=TR(0.05, 0.05, "binary_kl_max", sign="none", level=level))
    out = op.policy_loss_from_logprobs(lp, lq, adv, loss_mask=mask, seq_ids=seq, correction=corr)
    out.loss.backward()
    assert math.isfinite(float(out.loss.detach())) and bool(torch.isfinite(lp.grad).all())
    assert torch.equal(out.token_weight[mask] != 0, torch.tensor([False, False, True, False]))
    assert float(out.metrics["trust_region_masked_frac"]) == 0.75
    empty = op.policy_loss_from_logprobs(lp.detach(), lq, adv, loss_mask=torch.zeros(6, dtype=torch.bool),
                                         seq_ids=seq, correction=corr)
    assert float(empty.loss) == 0.0 and float(empty.metrics["trust_region_masked_frac"]) == 0.0


def test_every_token_masked_leaves_only_the_penalty():
    lp = torch.tensor([-0.1, -0.2, -3.0], dtype=torch.float64, requires_grad=True)
    lq = torch.tensor([-2.0, -2.5, -0.1], dtype=torch.float64)
    adv = torch.tensor([1.0, 2.0, -1.0], dtype=torch.float64)
    corr = op.Correction(trust_region=TR(0.0, 0.0, penalty=0.5))
    out = op.policy_loss_from_logprobs(lp, lq, adv, correction=corr)
    assert float(out.metrics["trust_region_masked_frac"]) == 1.0
    want = 0.5 * ((lp.detach() - lq) ** 2).mean()
    assert math.isclose(float(out.loss), float(want), rel_tol=1e-14)


@pytest.mark.parametrize("kwargs, match", [
    (dict(lower=-0.1, upper=0.2), "TrustRegion.lower"),
    (dict(lower=0.1, upper=math.inf), "TrustRegion.upper"),
    (dict(lower=0.1, upper=math.nan), "TrustRegion.upper"),
    (dict(lower=True, upper=0.2), "TrustRegion.lower"),
    (dict(lower=0.1, upper=0.2, penalty=-1.0), "TrustRegion.penalty"),
    (dict(lower=0.1, upper=0.2, divergence="tv"), "TrustRegion.divergence"),
    (dict(lower=0.1, upper=0.2, sign="positive"), "TrustRegion.sign"),
    (dict(lower=0.1, upper=0.2, on="old"), "TrustRegion.on"),
    (dict(lower=0.1, upper=0.2, level="seq"), "TrustRegion.level"),
    (dict(lower=0.1, upper=0.2, level="sequence"), "sign='none'"),
    (dict(lower=0.1, upper=0.2, level="geometric", sign="none", divergence="binary_kl"), "pass lower == upper"),
    (dict(lower=0.1, upper=0.2, level="sequence_max"), "needs sign='none'"),
])
def test_bad_trust_region_is_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TR(**kwargs)


def test_bad_combinations_are_named():
    with pytest.raises(TypeError, match="Correction.trust_region"):
        op.Correction(trust_region=(0.2, 0.2))
    with pytest.raises(ValueError, match="score_centering=True cannot be combined with trust_region"):
        op.Correction(score_centering=True, trust_region=TR(0.2, 0.2, on="weights"))
    for soft in (dict(sapo=(1.0, 1.05)), dict(vespo=(2.0, 3.0, 3.0, 2.0)), dict(gmpo=(0.4, 0.4))):
        with pytest.raises(ValueError, match=f"trust_region cannot be combined with {next(iter(soft))}"):
            op.Correction(trust_region=TR(0.2, 0.2), **soft)
    lp, lq, adv = torch.full((3,), -0.5), torch.full((3,), -0.6), torch.ones(3)
    corr = op.Correction(trust_region=TR(0.1, 0.1, sign="none", level="sequence"))
    with pytest.raises(ValueError, match="needs seq_ids"):
        op.policy_loss_from_logprobs(lp, lq, adv, correction=corr)
    with pytest.raises(ValueError, match="proximal_logprobs"):
        op.policy_loss_from_logprobs(lp, lq, adv, correction=op.Correction(trust_region=TR(0.1, 0.1, on="weights")),
                                     proximal_logprobs=lq)
