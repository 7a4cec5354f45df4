"""Regression tests for the five bugs of the family comparison with verl, slime and TRL (each failed on the code
before its fix), and the metric keys checked one by one against the float64 reference."""

from __future__ import annotations

import math

import pytest
import torch

import offpolicy as op
from offpolicy.reference import reference_metrics, reference_policy_loss

from support.batches import make_batch


def test_opsm_under_ppo_tests_the_current_policy():
    """log p = log(.2, .2), lq = prox = log(.5, .5), A = -1: mean(lq - log p) = log 2.5 > 0.5, so the sequence is
    dropped whether or not decoupled PPO is on (before the fix, PPO tested pi_prox and kept it)."""
    logp = torch.log(torch.tensor([0.2, 0.2], dtype=torch.float64)).requires_grad_()
    lq = torch.log(torch.tensor([0.5, 0.5], dtype=torch.float64))
    adv = torch.tensor([-1.0, -1.0], dtype=torch.float64)
    seq = torch.tensor([0, 0])
    for extra in ({}, {"ppo_clip": (0.2, 0.2)}):
        corr = op.Correction(opsm_delta=0.5, **extra)
        prox = lq.clone() if extra else None
        out = op.policy_loss_from_logprobs(logp, lq, adv, correction=corr, seq_ids=seq, proximal_logprobs=prox)
        assert float(out.metrics["rejected_frac"]) == 1.0
        assert out.token_loss.tolist() == [0.0, 0.0] and float(out.loss.detach()) == 0.0


def test_ratio_fracs_count_the_bounded_ratio():
    """Two tokens with r = 1.8 under sequence-level MIS (0.5, 2): the sequence ratio 3.24 is above U, both tokens
    are masked and ratio_above_upper_frac = 1 (it was 0: it counted the token ratio)."""
    lq = torch.log(torch.tensor([0.5, 0.5], dtype=torch.float64))
    logp = lq + math.log(1.8)
    corr = op.Correction(weights="mis", bounds=(0.5, 2.0), level="sequence")
    out = op.policy_loss_from_logprobs(logp, lq, torch.ones(2, dtype=torch.float64), correction=corr,
                                       seq_ids=torch.tensor([0, 0]))
    assert out.token_weight.tolist() == [0.0, 0.0]
    assert float(out.metrics["ratio_above_upper_frac"]) == 1.0
    assert float(out.metrics["ratio_below_lower_frac"]) == 0.0
    # Under decoupled PPO the bounds act on pi_prox / q.
    corr = op.Correction(weights="mis", bounds=(0.5, 2.0), ppo_clip=(0.2, 0.2))
    out = op.policy_loss_from_logprobs(logp, lq, torch.ones(2, dtype=torch.float64), correction=corr,
                                       proximal_logprobs=lq - 1.0)
    assert float(out.metrics["ratio_below_lower_frac"]) == 1.0 and float(out.metrics["ratio_above_upper_frac"]) == 0.0


CORRS_AT_ZERO = [
    op.Correction(),
    op.Correction(weights="tis"),
    op.Correction(weights="tis", bounds=(0.5, 2.0)),
    op.Correction(weights="mis"),
    op.Correction(weights="reject", bounds=(0.0, 3.0)),
    op.Correction(kl_rejection=op.KLRejection(5.0, "k2", "token")),
]


