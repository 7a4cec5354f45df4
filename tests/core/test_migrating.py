"""Every row of docs/migrating.md: the peer's formula, written here from its documentation and source semantics
(verl 0.9.1, TRL 1.16, slime and Miles at the revisions named in docs/migrating.md) in plain float64 torch on a
padded ``[B, T]`` batch, against ``op.policy_loss_from_logprobs`` with the arguments the row names (loss value to
1e-12 relative, gradient with respect to the trainer's log-probabilities to 1e-10). Rows marked "not supported"
have a test that shows the difference (the losses differ) and, where the page names one, the exact workaround.

Notation: ``logp`` the trainer's current log-probabilities (the leaf), ``old`` the trainer's log-probabilities
before the update (verl's pi_old, TRL's old_per_token_logps, slime's log_probs), ``roll`` the sampler's (rollout,
vLLM, SGLang).
"""

from __future__ import annotations

import math

import pytest
import torch

import offpolicy as op

B, T = 5, 7


def _batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    roll = torch.log(torch.rand(B, T, generator=gen, dtype=torch.float64) * 0.9 + 0.05)
    old = roll + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    logp = old + 0.2 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    logp, old = logp.clamp(max=-1e-3), old.clamp(max=-1e-3)
    lengths = torch.tensor([7, 3, 5, 1, 6])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    adv = torch.randn(B, generator=gen, dtype=torch.float64)[:, None].expand(B, T).clone()
    return logp, old, roll, mask, adv


def _ours(logp, old, roll, mask, adv, corr, proximal="old", **kw):
    leaf = logp.clone().requires_grad_()
    prox = {"old": old, "roll": roll, None: None}[proximal]
    out = op.policy_loss_from_logprobs(
        leaf.reshape(-1), roll.reshape(-1), adv.reshape(-1), loss_mask=mask.reshape(-1), correction=corr,
        seq_ids=torch.arange(B)[:, None].expand(B, T).reshape(-1),
        proximal_logprobs=None if prox is None else prox.reshape(-1), **kw)
    out.loss.backward()
    return out, leaf.grad


def _theirs(per_token_loss_fn, logp, agg, mask):
    """The peer's aggregation of ``per_token_loss_fn(leaf) -> (loss [B, T], keep [B, T] bool)`` over the tokens
    of ``mask & keep``; ``("sample-mean-full-denominator", n)``: slime's per-sample mean whose numerator uses
    ``mask & keep`` and whose denominators are the original per-sample token counts, summed and divided by
    ``n`` samples."""
    leaf = logp.clone().requires_grad_()
    loss_bt, keep = per_token_loss_fn(leaf)
    m = (mask & keep).double()
    if agg == "token-mean":
        loss = (loss_bt * m).sum() / m.sum()
    elif agg == "token-sum":
        loss = (loss_bt * m).sum()
    elif agg == "seq-mean-token-mean":
        rows = m.sum(1) > 0
        loss = ((loss_bt * m).sum(1)[rows] / m.sum(1)[rows]).mean()
    elif agg == "seq-mean-token-sum":
        loss = (loss_bt * m).sum(1)[m.sum(1) > 0].mean()
    elif agg[0] == "sample-mean-full-denominator":
        loss = ((loss_bt * m).sum(1) / mask.double().sum(1).clamp(min=1)).sum() / agg[1]
    elif agg[0] == "sample-mean":
        loss = ((loss_bt * m).sum(1) / m.sum(1).clamp(min=1)).sum() / agg[1]
    else:  # ("constant", C)
        loss = (loss_bt * m).sum() / agg[1]
    loss.backward()
    return loss.detach(), leaf.grad


def _check(ours, theirs):
    (out, g), (loss, g_ref) = ours, theirs
    assert abs(out.loss.item() - loss.item()) <= 1e-12 * max(1.0, abs(loss.item()))
    torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-13)


def _differs(ours, theirs):
    """The two losses differ well beyond rounding (a row that is not supported)."""
    (out, _), (loss, _) = ours, theirs
    assert abs(out.loss.item() - loss.item()) > 1e-6 * max(1.0, abs(loss.item()))


def _ppo(u, a, lo, hi, c=None, delta=None):
    """PPO's per-token loss max(-A u, -A clip(u)); dual clip: min(that, -c A) where A < 0; TRL's delta caps the
    unclipped u."""
    first = -a * (u if delta is None else u.clamp(max=delta))
    loss = torch.maximum(first, -a * u.clamp(1 - lo, 1 + hi))
    if c is not None:
        loss = torch.where(a < 0, torch.minimum(loss, -c * a), loss)
    return loss


def _seq_sum(x, mask):
    return (x * mask).sum(1, keepdim=True)


def _rejected_some(keep, mask):
    """Some but not all trained tokens are rejected (the case is not vacuous)."""
    kept = int((keep & mask).sum())
    assert 0 < kept < int(mask.sum()), (kept, int(mask.sum()))


# ---------------------------------------------------------------------------------------------------------------
# verl 0.9.1 (algorithm.rollout_correction + actor PPO options)
# ---------------------------------------------------------------------------------------------------------------

VERL_C = 3.0  # clip_ratio_c: verl's vanilla PPO loss always applies the dual clip, default 3.0


def _verl_rs_keep(log_ratio, mask, options: str, thresholds: str):
    """verl 0.9.1 ``rollout_rs`` / ``rollout_rs_threshold`` on ``log_ratio = log(pi_train / pi_rollout)``: the
    comma separated options must all pass (one threshold entry per option, or one shared). Per token
    ``k1 = -lr``, ``k2 = lr^2 / 2``, ``k3 = e^lr - 1 - lr`` with ``lr`` clamped to [-20, 20]; ``token_*`` tests
    each token, ``seq_sum_* / seq_mean_* / seq_max_*`` the masked sum / mean (count + 1e-8) / max over the
    sequence. ``*_k1`` keeps ``log(lo) <= stat <= log(hi)`` for the entry ``"lo_hi"`` (a single ``U`` means
    ``lo = 1 / U``); k2 / k3 keep ``stat <= U``. Returns ``[B, T]`` bool."""
    opts = [o.strip() for o in options.split(",")]
    specs = [s.strip() for s in thresholds.split(",")]
    specs = specs * len(opts) if len(specs) == 1 else specs
    lr = log_ratio.clamp(-20.0, 20.0)
    per_token = {"k1": -lr, "k2": 0.5 * lr ** 2, "k3": torch.exp(lr) - 1 - lr}
    m = mask.double()
    keep = torch.ones_like(mask)
    for opt, spec in zip(opts, specs):
        level, est = opt.rsplit("_", 1)
        k = per_token[est]
        if level == "token":
            stat = k
        elif level == "seq_sum":
            stat = (k * m).sum(1, keepdim=True)
        elif level == "seq_mean":
            stat = (k * m).sum(1, keepdim=True) / (m.sum(1, keepdim=True) + 1e-8)
        else:
            stat = k.masked_fill(~mask, -math.inf).max(1, keepdim=True).values
        if est == "k1":
            lo, hi = (float(x) for x in spec.split("_")) if "_" in spec else (1 / float(spec), float(spec))
            ok = (stat >= math.log(lo)) & (stat <= math.log(hi))
        else:
            ok = stat <= float(spec)
        keep = keep & ok.expand(B, T)
    return keep


