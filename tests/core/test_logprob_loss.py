"""``op.policy_loss_from_logprobs``: the loss math on per-token log-probabilities that a trainer computed itself.

Fed the log-probabilities a dense float64 log-softmax gives (renormalised over the support under mask replay),
it must equal ``op.policy_loss`` on the logits (loss, per-token loss, gradient through the caller's
log-softmax, metrics) in every mode, and it must refuse what it cannot check or compute.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import offpolicy as op
from support.batches import make_batch
from offpolicy.testing import LossConfig, check_all, family_configs
from offpolicy.testing import strategies as S

EXACT = dict(rtol=1e-12, atol=1e-13)


def dense_logprobs(z: torch.Tensor, tokens, cands, tau):
    """What a framework computes: ``log softmax(z / tau)`` (over the support for support records), gathered at
    the sampled tokens and at the recorded candidates ``[N] , [N, K]``."""
    x = z / tau
    if cands is not None and cands.kind == "support":
        slot = torch.where(cands.ids >= 0, cands.ids, torch.full_like(cands.ids, z.shape[1]))
        inside = torch.zeros(z.shape[0], z.shape[1] + 1, dtype=torch.bool).scatter(1, slot, True)[:, :-1]
        x = x.masked_fill(~inside, -math.inf)
    logp = torch.log_softmax(x, dim=1)
    cand = None if cands is None else logp.gather(1, cands.ids.clamp_min(0))
    entropy = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(1)
    return logp.gather(1, tokens[:, None])[:, 0], cand, entropy.detach()


MODES = [
    (op.Correction(weights="mis", score_centering=True), "head", "token_mean"),
    (op.Correction(weights="tis", bounds=(0.5, 2.0), score_centering=True), "support", "seq_mean_token_mean"),
    (op.Correction(weights="reject", score_centering=True), "head", "seq_mean_token_sum"),
    (op.Correction(weights="mis", level="geometric"), None, "token_mean"),
    (op.Correction(weights="tis", level="sequence", veto=1e-3), "head", "constant"),
    (op.Correction(weights="mis", opsm_delta=0.1, batch_normalize=True), "support", "token_mean"),
    (op.Correction(kl_rejection=op.KLRejection(0.5, "k3", "seq_max")), None, "token_mean"),
]


@pytest.mark.parametrize("corr, kind, agg", MODES, ids=[f"{c.weights}-{c.level}-{k}-{a}" for c, k, a in MODES])
@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_equals_policy_loss_on_logits(corr, kind, agg, tau):
    z, y, lq, cands = make_batch(n=14, v=30, k=5, kind=kind, seed=5, temperature=tau)
    adv = torch.randn(14, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    mask = torch.ones(14, dtype=torch.bool)
    mask[[2, 9]] = False
    seq_ids = torch.tensor([0] * 4 + [1] * 5 + [2] * 5)
    common = dict(loss_mask=mask, correction=corr, seq_ids=seq_ids, aggregation=agg,
                  constant_normalizer=20.0 if agg == "constant" else None, groups=seq_ids % 2)
    za = z.clone().requires_grad_(True)
    want = op.policy_loss(za, y, lq, adv, candidates=cands, temperature=tau, **common)
    want.loss.backward()
    zb = z.clone().requires_grad_(True)
    lp_y, lp_c, ent = dense_logprobs(zb, y, cands, tau)
    got = op.policy_loss_from_logprobs(lp_y, lq, adv, cands, lp_c if corr.score_centering else None, entropy=ent,
                                       **common)
    got.loss.backward()
    torch.testing.assert_close(got.loss.detach(), want.loss.detach(), **EXACT)
    torch.testing.assert_close(got.token_loss, want.token_loss, **EXACT)
    torch.testing.assert_close(zb.grad, za.grad, **EXACT)
    assert got.metrics.keys() == want.metrics.keys()
    for key, val in want.metrics.items():
        torch.testing.assert_close(got.metrics[key], val, rtol=1e-10, atol=1e-12, msg=key)


def test_entropy_metric_only_when_given_and_float32_inputs():
    z, y, lq, cands = make_batch(kind="head", seed=2)
    adv = torch.ones(z.shape[0], dtype=torch.float32)
    lp_y, lp_c, _ = dense_logprobs(z.float().requires_grad_(True), y, cands, 1.0)
    out = op.policy_loss_from_logprobs(lp_y, lq, adv, cands, lp_c, correction=op.Correction("mis",
                                                                                             score_centering=True))
    assert "entropy" not in out.metrics and "sc_rho" in out.metrics
    assert out.loss.dtype == torch.float32 and out.loss.requires_grad


def _adapter(cfg: LossConfig):
    """The kit's signature on top of the framework path: the caller's dense log-softmax, then our loss math."""

    def logprob_framework_loss(logits, tokens, sampler_logprobs, candidates, advantages, temperature,
                               loss_mask=None, seq_ids=None, proximal_logprobs=None, versions=None,
                               current_version=None, route_flips=None):
        lp_y, lp_c, _ = dense_logprobs(logits, tokens, candidates, temperature)
        agg = {"aggregation": cfg.aggregation or "constant",
               "constant_normalizer": cfg.constant_normalizer if cfg.aggregation else 1.0}
        out = op.policy_loss_from_logprobs(
            lp_y, sampler_logprobs, advantages, candidates, lp_c if cfg.score_centering else None,
            loss_mask=loss_mask, correction=cfg.correction, seq_ids=seq_ids, proximal_logprobs=proximal_logprobs,
            versions=versions, current_version=current_version, route_flips=route_flips, **agg)
        if cfg.aggregation is not None:
            return out.loss
        first = (torch.arange(tokens.shape[0]) == 0).to(out.loss.dtype)
        return out.token_loss.to(out.loss.dtype) + (out.loss - out.loss.detach()) * first

    return logprob_framework_loss


@pytest.mark.parametrize("cfg", [LossConfig(weights="mis", score_centering=True, record="head"),
                                 LossConfig(weights="tis", score_centering=True, record="support"),
                                 LossConfig(weights="mis", level="sequence", record="support")],
                         ids=lambda c: c.describe())
def test_passes_the_testing_kit(cfg):
    report = check_all(_adapter(cfg), cfg, max_examples=30, raise_on_failure=False)
    assert report.passed, str(report)


@pytest.mark.parametrize("cfg", family_configs(), ids=lambda c: c.short())
def test_the_family_passes_the_testing_kit(cfg):
    """Each member of the correction family (surrogates with proximal log-probabilities, rejection chains,
    normalisations, the normaliser convention) through the log-probability entry point."""
    report = check_all(_adapter(cfg), cfg, max_examples=20, raise_on_failure=False)
    assert report.passed, str(report)
    assert report["agreement"].status == "pass" and report["masking"].status == "pass"


@pytest.mark.parametrize("change, match", [
    (lambda kw: kw.update(logprobs=kw["logprobs"].abs() + 0.5), r"> 0 on a trained token .*were logits passed"),
    (lambda kw: kw["logprobs"].__setitem__(3, float("nan")), "logprobs: NaN on trained token 3"),
    (lambda kw: kw.update(candidate_logprobs=None), "score centering needs candidate_logprobs"),
    (lambda kw: kw.update(candidate_logprobs=kw["candidate_logprobs"][:, :2]), r"candidate_logprobs must be \[N, K\]"),
    (lambda kw: kw.update(candidates=None), "candidate_logprobs needs candidates"),
    (lambda kw: kw.update(logprobs=kw["logprobs"][:, None]), r"logprobs must be a \[N\] tensor"),
    (lambda kw: kw.update(sampler_logprobs=kw["sampler_logprobs"][:-1]), r"sampler_logprobs must have shape"),
    (lambda kw: kw.update(aggregation="seq_mean_token_mean"), "needs seq_ids"),
    (lambda kw: kw.update(entropy=torch.zeros(3)), "entropy must have shape"),
])
def test_errors(change, match):
    z, y, lq, cands = make_batch(kind="head", seed=3)
    lp_y, lp_c, _ = dense_logprobs(z, y, cands, 1.0)
    kw = dict(logprobs=lp_y.clone(), sampler_logprobs=lq, advantages=torch.ones(z.shape[0]), candidates=cands,
              candidate_logprobs=lp_c, correction=op.Correction("mis", score_centering=True))
    change(kw)
    with pytest.raises((ValueError, TypeError), match=match):
        op.policy_loss_from_logprobs(**kw)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), weights=st.sampled_from(["none", "tis", "mis", "reject"]), sc=st.booleans(),
       record=st.sampled_from(["head", "support", None]))
def test_equals_policy_loss_on_fresh_draws(data, weights, sc, record):
    """Hypothesis batches (mismatched samplers, SGLang-filtered supports, skewed logits): the two entry points agree
    in value and gradient."""
    prob = data.draw(S.problems(record))
    corr = op.Correction(weights=weights, score_centering=sc and record is not None)
    mask = data.draw(S.loss_masks(prob.num_tokens))
    common = dict(loss_mask=mask, correction=corr)
    za = prob.logits.clone().requires_grad_(True)
    want = op.policy_loss(za, prob.tokens, prob.sampler_logprobs, prob.advantages, candidates=prob.candidates,
                          temperature=prob.temperature, **common)
    want.loss.backward()
    zb = prob.logits.clone().requires_grad_(True)
    lp_y, lp_c, ent = dense_logprobs(zb, prob.tokens, prob.candidates, prob.temperature)
    got = op.policy_loss_from_logprobs(lp_y, prob.sampler_logprobs, prob.advantages, prob.candidates,
                                       lp_c if corr.score_centering else None, entropy=ent, **common)
    got.loss.backward()
    scale = 1.0 + float(want.token_loss.abs().max()) if prob.num_tokens else 1.0
    torch.testing.assert_close(got.loss.detach(), want.loss.detach(), rtol=1e-9, atol=1e-11 * scale)
    torch.testing.assert_close(zb.grad, za.grad, rtol=1e-9, atol=1e-11 * scale)
