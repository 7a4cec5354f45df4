"""Every row of docs/migrating.md: the peer's documented formula, written here from its documentation in plain
float64 torch on a padded ``[B, T]`` batch, against ``op.policy_loss_from_logprobs`` with the arguments the row
names (loss value to 1e-12 relative, gradient with respect to the trainer's log-probabilities to 1e-10).

Notation: ``logp`` the trainer's current log-probabilities (the leaf), ``old`` the trainer's log-probabilities
before the update (verl's pi_old, TRL's old_per_token_logps), ``roll`` the sampler's (rollout, vLLM).
"""

from __future__ import annotations

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
    leaf = logp.clone().requires_grad_()
    loss_bt, keep = per_token_loss_fn(leaf)
    m = (mask & keep).double()
    if agg == "token-mean":
        loss = (loss_bt * m).sum() / m.sum()
    elif agg == "seq-mean-token-mean":
        rows = m.sum(1) > 0
        loss = ((loss_bt * m).sum(1)[rows] / m.sum(1)[rows]).mean()
    elif agg == "seq-mean-token-sum":
        loss = (loss_bt * m).sum(1)[m.sum(1) > 0].mean()
    else:  # ("constant", C)
        loss = (loss_bt * m).sum() / agg[1]
    loss.backward()
    return loss.detach(), leaf.grad


def _check(ours, theirs):
    (out, g), (loss, g_ref) = ours, theirs
    assert abs(out.loss.item() - loss.item()) <= 1e-12 * max(1.0, abs(loss.item()))
    torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-13)


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


# ---------------------------------------------------------------------------------------------------------------
# verl 0.9 (algorithm.rollout_correction + actor PPO options)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("normalize", [False, True])
def test_verl_rollout_is_decoupled_ppo(level, normalize):
    """rollout_is=token|sequence, rollout_is_threshold=C, rollout_is_batch_normalize, clip_ratio_low/high,
    decoupled mode: w = min(rho, C) with rho = pi_old / pi_rollout (per token, or the sequence product), optionally
    divided by its batch mean (tokens, or sequences at the sequence level), multiplies PPO's per-token loss."""
    logp, old, roll, mask, adv = _batch(1)
    c_is, lo, hi = 1.6, 0.2, 0.28

    def theirs(lp):
        log_rho = (old - roll) if level == "token" else _seq_sum(old - roll, mask).expand(B, T)
        w = torch.exp(log_rho.clamp(-20, 20)).clamp(max=c_is) * mask
        if normalize:
            w = w / (w.sum() / mask.sum() if level == "token" else w[:, 0].mean())
        return w * _ppo(torch.exp(lp - old), adv, lo, hi), torch.ones_like(mask)

    corr = op.Correction(weights="tis", bounds=c_is, level=level, ppo_clip=(lo, hi),
                         batch_normalize=("tokens" if level == "token" else "sequences") if normalize else False)
    _check(_ours(logp, old, roll, mask, adv, corr), _theirs(theirs, logp, "token-mean", mask))


def test_verl_veto_and_dual_clip():
    """rollout_token_veto_threshold=tau (a sequence with any rho < tau leaves the loss and its normaliser) and
    clip_ratio_c=c (dual-clip PPO) with token TIS."""
    logp, old, roll, mask, adv = _batch(2)
    tau, c_is, c = 0.65, 2.0, 3.0

    def theirs(lp):
        rho = torch.exp(old - roll)
        keep = ~((rho < tau) & mask).any(1, keepdim=True).expand(B, T)
        w = rho.clamp(max=c_is)
        return w * _ppo(torch.exp(lp - old), adv, 0.2, 0.2, c=c), keep

    corr = op.Correction(weights="tis", bounds=c_is, veto=tau, ppo_clip=(0.2, 0.2), dual_clip=c,
                         rejected_in_normalizer=False)
    out = _ours(logp, old, roll, mask, adv, corr)
    assert 0 < float(out[0].metrics["rejected_frac"]) < 1
    _check(out, _theirs(theirs, logp, "token-mean", mask))


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_verl_rollout_rs(level):
    """rollout_rs=token|sequence|geometric, rollout_rs_threshold=U, rollout_rs_threshold_lower=L, no IS weights,
    decoupled PPO: tokens (or whole sequences) whose ratio pi_old / pi_rollout (per token, the sequence product, or
    the geometric mean) lies outside [L, U] leave the loss mask, numerator and denominator alike."""
    logp, old, roll, mask, adv = _batch(11)
    lo, hi = {"token": (0.8, 1.25), "sequence": (0.5, 2.0), "geometric": (0.9, 1.1)}[level]

    def theirs(lp):
        log_rho = old - roll
        if level == "sequence":
            log_rho = _seq_sum(log_rho, mask).expand(B, T)
        elif level == "geometric":
            log_rho = (_seq_sum(log_rho, mask) / mask.sum(1, keepdim=True)).expand(B, T)
        rho = torch.exp(log_rho)
        return _ppo(torch.exp(lp - old), adv, 0.2, 0.2), (rho >= lo) & (rho <= hi)

    corr = op.Correction(weights="reject", bounds=(lo, hi), level=level, ppo_clip=(0.2, 0.2),
                         rejected_in_normalizer=False)
    out = _ours(logp, old, roll, mask, adv, corr)
    assert 0 < float(out[0].metrics["ratio_above_upper_frac"] + out[0].metrics["ratio_below_lower_frac"]) < 1
    _check(out, _theirs(theirs, logp, "token-mean", mask))


