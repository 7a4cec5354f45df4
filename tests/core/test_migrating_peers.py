"""docs/migrating.md's sections for prime-rl, AReaL, ROLL, SkyRL, NeMo-RL and OpenRLHF: each row's peer formula,
transcribed here in plain float64 torch from the peer's source at the revision its section pins (the docstring of
each test names the file), against ``op.policy_loss_from_logprobs`` with the row's arguments (loss value to 1e-12
relative, gradient with respect to the trainer's log-probabilities to 1e-10; ``_check`` of
tests/core/test_migrating.py). Rows marked "not supported" have a test that shows the difference. Where the peer's
package installs without its heavy dependencies (OpenRLHF), ``test_openrlhf_transcription_matches_the_package``
checks the transcription against the package's own ``PolicyLoss`` in a side venv.

The peers' masked means add ``1e-8`` to their token or sequence counts (NeMo-RL's ``masked_mean``, ROLL's,
OpenRLHF's per-sample mean); the transcriptions leave it out, as tests/core/test_migrating.py does for verl.

Notation as in tests/core/test_migrating.py: ``logp`` the trainer's current log-probabilities (the leaf), ``old``
the trainer's before the update (prime-rl has none; AReaL's ``prox_logp``, NeMo-RL's ``prev_logprobs``, ROLL's and
OpenRLHF's ``old_log_probs``), ``roll`` the sampler's (AReaL's ``logprobs``/``old_logp`` from the inference engine,
NeMo-RL's ``generation_logprobs``, ROLL's ``infer_logprobs``, OpenRLHF's and SkyRL's ``rollout_log_probs``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
from test_migrating import B, T, _batch, _check, _differs, _ours, _ppo, _rejected_some, _seq_sum, _theirs

import offpolicy as op

UNBOUNDED = 1e30  # an upper bound no ratio reaches (offpolicy clamps log-ratios to [-20, 20]): the raw ratio


def _geo(x, mask):
    """Per-sequence masked mean of ``x`` (``[B, 1]``), the log of a geometric-mean ratio."""
    return _seq_sum(x, mask) / mask.sum(1, keepdim=True).clamp(min=1)


# ---------------------------------------------------------------------------------------------------------------
# prime-rl (PrimeIntellect-ai/prime-rl at 559b447, src/prime_rl/trainer/rl/loss.py)
# ---------------------------------------------------------------------------------------------------------------


def _prime_rl_loss(lp, roll, adv, mask, adv_tau, kl_tau, mask_low=math.inf, mask_high=math.inf, ipo=None):
    """``default_loss_fn`` (``ipo=None``) or ``ipo_loss_fn`` (``ipo=threshold``) per sample, summed over samples and
    divided by the rl token count (``compute_loss``'s ``rl_scale``): per token
    ``-keep * adv_tau * A * r + kl_tau * (log r)^2`` with ``r = p / q`` (not detached), ``keep`` the trust region on
    ``p - q`` (default: ``p - q > mask_high`` masked where ``A > 0``, ``< -mask_low`` where ``A <= 0``; ipo:
    ``|p - q| > ipo`` masked)."""
    log_r = lp - roll
    diff = lp.exp() - roll.exp()
    if ipo is None:
        masked = torch.where(adv > 0, diff > mask_high, diff < -mask_low)
    else:
        masked = diff.abs() > ipo
    m = mask.double()
    per_token = -(m * (~masked)) * adv_tau * adv * log_r.exp() + kl_tau * m * log_r ** 2
    return per_token.sum() / m.sum()


def _prime_rl_ours(logp, roll, mask, adv, adv_tau, kl_tau):
    """The row's mapping: an unclipped IS surrogate (PPO anchored at the sampler whose clip does not bind for
    ``0.01 <= r <= 1e6``) on ``adv_tau * A``, plus the trainer's own ``kl_tau * mean (log r)^2``."""
    leaf = logp.clone().requires_grad_()
    out = op.policy_loss_from_logprobs(
        leaf.reshape(-1), roll.reshape(-1), (adv_tau * adv).reshape(-1), loss_mask=mask.reshape(-1),
        correction=op.Correction(ppo_clip=(0.99, 1e6)), proximal_logprobs=roll.reshape(-1))
    m = mask.double()
    loss = out.loss + kl_tau * (m * (leaf - roll) ** 2).sum() / m.sum()
    loss.backward()
    return loss.detach(), leaf.grad


@pytest.mark.parametrize("kl_tau", [0.0, 1e-3])
def test_prime_rl_default_loss_without_trust_region(kl_tau):
    """prime-rl's default loss with the DPPO trust region open (``dppo_mask_low = dppo_mask_high = inf``):
    ``-adv_tau A r`` (gradient ``-adv_tau A r grad log p``, plain untruncated IS) plus ``kl_tau (log r)^2``, over
    the rl token count: offpolicy's unclipped surrogate on ``adv_tau * A`` plus the KL term added by the trainer."""
    logp, old, roll, mask, adv = _batch(50)
    r = (logp - roll).exp()[mask]
    assert bool((r > 0.01).all() & (r < 1e6).all())
    leaf = logp.clone().requires_grad_()
    theirs = _prime_rl_loss(leaf, roll, adv, mask, 0.5, kl_tau)
    theirs.backward()
    loss, grad = _prime_rl_ours(logp, roll, mask, adv, 0.5, kl_tau)
    assert abs(loss.item() - theirs.item()) <= 1e-12 * max(1.0, abs(theirs.item()))
    torch.testing.assert_close(grad, leaf.grad, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("seed", [50, 51, 52])
def test_prime_rl_ipo_defaults_since_3418(seed):
    """prime-rl#3418 (after 559b447) made IPO the only built-in loss and the default when ``[trainer.loss]`` is
    omitted, with ``ipo_threshold`` renamed ``eps`` (default 0.1; ``adv_tau`` 1, ``kl_tau`` 1e-3). The PR renames;
    the formula is 559b447's ``ipo_loss_fn`` (``_prime_rl_loss(..., ipo=eps)``): ``op.TrustRegion(eps, eps,
    sign="none", penalty=kl_tau)`` on the sampler's log-probabilities, token mean over the rl token count."""
    logp, old, roll, mask, adv = _batch(seed)
    eps, adv_tau, kl_tau = 0.1, 1.0, 1e-3
    gap = (logp.exp() - roll.exp()).abs()[mask]
    assert bool((gap > eps).any() & (gap <= eps).any())  # the trust region masks some tokens, not all
    leaf = logp.clone().requires_grad_()
    theirs = _prime_rl_loss(leaf, roll, adv, mask, adv_tau, kl_tau, ipo=eps)
    theirs.backward()
    out, grad = _ours(logp, old, roll, mask, adv,
                      op.Correction(trust_region=op.TrustRegion(eps, eps, sign="none", penalty=kl_tau)), proximal=None)
    assert abs(out.loss.item() - theirs.item()) <= 1e-12 * max(1.0, abs(theirs.item()))
    torch.testing.assert_close(grad, leaf.grad, rtol=1e-10, atol=1e-13)


# ---------------------------------------------------------------------------------------------------------------
# AReaL (inclusionAI/AReaL at 4aef98d, areal/utils/functional/functional.py: ppo_actor_loss_fn,
# apply_rejection_sampling; areal/utils/data.py: KLEstimator._compute_approx_kl). The binary_kl metric (KPop) and
# sapo_loss_fn: areal-project/AReaL at cbff54d645d2cd8ee1f1c358a82f3f473588433d, the same file
# (compute_binary_kl_divergence; ppo_actor_loss_fn still divides by the loss_mask count taken before rejection).
# ---------------------------------------------------------------------------------------------------------------

TR = op.TrustRegion


def _areal_binary_kl(log_p, log_q, eps=1e-8):
    """``compute_binary_kl_divergence``: Bernoulli KL with both probabilities clamped to ``[eps, 1 - eps]``."""
    p = torch.clamp(torch.exp(log_p), eps, 1.0 - eps)
    q = torch.clamp(torch.exp(log_q), eps, 1.0 - eps)
    return p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))