@pytest.mark.parametrize("sc", [False, True])
@pytest.mark.parametrize("corr", CORRS_AT_ZERO, ids=lambda c: repr(c)[11:60])
@pytest.mark.parametrize("kind", ["head", "support"])
def test_sampled_token_with_trainer_probability_zero(corr, sc, kind):
    """A -inf logit at the sampled token (and at a recorded candidate): weight exactly 0, finite loss and
    gradient, counted in zero_prob_frac, equal to the reference (before the fix: TIS loss inf)."""
    corr = op.Correction(weights=corr.weights, bounds=corr.bounds, kl_rejection=corr.kl_rejection,
                         score_centering=sc)
    z, y, lq, cands = make_batch(6, 20, 4, kind, seed=4, mismatch=0.5)
    z[1, y[1]] = -math.inf  # the trainer (p, or p^S over a support) gives row 1's sampled token probability 0
    adv = torch.tensor([1.0, -2.0, 0.5, 1.5, -1.0, 0.3], dtype=torch.float64)
    z1 = z.clone().requires_grad_()
    z2 = z.clone().requires_grad_()
    out = op.policy_loss(z1, y, lq, adv, cands, correction=corr)
    ref, ref_tl, ref_w = reference_policy_loss(z2, y, lq, adv, cands, correction=corr)
    out.loss.backward()
    ref.backward()
    assert float(out.token_weight[1]) == 0.0 and float(ref_w[1]) == 0.0
    assert math.isfinite(out.loss.item()) and bool(torch.isfinite(z1.grad).all())
    assert abs(out.loss.item() - ref.item()) <= 1e-10 * max(1.0, abs(ref.item()))
    torch.testing.assert_close(z1.grad, z2.grad, rtol=1e-9, atol=1e-11)
    assert math.isclose(float(out.metrics["zero_prob_frac"]), 1 / 6)
    ref_m = reference_metrics(z, y, lq, adv, cands, correction=corr)
    assert set(ref_m) == set(out.metrics)
    for key, val in ref_m.items():  # perplexities leave the impossible token out; every value stays finite
        assert math.isfinite(float(out.metrics[key])), key
        assert math.isclose(float(out.metrics[key]), val, rel_tol=1e-10, abs_tol=1e-12), key


def test_score_centering_without_candidates_names_them():
    z, y, lq, _ = make_batch(4, 10, 3, "head", seed=1)
    corr = op.Correction(weights="mis", score_centering=True)
    with pytest.raises(ValueError, match="needs candidates"):
        op.policy_loss(z, y, lq, torch.ones(4), None, correction=corr)
    with pytest.raises(ValueError, match="needs candidates"):
        op.policy_loss_from_logprobs(torch.full((4,), -1.0), lq, torch.ones(4), correction=corr)


def test_untrained_rows_may_hold_placeholder_records():
    """A padded batch: the post-EOS rows (loss_mask False) hold a placeholder support that neither sums to 1 nor
    contains the token. Only trained rows are checked (before the fix this raised)."""
    z, y, lq, cands = make_batch(6, 20, 4, "support", seed=2)
    ids, lp = cands.ids.clone(), cands.logprobs.clone()
    ids[4:] = torch.tensor([0, 1, -1, -1])
    lp[4:] = torch.tensor([-3.0, -3.0, -math.inf, -math.inf])
    y = y.clone()
    y[4:] = 7
    placeholder = op.Candidates(ids, lp, "support")
    mask = torch.tensor([True, True, True, True, False, False])
    out = op.policy_loss(z, y, lq, torch.ones(6), placeholder, mask, correction=op.Correction(weights="mis"))
    assert math.isfinite(out.loss.item())
    with pytest.raises(ValueError, match="row 4"):
        op.policy_loss(z, y, lq, torch.ones(6), placeholder, correction=op.Correction(weights="mis"))


METRIC_CASES = [
    (op.Correction(), "head"),
    (op.Correction(weights="tis", score_centering=True), "head"),
    (op.Correction(weights="mis", score_centering=True), "support"),
    (op.Correction(weights="mis", level="sequence", bounds=(0.3, 3.0)), "head"),
    (op.Correction(weights="reject", level="geometric", bounds=(0.8, 1.2)), None),
    (op.Correction(weights="tis", veto=0.2, kl_rejection=op.KLRejection(0.5, "k3", "seq_mean")), "head"),
    (op.Correction(weights="mis", opsm_delta=0.05, batch_normalize=True, score_centering=True), "head"),
    (op.Correction(weights="mis", ppo_clip=(0.2, 0.3)), None),
    (op.Correction(weights="tis", ppo_clip=(0.2, 0.3), ppo_ratio="gspo_token", dual_clip=3.0, veto=0.3), None),
    (op.Correction(weights="mis", cispo=(0.0, 2.0), batch_normalize="sequences", opsm_delta=0.1,
                   rejected_in_normalizer=False), "head"),
    (op.Correction(weights="tis", rejections=(op.RatioRejection(0.5, 2.0, "geometric"),
                                              op.KLRejection(0.3, "k2", "seq_max"), op.KLRejection(0.4, "k1"))),
     "support"),
]