def _verl_rs_as_rules(options: str, thresholds: str):
    """The row's mapping: each verl option ``<level>_<k>`` with its threshold entry is a
    ``KLRejection(threshold, k, level)``; a k1 entry ``"lo_hi"`` is the two-sided threshold
    ``(log lo, log hi)`` on k1 = -log r (a single ``U``: ``(-log U, log U)``)."""
    opts = [o.strip() for o in options.split(",")]
    specs = [s.strip() for s in thresholds.split(",")]
    specs = specs * len(opts) if len(specs) == 1 else specs
    rules = []
    for opt, spec in zip(opts, specs):
        level, est = opt.rsplit("_", 1)
        if est == "k1":
            lo, hi = (float(x) for x in spec.split("_")) if "_" in spec else (1 / float(spec), float(spec))
            threshold = (math.log(lo), math.log(hi))
        else:
            threshold = float(spec)
        rules.append(op.KLRejection(threshold, est, level))
    return tuple(rules)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("normalize", [False, True])
def test_verl_rollout_is_decoupled_ppo(level, normalize):
    """rollout_is=token|sequence, rollout_is_threshold=C (a number: TIS), rollout_is_batch_normalize,
    clip_ratio_low/high, clip_ratio_c (always on in verl's vanilla loss), decoupled mode: w = min(rho, C) with
    rho = pi_old / pi_rollout (per token, or the sequence product), optionally divided by its batch mean (tokens,
    or sequences at the sequence level), multiplies PPO's dual-clipped per-token loss."""
    logp, old, roll, mask, adv = _batch(1)
    c_is, lo, hi = 1.6, 0.2, 0.28

    def theirs(lp):
        log_rho = (old - roll) if level == "token" else _seq_sum(old - roll, mask).expand(B, T)
        w = torch.exp(log_rho.clamp(-20, 20)).clamp(max=c_is) * mask
        if normalize:
            w = w / (w.sum() / mask.sum() if level == "token" else w[:, 0].mean())
        return w * _ppo(torch.exp(lp - old), adv, lo, hi, c=VERL_C), torch.ones_like(mask)

    corr = op.Correction(weights="tis", bounds=c_is, level=level, ppo_clip=(lo, hi), dual_clip=VERL_C,
                         batch_normalize=("tokens" if level == "token" else "sequences") if normalize else False)
    _check(_ours(logp, old, roll, mask, adv, corr), _theirs(theirs, logp, "token-mean", mask))


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("normalize", [False, True])
def test_verl_rollout_is_icepop(level, normalize):
    """rollout_is_threshold="lo_hi" (IcePop): w = rho where lo <= rho <= hi, else 0; response_mask unchanged (a
    zeroed token stays in the normaliser and, with rollout_is_batch_normalize, in the batch mean as a 0)."""
    logp, old, roll, mask, adv = _batch(14)
    lo_is, hi_is = (0.7, 1.3) if level == "token" else (0.5, 2.0)

    def theirs(lp):
        log_rho = (old - roll) if level == "token" else _seq_sum(old - roll, mask).expand(B, T)
        rho = torch.exp(log_rho.clamp(-20, 20)) * mask
        w = torch.where((rho >= lo_is) & (rho <= hi_is), rho, torch.zeros_like(rho))
        if normalize:
            w = w / (w.sum() / mask.sum() if level == "token" else w[:, 0].mean())
        return w * _ppo(torch.exp(lp - old), adv, 0.2, 0.2, c=VERL_C), torch.ones_like(mask)

    corr = op.Correction(weights="mis", bounds=(lo_is, hi_is), level=level, ppo_clip=(0.2, 0.2), dual_clip=VERL_C,
                         batch_normalize=("tokens" if level == "token" else "sequences") if normalize else False)
    out = _ours(logp, old, roll, mask, adv, corr)
    assert 0 < float(out[0].metrics["ratio_above_upper_frac"] + out[0].metrics["ratio_below_lower_frac"]) < 1
    _check(out, _theirs(theirs, logp, "token-mean", mask))


def test_verl_dual_clip():
    """clip_ratio_c=c (dual-clip PPO; verl applies it in every vanilla PPO loss): with A < 0 the per-token loss is
    min(max(-A u, -A clip(u)), -c A). c = 1.1 so that the dual clip binds on this batch."""
    logp, old, roll, mask, adv = _batch(2)
    c = 1.1

    def theirs(lp):
        return _ppo(torch.exp(lp - old), adv, 0.2, 0.2, c=c), torch.ones_like(mask)

    binds = (adv < 0) & (torch.exp(logp - old) > c) & mask
    assert bool(binds.any())
    corr = op.Correction(ppo_clip=(0.2, 0.2), dual_clip=c)
    _check(_ours(logp, old, roll, mask, adv, corr), _theirs(theirs, logp, "token-mean", mask))


VERL_RS_CASES = {
    "token_k1": "0.8_1.5", "token_k2": "0.02", "token_k3": "0.02",
    "seq_sum_k1": "0.5_1.2", "seq_sum_k2": "0.15", "seq_sum_k3": "0.15",
    "seq_mean_k1": "0.95_1.1", "seq_mean_k2": "0.04", "seq_mean_k3": "0.04",
    "seq_max_k2": "0.08", "seq_max_k3": "0.08",
}


