"""op.TrustRegion against transcriptions of the peers whose code is not installed here (float64, random masked
batches): prime-rl's default loss and its 'ipo' loss (loss 1e-12, gradient 1e-10, the masked fraction), ROLL's
probability-difference filter and AReaL's KPop rejection, token and sequence level (the masks exactly, the
filtered fraction 1e-12).

Each transcription names its file and commit; the formulas are re-typed from them, not imported.
Mappings (the migration rows):

* prime-rl ``[trainer.loss] type="default"`` (``dppo_mask_low/high``, ``adv_tau``, ``kl_tau``):
  ``Correction(trust_region=TrustRegion(dppo_mask_low, dppo_mask_high, penalty=kl_tau))`` on ``adv_tau * A``,
  ``sampler_logprobs`` = inference log-probs, ``aggregation="token_mean"`` (prime-rl divides by the loss tokens).
* prime-rl ``type="ipo"`` (``ipo_threshold``): ``TrustRegion(t, t, sign="none", penalty=kl_tau)``.
* ROLL ``train_infer_correction.filters[i]`` with ``diff_enabled`` (``agg_type`` token / geometric / sequence,
  ``diff_low <= 0 <= diff_high``): ``TrustRegion(-diff_low, diff_high, sign="none", level=agg_type,
  on="weights")`` with ``proximal_logprobs=old_log_probs``, ``rejected_in_normalizer=False`` (ROLL multiplies the
  response mask).
* AReaL ``rejection_sampling: {metric: binary_kl, level: token, action: mask, upper: phi}``:
  ``TrustRegion(phi, phi, divergence="binary_kl_max", sign="none", on="weights")`` with
  ``proximal_logprobs=proximal``. Only the masks are compared here; the whole row (``weights="mis"`` for AReaL's
  raw behaviour weight, rejected tokens kept in the normaliser) is checked on the loss in
  tests/core/test_migrating_peers.py (``test_areal_rejection_sampling``).
* AReaL ``{metric: binary_kl, level: sequence, action: mask, agg: sum | mean | max, upper: phi}`` (the same
  commit's 2D padded branch): ``TrustRegion(phi, phi, "binary_kl_max", sign="none", level="sequence" |
  "geometric" | "sequence_max", on="weights")``, the rest as the token row. AReaL's ``lower`` (documented as
  unused with ``binary_kl``, yet applied by its ``_check_bounds``: a sequence whose divergence is below it is
  masked) has no offpolicy counterpart.
"""

from __future__ import annotations

import math

import pytest
import torch

import offpolicy as op

PRIME_RL = "PrimeIntellect-ai/prime-rl src/prime_rl/trainer/rl/loss.py @ 559b44772e471d1538537b8805cc77f3824a5e64"
ROLL = "alibaba/ROLL roll/utils/train_infer_corrections.py @ 8eb27cc2dc34c4d1310b169d9b86d339004d811a"
AREAL = "areal-project/AReaL areal/utils/functional/functional.py @ cbff54d645d2cd8ee1f1c358a82f3f473588433d"


def _batch(seed, b=6, t=9, vocab=5, drift=1.0, step=0.7):
    g = torch.Generator().manual_seed(seed)
    z = 2.5 * torch.randn(b, t, vocab, generator=g, dtype=torch.float64)
    tok = torch.randint(0, vocab, (b, t), generator=g)

    def lp(x):
        return torch.log_softmax(x, -1).gather(-1, tok[..., None])[..., 0]

    old = z + drift * torch.randn(z.shape, generator=g, dtype=torch.float64)
    mask = torch.arange(t)[None] < torch.randint(2, t + 1, (b,), generator=g)[:, None]
    adv = torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, t).clone()
    return {"infer": lp(z), "old": lp(old), "lp": lp(old + step * torch.randn(z.shape, generator=g,
                                                                            dtype=torch.float64)),
            "adv": adv, "mask": mask, "seq": torch.arange(b)[:, None].expand(b, t).reshape(-1)}


# ---- prime-rl: default_loss_fn / ipo_loss_fn, then compute_loss's sum over samples / rl_scale (PRIME_RL) ----

def _prime_rl(x, kind, low, high, adv_tau, kl_tau):
    lp = x["lp"].clone().requires_grad_(True)
    total, masked = lp.sum() * 0.0, []
    for i in range(lp.shape[0]):
        t_lp, i_lp, a, m = lp[i], x["infer"][i], x["adv"][i], x["mask"][i]
        log_r = t_lp - i_lp
        r = torch.exp(log_r)
        d = torch.exp(t_lp) - torch.exp(i_lp)
        if kind == "default":
            is_masked = torch.where(a > 0, d > high, d < -low)
        else:
            is_masked = d.abs() > high
        keep = m & ~is_masked
        per_token = -(keep * (adv_tau * a) * r) + kl_tau * (m * log_r**2)
        total = total + per_token.sum()
        masked.append((int(is_masked[m].sum()), int(m.sum())))
    rl_scale = int(x["mask"].sum())
    loss = total / rl_scale
    loss.backward()
    frac = sum(k for k, _ in masked) / sum(n for _, n in masked)
    return loss.detach(), lp.grad, frac


