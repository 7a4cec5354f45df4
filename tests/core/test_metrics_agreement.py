"""The probability-agreement metrics users asked for (verl#7196, verl#7519; issue 44): ``prob_pearson`` (Pearson's
correlation of the trained tokens' ``p`` and ``q``), ``prob_abs_diff_max/mean/std`` (of ``|p - q|``) and
``chi2_token`` (``mean r^2 - 1``), each against

* a float64 literal computation written here (plain Python over the trained tokens),
* a transcription of verl's code: ``verl/utils/debug/metrics.py`` (``calculate_debug_metrics``:
  ``torch.corrcoef`` of the masked probabilities, ``torch.max/mean/std`` of ``|p - q|``) and ``compute_offpolicy_metrics``
  of ``verl/trainer/ppo/rollout_corr_helper.py`` (``chi2_token = masked_mean(exp(clamp(log r, -20, 20))^2) - 1``,
  ``masked_mean`` adding ``1e-8`` to the count), verl 0.9.1; the installed package is checked in
  ``tests/adapters/test_verl_cases.py::test_verl_agreement_metrics_match_offpolicy``,
* and ``offpolicy.reference.reference_metrics`` (overall, per group, per staleness).
"""

from __future__ import annotations

import math

import pytest
import torch

import offpolicy as op
from offpolicy.reference import reference_metrics

from support.batches import make_batch

KEYS = ("prob_pearson", "prob_abs_diff_max", "prob_abs_diff_mean", "prob_abs_diff_std", "chi2_token")


def _literal(logp: list[float], lq: list[float]) -> dict[str, float]:
    """Float64 literal forms over the trained tokens (the definitions of docs/spec.md#metrics)."""
    p = [math.exp(x) for x in logp]
    q = [math.exp(x) for x in lq]
    n = len(p)
    mp, mq = sum(p) / n, sum(q) / n
    cov = sum((a - mp) * (b - mq) for a, b in zip(p, q))
    var_p = sum((a - mp) ** 2 for a in p)
    var_q = sum((b - mq) ** 2 for b in q)
    d = [abs(a - b) for a, b in zip(p, q)]
    md = sum(d) / n
    r = [math.exp(min(max(a - b, -20.0), 20.0)) for a, b in zip(logp, lq)]
    return {
        "prob_pearson": cov / math.sqrt(var_p * var_q),
        "prob_abs_diff_max": max(d),
        "prob_abs_diff_mean": md,
        "prob_abs_diff_std": math.sqrt(sum((x - md) ** 2 for x in d) / (n - 1)),
        "chi2_token": sum(x * x for x in r) / n - 1,
    }


def _verl(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor) -> dict:
    """verl 0.9.1's code on ``[B, T]`` tensors: calculate_debug_metrics' probability statistics (keys renamed to
    offpolicy's) and compute_offpolicy_metrics' chi2_token."""
    actor_probs = torch.exp(old_log_prob)
    rollout_probs = torch.exp(rollout_log_prob)
    mask = response_mask.bool()
    mt1 = torch.masked_select(actor_probs, mask)
    mt2 = torch.masked_select(rollout_probs, mask)
    pearson = torch.corrcoef(torch.stack([mt1, mt2], dim=0))[0][1].item()
    diff = torch.masked_select(torch.abs(actor_probs - rollout_probs), mask)
    log_ratio = old_log_prob - rollout_log_prob
    rho = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))
    m = response_mask.to(rho.dtype)
    chi2 = (rho.square() * m).sum() / (m.sum() + 1e-8) - 1.0
    return {"prob_pearson": pearson, "prob_abs_diff_max": torch.max(diff).item(),
            "prob_abs_diff_mean": torch.mean(diff).item(), "prob_abs_diff_std": torch.std(diff).item(),
            "chi2_token": chi2.item()}


def _padded(seed: int, b: int = 6, t: int = 9, drift: float = 0.4):
    g = torch.Generator().manual_seed(seed)
    lq = torch.log(torch.rand(b, t, generator=g, dtype=torch.float64) * 0.95 + 0.02)
    logp = (lq + drift * torch.randn(b, t, generator=g, dtype=torch.float64)).clamp(max=0.0)
    lengths = torch.randint(2, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None] < lengths[:, None]
    return logp, lq, mask


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_agreement_metrics_match_literal_and_verl(seed, dtype):
    logp, lq, mask = _padded(seed)
    adv = torch.randn(logp.shape, generator=torch.Generator().manual_seed(seed + 50), dtype=torch.float64)
    out = op.policy_loss_from_logprobs(logp.reshape(-1).to(dtype), lq.reshape(-1).to(dtype),
                                       adv.reshape(-1).to(dtype), loss_mask=mask.reshape(-1),
                                       correction=op.Correction(weights="mis", bounds=(0.5, 2.0)))
    sel = mask.reshape(-1)
    lit = _literal(logp.reshape(-1)[sel].tolist(), lq.reshape(-1)[sel].tolist())
    theirs = _verl(logp, lq, mask)
    tol = dict(rel_tol=1e-12, abs_tol=1e-14) if dtype == torch.float64 else dict(rel_tol=2e-5, abs_tol=1e-6)
    for key in KEYS:
        assert math.isclose(float(out.metrics[key]), lit[key], **tol), (key, float(out.metrics[key]), lit[key])
        # verl's masked_mean adds 1e-8 to the count: 1e-8 / n relative on chi2_token + 1.
        assert math.isclose(theirs[key], lit[key], rel_tol=1e-8, abs_tol=1e-9), (key, theirs[key], lit[key])
    assert -1.0 <= float(out.metrics["prob_pearson"]) <= 1.0