@pytest.mark.parametrize("corr,kind", METRIC_CASES, ids=lambda c: repr(c)[11:60] if isinstance(c, op.Correction)
                         else str(c))
def test_every_metric_key_matches_the_reference(corr, kind):
    """The same key set as the reference, and every value (overall, per group, per staleness) equal to 1e-10."""
    n = 16
    z, y, lq, cands = make_batch(n, 24, 5, kind or "head", seed=7, mismatch=0.9)
    cands = cands if kind else None
    gen = torch.Generator().manual_seed(3)
    mask = torch.rand(n, generator=gen) > 0.2
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    seq = torch.arange(n) // 4
    groups = torch.arange(n) % 3
    versions = torch.tensor([4, 3, 4, 2] * 4)
    prox = None
    if corr.surrogate.needs_proximal:
        prox = torch.log_softmax(z + 0.2 * torch.randn(z.shape, generator=gen, dtype=torch.float64), 1)
        prox = prox.gather(1, y[:, None])[:, 0]
    out = op.policy_loss(z, y, lq, adv, cands, mask, 1.0, corr, seq_ids=seq, groups=groups, versions=versions,
                         proximal_logprobs=prox)
    ref = reference_metrics(z, y, lq, adv, cands, mask, 1.0, corr, seq, proximal_logprobs=prox, groups=groups,
                            versions=versions)
    assert set(out.metrics) == set(ref)
    for key, val in ref.items():
        assert math.isclose(float(out.metrics[key]), val, rel_tol=1e-10, abs_tol=1e-12), key