def _areal_rejection(prox, behave, mask, level, action, metric, agg, lower, upper):
    """``apply_rejection_sampling`` on the 2D padded layout: returns (``behave_imp_weight``, updated ``loss_mask``).
    ``log r = prox - behave``; metric ``ratio``: r (sequence level: aggregated in log space, and the weight becomes
    the geometric mean); ``kl_k1 = log r``, ``kl_k2 = (log r)^2 / 2``, ``kl_k3 = exp(-log r) - 1 + log r``,
    ``binary_kl`` the max of both clamped binary KLs (KPop); bounds ``lower <= metric <= upper`` (no lower bound
    when None)."""
    log_r = prox - behave
    metric_t = {"ratio": log_r.exp(), "kl_k1": log_r, "kl_k2": log_r ** 2 / 2,
                "kl_k3": (-log_r).exp() - 1 + log_r,
                "binary_kl": torch.maximum(_areal_binary_kl(prox, behave), _areal_binary_kl(behave, prox))}[metric]
    weight = log_r.exp()

    def inside(x):
        return (x <= upper) if lower is None else (x >= lower) & (x <= upper)

    keep = torch.ones_like(mask)
    if level == "sequence":
        values = log_r if metric == "ratio" else metric_t
        if metric == "ratio":
            weight = _geo(log_r, mask).exp().expand(B, T)
        if agg == "max":
            stat = values.masked_fill(~mask, -math.inf).max(1, keepdim=True).values
        else:
            stat = _seq_sum(values, mask) / (mask.sum(1, keepdim=True).clamp(min=1) if agg == "mean" else 1)
        stat = stat.exp() if metric == "ratio" else stat
        ok = inside(stat).expand(B, T)
        if action == "mask":
            keep = ok
        else:
            weight = torch.where(ok, weight, weight.clamp(lower or 0.0, upper))
    elif action == "mask":
        keep = inside(metric_t)
    else:
        weight = weight.clamp(lower or 0.0, upper)
    return torch.where(mask & keep, weight, 0.0), mask & keep


# (level, action, metric, agg, lower, upper) -> the Correction fields the row gives
AREAL_CASES = {
    ("token", "mask", "ratio", None, 0.7, 1.4): dict(weights="mis", bounds=(0.7, 1.4)),
    ("token", "clamp", "ratio", None, None, 1.5): dict(weights="tis", bounds=(0.0, 1.5)),
    ("token", "clamp", "ratio", None, 0.8, 1.5): dict(weights="tis", bounds=(0.8, 1.5)),
    ("sequence", "mask", "ratio", "mean", 0.9, 1.1): dict(weights="mis", bounds=(0.9, 1.1), level="geometric"),
    ("sequence", "clamp", "ratio", "mean", 0.9, 1.1): dict(weights="tis", bounds=(0.9, 1.1), level="geometric"),
    ("sequence", "mask", "ratio", "sum", 0.5, 1.5): dict(
        weights="mis", bounds=(0.0, UNBOUNDED), level="geometric",
        rejections=(op.RatioRejection(0.5, 1.5, "sequence"),)),
    ("token", "mask", "kl_k1", None, -0.3, 0.3): dict(
        weights="mis", bounds=(0.0, UNBOUNDED), rejections=(op.KLRejection((-0.3, 0.3), "k1"),)),
    ("sequence", "mask", "kl_k1", "sum", None, 0.2): dict(
        weights="mis", bounds=(0.0, UNBOUNDED), rejections=(op.KLRejection((-0.2, 20.0 * T), "k1", "seq_sum"),)),
    ("sequence", "mask", "kl_k2", "mean", None, 0.04): dict(
        weights="mis", bounds=(0.0, UNBOUNDED), rejections=(op.KLRejection(0.04, "k2", "seq_mean"),)),
    ("sequence", "mask", "kl_k2", "max", None, 0.08): dict(
        weights="mis", bounds=(0.0, UNBOUNDED), rejections=(op.KLRejection(0.08, "k2", "seq_max"),)),
    # KPop (cbff54d): token level, then the sequence's sum / mean / max of the divergence.
    ("token", "mask", "binary_kl", None, None, 0.05): dict(
        weights="mis", bounds=(0.0, UNBOUNDED), trust_region=TR(0.05, 0.05, "binary_kl_max", "none", on="weights")),
    ("sequence", "mask", "binary_kl", "sum", None, 0.2): dict(
        weights="mis", bounds=(0.0, UNBOUNDED),
        trust_region=TR(0.2, 0.2, "binary_kl_max", "none", "sequence", on="weights")),
    ("sequence", "mask", "binary_kl", "mean", None, 0.1): dict(
        weights="mis", bounds=(0.0, UNBOUNDED),
        trust_region=TR(0.1, 0.1, "binary_kl_max", "none", "geometric", on="weights")),
    ("sequence", "mask", "binary_kl", "max", None, 0.2): dict(
        weights="mis", bounds=(0.0, UNBOUNDED),
        trust_region=TR(0.2, 0.2, "binary_kl_max", "none", "sequence_max", on="weights")),
}


