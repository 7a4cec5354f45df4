"""SAPO, VESPO, GMPO and the KL-to-reference penalty against the peers' own code, in float64 on random masked
``[B, T]`` batches (loss to 1e-12 relative, gradient with respect to the trainer's log-probabilities to 1e-10):

* VESPO: TRL 1.16's own ``GRPOTrainer.get_gamma_weights`` (a static method, called as it is);
* SAPO and TRL's KL term (``beta``, ``use_bias_correction_kl``): transcribed from TRL 1.16
  ``trl/trainer/grpo_trainer.py`` ``GRPOTrainer._compute_loss`` (the ``loss_type == "sapo"`` branch and the
  ``per_token_kl`` lines), which is not callable on its own;
* GMPO: transcribed from verl 0.9.1 ``verl/trainer/ppo/core_algos.py`` ``compute_policy_loss_geo_mean``
  (tests/adapters/test_gmpo_verl_cases.py calls verl's own function in its venv);
* slime's ``--use-kl-loss --kl-loss-type {k1,k2,k3} --use-unbiased-kl``: transcribed from THUDM/slime
  ``slime/utils/ppo_utils.py`` ``compute_approx_kl`` at commit 06787cf5798525d9af068135ade88dc795d75821, with
  ``importance_ratio = exp(log_probs - old_log_probs)`` as its policy loss passes it.

Then each through ``op.policy_loss`` (logits) against :mod:`offpolicy.reference` on hostile batches, and the
boundary errors.
"""

from __future__ import annotations

import math

import pytest
import torch

import offpolicy as op
from offpolicy.reference import reference_metrics, reference_policy_loss

B, T = 6, 7


def _batch(seed: int, drift: float = 0.2):
    """``[B, T]`` float64 ``logp`` (trainer), ``old`` (proximal), ``roll`` (sampler), ``ref`` (reference model),
    a ragged mask and per-sequence advantages of both signs with one zero."""
    gen = torch.Generator().manual_seed(seed)
    roll = torch.log(torch.rand(B, T, generator=gen, dtype=torch.float64) * 0.9 + 0.05)
    old = (roll + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)).clamp(max=-1e-3)
    logp = (old + drift * torch.randn(B, T, generator=gen, dtype=torch.float64)).clamp(max=-1e-3)
    ref = (old + 0.4 * torch.randn(B, T, generator=gen, dtype=torch.float64)).clamp(max=-1e-3)
    mask = torch.arange(T)[None, :] < torch.tensor([7, 3, 5, 1, 6, 4])[:, None]
    adv = torch.randn(B, generator=gen, dtype=torch.float64)
    adv[2] = 0.0
    return logp, old, roll, ref, mask, adv[:, None].expand(B, T).clone()


def _ours(logp, old, roll, mask, adv, corr, proximal="old", ref=None, **kw):
    leaf = logp.clone().requires_grad_()
    prox = {"old": old, "roll": roll}[proximal]
    out = op.policy_loss_from_logprobs(
        leaf.reshape(-1), roll.reshape(-1), adv.reshape(-1), loss_mask=mask.reshape(-1), correction=corr,
        seq_ids=torch.arange(B)[:, None].expand(B, T).reshape(-1), proximal_logprobs=prox.reshape(-1),
        reference_logprobs=None if ref is None else ref.reshape(-1), **kw)
    out.loss.backward()
    return out, leaf.grad