@pytest.mark.parametrize("option", sorted(VERL_RS_CASES))
def test_verl_rollout_rs(option):
    """rollout_rs=<option>, rollout_rs_threshold=<entry> (verl 0.9.1's eleven options), no IS weights, decoupled
    PPO: tokens (or whole sequences) that fail the option leave response_mask, so the loss's numerator and
    denominator alike."""
    logp, old, roll, mask, adv = _batch(11)
    spec = VERL_RS_CASES[option]
    keep = _verl_rs_keep(old - roll, mask, option, spec)
    _rejected_some(keep, mask)

    def theirs(lp):
        return _ppo(torch.exp(lp - old), adv, 0.2, 0.2, c=VERL_C), keep

    corr = op.Correction(ppo_clip=(0.2, 0.2), dual_clip=VERL_C, rejections=_verl_rs_as_rules(option, spec),
                         rejected_in_normalizer=False)
    _check(_ours(logp, old, roll, mask, adv, corr), _theirs(theirs, logp, "token-mean", mask))


@pytest.mark.parametrize("as_ratio", [False, True])
def test_verl_rollout_rs_chained_with_is(as_ratio):
    """rollout_is=token (threshold C) with the chained rollout_rs="token_k1,seq_max_k2",
    rollout_rs_threshold="0.8_1.5,0.08": every option must pass. token_k1's "lo_hi" bounds k1 = log(q / p), so
    it keeps 1 / hi <= p / q <= 1 / lo: written as KLRejection((log lo, log hi), "k1") or, equivalently, as
    RatioRejection(1 / hi, 1 / lo) on offpolicy's ratio r = p / q."""
    logp, old, roll, mask, adv = _batch(12)
    c_is, options, spec = 1.5, "token_k1,seq_max_k2", "0.8_1.5,0.08"
    keep = _verl_rs_keep(old - roll, mask, options, spec)
    _rejected_some(keep, mask)

    def theirs(lp):
        w = torch.exp((old - roll).clamp(-20, 20)).clamp(max=c_is)
        return w * _ppo(torch.exp(lp - old), adv, 0.2, 0.2, c=VERL_C), keep

    rules = _verl_rs_as_rules(options, spec)
    if as_ratio:
        rules = (op.RatioRejection(1 / 1.5, 1 / 0.8, "token"), rules[1])
    corr = op.Correction(weights="tis", bounds=c_is, ppo_clip=(0.2, 0.2), dual_clip=VERL_C, rejections=rules,
                         rejected_in_normalizer=False)
    _check(_ours(logp, old, roll, mask, adv, corr), _theirs(theirs, logp, "token-mean", mask))


def test_verl_token_k1_band_is_on_the_inverse_ratio():
    """verl's documentation calls a k1 entry "lo_hi" ratio bounds, but its code compares k1 = -log(p / q) with
    (log lo, log hi), i.e. it keeps lo <= q / p <= hi. Reading the entry as bounds on p / q
    (RatioRejection(lo, hi)) gives a different loss for an asymmetric band; RatioRejection(1 / hi, 1 / lo) is
    verl's."""
    logp, old, roll, mask, adv = _batch(11)
    keep = _verl_rs_keep(old - roll, mask, "token_k1", "0.8_1.5")

    def theirs(lp):
        return _ppo(torch.exp(lp - old), adv, 0.2, 0.2, c=VERL_C), keep

    common = dict(ppo_clip=(0.2, 0.2), dual_clip=VERL_C, rejected_in_normalizer=False)
    docs_reading = op.Correction(rejections=(op.RatioRejection(0.8, 1.5),), **common)
    _differs(_ours(logp, old, roll, mask, adv, docs_reading), _theirs(theirs, logp, "token-mean", mask))
    verl_code = op.Correction(rejections=(op.RatioRejection(1 / 1.5, 1 / 0.8),), **common)
    _check(_ours(logp, old, roll, mask, adv, verl_code), _theirs(theirs, logp, "token-mean", mask))


def test_verl_rollout_is_with_rollout_rs():
    """rollout_is=token (threshold C) together with rollout_rs=seq_mean_k1 ("lo_hi", verl's geometric-mean RS
    preset): the IS weight min(rho, C) and the rejection mask are separate; rejected sequences leave the loss
    mask, numerator and denominator. seq_mean_k1 is also RatioRejection(1 / hi, 1 / lo, "geometric")."""
    logp, old, roll, mask, adv = _batch(12)
    c_is, spec = 1.5, "0.95_1.1"
    keep = _verl_rs_keep(old - roll, mask, "seq_mean_k1", spec)
    _rejected_some(keep, mask)

    def theirs(lp):
        w = torch.exp((old - roll).clamp(-20, 20)).clamp(max=c_is)
        return w * _ppo(torch.exp(lp - old), adv, 0.2, 0.2, c=VERL_C), keep

    corr = op.Correction(weights="tis", bounds=c_is, ppo_clip=(0.2, 0.2), dual_clip=VERL_C,
                         rejections=(op.RatioRejection(1 / 1.1, 1 / 0.95, "geometric"),),
                         rejected_in_normalizer=False)
    out = _ours(logp, old, roll, mask, adv, corr)
    assert 0 < float(out[0].metrics["rejected_frac/rule0"]) < 1
    _check(out, _theirs(theirs, logp, "token-mean", mask))


def test_verl_batch_normalize_with_rollout_rs():
    """rollout_is=token, rollout_is_batch_normalize=True and rollout_rs together: verl divides the weights by
    their mean over the *original* response_mask (the rejected tokens' truncated ratios included; count + 1e-8),
    then the rejection removes tokens from the mask. offpolicy's batch_normalize averages over the tokens it keeps
    (a token-rejected weight counts as 0): the losses differ. Exact by hand: batch_normalize=False and
    num_loss_tokens = (kept tokens) * (verl's mean)."""
    logp, old, roll, mask, adv = _batch(15)
    c_is, options, spec = 1.6, "token_k2", "0.02"
    keep = _verl_rs_keep(old - roll, mask, options, spec)
    _rejected_some(keep, mask)
    w_raw = torch.exp((old - roll).clamp(-20, 20)).clamp(max=c_is) * mask
    verl_mean = w_raw.sum() / (mask.sum() + 1e-8)

    def theirs(lp):
        return (w_raw / verl_mean) * _ppo(torch.exp(lp - old), adv, 0.2, 0.2, c=VERL_C), keep

    common = dict(weights="tis", bounds=c_is, ppo_clip=(0.2, 0.2), dual_clip=VERL_C,
                  rejections=_verl_rs_as_rules(options, spec), rejected_in_normalizer=False)
    reference = _theirs(theirs, logp, "token-mean", mask)
    _differs(_ours(logp, old, roll, mask, adv, op.Correction(batch_normalize="tokens", **common)), reference)
    by_hand = _ours(logp, old, roll, mask, adv, op.Correction(**common),
                    num_loss_tokens=float((keep & mask).sum() * verl_mean))
    _check(by_hand, reference)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum",
                                 "seq-mean-token-sum-norm"])