@pytest.mark.parametrize("case", sorted(AREAL_CASES, key=str))
def test_areal_rejection_sampling(case):
    """``actor.use_decoupled_loss=True`` with ``actor.rejection_sampling`` (level, action, metric, agg, lower,
    upper), ``eps_clip``, ``eps_clip_higher``, ``c_clip``: PPO on ``p / prox`` with dual clip, times the
    behaviour weight; masked tokens leave the numerator but the denominator is the original ``loss_mask`` count
    (``loss_mask_count`` is taken before rejection)."""
    logp, old, roll, mask, adv = _batch(60 + len(str(case)))
    w, keep = _areal_rejection(old, roll, mask, *case)
    if case[1] == "mask":
        _rejected_some(keep, mask)

    def theirs(lp):
        return w * _ppo(torch.exp(lp - old), adv, 0.2, 0.28, c=3.0), torch.ones_like(mask)

    corr = op.Correction(ppo_clip=(0.2, 0.28), dual_clip=3.0, **AREAL_CASES[case])
    _check(_ours(logp, old, roll, mask, adv, corr), _theirs(theirs, logp, "token-mean", mask))


@pytest.mark.parametrize("case", [("token", "mask", "kl_k3", None, None, 0.1),
                                  ("sequence", "mask", "kl_k1", "max", None, 0.2)])
def test_areal_kl_k3_and_seq_max_k1_not_supported(case):
    """AReaL's ``kl_k3`` is ``1 / r - 1 + log r`` (its help text says ``r - log r - 1``, offpolicy's ``k3``), and
    its sequence ``max`` of ``kl_k1`` bounds ``max_t log r_t``, where offpolicy's ``seq_max`` k1 bounds
    ``max_t (-log r_t)``: the nearest offpolicy rule gives a different loss."""
    logp, old, roll, mask, adv = _batch(70)
    w, keep = _areal_rejection(old, roll, mask, *case)
    _rejected_some(keep, mask)

    def theirs(lp):
        return w * _ppo(torch.exp(lp - old), adv, 0.2, 0.2), torch.ones_like(mask)

    rule = (op.KLRejection(0.1, "k3") if case[2] == "kl_k3" else op.KLRejection((-0.2, 20.0), "k1", "seq_max"))
    corr = op.Correction(ppo_clip=(0.2, 0.2), weights="mis", bounds=(0.0, UNBOUNDED), rejections=(rule,))
    _differs(_ours(logp, old, roll, mask, adv, corr), _theirs(theirs, logp, "token-mean", mask))


@pytest.mark.parametrize("decoupled", [False, True])
def test_areal_gspo_sequence_level(decoupled):
    """``actor.importance_sampling_level="sequence"`` (GSPO): the PPO ratio is ``exp(mean_t log(p / prox))`` with
    its gradient, the advantage the sequence mean; token mean over ``loss_mask``. Without ``use_decoupled_loss``
    prox is the behaviour policy itself."""
    logp, old, roll, mask, adv = _batch(71)
    prox = old if decoupled else roll

    def theirs(lp):
        s = _geo(lp - prox, mask).exp().expand(B, T)
        return _ppo(s, adv, 3e-3, 4e-3), torch.ones_like(mask)

    corr = op.Correction(ppo_clip=(3e-3, 4e-3), ppo_ratio="gspo_token")
    _check(_ours(logp, prox, roll, mask, adv, corr, proximal="old"), _theirs(theirs, logp, "token-mean", mask))


def _areal_sapo(lp, old_logp, adv, mask, tau_pos, tau_neg, level="token"):
    """``sapo_loss_fn`` (cbff54d), 2D padded: ``log_ratio = logprobs - old_logprobs`` (no clamp); at
    ``importance_sampling_level="sequence"`` the ratio is ``exp`` of the row's masked mean log-ratio and the
    advantage the row's masked mean (``_compute_sequence_level_ratio_and_advantages``); the gate
    ``sigmoid(tau (ratio - 1)) * 4 / tau`` with ``tau_pos`` where the advantage is ``> 0``, else ``tau_neg``;
    ``-soft_gate * advantages``, summed over ``loss_mask`` and divided by its count (the ``_theirs`` token mean)."""
    log_ratio = lp - old_logp
    if level == "sequence":
        ratio = _geo(log_ratio, mask).exp().expand(B, T)
        adv = _geo(adv, mask).expand(B, T)
    else:
        ratio = torch.exp(log_ratio)
    scaled_gate_pos = torch.sigmoid(tau_pos * (ratio - 1.0)) * (4.0 / tau_pos)
    scaled_gate_neg = torch.sigmoid(tau_neg * (ratio - 1.0)) * (4.0 / tau_neg)
    soft_gate = torch.where(adv > 0, scaled_gate_pos, scaled_gate_neg)
    return -soft_gate * adv, torch.ones_like(mask)


@pytest.mark.parametrize("taus", [(1.0, 1.05), (0.5, 3.0)])
def test_areal_sapo(taus):
    """``actor.use_sapo_loss=True``, ``sapo_tau_pos`` / ``sapo_tau_neg`` (AReaL refuses it with
    ``use_decoupled_loss=True``): the ratio is against ``old_logp`` (the engine's, here ``roll``), token mean over
    ``loss_mask``: offpolicy's SAPO with ``proximal_logprobs`` and ``sampler_logprobs`` both ``old_logp`` (no
    weights), as the ``use_decoupled_loss=False`` row. The same gate as TRL's."""
    logp, _, roll, mask, adv = _batch(72)
    _check(_ours(logp, roll, roll, mask, adv, op.Correction(sapo=taus)),
           _theirs(lambda lp: _areal_sapo(lp, roll, adv, mask, *taus), logp, "token-mean", mask))