def _theirs(per_token_loss_fn, logp, agg, mask):
    """The peer's aggregation of ``per_token_loss_fn(leaf) -> [B, T]`` over ``mask``: TRL's grpo / sapo
    (``seq-mean-token-mean``), vespo / dapo (token sum over the token count: ``token-mean``), verl's geo_mean
    (``seq-mean``, one value per row averaged over all ``B`` rows)."""
    leaf = logp.clone().requires_grad_()
    loss_bt = per_token_loss_fn(leaf)
    m = mask.double()
    if agg == "token-mean":
        loss = (loss_bt * m).sum() / m.sum()
    elif agg == "seq-mean-token-mean":
        loss = ((loss_bt * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    else:
        loss = loss_bt.mean()
    loss.backward()
    return loss.detach(), leaf.grad


def _check(ours, theirs):
    (out, g), (loss, g_ref) = ours, theirs
    assert abs(out.loss.item() - loss.item()) <= 1e-12 * max(1.0, abs(loss.item()))
    torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-13)


def _ppo(u, a, lo, hi):
    return -torch.minimum(u * a, u.clamp(1 - lo, 1 + hi) * a)


# ---------------------------------------------------------------------------------------------------------------
# SAPO (TRL 1.16 loss_type="sapo")
# ---------------------------------------------------------------------------------------------------------------


def _trl_sapo(lp, old, adv, tau_pos, tau_neg):
    """TRL 1.16 grpo_trainer.py, loss_type == "sapo" (importance_sampling_level="token"). TRL's
    ``torch.where(advantages > 0, tau_pos, tau_neg)`` on Python floats makes float32 temperatures (1.05 then reads
    1.0499999523); here they are float64, as TRL computes on float64 advantages' own precision would want."""
    coef_1 = torch.exp(lp - old)
    temperatures = torch.where(adv > 0, torch.tensor(tau_pos, dtype=adv.dtype), torch.tensor(tau_neg, dtype=adv.dtype))
    soft_coef_1 = torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures
    return -soft_coef_1 * adv


@pytest.mark.parametrize("taus, drift", [((1.0, 1.05), 0.2), ((0.5, 3.0), 1.5)])
def test_trl_sapo(taus, drift):
    """loss_type='sapo', sapo_temperature_pos / _neg: per-token 4/tau sigmoid(tau (u - 1)) A, sequence mean of
    token means; u = p / old (old_per_token_logps = proximal_logprobs). drift=1.5 puts u far outside any clip."""
    logp, old, roll, _, mask, adv = _batch(1, drift)
    corr = op.Correction(sapo=taus)
    _check(_ours(logp, old, roll, mask, adv, corr, aggregation="seq_mean_token_mean"),
           _theirs(lambda lp: _trl_sapo(lp, old, adv, *taus), logp, "seq-mean-token-mean", mask))


def test_trl_sapo_with_vllm_truncated_importance_sampling():
    """vllm_importance_sampling_correction=True, mode token_truncate, clip_max C: TRL multiplies the SAPO per-token
    loss by min(old / vllm, C), which is offpolicy's weights='tis', bounds=C on pi_prox / q."""
    logp, old, roll, _, mask, adv = _batch(2)
    cap = 1.3
    corr = op.Correction(weights="tis", bounds=cap, sapo=(1.0, 1.05))
    _check(_ours(logp, old, roll, mask, adv, corr, aggregation="seq_mean_token_mean"),
           _theirs(lambda lp: _trl_sapo(lp, old, adv, 1.0, 1.05) * torch.exp(old - roll).clamp(max=cap), logp,
                   "seq-mean-token-mean", mask))


# ---------------------------------------------------------------------------------------------------------------
# VESPO (TRL 1.16 loss_type="vespo"), against TRL's own get_gamma_weights
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trl_gamma_weights():
    grpo = pytest.importorskip("trl.trainer.grpo_trainer", reason="TRL 1.16 (in .venv) holds VESPO's gamma weights")
    return grpo.GRPOTrainer.get_gamma_weights


@pytest.mark.parametrize("params, shift", [((2.0, 3.0, 3.0, 2.0), 0.0), ((1.5, 0.5, 4.0, 1.0), 0.0),
                                           ((2.0, 3.0, 3.0, 2.0), -3.0)])
def test_trl_vespo(trl_gamma_weights, params, shift):
    """loss_type='vespo', vespo_k_pos / lambda_pos / k_neg / lambda_neg: -phi(W) A log p with TRL's own
    get_gamma_weights (W = prod_t p / old over the row's mask), token sum over the token count (one batch:
    num_items_in_batch = the mask's count). shift=-3 drags one row's log W below TRL's floor log(1e-8). The
    parameters are exact in float32 (TRL's torch.where on Python floats makes k and lambda float32)."""
    logp, old, roll, _, mask, adv = _batch(3)
    logp = logp.clone()
    logp[0] = logp[0] + shift
    k_pos, lam_pos, k_neg, lam_neg = params

    def theirs(lp):
        phi = trl_gamma_weights(adv[:, :1], lp - old, mask.double(), None, k_pos=k_pos, lambda_pos=lam_pos,
                                k_neg=k_neg, lambda_neg=lam_neg)
        return -phi * adv * lp

    _check(_ours(logp, old, roll, mask, adv, op.Correction(vespo=params)), _theirs(theirs, logp, "token-mean", mask))


def test_trl_vespo_with_vllm_importance_sampling(trl_gamma_weights):
    """With vllm_importance_sampling_correction, TRL passes the token IS ratio old / vllm into the gamma weight
    (W = prod_t p / old * prod_t old / vllm) and does not multiply the loss by it. Untruncated, that is
    W = prod_t p / vllm: offpolicy's vespo with proximal_logprobs = the sampler's log-probabilities."""
    logp, old, roll, _, mask, adv = _batch(4)

    def theirs(lp):
        is_ratio = torch.where(mask, torch.exp(old - roll), torch.ones_like(old))
        phi = trl_gamma_weights(adv[:, :1], lp - old, mask.double(), is_ratio)
        return -phi * adv * lp

    _check(_ours(logp, old, roll, mask, adv, op.Correction(vespo=(2.0, 3.0, 3.0, 2.0)), proximal="roll"),
           _theirs(theirs, logp, "token-mean", mask))


# ---------------------------------------------------------------------------------------------------------------
# GMPO (verl 0.9.1 policy_loss.loss_mode="geo_mean")
# ---------------------------------------------------------------------------------------------------------------


def _verl_geo_mean(lp, old, adv, mask, lo, hi):
    """verl 0.9.1 core_algos.py compute_policy_loss_geo_mean, per row (before its mean over rows), without its
    ``+ 1e-8`` in the two denominators (a 1e-8-relative change; the verl case file keeps it)."""
    neg_kl = lp - old
    sgn = torch.sign(adv)
    neg_kl_min = sgn * torch.min(sgn * neg_kl, sgn * torch.clamp(neg_kl, -lo, hi))
    m = mask.double()
    ratio = torch.exp((neg_kl_min * m).sum(-1) / m.sum(-1))
    advantage = (adv * m).sum(-1) / m.sum(-1)
    return -advantage * ratio


@pytest.mark.parametrize("eps, drift", [((0.4, 0.4), 0.2), ((0.1, 0.2), 0.5)])
def test_verl_gmpo(eps, drift):
    """loss_mode='geo_mean' (clip_ratio_low / clip_ratio_high in log space): -A_i exp(mean_t clip-min(log u_t)),
    averaged over rows: offpolicy's gmpo with aggregation='seq_mean_token_mean' (one value per sequence)."""
    logp, old, roll, _, mask, adv = _batch(5, drift)
    corr = op.Correction(gmpo=eps)
    _check(_ours(logp, old, roll, mask, adv, corr, aggregation="seq_mean_token_mean"),
           _theirs(lambda lp: _verl_geo_mean(lp, old, adv, mask, *eps)[:, None], logp, "seq-mean", mask))


# ---------------------------------------------------------------------------------------------------------------
# The KL penalty: TRL beta / use_bias_correction_kl, slime --use-kl-loss / --use-unbiased-kl
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias_correction", [False, True])
def test_trl_kl_penalty(bias_correction):
    """beta=b, use_bias_correction_kl: per_token_loss = PPO + b * (exp(ref - p) - (ref - p) - 1) [* exp(p - old),
    differentiable], loss_type='grpo' (sequence mean of token means); TRL's 'kl' metric (masked token mean of
    per_token_kl) is offpolicy's ref_kl."""
    logp, old, roll, ref, mask, adv = _batch(6)
    beta = 0.3

    def trl_kl(lp):
        kl = torch.exp(ref - lp) - (ref - lp) - 1
        return kl * torch.exp(lp - old) if bias_correction else kl

    corr = op.Correction(ppo_clip=(0.2, 0.28), kl_penalty=op.KLPenalty(beta, "k3", bias_correction))
    ours = _ours(logp, old, roll, mask, adv, corr, ref=ref, aggregation="seq_mean_token_mean")
    _check(ours, _theirs(lambda lp: _ppo(torch.exp(lp - old), adv, 0.2, 0.28) + beta * trl_kl(lp), logp,
                         "seq-mean-token-mean", mask))
    m = mask.double()
    trl_metric = (trl_kl(logp) * m).sum() / m.sum()
    assert abs(ours[0].metrics["ref_kl"].item() - trl_metric.item()) <= 1e-12 * abs(trl_metric.item())


def _slime_kl(lp, ref, kl_loss_type, importance_ratio):
    """THUDM/slime slime/utils/ppo_utils.py compute_approx_kl @ 06787cf (k1 / k2 / k3)."""
    log_ratio = lp - ref
    if kl_loss_type == "k1":
        kl = log_ratio
    elif kl_loss_type == "k2":
        kl = log_ratio ** 2 / 2.0
    else:
        log_ratio = -log_ratio
        kl = log_ratio.exp() - 1 - log_ratio
    return importance_ratio * kl if importance_ratio is not None else kl


@pytest.mark.parametrize("kl_loss_type", ["k1", "k2", "k3"])
@pytest.mark.parametrize("unbiased", [False, True])
@pytest.mark.parametrize("rollout_logprobs", [False, True])
def test_slime_kl_loss(kl_loss_type, unbiased, rollout_logprobs):
    """--use-kl-loss --kl-loss-coef c --kl-loss-type t [--use-unbiased-kl] with --calculate-per-token-loss: loss =
    PPO + c * KL, KL multiplied by exp(log_probs - old_log_probs) (differentiable) when unbiased; old_log_probs
    are the trainer's, or the rollout's with --use-rollout-logprobs (proximal_logprobs = that reference)."""
    logp, old, roll, ref, mask, adv = _batch(7)
    coef = 0.25
    anchor = roll if rollout_logprobs else old

    def theirs(lp):
        ratio = torch.exp(lp - anchor) if unbiased else None
        return _ppo(torch.exp(lp - anchor), adv, 0.2, 0.28) + coef * _slime_kl(lp, ref, kl_loss_type, ratio)

    corr = op.Correction(ppo_clip=(0.2, 0.28), kl_penalty=op.KLPenalty(coef, kl_loss_type, unbiased))
    _check(_ours(logp, old, roll, mask, adv, corr, proximal="roll" if rollout_logprobs else "old", ref=ref),
           _theirs(theirs, logp, "token-mean", mask))


def test_importance_weighted_k3_is_the_reverse_kl_gradient():
    """The point of the weighted form: on a small vocabulary, the exact expectation over tokens drawn from pi_old of
    the gradient of (p / pi_old) k3 equals the gradient of KL(p || p_ref); unweighted k3 does not."""
    gen = torch.Generator().manual_seed(8)
    v = 6
    z = torch.randn(v, generator=gen, dtype=torch.float64, requires_grad=True)
    log_old = torch.log_softmax(torch.randn(v, generator=gen, dtype=torch.float64), 0)
    log_ref = torch.log_softmax(torch.randn(v, generator=gen, dtype=torch.float64), 0)
    (kl_grad,) = torch.autograd.grad((torch.log_softmax(z, 0).exp() * (torch.log_softmax(z, 0) - log_ref)).sum(), z)
    grads = {}
    for weighted in (True, False):
        corr = op.Correction(kl_penalty=op.KLPenalty(1.0, "k3", weighted))
        grads[weighted] = torch.zeros(v, dtype=torch.float64)
        for y in range(v):  # E_old[grad pen] = sum_y old(y) grad pen(y), pen(y) alone via a one-hot loss_mask
            out = op.policy_loss_from_logprobs(
                torch.log_softmax(z, 0), log_old, torch.zeros(v, dtype=torch.float64),
                loss_mask=torch.arange(v) == y, aggregation="constant", constant_normalizer=1.0, correction=corr,
                reference_logprobs=log_ref)
            grads[weighted] += log_old[y].exp() * torch.autograd.grad(out.loss, z)[0]
    torch.testing.assert_close(grads[True], kl_grad, rtol=1e-12, atol=1e-14)
    assert (grads[False] - kl_grad).abs().max() > 1e-3


# ---------------------------------------------------------------------------------------------------------------
# op.policy_loss (logits) against offpolicy.reference: hostile values, masks, metrics
# ---------------------------------------------------------------------------------------------------------------

CORRECTIONS = {
    "sapo": op.Correction(sapo=(1.0, 1.05)),
    "sapo+mis": op.Correction(weights="mis", bounds=(0.3, 3.0), sapo=(0.7, 2.0)),
    "vespo": op.Correction(vespo=(2.0, 3.0, 3.0, 2.0)),
    "vespo+tis+opsm": op.Correction(weights="tis", vespo=(1.0, 0.5, 2.0, 1.5), opsm_delta=0.3),
    "gmpo": op.Correction(gmpo=(0.4, 0.4)),
    "gmpo+geometric-tis": op.Correction(weights="tis", level="geometric", bounds=(0.5, 2.0), gmpo=(0.1, 0.3)),
    "kl-k3-weighted": op.Correction(kl_penalty=op.KLPenalty(0.2, "k3", True)),
    "kl-k1+ppo": op.Correction(ppo_clip=(0.2, 0.2), kl_penalty=op.KLPenalty(0.5, "k1", True)),
    "kl-k2+gmpo": op.Correction(gmpo=(0.2, 0.2), kl_penalty=op.KLPenalty(0.1, "k2", False)),
}


def _logit_batch(seed: int, n: int, scale: float, mask_all: bool = False):
    gen = torch.Generator().manual_seed(seed)
    v = 11
    z = scale * torch.randn(n, v, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, v, (n,), generator=gen)

    def lp(x):
        return torch.log_softmax(x, -1)[torch.arange(n), tokens]

    lq = lp(z + scale * torch.randn(n, v, generator=gen, dtype=torch.float64))
    prox = lp(z + 0.5 * scale * torch.randn(n, v, generator=gen, dtype=torch.float64))
    ref = lp(z + scale * torch.randn(n, v, generator=gen, dtype=torch.float64))
    seq = torch.sort(torch.randint(0, max(1, n // 3), (n,), generator=gen)).values
    adv = torch.randn(int(seq.max()) + 1, generator=gen, dtype=torch.float64)[seq]
    mask = torch.zeros(n, dtype=torch.bool) if mask_all else torch.rand(n, generator=gen) > 0.25
    return z, tokens, lq, prox, ref, seq, adv, mask


@pytest.mark.parametrize("name", list(CORRECTIONS))
@pytest.mark.parametrize("case", ["random", "hostile", "single_token", "all_masked"])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_policy_loss_matches_the_reference(name, case, aggregation):
    """Loss, per-token loss, weights and the logits' gradient (1e-12 / 1e-10), and the metrics, of op.policy_loss
    against reference.py; 'hostile' has logits of scale 8 (|log r| up to ~30, past max_log_ratio=20 here clamped
    at 6) so every clamp and clip engages."""
    corr = CORRECTIONS[name]
    n, scale = {"random": (14, 1.0), "hostile": (14, 8.0), "single_token": (1, 1.0), "all_masked": (9, 1.0)}[case]
    if case == "hostile":
        from dataclasses import replace
        corr = replace(corr, max_log_ratio=6.0)
    seed = 10 * list(CORRECTIONS).index(name) + len(case)
    z, y, lq, prox, ref, seq, adv, mask = _logit_batch(seed, n, scale, case == "all_masked")
    if case == "single_token":
        mask = torch.ones(1, dtype=torch.bool)
    kw = dict(loss_mask=mask, correction=corr, seq_ids=seq, aggregation=aggregation,
              proximal_logprobs=prox if corr.surrogate.needs_proximal else None,
              reference_logprobs=ref if corr.kl_penalty is not None else None)
    z1, z2 = z.clone().requires_grad_(), z.clone().requires_grad_()
    out = op.policy_loss(z1, y, lq, adv, **kw)
    loss, token_loss, w = reference_policy_loss(z2, y, lq, adv, **kw)
    out.loss.backward()
    loss.backward()
    assert abs(out.loss.item() - loss.item()) <= 1e-12 * max(1.0, abs(loss.item()))
    torch.testing.assert_close(out.token_loss, token_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(out.token_weight, w, rtol=1e-12, atol=0.0)
    torch.testing.assert_close(z1.grad, z2.grad, rtol=1e-10, atol=1e-13)
    ref_m = reference_metrics(z, y, lq, adv, loss_mask=mask, correction=corr, seq_ids=seq,
                              proximal_logprobs=kw["proximal_logprobs"], reference_logprobs=kw["reference_logprobs"],
                              aggregation=aggregation)
    for key in ("ref_kl", "kl_penalty", "weight_mean", "kl_k3", "rejected_frac"):
        if key in ref_m:
            assert abs(out.metrics[key].item() - ref_m[key]) <= 1e-12 * max(1.0, abs(ref_m[key])), key
    assert ("ref_kl" in out.metrics) == (corr.kl_penalty is not None)


# ---------------------------------------------------------------------------------------------------------------
# Errors at the boundary
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(sapo=(1.0, 0.0)), r"Correction.sapo must be \(tau_pos, tau_neg\) with finite temperatures > 0"),
    (dict(sapo=(1.0,)), "Correction.sapo must be a pair of numbers"),
    (dict(vespo=(2.0, 3.0, 3.0)), "Correction.vespo must be four of numbers"),
    (dict(vespo=(2.0, 0.0, 3.0, 2.0)), "k >= 0 and lam > 0"),
    (dict(vespo=(-1.0, 3.0, 3.0, 2.0)), "k >= 0 and lam > 0"),
    (dict(gmpo=(0.2, math.inf)), r"Correction.gmpo must be \(eps_lo, eps_hi\) finite and >= 0"),
    (dict(gmpo=(0.2, 0.2), sapo=(1.0, 1.0)), "Correction.sapo and gmpo exclude each other"),
    (dict(ppo_clip=(0.2, 0.2), vespo=(2.0, 3.0, 3.0, 2.0)), "Correction.ppo_clip and vespo exclude each other"),
    (dict(sapo=(1.0, 1.0), score_centering=True, weights="tis"), "score_centering=True cannot be combined"),
    (dict(kl_penalty=0.1), "Correction.kl_penalty must be a KLPenalty"),
])
def test_correction_errors(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        op.Correction(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(coef=-0.1), "KLPenalty.coef must be a finite number >= 0"),
    (dict(coef=True), "KLPenalty.coef must be a finite number >= 0"),
    (dict(coef=0.1, estimator="k4"), r"KLPenalty.estimator must be one of \('k1', 'k2', 'k3'\)"),
    (dict(coef=0.1, importance_weighted=1), "KLPenalty.importance_weighted must be a bool"),
])
def test_kl_penalty_errors(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        op.KLPenalty(**kwargs)


def _call(entry, corr, **over):
    z, y, lq, prox, ref, seq, adv, mask = _logit_batch(9, 8, 1.0)
    kw = dict(loss_mask=mask, correction=corr, seq_ids=seq, proximal_logprobs=prox, reference_logprobs=ref)
    kw.update(over)
    if entry == "logits":
        return op.policy_loss(z, y, lq, adv, **kw)
    lp = torch.log_softmax(z, -1)[torch.arange(8), y]
    return op.policy_loss_from_logprobs(lp, lq, adv, **kw)


PEN = op.Correction(ppo_clip=(0.2, 0.2), kl_penalty=op.KLPenalty(0.1))


@pytest.mark.parametrize("entry", ["logits", "logprobs"])
@pytest.mark.parametrize("corr, over, match", [
    (op.Correction(ppo_clip=(0.2, 0.2)), {}, "correction.kl_penalty and reference_logprobs go together"),
    (PEN, dict(reference_logprobs=None), "correction.kl_penalty and reference_logprobs go together"),
    (PEN, dict(reference_logprobs=torch.zeros(7, dtype=torch.float64)), r"reference_logprobs must have shape"),
    (PEN, dict(reference_logprobs=torch.zeros(8, dtype=torch.int64)), "reference_logprobs must be a floating-point"),
    (PEN, dict(reference_logprobs=torch.full((8,), math.nan, dtype=torch.float64)),
     "reference_logprobs: NaN or inf on a trained token"),
    (PEN, dict(reference_logprobs=torch.full((8,), 0.5, dtype=torch.float64)), "reference_logprobs: value 0.5 > 0"),
    (op.Correction(gmpo=(0.2, 0.2)), dict(seq_ids=None, reference_logprobs=None), "needs seq_ids"),
    (op.Correction(sapo=(1.0, 1.0)), dict(proximal_logprobs=None, reference_logprobs=None),
     "proximal_logprobs go together"),
])
def test_boundary_errors(entry, corr, over, match):
    with pytest.raises((ValueError, TypeError), match=match):
        _call(entry, corr, **over)