def test_agreement_metrics_per_group_and_staleness_match_the_reference():
    n = 41
    z, y, lq, cands = make_batch(n, 30, 4, "head", seed=21, mismatch=1.2)
    g = torch.Generator().manual_seed(5)
    mask = torch.rand(n, generator=g) > 0.2
    adv = torch.randn(n, generator=g)
    groups = torch.randint(0, 3, (n,), generator=g)
    versions = torch.randint(2, 5, (n,), generator=g)
    corr = op.Correction(weights="tis", bounds=2.0, score_centering=True)
    kw = dict(correction=corr, groups=groups, versions=versions, current_version=5, seq_ids=torch.arange(n) // 6)
    out = op.policy_loss(z, y, lq, adv, cands, mask, **kw)
    ref = reference_metrics(z, y, lq, adv, cands, mask, **kw)
    checked = 0
    for key, val in ref.items():
        if key.rsplit("/", 1)[-1] in KEYS:
            assert math.isclose(float(out.metrics[key]), val, rel_tol=1e-5, abs_tol=1e-6), key
            checked += 1
    assert checked >= 5 * (1 + 3 + 3), checked  # overall, three groups, three staleness values
    # The trainer's p of the sampled token from the logits, by hand, for the overall Pearson.
    logp = torch.log_softmax(z.double(), -1).gather(1, y[:, None])[:, 0]
    lit = _literal(logp[mask].tolist(), lq.double()[mask].tolist())
    for key in KEYS:
        assert math.isclose(float(out.metrics[key]), lit[key], rel_tol=1e-5, abs_tol=1e-6), key


def test_agreement_metrics_hostile():
    """Constant columns, one token, no token, a token the trainer gives probability 0, and a float32 batch whose
    probabilities differ by 1e-7 around 0.9 (one pass would cancel to noise): finite, in range, as defined."""
    def metrics(logp, lq, mask=None, dtype=torch.float64):
        logp = torch.tensor(logp, dtype=dtype)
        lq = torch.tensor(lq, dtype=dtype)
        out = op.policy_loss_from_logprobs(logp, lq, torch.ones_like(lq), loss_mask=mask,
                                           correction=op.Correction(weights="mis", bounds=(0.5, 2.0)))
        return {k: float(out.metrics[k]) for k in KEYS}

    same = metrics([-1.0] * 4, [-1.0] * 4)
    assert same["prob_pearson"] == 1.0 and same["prob_abs_diff_max"] == 0.0 and same["prob_abs_diff_std"] == 0.0
    assert metrics([-1.0] * 4, [-1.2] * 4)["prob_pearson"] == 0.0          # both constant, different
    assert metrics([-1.0] * 4, [-1.0, -2.0, -0.5, -1.0])["prob_pearson"] == 0.0  # p constant
    one = metrics([-0.5], [-0.7])
    assert one["prob_abs_diff_std"] == 0.0 and one["prob_pearson"] == 0.0
    assert math.isclose(one["prob_abs_diff_mean"], math.exp(-0.5) - math.exp(-0.7), rel_tol=1e-14)
    none = metrics([-0.5, -1.0], [-0.7, -1.0], mask=torch.tensor([False, False]))
    assert all(v == 0.0 for v in none.values()), none
    zero_p = metrics([-math.inf, -1.0, -0.3], [-2.0, -1.1, -0.2])
    lit = _literal([-1e300, -1.0, -0.3], [-2.0, -1.1, -0.2])
    for key in ("prob_pearson", "prob_abs_diff_max", "prob_abs_diff_mean", "prob_abs_diff_std"):
        assert math.isclose(zero_p[key], lit[key], rel_tol=1e-12), key
    base = torch.full((64,), 0.9, dtype=torch.float64)
    jitter = torch.randn(64, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 1e-6
    lp32, lq32 = torch.log(base + jitter).float(), torch.log(base + 0.5 * jitter).float()
    f32 = metrics(lp32.tolist(), lq32.tolist(), dtype=torch.float32)
    p32, q32 = torch.exp(lp32).double(), torch.exp(lq32).double()  # the float32 probabilities, exactly
    lit = _literal(torch.log(p32).tolist(), torch.log(q32).tolist())
    assert lit["prob_pearson"] > 0.9
    assert math.isclose(f32["prob_pearson"], lit["prob_pearson"], abs_tol=1e-3), (f32, lit)
    # The one-pass form E[pq] - E[p] E[q] in float32 is noise here: the two-pass form is needed.
    one_pass = (p32.float() * q32.float()).mean() - p32.float().mean() * q32.float().mean()
    assert abs(float(one_pass) - float(((p32 - p32.mean()) * (q32 - q32.mean())).mean())) > 1e-13
    assert all(math.isfinite(v) for v in f32.values())
    # Probabilities near e^-50 (1.9e-22) with a 5% spread in fp32: the deviations' squares (~1e-46) underflow.
    tiny_lp = (-50.0 + 0.05 * torch.randn(64, generator=torch.Generator().manual_seed(2), dtype=torch.float64))
    tiny_lq = tiny_lp + 0.02 * torch.randn(64, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    lp32, lq32 = tiny_lp.float(), tiny_lq.float()
    f32 = metrics(lp32.tolist(), lq32.tolist(), dtype=torch.float32)
    lit = _literal(torch.log(torch.exp(lp32).double()).tolist(), torch.log(torch.exp(lq32).double()).tolist())
    assert lit["prob_pearson"] > 0.8
    assert math.isclose(f32["prob_pearson"], lit["prob_pearson"], abs_tol=1e-4), (f32["prob_pearson"], lit)
    assert math.isclose(f32["prob_abs_diff_std"], lit["prob_abs_diff_std"], rel_tol=1e-4), (f32, lit)