def test_areal_sapo_sequence_level():
    """``importance_sampling_level="sequence"`` with SAPO gates the sequence's geometric-mean ratio (with its
    gradient) on the sequence's mean advantage: ``sapo_level="sequence"`` with the advantages replaced by each
    sequence's masked mean (here already constant along each sequence, as GRPO's). Token-level SAPO differs."""
    logp, _, roll, mask, adv = _batch(73)
    theirs = _theirs(lambda lp: _areal_sapo(lp, roll, adv, mask, 1.0, 1.05, "sequence"), logp, "token-mean", mask)
    mean_adv = _geo(adv, mask).expand(B, T)
    _check(_ours(logp, roll, roll, mask, mean_adv, op.Correction(sapo=(1.0, 1.05), sapo_level="sequence")), theirs)
    _differs(_ours(logp, roll, roll, mask, adv, op.Correction(sapo=(1.0, 1.05))), theirs)


# ---------------------------------------------------------------------------------------------------------------
# ROLL (alibaba/ROLL at 8eb27cc, roll/pipeline/rlvr/actor_worker.py, roll/utils/train_infer_corrections.py,
# roll/utils/functionals.py: agg_loss)
# ---------------------------------------------------------------------------------------------------------------


def _roll_ratios(old, roll, mask):
    """``_compute_all_granularity``: the token ratio ``old / infer``, the geometric mean and the product over the
    sequence (``[B, T]``), and the probability difference ``exp(old) - exp(infer)`` per token."""
    log_r = old - roll
    return {"token": log_r.exp(), "geometric": _geo(log_r, mask).exp().expand(B, T),
            "sequence": _seq_sum(log_r, mask).exp().expand(B, T)}, old.exp() - roll.exp()


ROLL_CASES = {  # (is_weight weight_type, upper_bound, filter agg_type, ratio_low, ratio_high, dual_clip_loss)
    ("token", 1.5, None, None, None, False): dict(weights="tis", bounds=(0.0, 1.5)),
    ("geometric", 1.2, None, None, None, True): dict(weights="tis", bounds=(0.0, 1.2), level="geometric"),
    ("sequence", 2.0, None, None, None, False): dict(weights="tis", bounds=(0.0, 2.0), level="sequence"),
    (None, None, "token", 0.8, 1.25, False): dict(rejections=(op.RatioRejection(0.8, 1.25, "token"),)),
    ("token", 1.5, "geometric", 0.9, 1.1, True): dict(
        weights="tis", bounds=(0.0, 1.5), rejections=(op.RatioRejection(0.9, 1.1, "geometric"),)),
    (None, None, "sequence", 0.6, 1.6, False): dict(rejections=(op.RatioRejection(0.6, 1.6, "sequence"),)),
}


@pytest.mark.parametrize("case", sorted(ROLL_CASES, key=str))
def test_roll_train_infer_correction(case):
    """``train_infer_correction.is_weight`` (``weight_type``, ``upper_bound``: ``clamp(ratio, 0, ub)``) and a
    ``filters`` entry with ``ratio_enabled`` (``agg_type``, ``ratio_low <= ratio <= ratio_high``), PPO with
    ``pg_clip`` and ``dual_clip_loss`` (whose bound is ``1 + 2 pg_clip``), the default
    ``loss_agg_mode="seq-mean-token-mean"``: filtered tokens leave ``final_response_mask``, so each sample's token
    mean, while ``global_valid_samples`` (counted before the filter) stays the divisor."""
    weight_type, ub, agg, lo, hi, dual = case
    logp, old, roll, mask, adv = _batch(80 + len(str(case)))
    ratio, _ = _roll_ratios(old, roll, mask)
    w = ratio[weight_type].clamp(0.0, ub) if weight_type else torch.ones_like(old)
    keep = ((ratio[agg] >= lo) & (ratio[agg] <= hi)) if agg else torch.ones_like(mask)
    if agg:
        _rejected_some(keep, mask)

    def theirs(lp):
        return w * _ppo(torch.exp(lp - old), adv, 0.2, 0.2, c=1.4 if dual else None), keep

    corr = op.Correction(ppo_clip=(0.2, 0.2), dual_clip=1.4 if dual else None, rejected_in_normalizer=False,
                         **ROLL_CASES[case])
    _check(_ours(logp, old, roll, mask, adv, corr, aggregation="seq_mean_token_mean", num_sequences=float(B)),
           _theirs(theirs, logp, ("sample-mean", B), mask))


def test_roll_seq_importance_sampling():
    """``importance_sampling="seq"``: the PPO ratio is ``exp(masked_mean_t log(p / old))`` with its gradient
    (GSPO); with a sequence-constant advantage GSPO-token has its value and gradient."""
    logp, old, roll, mask, adv = _batch(88)

    def theirs(lp):
        return _ppo(_geo(lp - old, mask).exp().expand(B, T), adv, 3e-3, 4e-3), torch.ones_like(mask)

    corr = op.Correction(ppo_clip=(3e-3, 4e-3), ppo_ratio="gspo_token")
    _check(_ours(logp, old, roll, mask, adv, corr, aggregation="seq_mean_token_mean"),
           _theirs(theirs, logp, ("sample-mean", B), mask))


def _roll_segment_mean(x, mask):
    """Transcription of ROLL's ``compute_segment_masked_mean`` (roll/pipeline/agentic/utils.py, read from its
    source): per row of ``[B, T]``, every maximal run of ones in the mask is one segment; each position of the run
    gets the mean of ``x`` over the run, positions outside runs 0."""
    out = torch.zeros_like(x)
    for b in range(mask.shape[0]):
        t = 0
        while t < mask.shape[1]:
            if not mask[b, t]:
                t += 1
                continue
            end = t
            while end < mask.shape[1] and mask[b, end]:
                end += 1
            out[b, t:end] = x[b, t:end].mean()
            t = end
    return out