def test_verl_rollout_is_with_rollout_rs():
    """rollout_is=token (threshold C) together with rollout_rs=geometric [L, U]: the IS weight min(rho, C) and the
    rejection mask are separate (verl's separation of IS weights and rejection sampling); rejected sequences leave
    the loss mask, numerator and denominator."""
    logp, old, roll, mask, adv = _batch(12)
    c_is, lo, hi = 1.5, 0.9, 1.1

    def theirs(lp):
        log_rho = old - roll
        geo = torch.exp(_seq_sum(log_rho, mask) / mask.sum(1, keepdim=True)).expand(B, T)
        w = torch.exp(log_rho).clamp(max=c_is)
        return w * _ppo(torch.exp(lp - old), adv, 0.2, 0.2), (geo >= lo) & (geo <= hi)

    corr = op.Correction(weights="tis", bounds=c_is, ppo_clip=(0.2, 0.2),
                         rejections=(op.RatioRejection(lo, hi, "geometric"),), rejected_in_normalizer=False)
    out = _ours(logp, old, roll, mask, adv, corr)
    assert 0 < float(out[0].metrics["rejected_frac/rule0"]) < 1
    _check(out, _theirs(theirs, logp, "token-mean", mask))


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_verl_bypass_ppo_and_loss_agg_mode(agg):
    """bypass_mode=True (pi_old := pi_rollout, no IS weight) with each loss_agg_mode."""
    logp, old, roll, mask, adv = _batch(3)

    def theirs(lp):
        return _ppo(torch.exp(lp - roll), adv, 0.2, 0.3), torch.ones_like(mask)

    ours_agg = {"token-mean": "token_mean", "seq-mean-token-mean": "seq_mean_token_mean",
                "seq-mean-token-sum": "seq_mean_token_sum"}[agg]
    corr = op.Correction(ppo_clip=(0.2, 0.3))
    _check(_ours(logp, old, roll, mask, adv, corr, proximal="roll", aggregation=ours_agg),
           _theirs(theirs, logp, agg, mask))


def test_verl_policy_gradient_with_sequence_is():
    """bypass_mode + use_policy_gradient + rollout_is=sequence (the pg_is preset): REINFORCE -A sg(w) log p with
    w = min(prod_t p_t / pi_rollout_t, C)."""
    logp, old, roll, mask, adv = _batch(4)
    c_is = 3.0

    def theirs(lp):
        w = torch.exp(_seq_sum(lp.detach() - roll, mask).clamp(-20, 20)).clamp(max=c_is).expand(B, T)
        return -adv * w * lp, torch.ones_like(mask)

    corr = op.Correction(weights="tis", bounds=c_is, level="sequence")
    _check(_ours(logp, old, roll, mask, adv, corr, proximal=None), _theirs(theirs, logp, "token-mean", mask))