def test_verl_bypass_ppo_and_loss_agg_mode(agg):
    """bypass_mode=True, loss_type=ppo_clip (pi_old := pi_rollout, no IS weight) with each loss_agg_mode. verl's
    seq-mean-token-sum-norm divides the token sum by (sequences) * loss_scale_factor, whose default (None) is the
    padded response width loss_mask.shape[-1] (T here); token-sum is the plain sum."""
    logp, old, roll, mask, adv = _batch(3)

    def theirs(lp):
        return _ppo(torch.exp(lp - roll), adv, 0.2, 0.3, c=VERL_C), torch.ones_like(mask)

    n_seq = int((mask.sum(1) > 0).sum())
    ours_agg = {"token-mean": dict(aggregation="token_mean"),
                "seq-mean-token-mean": dict(aggregation="seq_mean_token_mean"),
                "seq-mean-token-sum": dict(aggregation="seq_mean_token_sum"),
                "token-sum": dict(aggregation="constant", constant_normalizer=1.0),
                "seq-mean-token-sum-norm": dict(aggregation="constant", constant_normalizer=float(n_seq * T))}[agg]
    their_agg = ("constant", n_seq * T) if agg == "seq-mean-token-sum-norm" else agg
    corr = op.Correction(ppo_clip=(0.2, 0.3), dual_clip=VERL_C)
    _check(_ours(logp, old, roll, mask, adv, corr, proximal="roll", **ours_agg),
           _theirs(theirs, logp, their_agg, mask))


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("rs", [None, "token_k1,seq_mean_k3"])
def test_verl_bypass_reinforce_with_is(level, rs):
    """bypass_mode=True, loss_type=reinforce, rollout_is=token|sequence (the bypass_pg_is preset), optionally with
    rollout_rs: REINFORCE -A sg(w) log p with w = min(p / pi_rollout, C) (per token or the sequence product),
    IS weights and rejections both measured with the current policy p."""
    logp, old, roll, mask, adv = _batch(4)
    c_is, spec = 3.0, "0.8_1.5,0.05"
    keep = torch.ones_like(mask) if rs is None else _verl_rs_keep(logp - roll, mask, rs, spec)
    if rs is not None:
        _rejected_some(keep, mask)

    def theirs(lp):
        log_rho = lp.detach() - roll
        log_rho = log_rho if level == "token" else _seq_sum(log_rho, mask).expand(B, T)
        w = torch.exp(log_rho.clamp(-20, 20)).clamp(max=c_is)
        return -adv * w * lp, keep

    corr = op.Correction(weights="tis", bounds=c_is, level=level, rejected_in_normalizer=False,
                         rejections=() if rs is None else _verl_rs_as_rules(rs, spec))
    _check(_ours(logp, old, roll, mask, adv, corr, proximal=None), _theirs(theirs, logp, "token-mean", mask))


def test_verl_bypass_ppo_with_rollout_rs():
    """bypass_mode=True, loss_type=ppo_clip with rollout_rs: verl measures the rejection statistic on the current
    policy, log p - log pi_rollout. offpolicy's rejection rules act on the ratio its weights use, pi_prox / q,
    which is 1 under proximal_logprobs=roll, so they reject nothing and the losses differ. Exact by hand: compute
    verl's mask from logp.detach() - roll and pass it as loss_mask."""
    logp, old, roll, mask, adv = _batch(16)
    options, spec = "seq_mean_k3", "0.02"
    keep = _verl_rs_keep(logp - roll, mask, options, spec)
    _rejected_some(keep, mask)

    def theirs(lp):
        return _ppo(torch.exp(lp - roll), adv, 0.2, 0.2, c=VERL_C), keep

    reference = _theirs(theirs, logp, "token-mean", mask)
    rules = op.Correction(ppo_clip=(0.2, 0.2), dual_clip=VERL_C, rejections=_verl_rs_as_rules(options, spec),
                          rejected_in_normalizer=False)
    _differs(_ours(logp, old, roll, mask, adv, rules, proximal="roll"), reference)
    plain = op.Correction(ppo_clip=(0.2, 0.2), dual_clip=VERL_C)
    _check(_ours(logp, old, roll, mask & keep, adv, plain, proximal="roll"), reference)


# ---------------------------------------------------------------------------------------------------------------
# TRL 1.16 (GRPOConfig)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("clip_min", [None, 0.8])
def test_trl_vllm_importance_sampling(mode, clip_min):
    """vllm_importance_sampling_correction=True, vllm_importance_sampling_mode,
    vllm_importance_sampling_clip_max=C (the deprecated _cap), vllm_importance_sampling_clip_min=c (default
    None): rho = exp(old - vllm) (summed over the sequence for sequence_*), truncated (clamp(rho, c, C)) or masked
    (0 outside [c, C]); it multiplies the per-token PPO loss (epsilon, epsilon_high); loss_type='bnpo'."""
    logp, old, roll, mask, adv = _batch(5)
    cap = 1.4 if mode.startswith("token") else 2.5

    def theirs(lp):
        diff = (old - roll) * mask
        log_rho = diff if mode.startswith("token") else diff.sum(1, keepdim=True).expand(B, T)
        rho = torch.exp(log_rho)
        if mode.endswith("truncate"):
            w = rho.clamp(min=clip_min, max=cap)
        else:
            w = rho.masked_fill((rho < (clip_min or -math.inf)) | (rho > cap), 0.0)
        return w * _ppo(torch.exp(lp - old), adv, 0.2, 0.28), torch.ones_like(mask)

    corr = op.Correction(weights="tis" if mode.endswith("truncate") else "mis", bounds=(clip_min or 0.0, cap),
                         level="token" if mode.startswith("token") else "sequence", ppo_clip=(0.2, 0.28))
    _check(_ours(logp, old, roll, mask, adv, corr), _theirs(theirs, logp, "token-mean", mask))


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"])
def test_trl_loss_type_aggregation_and_delta(loss_type):
    """loss_type grpo (mean over sequences of each sequence's token mean), bnpo (token mean), dr_grpo (sum over
    B * max_completion_length), dapo (token mean over the global count of trained tokens; one batch here), luspo
    (each sequence's token sum, averaged over all B sequences), with epsilon=0.2, epsilon_high=0.28 and delta=1.5
    (two-sided clipping)."""
    logp, old, roll, mask, adv = _batch(6)
    agg = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dr_grpo": ("constant", B * T),
           "dapo": "token-mean", "luspo": ("constant", B)}[loss_type]

    def theirs(lp):
        return _ppo(torch.exp(lp - old), adv, 0.2, 0.28, delta=1.5), torch.ones_like(mask)

    ours = {"grpo": dict(aggregation="seq_mean_token_mean"), "bnpo": dict(aggregation="token_mean"),
            "dr_grpo": dict(aggregation="constant", constant_normalizer=float(B * T)),
            "dapo": dict(aggregation="token_mean", num_loss_tokens=float(mask.sum())),
            "luspo": dict(aggregation="seq_mean_token_sum", num_sequences=float(B))}[loss_type]
    corr = op.Correction(ppo_clip=(0.2, 0.28), ppo_delta=1.5)
    _check(_ours(logp, old, roll, mask, adv, corr, **ours), _theirs(theirs, logp, agg, mask))