@pytest.mark.parametrize("ub", [1.3, 1e30])
def test_roll_segment_is_weight(ub):
    """``is_weight`` with ``weight_type="segment"`` (``ratio_segment = exp(compute_segment_masked_mean(old - infer,
    response_mask))``, then ``clamp(0, upper_bound)``) on multi-turn rows (observation tokens split each row into
    turns), under PPO with ``pg_clip`` and ``seq-mean-token-mean``: ``weights="tis", bounds=(0, ub),
    level="segment"`` with ``segment_ids`` = each token's run index in its row."""
    logp, old, roll, mask, adv = _batch(91)
    mask = mask.clone()
    mask[:, 2] = False  # an observation token: rows longer than 3 hold two or three turns
    mask[:, 4] = False
    w = _roll_segment_mean(old - roll, mask).exp().clamp(0.0, ub)
    starts = torch.diff(mask.long(), dim=1, prepend=torch.zeros(B, 1, dtype=torch.long)) == 1
    turn = torch.cumsum(starts.long(), dim=1)
    assert int(turn.max()) == 3

    def theirs(lp):
        return w * _ppo(torch.exp(lp - old), adv, 0.2, 0.2), torch.ones_like(mask)

    corr = op.Correction(weights="tis", bounds=(0.0, ub), level="segment", ppo_clip=(0.2, 0.2))
    _check(_ours(logp, old, roll, mask, adv, corr, aggregation="seq_mean_token_mean",
                 segment_ids=turn.reshape(-1)),
           _theirs(theirs, logp, "seq-mean-token-mean", mask))


# ---------------------------------------------------------------------------------------------------------------
# SkyRL (NovaSky-AI/SkyRL at a956457; skyrl 0.3.0 as installed in .venv-trainers has the same code:
# skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py, ppo_utils.py: ppo_policy_loss, reduce_loss)
# ---------------------------------------------------------------------------------------------------------------

SKYRL_CASES = {  # (tis_ratio_type, cap, sequence_mask_metric, low, high, token mask (low, high), outlier_low)
    ("token", 2.0, None, None, None, None, None): dict(weights="tis", bounds=(0.0, 2.0)),
    ("sequence", 3.0, None, None, None, None, None): dict(weights="tis", bounds=(0.0, 3.0), level="sequence"),
    (None, None, "geometric", 0.95, 1.05, None, None): dict(rejections=(op.RatioRejection(0.95, 1.05, "geometric"),)),
    ("token", 2.0, "product", 0.7, 1.4, None, None): dict(
        weights="tis", bounds=(0.0, 2.0), rejections=(op.RatioRejection(0.7, 1.4, "sequence"),)),
    (None, None, None, None, None, (0.8, 1.25), None): dict(rejections=(op.RatioRejection(0.8, 1.25, "token"),)),
    ("token", 2.0, None, None, None, None, 0.6): dict(weights="tis", bounds=(0.0, 2.0), veto=0.6),
}


def _skyrl_correction(old, roll, mask, tis, cap, seq_metric, lo, hi, token_band, outlier_low, outlier_high=None):
    """``compute_off_policy_correction``: the outlier mask (a sequence with any token ``r < low`` or ``r > high``
    is dropped), the token mask (``low <= r <= high``), the TIS ratio (``min(r, cap)``, token or sequence
    product) and the sequence mask (geometric mean or product in ``[low, high]``, over the tokens still in the
    mask), ``r = old / rollout``. Returns (weight, kept mask)."""
    log_r = old - roll
    r = log_r.exp()
    keep = mask.clone()
    if outlier_low is not None or outlier_high is not None:
        bad = ((r < outlier_low) if outlier_low is not None else torch.zeros_like(mask))
        bad = bad | ((r > outlier_high) if outlier_high is not None else torch.zeros_like(mask))
        keep = keep & ~(bad & mask).any(1, keepdim=True)
    if token_band is not None:
        keep = keep & (r >= token_band[0]) & (r <= token_band[1])
    w = torch.ones_like(old)
    if tis == "token":
        w = r.clamp(max=cap)
    elif tis == "sequence":
        w = _seq_sum(log_r, keep).exp().clamp(max=cap).expand(B, T)
    if seq_metric is not None:
        stat = (_geo(log_r, keep) if seq_metric == "geometric" else _seq_sum(log_r, keep)).exp()
        keep = keep & ((stat >= lo) & (stat <= hi)).expand(B, T)
    return w, keep


@pytest.mark.parametrize("case", sorted(SKYRL_CASES, key=str))
@pytest.mark.parametrize("dual_clip", [False, True])
def test_skyrl_off_policy_correction(case, dual_clip):
    """``trainer.algorithm.off_policy_correction`` (tis_ratio_type, token/sequence_tis_ratio_clip_high,
    sequence_mask_metric with geo_mask_* / product_mask_*, token_mask_is_threshold_*,
    outlier_token_is_threshold_low) on ``policy_loss_type="regular"`` / ``"dual_clip"`` (``clip_ratio_c``):
    ``reduce_loss`` sums ``loss * loss_mask`` with the corrected mask on advantages that
    ``apply_loss_reduction_to_advantages_minibatch`` divided by the original token count (token_mean), so a
    rejected token stays in the normaliser."""
    logp, old, roll, mask, adv = _batch(90 + len(str(case)))
    w, keep = _skyrl_correction(old, roll, mask, *case)
    if case[2] or case[5] or case[6]:
        _rejected_some(keep, mask)
    c = 3.0 if dual_clip else None

    def theirs(lp):
        return w * _ppo(torch.exp(lp - old), adv, 0.2, 0.28, c=c), keep

    corr = op.Correction(ppo_clip=(0.2, 0.28), dual_clip=c, **SKYRL_CASES[case])
    _check(_ours(logp, old, roll, mask, adv, corr),
           _theirs(theirs, logp, ("constant", float(mask.sum())), mask))


def test_skyrl_masks_that_compose_not_supported():
    """SkyRL's sequence mask after a token mask averages over the surviving tokens, offpolicy's geometric ratio
    over all trained tokens: it differs from the nearest Correction. Exact by hand: SkyRL's mask passed as
    ``loss_mask`` with ``num_loss_tokens`` = the original count. (``outlier_token_is_threshold_high`` is
    ``veto_high``: tests/core/test_veto_high.py.)"""
    logp, old, roll, mask, adv = _batch(99)
    for case, nearest in [((None, None, "geometric", 0.97, 1.03, (0.8, 1.25), None),
                           dict(rejections=(op.RatioRejection(0.8, 1.25), op.RatioRejection(0.97, 1.03,
                                                                                              "geometric"))))]:
        w, keep = _skyrl_correction(old, roll, mask, *case)
        _rejected_some(keep, mask)

        def theirs(lp):
            return w * _ppo(torch.exp(lp - old), adv, 0.2, 0.28), keep

        reference = _theirs(theirs, logp, ("constant", float(mask.sum())), mask)
        _differs(_ours(logp, old, roll, mask, adv, op.Correction(ppo_clip=(0.2, 0.28), **nearest)), reference)
        _check(_ours(logp, old, roll, keep, adv, op.Correction(ppo_clip=(0.2, 0.28)),
                     num_loss_tokens=float(mask.sum())), reference)