# ---------------------------------------------------------------------------------------------------------------
# TRL 1.16 (GRPOConfig)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_trl_vllm_importance_sampling(mode):
    """vllm_importance_sampling_correction=True, vllm_importance_sampling_mode, _cap=C: rho = exp(old - vllm)
    (summed over the sequence for sequence_*), truncated (min(rho, C)) or masked (0 where rho > C); it multiplies
    the per-token PPO loss (epsilon, epsilon_high); loss_type='bnpo' (token mean over the local batch)."""
    logp, old, roll, mask, adv = _batch(5)
    cap = 1.4

    def theirs(lp):
        diff = (old - roll) * mask
        log_rho = diff if mode.startswith("token") else diff.sum(1, keepdim=True).expand(B, T)
        rho = torch.exp(log_rho)
        w = rho.clamp(max=cap) if mode.endswith("truncate") else rho.masked_fill(rho > cap, 0.0)
        return w * _ppo(torch.exp(lp - old), adv, 0.2, 0.28), torch.ones_like(mask)

    corr = op.Correction(weights="tis" if mode.endswith("truncate") else "mis", bounds=(0.0, cap),
                         level="token" if mode.startswith("token") else "sequence", ppo_clip=(0.2, 0.28))
    _check(_ours(logp, old, roll, mask, adv, corr), _theirs(theirs, logp, "token-mean", mask))


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_trl_loss_type_aggregation_and_delta(loss_type):
    """loss_type grpo (mean over sequences of each sequence's token mean), bnpo (token mean), dr_grpo (sum over
    B * max_completion_length), dapo (token mean over the global count of trained tokens; one batch here), with
    epsilon=0.2, epsilon_high=0.28 and delta=1.5 (two-sided clipping)."""
    logp, old, roll, mask, adv = _batch(6)
    agg = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dr_grpo": ("constant", B * T),
           "dapo": "token-mean"}[loss_type]

    def theirs(lp):
        return _ppo(torch.exp(lp - old), adv, 0.2, 0.28, delta=1.5), torch.ones_like(mask)

    ours = {"grpo": dict(aggregation="seq_mean_token_mean"), "bnpo": dict(aggregation="token_mean"),
            "dr_grpo": dict(aggregation="constant", constant_normalizer=float(B * T)),
            "dapo": dict(aggregation="token_mean", num_loss_tokens=float(mask.sum()))}[loss_type]
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


# ---------------------------------------------------------------------------------------------------------------
# slime (and the Miles fork, which keeps these options)
# ---------------------------------------------------------------------------------------------------------------


def test_slime_tis_and_dual_clip():
    """--use-tis --tis-clip C --tis-clip-low c, --eps-clip, --eps-clip-high, --eps-clip-c: w = clamp(rho, c, C)
    with rho = pi_old / pi_rollout on PPO's dual-clipped per-token loss; --calculate-per-token-loss (token mean)."""
    logp, old, roll, mask, adv = _batch(9)

    def theirs(lp):
        w = torch.exp(old - roll).clamp(0.5, 2.0)
        return w * _ppo(torch.exp(lp - old), adv, 0.2, 0.28, c=3.0), torch.ones_like(mask)

    corr = op.Correction(weights="tis", bounds=(0.5, 2.0), ppo_clip=(0.2, 0.28), dual_clip=3.0)
    _check(_ours(logp, old, roll, mask, adv, corr), _theirs(theirs, logp, "token-mean", mask))


def test_slime_cispo_and_opsm():
    """CISPO with slime's bounds: -sg(clamp(p / old, 1 - eps, 1 + eps_high)) A log p; OPSM (--use-opsm
    --opsm-delta d): a sequence with A < 0 and mean_t (log pi_rollout - log p) > d is dropped (kept in the token
    mean's normaliser, as offpolicy does by default)."""
    logp, old, roll, mask, adv = _batch(10)
    d = 0.05

    def theirs(lp):
        coef = torch.exp(lp.detach() - old).clamp(0.8, 1.28)
        mean_k1 = _seq_sum(roll - lp.detach(), mask) / mask.sum(1, keepdim=True)
        drop = (adv[:, :1] < 0) & (mean_k1 > d)
        return torch.where(drop.expand(B, T), 0.0, -coef * adv * lp), torch.ones_like(mask)

    corr = op.Correction(cispo=(0.8, 1.28), opsm_delta=d)
    out = _ours(logp, old, roll, mask, adv, corr)
    assert 0 < float(out[0].metrics["rejected_frac"]) < 1
    _check(out, _theirs(theirs, logp, "token-mean", mask))


def test_every_row_has_a_test():
    """docs/migrating.md names a test of this file in every supported row."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "migrating.md").read_text()
    named = {name for name in globals() if name.startswith("test_") and name != "test_every_row_has_a_test"}
    cited = {word.strip("`.,") for word in text.split() if word.strip("`").startswith("test_")}
    cited.discard("test_every_row_has_a_test")
    assert named <= cited, f"tests without a row: {named - cited}"
    assert cited <= named, f"rows citing missing tests: {cited - named}"