def test_trl_cispo():
    """loss_type='cispo', epsilon_high=E: -sg(min(p / old, E)) A log p per token."""
    logp, old, roll, mask, adv = _batch(7)
    e_high = 1.3

    def theirs(lp):
        coef = torch.exp(lp.detach() - old).clamp(max=e_high)
        return -coef * adv * lp, torch.ones_like(mask)

    corr = op.Correction(cispo=(0.0, e_high))
    _check(_ours(logp, old, roll, mask, adv, corr), _theirs(theirs, logp, "token-mean", mask))


def test_trl_gspo_sequence_importance_sampling():
    """importance_sampling_level='sequence' (GSPO) with loss_type='grpo': s_i = exp(mean_t log(p / old)) over the
    sequence's tokens, the per-token loss is PPO's on s_i, gradient through s_i. With the sequence-level advantages
    GRPO gives, GSPO-token has the same value and gradient."""
    logp, old, roll, mask, adv = _batch(8)
    eps_lo, eps_hi = 3e-4, 4e-4

    def theirs(lp):
        s = torch.exp(_seq_sum(lp - old, mask) / mask.sum(1, keepdim=True).clamp(min=1))
        return _ppo(s.expand(B, T), adv, eps_lo, eps_hi), torch.ones_like(mask)

    corr = op.Correction(ppo_clip=(eps_lo, eps_hi), ppo_ratio="gspo_token")
    _check(_ours(logp, old, roll, mask, adv, corr, aggregation="seq_mean_token_mean"),
           _theirs(theirs, logp, "seq-mean-token-mean", mask))


@pytest.mark.parametrize("use_vllm", [False, True])
def test_trl_off_policy_mask(use_vllm):
    """off_policy_mask_threshold=d (OPSM): TRL keeps sequence i iff A_i >= 0 or
    mean_t (sampling_logp - sg(log p)) <= d over its completion tokens, with sampling_logp the vLLM log-probs
    (old_per_token_logps without vLLM) and p the current policy; a dropped sequence's per-token loss is multiplied
    by 0 and it stays in the normaliser. With vLLM, the token_truncate IS weight multiplies afterwards."""
    logp, old, roll, mask, adv = _batch(18)
    d, cap = 0.05, 2.0
    sampler = roll if use_vllm else old

    def theirs(lp):
        kl = (sampler - lp.detach()) * mask
        avg = kl.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1.0)
        kept_seq = ((adv[:, :1] >= 0) | (avg <= d)).double()
        loss = _ppo(torch.exp(lp - old), adv, 0.2, 0.28) * kept_seq
        if use_vllm:
            loss = loss * torch.exp((old - roll) * mask).clamp(max=cap)
        return loss, torch.ones_like(mask)

    corr = op.Correction(weights="tis" if use_vllm else "none", bounds=(0.0, cap) if use_vllm else None,
                         ppo_clip=(0.2, 0.28), opsm_delta=d)
    out = _ours(logp, old, sampler, mask, adv, corr)
    assert 0 < float(out[0].metrics["rejected_frac"]) < 1
    _check(out, _theirs(theirs, logp, "token-mean", mask))


# ---------------------------------------------------------------------------------------------------------------
# slime (THUDM/slime) and the Miles fork
# ---------------------------------------------------------------------------------------------------------------


def _slime_mis(old, roll, mask, tis_mode, tis_level, rs_level, lower, upper, rs_bounds=None, veto=None,
               normalize=False):
    """slime's train-inference mismatch helper (examples/train_infer_mismatch_helper, ``compute_mis_weights``):
    per sequence, log r = old - roll at ``tis_level`` (token; sequence: the masked sum; geometric: the masked mean
    over max(count, 1)), clamped to [-20, 20], exponentiated; ``truncate``: clamp(r, 0, U); ``clip``:
    clamp(r, L, U); ``mask``: r kept as the weight, tokens outside [L, U] leave the returned mask. ``use_rs``
    (``rs_level`` not None): the raw ratio at ``rs_level`` outside ``rs_bounds`` (default (L, U)) leaves the mask;
    ``rs_veto_threshold``: a sequence with any trained token r < veto leaves it. ``tis_batch_normalize``: divide
    by the mean weight over the original mask (token level) or the mean over all sequences of each sequence's mean
    (sequence level). Returns (weights [B, T], modified mask [B, T] bool)."""
    m = mask.double()
    lr = old - roll

    def at(level):
        if level == "token":
            return lr
        s = _seq_sum(lr, m)
        return (s if level == "sequence" else s / m.sum(1, keepdim=True).clamp(min=1)).expand(B, T)

    r = torch.exp(at(tis_level).clamp(-20, 20))
    modified = mask.clone()
    if tis_mode == "truncate":
        w = r.clamp(0, upper) * m
    elif tis_mode == "clip":
        w = r.clamp(lower, upper) * m
    else:
        w = r * m
        modified = modified & (r >= lower) & (r <= upper)
    if rs_level is not None:
        rs_lo, rs_hi = rs_bounds or (lower, upper)
        r_rs = torch.exp(at(rs_level).clamp(-20, 20))
        modified = modified & (r_rs >= rs_lo) & (r_rs <= rs_hi)
        if veto is not None:
            modified = modified & ~((lr < math.log(veto)) & mask).any(1, keepdim=True)
    if normalize:
        if tis_level == "token":
            w = w / ((w * m).sum() / m.sum().clamp(min=1))
        else:
            w = w / ((w * m).sum(1) / m.sum(1).clamp(min=1)).mean()
    return w, modified