@pytest.mark.parametrize("loss_type", ["cispo_old", "cispo_rollout", "gspo"])
def test_skyrl_cispo_and_gspo(loss_type):
    """``policy_loss_type="cispo"``: ``-A sg(clamp(p / anchor, 1 - cispo_eps_clip_low, 1 + cispo_eps_clip_high))
    log p`` with ``cispo.cispo_anchor="old"`` (``old``) or ``"rollout"`` (the sampler's); ``"gspo"``: GSPO-token,
    ``s = sg(exp(masked_mean_t log(p / old))) p / sg(p)`` in PPO's surrogate; both summed over the mask on
    token_mean-scaled advantages."""
    logp, old, roll, mask, adv = _batch(97)
    anchor = roll if loss_type == "cispo_rollout" else old

    def theirs(lp):
        if loss_type == "gspo":
            s = (lp - lp.detach() + _geo(lp.detach() - old, mask)).exp()
            return _ppo(s, adv, 3e-3, 4e-3), torch.ones_like(mask)
        return -torch.exp(lp.detach() - anchor).clamp(0.8, 1.28) * adv * lp, torch.ones_like(mask)

    corr = (op.Correction(ppo_clip=(3e-3, 4e-3), ppo_ratio="gspo_token") if loss_type == "gspo"
            else op.Correction(cispo=(0.8, 1.28)))
    _check(_ours(logp, anchor, roll, mask, adv, corr), _theirs(theirs, logp, ("constant", float(mask.sum())), mask))


# ---------------------------------------------------------------------------------------------------------------
# NeMo-RL (NVIDIA-NeMo/RL at 7ea279a, nemo_rl/algorithms/loss/loss_functions.py: ClippedPGLossFn)
# ---------------------------------------------------------------------------------------------------------------

NEMO_CASES = {  # (use_importance_sampling_correction, truncated_importance_sampling_type, ratio_min, ratio)
    (False, None, None, None): dict(),
    (True, None, None, None): dict(weights="mis", bounds=(0.0, UNBOUNDED)),
    (True, "tis", None, 1.5): dict(weights="tis", bounds=(0.0, 1.5)),
    (True, "tis", 0.8, 1.5): dict(weights="tis", bounds=(0.8, 1.5)),
    (True, "icepop", 0.8, 1.25): dict(weights="mis", bounds=(0.8, 1.25)),
    (True, "seq-mask-tis", 0.95, 1.05): dict(weights="mis", bounds=(0.0, UNBOUNDED),
                                            rejections=(op.RatioRejection(0.95, 1.05, "geometric"),)),
}


def _nemo_weight(old, roll, mask, use_is, kind, lo, hi):
    """The actor importance weight ``exp(prev - generation)`` after ``truncated_importance_sampling_type``:
    ``tis`` clamps to ``[min or 0, ratio]``, ``icepop`` zeroes outside ``[min, ratio]``, ``seq-mask-tis`` zeroes
    sequences whose geometric mean lies outside; ones when the correction is off."""
    if not use_is:
        return torch.ones_like(old)
    r = (old - roll).exp()
    if kind == "tis":
        return r.clamp(lo or 0.0, hi)
    if kind == "icepop":
        return torch.where((r >= lo) & (r <= hi), r, 0.0)
    if kind == "seq-mask-tis":
        g = _geo(old - roll, mask).exp()
        return r * ((g >= lo) & (g <= hi))
    return r


@pytest.mark.parametrize("case", sorted(NEMO_CASES, key=str))
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_nemo_rl_clipped_pg(case, dual_clip):
    """``loss_fn``: ``ratio_clip_min``, ``ratio_clip_max``, ``ratio_clip_c`` (dual clip where ``A < 0``),
    ``use_importance_sampling_correction`` with ``truncated_importance_sampling_type``,
    ``truncated_importance_sampling_ratio`` and ``_ratio_min``; ``token_level_loss=True``: the token mean over
    ``token_mask * sample_mask`` (``global_valid_toks``), zeroed weights staying in it."""
    logp, old, roll, mask, adv = _batch(100 + len(str(case)))
    w = _nemo_weight(old, roll, mask, *case)

    def theirs(lp):
        return w * _ppo(torch.exp(lp - old), adv, 0.2, 0.28, c=dual_clip), torch.ones_like(mask)

    corr = op.Correction(ppo_clip=(0.2, 0.28), dual_clip=dual_clip, **NEMO_CASES[case])
    _check(_ours(logp, old, roll, mask, adv, corr), _theirs(theirs, logp, "token-mean", mask))


@pytest.mark.parametrize("cap", [None, 3.0])
def test_nemo_rl_sequence_level_importance_ratios(cap):
    """``sequence_level_importance_ratios=True`` with ``token_level_loss=False`` (GSPO): the PPO ratio is
    ``exp(masked_mean_t log(p / prev))`` with its gradient, the importance weight the sequence product
    ``exp(sum_t (prev - generation))`` (clamped to ``[0, ratio]`` with ``tis``); each sample's token mean, averaged
    over samples."""
    logp, old, roll, mask, adv = _batch(110)
    w = _seq_sum(old - roll, mask).exp().expand(B, T)
    w = w.clamp(0.0, cap) if cap else w

    def theirs(lp):
        return w * _ppo(_geo(lp - old, mask).exp().expand(B, T), adv, 3e-3, 4e-3), torch.ones_like(mask)

    corr = op.Correction(ppo_clip=(3e-3, 4e-3), ppo_ratio="gspo_token", weights="tis",
                         bounds=(0.0, cap or UNBOUNDED), level="sequence")
    _check(_ours(logp, old, roll, mask, adv, corr, aggregation="seq_mean_token_mean"),
           _theirs(theirs, logp, "seq-mean-token-mean", mask))