# Issue 17 item 4: extreme inputs on trained rows give a defined finite result (docs/errors.md).
@pytest.mark.parametrize("corr", [op.Correction(), op.Correction(weights="tis"), op.Correction(weights="mis")])
@pytest.mark.parametrize("what", ["minus_inf_at_token", "all_minus_inf_row"])
def test_extreme_logits_on_a_trained_row_are_finite_and_zero_weighted(corr, what):
    """A trained row whose sampled token gets probability 0 (a ``-inf`` logit there, or a row of ``-inf``)
    contributes exactly 0 and gets a zero gradient; the other rows are as without it. (A ``+inf`` logit on a
    trained row is refused: tests/core/test_errors.py.)"""
    z, y, lq, _ = make_batch(4, 9, 0, None, seed=3, empty_row=None)
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0], dtype=torch.float64)
    bad = z.clone()
    if what == "minus_inf_at_token":
        bad[1, int(y[1])] = -math.inf
    else:
        bad[1] = -math.inf
    zz = bad.clone().requires_grad_()
    out = op.policy_loss(zz, y, lq, adv, correction=corr)
    out.loss.backward()
    assert torch.isfinite(out.loss) and bool(torch.isfinite(zz.grad).all())
    assert bool((zz.grad[1] == 0).all())
    assert all(bool(torch.isfinite(m).all()) for m in out.metrics.values())
    assert float(out.metrics["zero_prob_frac"]) == 0.25
    keep = torch.tensor([True, False, True, True])
    z2 = z.clone().requires_grad_()
    alone = op.policy_loss(z2, y, lq, adv, loss_mask=keep, correction=corr, num_loss_tokens=4)
    alone.loss.backward()
    torch.testing.assert_close(out.loss, alone.loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(zz.grad[keep], z2.grad[keep], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("weights", ["none", "tis", "mis"])
def test_minus_inf_logprob_with_mixed_advantages_is_finite(weights):
    """``policy_loss_from_logprobs`` on a ``-inf`` log-probability: that token contributes 0 whatever the sign of
    its advantage (no ``-A * inf``), the others are unchanged."""
    lp = torch.tensor([-math.inf, -1.0, -0.5], dtype=torch.float64, requires_grad=True)
    lq = torch.tensor([-1.0, -1.2, -0.4], dtype=torch.float64)
    for adv in (torch.tensor([1.0, -1.0, 2.0]), torch.tensor([-1.0, 1.0, -2.0])):
        adv = adv.double()
        lp.grad = None
        out = op.policy_loss_from_logprobs(lp, lq, adv, correction=op.Correction(weights=weights))
        out.loss.backward()
        assert torch.isfinite(out.loss) and bool(torch.isfinite(lp.grad).all()) and float(lp.grad[0]) == 0.0
        lp2 = lp.detach()[1:].clone().requires_grad_()
        rest = op.policy_loss_from_logprobs(lp2, lq[1:], adv[1:], correction=op.Correction(weights=weights),
                                            num_loss_tokens=3)
        torch.testing.assert_close(out.loss, rest.loss, rtol=1e-12, atol=1e-12)


def test_perplexities_saturate_instead_of_overflowing():
    """fp32 logits of 1e3 give ``mean -log p`` near 1e3: the perplexity saturates at fp32's largest value."""
    z = torch.tensor([[770.0, -146.0]])
    out = op.policy_loss(z, torch.tensor([1]), torch.tensor([-0.5]), torch.tensor([1.0]))
    big = torch.finfo(torch.float32).max
    assert float(out.metrics["ppl_trainer"]) == big and float(out.metrics["ppl_ratio"]) == big
    assert float(out.metrics["ppl_sampler"]) == pytest.approx(math.exp(0.5))


def _two_sequences(log_r: list[float]):
    """Four trained tokens in two sequences with the given log-ratios ``log p - lq`` (float64)."""
    lq = torch.tensor([-1.5, -0.5, -1.0, -2.0], dtype=torch.float64)
    lp = (lq + torch.tensor(log_r, dtype=torch.float64)).clamp(max=0.0)
    return lp, lp - torch.tensor(log_r, dtype=torch.float64), torch.tensor([0, 0, 1, 1])


def test_veto_drops_a_sequence_with_one_catastrophic_token():
    """One token with ``r < veto`` drops its whole sequence even when another of its tokens has a large ratio."""
    lp, lq, seq = _two_sequences([-10.0, 0.0, 0.1, -0.2])
    lq[1] = lp[1] - 2.0  # the sequence's other token: r = e^2, far above the veto
    adv = torch.tensor([1.0, 1.0, -1.0, 2.0], dtype=torch.float64)
    out = op.policy_loss_from_logprobs(lp, lq, adv, correction=op.Correction(weights="tis", veto=1e-3), seq_ids=seq)
    assert out.token_weight[:2].tolist() == [0.0, 0.0]
    torch.testing.assert_close(out.token_weight[2:], torch.exp(torch.tensor([0.1, -0.2], dtype=torch.float64)))


def test_batch_normalize_averages_over_kept_tokens_only():
    """``batch_normalize`` divides by the mean weight of the tokens that survive the sequence rejections: the
    kept weights average to exactly 1 (the rejected sequence's zeros are not in the mean)."""
    lp, lq, seq = _two_sequences([-10.0, 0.3, 0.1, -0.2])
    adv = torch.tensor([1.0, 1.0, -1.0, 2.0], dtype=torch.float64)
    corr = op.Correction(weights="tis", veto=1e-3, batch_normalize=True)
    out = op.policy_loss_from_logprobs(lp, lq, adv, correction=corr, seq_ids=seq)
    assert out.token_weight[:2].tolist() == [0.0, 0.0]
    torch.testing.assert_close(out.token_weight[2:].mean(), torch.tensor(1.0, dtype=torch.float64), rtol=1e-12,
                               atol=1e-12)


def _seed_support_loss(z: torch.Tensor, y: torch.Tensor, lq: torch.Tensor, adv: torch.Tensor, cands, mode: str,
                       tau: float) -> torch.Tensor:
    """The research code's per-token score-centering loss on a replayed support, written from its definition in
    float64, independently of offpolicy (docs/spec.md#score-centering, "Support records"): the trainer's
    ``log p^S`` at the recorded ids, ``P = sum p^S``, ``Q = sum q``, the tail ratio floored at ``eps = 1e-6`` on
    both masses, ``alpha = rho f(1 / rho)``, the residual ``m(v) - alpha p(v)`` for every recorded candidate and
    ``loss = -A (w log p(y) - sum_v residual(v) log p(v))``. Modes: ``none``, ``tis`` (``min(r, 2)``) and ``mis``
    (``r 1[0.5 <= r <= 5]``)."""
    out = torch.zeros(z.shape[0], dtype=torch.float64)
    for t in range(z.shape[0]):
        ids = [int(i) for i in cands.ids[t] if i >= 0]
        x = z[t, ids].double() / tau
        logp = x - torch.logsumexp(x, 0)  # log p^S over the replayed support
        lqs = cands.logprobs[t, : len(ids)].double()
        p, q = logp.exp(), lqs.exp()
        rho = max(1.0 - float(q.sum()), 1e-6) / max(1.0 - float(p.sum()), 1e-6)
        ratio = p / q
        if mode == "none":
            m, alpha = q, rho
        elif mode == "tis":
            m, alpha = torch.minimum(p, 2.0 * q), min(2.0 * rho, 1.0)
        else:
            m, alpha = torch.where((ratio >= 0.5) & (ratio <= 5.0), p, 0.0), float(0.2 <= rho <= 2.0)
        residual = m - alpha * p
        r_y = math.exp(float(logp[ids.index(int(y[t]))]) - float(lq[t]))
        w = {"none": 1.0, "tis": min(r_y, 2.0), "mis": r_y if 0.5 <= r_y <= 5.0 else 0.0}[mode]
        logp_y = float(logp[ids.index(int(y[t]))])
        out[t] = -float(adv[t]) * (w * logp_y - float((residual * logp).sum()))
    return out


@pytest.mark.parametrize("mode", ["none", "tis", "mis"])
def test_support_record_loss_value_is_the_research_codes(mode):
    """With a support record the reported per-token loss is the research code's value, which keeps the
    ``-alpha p^S`` residual (``+A f(1) sum p^S log p^S``: no gradient, ``-A f(1) H(p^S)`` in value), so loss
    curves compare across trainers; and that term's gradient is zero (value differs, gradient equal to 1e-12)."""
    tau = 0.8
    z, y, lq, cands = make_batch(8, 30, 6, "support", seed=11, mismatch=0.4, temperature=tau)
    adv = torch.tensor([1.0, -2.0, 0.5, 1.5, -1.0, 0.3, 2.0, -0.7], dtype=torch.float64)
    corr = op.Correction(weights=mode, score_centering=True)
    zl = z.clone().requires_grad_()
    out = op.policy_loss(zl, y, lq, adv, cands, temperature=tau, correction=corr, aggregation="constant",
                         constant_normalizer=1.0)
    seed = _seed_support_loss(z, y, lq, adv, cands, mode, tau)
    torch.testing.assert_close(out.token_loss, seed, rtol=1e-12, atol=1e-12)
    # The alpha p^S term: the loss without it differs in value by A f(1) H(p^S) and not at all in gradient.
    (g,) = torch.autograd.grad(out.loss, zl)
    zr = z.clone().requires_grad_()
    lp = torch.log_softmax((zr / tau).masked_fill(~_support(cands, z.shape[1]), -math.inf), dim=1)
    ids = cands.ids.clamp_min(0)
    valid = cands.ids >= 0
    lpc = torch.where(valid, lp.gather(1, ids), 0.0)
    p = torch.where(valid, lpc.detach().exp(), 0.0)
    alpha_term = (adv[:, None] * p * lpc).sum(1)  # + A alpha sum_v sg(p^S) log p^S, alpha = f(1) = 1 here
    (g_alpha,) = torch.autograd.grad(alpha_term.sum(), zr)
    assert float(g_alpha.abs().max()) < 1e-12
    entropy = -(p * lpc.detach()).sum(1)
    assert float((adv * entropy).abs().max()) > 0.1  # visible in the value: -A f(1) H(p^S), up to 2 H here
    assert float((g_alpha.abs()).max()) < 1e-12 * max(1.0, float(g.abs().max()))


def _support(cands, vocab: int) -> torch.Tensor:
    from offpolicy.reference import support_mask

    return support_mask(cands, vocab)