SLIME_MIS_CASES = [
    # (tis_mode, tis_level, rs_level, (L, U), rs_bounds, veto, normalize)
    ("truncate", "token", "token", (0.5, 1.6), None, None, False),
    ("clip", "sequence", "geometric", (0.5, 2.0), (0.9, 1.1), 0.6, False),
    ("mask", "token", "sequence", (0.7, 1.4), (0.4, 2.5), None, False),
    ("truncate", "token", None, (0.5, 1.6), None, None, True),
    ("clip", "sequence", None, (0.5, 2.0), None, None, True),
]


def _slime_mis_correction(tis_mode, tis_level, rs_level, bounds, rs_bounds, veto, normalize, **kw):
    """The row's mapping of the helper's options onto a Correction (PPO against ``old``)."""
    lower, upper = bounds
    rejections = () if rs_level is None else (op.RatioRejection(*(rs_bounds or bounds), rs_level),)
    return op.Correction(
        weights="mis" if tis_mode == "mask" else "tis", bounds=(0.0, upper) if tis_mode == "truncate" else bounds,
        level=tis_level, rejections=rejections, veto=veto, ppo_clip=(0.2, 0.28),
        batch_normalize=("tokens" if tis_level == "token" else "sequences") if normalize else False, **kw)


@pytest.mark.parametrize("case", range(len(SLIME_MIS_CASES)))
def test_slime_mis_helper(case):
    """--use-tis with --custom-tis-function-path <the mismatch helper>: tis_mode, tis_level, tis_lower_bound,
    tis_upper_bound, use_rs, rs_level, rs_lower_bound, rs_upper_bound, rs_veto_threshold, tis_batch_normalize
    (without a rejection). slime (at the revision the page names) rebuilds its reducer with the modified mask in
    the numerator and the original per-sample token counts as denominators, so rejected tokens stay in the
    normaliser; default per-sample mean (no --calculate-per-token-loss)."""
    tis_mode, tis_level, rs_level, bounds, rs_bounds, veto, normalize = SLIME_MIS_CASES[case]
    logp, old, roll, mask, adv = _batch(20 + case)
    w, modified = _slime_mis(old, roll, mask, tis_mode, tis_level, rs_level, *bounds, rs_bounds, veto, normalize)
    if rs_level is not None or tis_mode == "mask":
        _rejected_some(modified, mask)

    def theirs(lp):
        return w * _ppo(torch.exp(lp - old), adv, 0.2, 0.28), modified

    corr = _slime_mis_correction(tis_mode, tis_level, rs_level, bounds, rs_bounds, veto, normalize)
    _check(_ours(logp, old, roll, mask, adv, corr, aggregation="seq_mean_token_mean"),
           _theirs(theirs, logp, ("sample-mean-full-denominator", B), mask))


def test_slime_masked_batch_normalized_weights():
    """tis_mode=mask with tis_batch_normalize: slime's batch mean averages the raw ratios of all trained tokens,
    the masked ones included; offpolicy's batch_normalize averages the weights it keeps (a masked token counts as
    0): the losses differ. Exact by hand: batch_normalize=False and num_sequences = B * (slime's mean)."""
    logp, old, roll, mask, adv = _batch(30)
    bounds = (0.7, 1.4)
    w, modified = _slime_mis(old, roll, mask, "mask", "token", None, *bounds, normalize=True)
    _rejected_some(modified, mask)
    m = mask.double()
    slime_mean = (torch.exp((old - roll).clamp(-20, 20)) * m).sum() / m.sum()

    def theirs(lp):
        return w * _ppo(torch.exp(lp - old), adv, 0.2, 0.28), modified

    reference = _theirs(theirs, logp, ("sample-mean-full-denominator", B), mask)
    normalized = _slime_mis_correction("mask", "token", None, bounds, None, None, True)
    _differs(_ours(logp, old, roll, mask, adv, normalized, aggregation="seq_mean_token_mean"), reference)
    by_hand = _slime_mis_correction("mask", "token", None, bounds, None, None, False)
    _check(_ours(logp, old, roll, mask, adv, by_hand, aggregation="seq_mean_token_mean",
                 num_sequences=float(B * slime_mean)), reference)


@pytest.mark.parametrize("icepop", [False, True])
def test_slime_tis_and_dual_clip(icepop):
    """--use-tis --tis-clip C --tis-clip-low c (the built-in vanilla_tis_function: w = clamp(rho, c, C); or
    --custom-tis-function-path ...icepop_function: w = rho inside [c, C], else 0) with rho = pi_old / pi_rollout,
    on PPO's dual-clipped per-token loss (--eps-clip, --eps-clip-high, --eps-clip-c);
    --calculate-per-token-loss (token mean)."""
    logp, old, roll, mask, adv = _batch(9)
    c_lo, c_hi = (0.5, 2.0) if not icepop else (0.8, 1.25)

    def theirs(lp):
        rho = torch.exp(old - roll)
        w = rho.clamp(c_lo, c_hi) if not icepop else torch.where((rho >= c_lo) & (rho <= c_hi), rho, 0.0)
        return w * _ppo(torch.exp(lp - old), adv, 0.2, 0.28, c=3.0), torch.ones_like(mask)

    corr = op.Correction(weights="mis" if icepop else "tis", bounds=(c_lo, c_hi), ppo_clip=(0.2, 0.28),
                         dual_clip=3.0)
    _check(_ours(logp, old, roll, mask, adv, corr), _theirs(theirs, logp, "token-mean", mask))


def test_verl_and_slime_cispo():
    """verl policy_loss.loss_mode=cispo (clip_ratio_low e, clip_ratio_high h) and slime --advantage-estimator cispo
    (--eps-clip e --eps-clip-high h): -sg(clamp(p / old, 1 - e, 1 + h)) A log p."""
    logp, old, roll, mask, adv = _batch(10)

    def theirs(lp):
        coef = torch.exp(lp.detach() - old).clamp(0.8, 1.28)
        return -coef * adv * lp, torch.ones_like(mask)

    corr = op.Correction(cispo=(0.8, 1.28))
    _check(_ours(logp, old, roll, mask, adv, corr), _theirs(theirs, logp, "token-mean", mask))