def _ours(x, corr, ref_key, proximal=None, adv_scale=1.0, **kw):
    lp = x["lp"].reshape(-1).clone().requires_grad_(True)
    out = op.policy_loss_from_logprobs(lp, x[ref_key].reshape(-1), adv_scale * x["adv"].reshape(-1),
                                       loss_mask=x["mask"].reshape(-1), correction=corr, seq_ids=x["seq"],
                                       proximal_logprobs=None if proximal is None else x[proximal].reshape(-1), **kw)
    out.loss.backward()
    return out.loss.detach(), lp.grad.reshape(x["lp"].shape), out


@pytest.mark.parametrize("kind, low, high", [("default", 0.05, 0.1), ("default", 0.2, 0.2), ("ipo", 0.08, 0.08)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prime_rl_losses(kind, low, high, seed):
    x = _batch(seed)
    adv_tau, kl_tau = 0.7, 0.05
    l_t, g_t, frac_t = _prime_rl(x, kind, low, high, adv_tau, kl_tau)
    sign = "advantage" if kind == "default" else "none"
    corr = op.Correction(trust_region=op.TrustRegion(low, high, sign=sign, penalty=kl_tau))
    l_o, g_o, out = _ours(x, corr, "infer", adv_scale=adv_tau)
    frac = float(out.metrics["trust_region_masked_frac"])
    assert 0 < frac < 1 and math.isclose(frac, frac_t, rel_tol=1e-12), PRIME_RL
    assert abs(float(l_o) - float(l_t)) <= 1e-12 * max(1.0, abs(float(l_t))), (PRIME_RL, float(l_o), float(l_t))
    assert float((g_o - g_t).abs().max()) <= 1e-10 * max(1.0, float(g_t.abs().max())), PRIME_RL


# ---- ROLL: _compute_all_granularity's diff and the diff filter of compute_train_infer_correction (ROLL) ----

def _roll_filter(x, agg, diff_low, diff_high):
    m = x["mask"].double()
    diff_token = x["old"].exp() - x["infer"].exp()
    if agg == "token":
        diff = diff_token
    elif agg == "geometric":
        diff = ((diff_token * m).sum(-1) / m.sum(-1))[:, None].expand_as(diff_token)
    else:
        diff = (diff_token * m).sum(-1)[:, None].expand_as(diff_token)
    filt = (diff >= diff_low).double() * (diff <= diff_high).double()
    final_mask_mean = float((m * filt).sum() / m.sum())
    return filt.bool(), final_mask_mean


@pytest.mark.parametrize("agg, diff_low, diff_high", [("token", -0.05, 0.1), ("geometric", -0.02, 0.04),
                                                      ("sequence", -0.15, 0.2)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_roll_difference_filter(agg, diff_low, diff_high, seed):
    x = _batch(20 + seed)
    keep_t, mean_t = _roll_filter(x, agg, diff_low, diff_high)
    corr = op.Correction(ppo_clip=(0.2, 0.2), rejected_in_normalizer=False,
                         trust_region=op.TrustRegion(-diff_low, diff_high, sign="none", level=agg, on="weights"))
    _, _, out = _ours(x, corr, "infer", proximal="old")
    m = x["mask"]
    keep_o = (out.token_weight.reshape(m.shape) != 0)
    assert torch.equal(keep_o[m], keep_t[m]), ROLL
    assert 0 < mean_t < 1 and math.isclose(1 - float(out.metrics["trust_region_masked_frac"]), mean_t,
                                           rel_tol=1e-12), ROLL


@pytest.mark.parametrize("diff_low, diff_high", [(-0.03, 0.05), (-0.1, 0.02)])
@pytest.mark.parametrize("seed", [0, 1])
def test_roll_difference_filter_at_segment_level(diff_low, diff_high, seed):
    """``diff_enabled`` with ``agg_type="segment"``: ROLL bands ``compute_segment_masked_mean(exp(old) - exp(infer),
    response_mask)``, each turn's mean difference (a turn: a run of response tokens; observation tokens split
    them): ``TrustRegion(-diff_low, diff_high, sign="none", level="segment", on="weights")`` with ``segment_ids`` =
    each token's run index in its row. The masks equal ROLL's exactly; the geometric (whole-sequence) band masks
    other tokens on the same batch."""
    from test_segment_rejection import _roll_compute_segment_masked_mean, _turns

    x = _batch(60 + seed, t=12)
    x["mask"] = x["mask"].clone()
    x["mask"][:, [3, 7]] = False  # observation tokens: up to three turns per row
    m = x["mask"]
    diff = _roll_compute_segment_masked_mean(x["old"].exp() - x["infer"].exp(), m.long())
    keep_t = (diff >= diff_low) & (diff <= diff_high)
    tr = op.TrustRegion(-diff_low, diff_high, sign="none", level="segment", on="weights")
    corr = op.Correction(ppo_clip=(0.2, 0.2), rejected_in_normalizer=False, trust_region=tr)
    _, _, out = _ours(x, corr, "infer", proximal="old", segment_ids=_turns(m).reshape(-1))
    keep_o = out.token_weight.reshape(m.shape) != 0
    assert torch.equal(keep_o[m], keep_t[m]), ROLL
    assert 0 < int((m & ~keep_t).sum()) < int(m.sum())  # some turns filtered, not all
    geo = op.Correction(ppo_clip=(0.2, 0.2), rejected_in_normalizer=False,
                        trust_region=op.TrustRegion(-diff_low, diff_high, sign="none", level="geometric",
                                                    on="weights"))
    _, _, out_geo = _ours(x, geo, "infer", proximal="old")
    assert not torch.equal((out_geo.token_weight.reshape(m.shape) != 0)[m], keep_t[m])


# ---- AReaL: compute_binary_kl_divergence and apply_rejection_sampling(metric="binary_kl", level="token") ----

def _areal_binary_kl(log_p, log_q, eps=1e-8):
    p = torch.clamp(torch.exp(log_p), eps, 1.0 - eps)
    q = torch.clamp(torch.exp(log_q), eps, 1.0 - eps)
    return p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))


def _areal_kpop(x, upper):
    metric = torch.maximum(_areal_binary_kl(x["old"], x["infer"]), _areal_binary_kl(x["infer"], x["old"]))
    in_bounds = metric <= upper
    cand = x["mask"]
    return in_bounds, float((cand & ~in_bounds).sum()) / max(int(cand.sum()), 1), metric


@pytest.mark.parametrize("phi", [0.01, 0.05])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_areal_kpop(phi, seed):
    x = _batch(40 + seed)
    keep_t, frac_t, metric = _areal_kpop(x, phi)
    m = x["mask"]
    # AReaL clamps probabilities to [1e-8, 1 - 1e-8]; away from the band that cannot flip a mask.
    assert bool(((metric[m] - phi).abs() > 1e-6).all())
    corr = op.Correction(ppo_clip=(0.2, 0.2), rejected_in_normalizer=False,
                         trust_region=op.TrustRegion(phi, phi, divergence="binary_kl_max", sign="none", on="weights"))
    _, _, out = _ours(x, corr, "infer", proximal="old")
    keep_o = (out.token_weight.reshape(m.shape) != 0)
    assert torch.equal(keep_o[m], keep_t[m]), AREAL
    assert 0 < frac_t < 1 and math.isclose(float(out.metrics["trust_region_masked_frac"]), frac_t, rel_tol=1e-12)


def _areal_kpop_sequence(x, agg, upper):
    """``apply_rejection_sampling(metric="binary_kl", level="sequence", action="mask", lower=None)``, 2D padded:
    the token metric masked by ``loss_mask``, summed / averaged over ``valid_count.clamp(min=1)`` / maxed with
    ``-inf`` fill per row, ``in_bounds = seq_metric <= upper`` expanded to the row."""
    metric = torch.maximum(_areal_binary_kl(x["old"], x["infer"]), _areal_binary_kl(x["infer"], x["old"]))
    m = x["mask"]
    masked_agg = torch.where(m, metric, 0.0)
    valid_count = m.sum(dim=-1, keepdim=True).clamp(min=1)
    if agg == "sum":
        seq_agg = masked_agg.sum(dim=-1, keepdim=True)
    elif agg == "mean":
        seq_agg = masked_agg.sum(dim=-1, keepdim=True) / valid_count
    else:
        seq_agg = metric.masked_fill(~m, float("-inf")).max(dim=-1, keepdim=True)[0]
        seq_agg = torch.where(m.sum(dim=-1, keepdim=True) == 0, torch.zeros_like(seq_agg), seq_agg)
    in_bounds = (seq_agg <= upper).expand_as(m)
    return in_bounds, float((m & ~in_bounds).sum()) / max(int(m.sum()), 1), seq_agg


@pytest.mark.parametrize("agg, level, phi", [("sum", "sequence", 0.5), ("mean", "geometric", 0.1),
                                             ("max", "sequence_max", 0.3)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_areal_kpop_sequence_level(agg, level, phi, seed):
    x = _batch(50 + seed, b=12)
    keep_t, frac_t, stat = _areal_kpop_sequence(x, agg, phi)
    # AReaL's [1e-8, 1 - 1e-8] clamp moves each divergence by far less than 1e-6 here: no sequence flips.
    assert bool(((stat - phi).abs() > 1e-6).all())
    corr = op.Correction(ppo_clip=(0.2, 0.2), rejected_in_normalizer=False,
                         trust_region=op.TrustRegion(phi, phi, "binary_kl_max", sign="none", level=level,
                                                     on="weights"))
    _, _, out = _ours(x, corr, "infer", proximal="old")
    m = x["mask"]
    keep_o = (out.token_weight.reshape(m.shape) != 0)
    assert torch.equal(keep_o[m], keep_t[m]), AREAL
    assert 0 < frac_t < 1 and math.isclose(float(out.metrics["trust_region_masked_frac"]), frac_t, rel_tol=1e-12)