def test_nemo_rl_cispo_and_force_on_policy_ratio():
    """``use_cispo=True``: ``-A sg(clamp(p / prev, 1 - ratio_clip_min, 1 + ratio_clip_max)) log p``;
    ``force_on_policy_ratio=True``: ``prev`` is ``p`` detached, so the PPO ratio is 1 with PPO's gradient."""
    logp, old, roll, mask, adv = _batch(111)

    def cispo(lp):
        return -torch.exp(lp.detach() - old).clamp(0.8, 1.28) * adv * lp, torch.ones_like(mask)

    _check(_ours(logp, old, roll, mask, adv, op.Correction(cispo=(0.8, 1.28))),
           _theirs(cispo, logp, "token-mean", mask))

    def on_policy(lp):
        return _ppo(torch.exp(lp - lp.detach()), adv, 0.2, 0.28), torch.ones_like(mask)

    _check(_ours(logp, logp.detach(), roll, mask, adv, op.Correction(ppo_clip=(0.2, 0.28))),
           _theirs(on_policy, logp, "token-mean", mask))


def test_nemo_rl_disable_ppo_ratio():
    """``disable_ppo_ratio=True`` (REINFORCE) with ``truncated_importance_sampling_type="tis"``: the per-token loss
    is ``-w A log p`` with ``w = clamp(prev / generation, 0, C)``; with ``prev`` the current policy (one update per
    rollout) that is offpolicy's TIS weight on the current ``p / q``, no ``proximal_logprobs``."""
    logp, _, roll, mask, adv = _batch(112)
    w = (logp - roll).exp().clamp(0.0, 1.5)

    def theirs(lp):
        return -w * adv * lp, torch.ones_like(mask)

    _check(_ours(logp, None, roll, mask, adv, op.Correction(weights="tis", bounds=(0.0, 1.5)), proximal=None),
           _theirs(theirs, logp, "token-mean", mask))


# ---------------------------------------------------------------------------------------------------------------
# OpenRLHF (openrlhf 0.11.2 on PyPI, openrlhf/models/loss.py: PolicyLoss, aggregate_loss)
# ---------------------------------------------------------------------------------------------------------------


def _openrlhf_policy_loss(lp, old, adv, mask, roll, clip=(0.2, 0.2), dual_clip=None, token_level_loss=True,
                          policy_loss_type="ppo", level="off", mode="mask", gating="ratio", threshold=(0.5, 5.0),
                          eps=0.0):
    """``PolicyLoss.forward`` (single rank, ``dp_size=1``, no global counts): ``eps`` is the ``1e-8`` OpenRLHF adds
    to each sample's token count in the per-sample mean (0 in the row tests, 1e-8 against the package)."""
    m = mask.double()
    if policy_loss_type == "ppo":
        ratio = (lp - old).clamp(-20.0, 20.0).exp()
    else:
        log_ratio = lp - roll if level != "off" else lp - old
        ratio = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1)).exp().unsqueeze(-1) * m
        token_level_loss = False
    surr1, surr2 = ratio * adv, ratio.clamp(1 - clip[0], 1 + clip[1]) * adv
    if dual_clip is None:
        loss = -torch.min(surr1, surr2)
    else:
        clip1 = torch.min(surr1, surr2)
        loss = -torch.where(adv < 0, torch.max(clip1, dual_clip * adv), clip1)
    if level != "off" and policy_loss_type == "ppo":
        low, high = threshold
        is_log_ratio = old - roll
        token_is = is_log_ratio.exp()
        if gating == "ratio":
            stat = ((is_log_ratio * m).sum(-1) / m.sum(-1)).unsqueeze(-1) if level == "seq" else is_log_ratio
            stat = stat.exp()
        else:
            p, q = roll.exp().clamp(1e-6, 1 - 1e-6), old.exp().clamp(1e-6, 1 - 1e-6)
            stat = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log() if gating == "binary_kl" else (p - q).abs()
            stat = ((stat * m).sum(-1) / m.sum(-1)).unsqueeze(-1) if level == "seq" else stat
        if mode == "clip":
            coef = stat.clamp(low, high)
        else:
            coef = torch.where((stat >= low) & (stat <= high), token_is, 0.0)
        loss = coef * loss
    if token_level_loss:
        return (loss * m).sum() / m.sum()
    counts = m.sum(-1)
    seq_loss = (loss * m).sum(-1) / (counts + eps)
    seq_mask = (counts > 0).double()
    return (seq_loss * seq_mask).sum() / seq_mask.sum()


OPENRLHF_CASES = {  # (is_correction_level, _mode, _gating, _threshold) -> Correction fields
    ("off", "mask", "ratio", (0.5, 5.0)): dict(),
    ("token", "clip", "ratio", (0.5, 2.0)): dict(weights="tis", bounds=(0.5, 2.0)),
    ("token", "mask", "ratio", (0.8, 1.25)): dict(weights="mis", bounds=(0.8, 1.25)),
    ("seq", "mask", "ratio", (0.95, 1.05)): dict(weights="mis", bounds=(0.0, UNBOUNDED),
                                                rejections=(op.RatioRejection(0.95, 1.05, "geometric"),)),
}


def _openrlhf_ours_and_theirs(case, dual_clip, seed):
    logp, old, roll, mask, adv = _batch(seed)
    level, mode, gating, threshold = case

    def theirs():
        leaf = logp.clone().requires_grad_()
        loss = _openrlhf_policy_loss(leaf, old, adv, mask, roll, (0.2, 0.28), dual_clip, level=level, mode=mode,
                                     gating=gating, threshold=threshold)
        loss.backward()
        return loss.detach(), leaf.grad

    return (logp, old, roll, mask, adv), theirs()