@pytest.mark.parametrize("rollout_logprobs", [False, True])
def test_slime_opsm(rollout_logprobs):
    """--use-opsm --opsm-delta d (without --use-tis): a token with A < 0 in a sequence whose
    mean_t (log pi_old - log p) exceeds d is dropped (multiplied by 0; it stays in the normaliser). pi_old is the
    trainer's old log-probs, or the rollout's with --use-rollout-logprobs (which also anchors PPO there):
    sampler_logprobs = proximal_logprobs = that reference."""
    logp, old, roll, mask, adv = _batch(10)
    d = 0.05
    ref = roll if rollout_logprobs else old

    def theirs(lp):
        seq_kl = _seq_sum(ref - lp.detach(), mask) / mask.sum(1, keepdim=True).clamp(min=1)
        drop = (adv < 0) & (seq_kl > d)
        return torch.where(drop, 0.0, _ppo(torch.exp(lp - ref), adv, 0.2, 0.28)), torch.ones_like(mask)

    corr = op.Correction(ppo_clip=(0.2, 0.28), opsm_delta=d)
    out = _ours(logp, ref, ref, mask, adv, corr)
    assert 0 < float(out[0].metrics["rejected_frac"]) < 1
    _check(out, _theirs(theirs, logp, "token-mean", mask))


def test_slime_opsm_with_tis():
    """--use-opsm with --use-tis: slime's OPSM statistic is mean_t (log pi_old - log p) while the TIS weight uses
    pi_old / pi_rollout; offpolicy's opsm_delta measures mean_t (log q - log p) against the sampler's q, so the
    losses differ. Exact by hand: drop slime's sequences through loss_mask and keep them in the normaliser with
    num_sequences = B."""
    logp, old, roll, mask, adv = _batch(18)
    d, c_lo, c_hi = 0.05, 0.5, 2.0
    seq_kl = _seq_sum(old - logp, mask) / mask.sum(1, keepdim=True).clamp(min=1)
    drop = ((adv < 0) & (seq_kl > d)).expand(B, T)
    assert 0 < int((drop & mask).sum()) < int(mask.sum())

    def theirs(lp):
        w = torch.exp(old - roll).clamp(c_lo, c_hi)
        return torch.where(drop, 0.0, w * _ppo(torch.exp(lp - old), adv, 0.2, 0.28)), torch.ones_like(mask)

    reference = _theirs(theirs, logp, ("sample-mean-full-denominator", B), mask)
    tis = dict(weights="tis", bounds=(c_lo, c_hi), ppo_clip=(0.2, 0.28))
    _differs(_ours(logp, old, roll, mask, adv, op.Correction(opsm_delta=d, **tis),
                   aggregation="seq_mean_token_mean"), reference)
    # The dropped sequences leave loss_mask wholly (A is constant along a sequence), so the other sequences keep
    # their original token counts; num_sequences = B keeps the dropped ones in the mean over samples.
    by_hand = _ours(logp, old, roll, mask & ~drop, adv, op.Correction(**tis), aggregation="seq_mean_token_mean",
                    num_sequences=float(B))
    _check(by_hand, reference)


@pytest.mark.parametrize("tis_mode", ["truncate", "mask"])
def test_miles_rejection_leaves_normaliser(tis_mode):
    """Miles (modal-projects/miles) runs slime's mismatch helper but rebuilds its reducer with the modified mask
    for numerator and per-sample denominators alike: a rejected token leaves its sample's count, while the number
    of samples stays B. offpolicy: rejected_in_normalizer=False, num_sequences=B; tis_mode=mask also needs its
    band as a RatioRejection (weights='mis' zeroes the weight but does not reject)."""
    logp, old, roll, mask, adv = _batch(40)
    bounds, rs_bounds, veto = (0.7, 1.4), (0.8, 1.25), 0.5
    w, modified = _slime_mis(old, roll, mask, tis_mode, "token", "geometric", *bounds, rs_bounds, veto)
    _rejected_some(modified, mask)

    def theirs(lp):
        return w * _ppo(torch.exp(lp - old), adv, 0.2, 0.28), modified

    rejections = (op.RatioRejection(*rs_bounds, "geometric"),)
    if tis_mode == "mask":
        rejections += (op.RatioRejection(*bounds, "token"),)
    corr = op.Correction(weights="mis" if tis_mode == "mask" else "tis",
                         bounds=bounds if tis_mode == "mask" else (0.0, bounds[1]), rejections=rejections, veto=veto,
                         ppo_clip=(0.2, 0.28), rejected_in_normalizer=False)
    _check(_ours(logp, old, roll, mask, adv, corr, aggregation="seq_mean_token_mean", num_sequences=float(B)),
           _theirs(theirs, logp, ("sample-mean", B), mask))


def test_miles_eps_clip_c_not_applied():
    """Miles parses --eps-clip-c but its policy loss calls compute_policy_loss without it, so no dual clip acts:
    Correction without dual_clip reproduces Miles; slime's dual_clip=c gives a different loss where it binds."""
    logp, old, roll, mask, adv = _batch(2)
    c = 1.1

    def theirs(lp):
        return _ppo(torch.exp(lp - old), adv, 0.2, 0.28), torch.ones_like(mask)

    reference = _theirs(theirs, logp, ("sample-mean", B), mask)
    _check(_ours(logp, old, roll, mask, adv, op.Correction(ppo_clip=(0.2, 0.28)), aggregation="seq_mean_token_mean"),
           reference)
    _differs(_ours(logp, old, roll, mask, adv, op.Correction(ppo_clip=(0.2, 0.28), dual_clip=c),
                   aggregation="seq_mean_token_mean"), reference)


def test_miles_max_weight_staleness():
    """--max-weight-staleness N (fully async rollout): groups whose weight version lags the trainer's by more than
    N never reach the loss. offpolicy: loss_mask &= (current_version - versions <= N), with versions and
    current_version passed for the per-staleness metrics."""
    logp, old, roll, mask, adv = _batch(41)
    versions = torch.tensor([7, 5, 8, 6, 4])[:, None].expand(B, T)
    fresh = (8 - versions) <= 2

    def theirs(lp):
        return -adv * torch.exp((lp.detach() - roll).clamp(-20, 20)).clamp(max=2.0) * lp, fresh

    corr = op.Correction(weights="tis", bounds=2.0)
    out = _ours(logp, old, roll, mask & fresh, adv, corr, proximal=None, aggregation="seq_mean_token_mean",
                versions=versions.reshape(-1), current_version=8)
    _check(out, _theirs(theirs, logp, ("sample-mean", int(fresh[:, 0].sum())), mask))


def _miles_score_centering_batch(seed: int, kind: str):
    """Trainer and sampler distributions over V = 12 on B x T tokens, a K = 4 record per token (the sampler's top 4
    for a head record; a random support of 4, renormalised, for a support record), tokens drawn from the sampler."""
    v, k = 12, 4
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(B * T, v, generator=gen, dtype=torch.float64)
    zq = z + 0.5 * torch.randn(B * T, v, generator=gen, dtype=torch.float64)
    if kind == "head":
        ids = zq.topk(k, dim=1).indices
        lq_full = torch.log_softmax(zq, 1)
        lq_ids = lq_full.gather(1, ids)
        y = torch.multinomial(lq_full.exp(), 1, generator=gen)[:, 0]
        lq_y = lq_full.gather(1, y[:, None])[:, 0]
        lp_full = torch.log_softmax(z, 1)
    else:
        ids = torch.stack([torch.randperm(v, generator=gen)[:k] for _ in range(B * T)])
        lq_ids = torch.log_softmax(zq.gather(1, ids), 1)
        pick = torch.multinomial(lq_ids.exp(), 1, generator=gen)[:, 0]
        y = ids.gather(1, pick[:, None])[:, 0]
        lq_y = lq_ids.gather(1, pick[:, None])[:, 0]
        lp_full = torch.log_softmax(z.masked_fill(torch.ones_like(z, dtype=torch.bool).scatter(1, ids, False),
                                                  -math.inf), 1)
    lp_y, lp_ids = lp_full.gather(1, y[:, None])[:, 0], lp_full.gather(1, ids)
    lengths = torch.tensor([7, 3, 5, 1, 6])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).reshape(-1)
    adv = torch.randn(B, generator=gen, dtype=torch.float64)[:, None].expand(B, T).reshape(-1).clone()
    return ids, lp_y, lp_ids, lq_y, lq_ids, mask, adv


def _miles_f(r: torch.Tensor, mode: str) -> torch.Tensor:
    """The research fork's weight functions: none 1, tis min(r, 2), mis r 1[0.5 <= r <= 5]."""
    if mode == "none":
        return torch.ones_like(r)
    if mode == "tis":
        return torch.clamp(r, max=2.0)
    return torch.where((r >= 0.5) & (r <= 5.0), r, torch.zeros_like(r))


@pytest.mark.parametrize("kind", ["head", "support"])
@pytest.mark.parametrize("mode", ["none", "tis", "mis"])
def test_miles_score_centering_loss(mode, kind):
    """The research fork's score-centering loss (``score_centering_loss(inputs, mode=..., tis_clip=2, mis_low=0.5,
    mis_high=5, eps=1e-6)``), from its definition: ``m(v) = q f(p / q)`` on the recorded candidates,
    ``rho = max(1 - Q, eps) / max(1 - P, eps)``, ``alpha = rho f(1 / rho)``, residual ``m - alpha p`` (detached,
    every record kind alike), token loss ``-A (f(r_y) log p(y) - sum_v residual(v) log p(v))``, reduced as a token
    mean over the loss mask."""
    ids, lp_y, lp_ids, lq_y, lq_ids, mask, adv = _miles_score_centering_batch(3, kind)
    bounds = {"none": None, "tis": 2.0, "mis": (0.5, 5.0)}[mode]
    corr = op.Correction(weights=mode, bounds=bounds, score_centering=True)
    leaf_y, leaf_c = lp_y.clone().requires_grad_(), lp_ids.clone().requires_grad_()
    out = op.policy_loss_from_logprobs(leaf_y, lq_y, adv, candidates=op.Candidates(ids, lq_ids, kind),
                                       candidate_logprobs=leaf_c, loss_mask=mask, correction=corr)
    out.loss.backward()

    ref_y, ref_c = lp_y.clone().requires_grad_(), lp_ids.clone().requires_grad_()
    with torch.no_grad():
        p, q = ref_c.exp(), lq_ids.exp()
        rho = (1 - q.sum(1)).clamp(min=1e-6) / (1 - p.sum(1)).clamp(min=1e-6)
        alpha = rho * _miles_f(1 / rho, mode)
        residual = q * _miles_f(p / q, mode) - alpha[:, None] * p
        w = _miles_f(torch.exp(ref_y - lq_y), mode)
    token = -adv * (w * ref_y - (residual * ref_c).sum(1))
    loss = token[mask].sum() / mask.sum()
    loss.backward()
    assert abs(out.loss.item() - loss.item()) <= 1e-12 * max(1.0, abs(loss.item()))
    torch.testing.assert_close(leaf_y.grad, ref_y.grad, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(leaf_c.grad, ref_c.grad, rtol=1e-10, atol=1e-13)


def test_every_row_has_a_test():
    """docs/migrating.md names a test of this file or of tests/core/test_migrating_peers.py in every supported
    row, and every test it names exists in one of them or in the test files of the corrections added since."""
    import re
    from pathlib import Path

    here = Path(__file__).resolve()
    text = (here.parents[2] / "docs" / "migrating.md").read_text()
    def names(source):
        return set(re.findall(r"^def (test_\w+)", source.read_text(), flags=re.M))

    named = names(here) | names(here.with_name("test_migrating_peers.py"))
    named.discard("test_every_row_has_a_test")
    # the tests of corrections added later live beside their objects (any test file of tests/); rows may cite them
    # (not all of them), so a new correction's test file needs no entry here
    beside = set().union(*(names(path) for path in sorted(here.parents[1].rglob("test_*.py"))))
    cited = {word.strip("`.,") for word in text.split() if word.strip("`").startswith("test_")}
    cited.discard("test_every_row_has_a_test")
    assert named <= cited, f"tests without a row: {named - cited}"
    # The SAPO / VESPO / GMPO / KL-penalty rows cite tests of tests/core/test_surrogates_and_kl_penalty.py.
    beside |= names(here.with_name("test_surrogates_and_kl_penalty.py"))
    assert cited <= named | beside, f"rows citing missing tests: {cited - named - beside}"