@pytest.mark.parametrize("case", sorted(OPENRLHF_CASES, key=str))
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_openrlhf_policy_loss(case, dual_clip):
    """``--actor.eps_clip_low_high``, ``--actor.dual_clip``, ``--algo.advantage.is_correction_level`` /
    ``_mode`` / ``_gating=ratio`` / ``_threshold`` with ``policy_loss_type="ppo"`` (token mean): ``clip`` clamps
    ``old / rollout`` to ``[low, high]`` per token; ``mask`` keeps the token ratio where the token (or the
    sequence's geometric mean) lies in ``[low, high]`` and zeroes it elsewhere, ``action_mask`` unchanged."""
    (logp, old, roll, mask, adv), reference = _openrlhf_ours_and_theirs(case, dual_clip, 120 + len(str(case)))
    corr = op.Correction(ppo_clip=(0.2, 0.28), dual_clip=dual_clip, **OPENRLHF_CASES[case])
    _check(_ours(logp, old, roll, mask, adv, corr), reference)


@pytest.mark.parametrize("is_correction", [False, True])
def test_openrlhf_gspo(is_correction):
    """``--actor.policy_loss_type gspo``: the ratio is ``exp(mean_t log(p / old))`` (``p / rollout`` when an
    is_correction level is set, and then no IS weight), its gradient kept; the loss is the per-sample mean."""
    logp, old, roll, mask, adv = _batch(130)
    leaf = logp.clone().requires_grad_()
    loss = _openrlhf_policy_loss(leaf, old, adv, mask, roll, (3e-3, 4e-3), policy_loss_type="gspo",
                                 level="token" if is_correction else "off")
    loss.backward()
    anchor = roll if is_correction else old
    corr = op.Correction(ppo_clip=(3e-3, 4e-3), ppo_ratio="gspo_token")
    _check(_ours(logp, anchor, roll, mask, adv, corr, aggregation="seq_mean_token_mean"), (loss.detach(), leaf.grad))


@pytest.mark.parametrize("gating", ["binary_kl", "tv"])
def test_openrlhf_divergence_gating_not_supported(gating):
    """``--algo.advantage.is_correction_gating binary_kl`` / ``tv`` gates on the sampled token's Bernoulli KL or
    ``|p - q|`` between rollout and trainer probabilities: a probability-difference trust region offpolicy has not
    yet; the nearest ratio band differs."""
    logp, old, roll, mask, adv = _batch(131)
    leaf = logp.clone().requires_grad_()
    loss = _openrlhf_policy_loss(leaf, old, adv, mask, roll, level="token", mode="mask", gating=gating,
                                 threshold=(0.0, 0.005 if gating == "binary_kl" else 0.03))
    loss.backward()
    corr = op.Correction(ppo_clip=(0.2, 0.2), weights="mis", bounds=(0.9, 1.1))
    _differs(_ours(logp, old, roll, mask, adv, corr), (loss.detach(), leaf.grad))


PEERS_VENV = Path(os.environ.get("OFFPOLICY_PEERS_VENV", Path(__file__).resolve().parents[2] / ".venv-trainers"))

_DRIVER = r"""
import importlib, json, os, site, sys, types
import torch
sys.modules["deepspeed"] = types.ModuleType("deepspeed")  # openrlhf.models.utils imports it; the loss does not use it
for name in ("openrlhf", "openrlhf.models"):  # skip the package __init__s (they import the trainer stack)
    mod = types.ModuleType(name)
    mod.__path__ = [os.path.join(site.getsitepackages()[0], *name.split("."))]
    sys.modules[name] = mod
loss_mod = importlib.import_module("openrlhf.models.loss")
data = torch.load(sys.argv[1])
out = []
for kw in json.loads(sys.argv[2]):
    leaf = data["logp"].clone().requires_grad_()
    fn = loss_mod.PolicyLoss(**kw)
    loss = fn(leaf, data["old"], data["adv"], action_mask=data["mask"].double(), rollout_log_probs=data["roll"])[0]
    loss.backward()
    out.append({"loss": loss.item(), "grad": leaf.grad.tolist()})
print(json.dumps(out))
"""


def test_openrlhf_transcription_matches_the_package(tmp_path):
    """The transcription above against openrlhf 0.11.2's own ``PolicyLoss`` (loaded from ``.venv-trainers``, where
    ``tools/setup_test_envs.sh`` installs it without its dependencies; ``OFFPOLICY_PEERS_VENV`` names another), every
    row's configuration plus the GSPO and divergence-gating rows: loss 1e-12 relative, gradient 1e-10."""
    python = PEERS_VENV / "bin" / "python"
    if not python.exists():
        pytest.skip(f"{PEERS_VENV} is missing: run tools/setup_test_envs.sh (or set OFFPOLICY_PEERS_VENV to a venv "
                    "with openrlhf==0.11.2 installed --no-deps beside torch and numpy)")
    logp, old, roll, mask, adv = _batch(140)
    torch.save({"logp": logp, "old": old, "roll": roll, "mask": mask, "adv": adv}, tmp_path / "batch.pt")
    configs = []
    for (level, mode, gating, threshold) in OPENRLHF_CASES:
        for dual_clip in (None, 3.0):
            configs.append(dict(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=dual_clip, is_correction_level=level,
                                is_correction_mode=mode, is_correction_gating=gating,
                                is_correction_threshold=list(threshold)))
    configs += [dict(clip_eps_low=3e-3, clip_eps_high=4e-3, policy_loss_type="gspo", is_correction_level=lv)
                for lv in ("off", "token")]
    configs += [dict(is_correction_level="token", is_correction_gating=g, is_correction_threshold=[0.0, t])
                for g, t in (("binary_kl", 0.005), ("tv", 0.03))]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run([str(python), "-c", _DRIVER, str(tmp_path / "batch.pt"), json.dumps(configs)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for kw, got in zip(configs, results):
        leaf = logp.clone().requires_grad_()
        ours = _openrlhf_policy_loss(
            leaf, old, adv, mask, roll, (kw.get("clip_eps_low", 0.2), kw.get("clip_eps_high", 0.2)),
            kw.get("dual_clip"), policy_loss_type=kw.get("policy_loss_type", "ppo"),
            level=kw["is_correction_level"], mode=kw.get("is_correction_mode", "mask"),
            gating=kw.get("is_correction_gating", "ratio"),
            threshold=tuple(kw.get("is_correction_threshold", (0.5, 5.0))), eps=1e-8)
        ours.backward()
        assert abs(ours.item() - got["loss"]) <= 1e-12 * max(1.0, abs(got["loss"])), kw
        torch.testing.assert_close(leaf.grad, torch.tensor(got["grad"], dtype=torch.float64), rtol=1e-10,
                                   atol=1e-13, msg=str(kw))
