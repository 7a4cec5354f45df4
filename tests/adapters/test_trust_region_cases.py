"""op.TrustRegion against verl 0.9.1's own ``dppo_tv`` / ``dppo_kl`` policy losses and SkyRL 0.3.0's own ``dppo``
(float64, random masked batches: loss 1e-12, gradient 1e-10, masks and masked fractions exactly). These run inside
.venv-trainers: tests/adapters/test_trust_region_trainers.py runs this file there in a subprocess.

Mappings (the migration rows):

* verl ``loss_mode="dppo_tv"`` (``clip_ratio_low/high`` = the TV bands, ``clip_ratio_c`` = the truncation ``C``):
  ``Correction(cispo=(0, C), trust_region=TrustRegion(low, high))`` with ``proximal_logprobs=old_log_prob``; the
  loss ``-A sg(min(u, C)) log p 1[valid]`` is CISPO's with the mask.
* verl ``"dppo_kl"``: the same with ``divergence="binary_kl"`` (verl adds 1e-8 inside the complement's log; the
  tests keep every token's divergence more than 1e-6 away from the bands, where that cannot flip a mask).
* SkyRL ``policy_loss_type="dppo"`` (``dppo_type`` binary_tv / binary_kl, ``delta_low/high``): ``Correction(
  trust_region=TrustRegion(delta_low, delta_high, divergence=...))`` with ``sampler_logprobs=rollout_logprobs``
  (its ``mu``; ``old_log_probs`` without them), ``aggregation="constant", constant_normalizer=1`` on SkyRL's
  pre-scaled advantages (``reduce_loss`` sums). SkyRL exponentiates the ratio in fp32 (``safe_exp_delta``); the
  float64 comparison replaces that helper by the same clamp and exp in float64, a second one keeps it at fp32's
  tolerance.
"""

import os
import sys
import types

import pytest
import torch

try:
    import verl  # noqa: F401
    import skyrl
except ImportError:
    pytest.skip("runs inside .venv-trainers, through tests/adapters/test_trust_region_trainers.py",
                allow_module_level=True)

_backends = types.ModuleType("skyrl.backends")
_backends.__path__ = [os.path.join(os.path.dirname(skyrl.__file__), "backends")]
sys.modules.setdefault("skyrl.backends", _backends)

from skyrl.backends.skyrl_train.utils import ppo_utils  # noqa: E402
from skyrl.train.config import AlgorithmConfig  # noqa: E402
from verl.trainer.ppo.core_algos import get_policy_loss_fn  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402
from verl.workers.config.actor import PolicyLossConfig  # noqa: E402

import offpolicy as op  # noqa: E402
from offpolicy.corrections.trust_region import binary_kl  # noqa: E402

VERL_AGG = {"token-mean": "token_mean", "seq-mean-token-mean": "seq_mean_token_mean",
            "seq-mean-token-sum": "seq_mean_token_sum"}


def _batch(seed, b=6, t=9, vocab=5, drift=1.0, step=0.7):
    """``[B, T]`` float64 rollout / proximal / current log-probs of sampled tokens from peaked nearby
    distributions (so probabilities move), ragged masks, per-sequence advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    z = 2.5 * torch.randn(b, t, vocab, generator=g, dtype=torch.float64)
    tok = torch.randint(0, vocab, (b, t), generator=g)

    def lp(x):
        return torch.log_softmax(x, -1).gather(-1, tok[..., None])[..., 0]

    old = z + drift * torch.randn(z.shape, generator=g, dtype=torch.float64)
    mask = torch.arange(t)[None] < torch.randint(2, t + 1, (b,), generator=g)[:, None]
    adv = torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, t).clone()
    return {"rollout": lp(z), "old": lp(old), "lp": lp(old + step * torch.randn(z.shape, generator=g,
                                                                              dtype=torch.float64)),
            "adv": adv, "mask": mask, "seq": torch.arange(b)[:, None].expand(b, t).reshape(-1)}


def _ours(x, corr, ref_key, proximal=None, **kw):
    lp = x["lp"].reshape(-1).clone().requires_grad_(True)
    out = op.policy_loss_from_logprobs(lp, x[ref_key].reshape(-1), x["adv"].reshape(-1),
                                       loss_mask=x["mask"].reshape(-1), correction=corr, seq_ids=x["seq"],
                                       proximal_logprobs=None if proximal is None else x[proximal].reshape(-1), **kw)
    out.loss.backward()
    return out.loss.detach(), lp.grad.reshape(x["lp"].shape), out


def _close(ours, theirs, what, loss_tol=1e-12, grad_tol=1e-10):
    (l_o, g_o), (l_t, g_t) = ours, theirs
    assert abs(float(l_o) - float(l_t)) <= loss_tol * max(1.0, abs(float(l_t))), (what, float(l_o), float(l_t))
    assert float((g_o - g_t).abs().max()) <= grad_tol * max(1.0, float(g_t.abs().max())), what


def _away_from_bands(div, bands, mask):
    return all(bool(((div[mask] - b).abs() > 1e-6).all()) for b in bands)


@pytest.mark.parametrize("agg", sorted(VERL_AGG))
@pytest.mark.parametrize("mode, bands", [("dppo_tv", (0.05, 0.1)), ("dppo_kl", (0.02, 0.01))])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_verl_dppo_equals_cispo_under_the_trust_region(mode, bands, agg, seed):
    x = _batch(seed)
    low, high = bands
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=2, ppo_mini_batch_size=4,
                      policy_loss=PolicyLossConfig(loss_mode=mode), loss_agg_mode=agg, clip_ratio=0.2,
                      clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=3.0)
    lp = x["lp"].clone().requires_grad_(True)
    loss, metrics = get_policy_loss_fn(mode)(x["old"], lp, x["adv"], x["mask"].double(), agg, cfg, None)
    loss.backward()
    divergence = "difference" if mode == "dppo_tv" else "binary_kl"
    corr = op.Correction(cispo=(0.0, 3.0), trust_region=op.TrustRegion(low, high, divergence=divergence))
    l_o, g_o, out = _ours(x, corr, "rollout", proximal="old", aggregation=VERL_AGG[agg])
    if mode == "dppo_kl":
        assert _away_from_bands(binary_kl(x["old"], x["lp"]), bands, x["mask"])
    assert bool(((x["lp"] - x["old"]).exp()[x["mask"]] > 3.0).any()) or seed != 0  # the truncation bites once
    frac = float(out.metrics["trust_region_masked_frac"])
    # verl's masked_mean divides by (count + 1e-8): the clip fraction agrees to that relative 1e-8 / count.
    assert 0 < frac < 1 and abs(frac - metrics["actor/pg_clipfrac"]) < 1e-9
    # verl's seq-mean-token-mean divides each sequence by (count + 1e-8): agreement to 1e-8 relative there only.
    tol = 1e-8 if agg == "seq-mean-token-mean" else None
    _close((l_o, g_o), (loss.detach(), lp.grad), (mode, agg, seed), *((tol, tol) if tol else ()))


def _skyrl(x, dppo_type, low, high, rollout=True):
    cfg = AlgorithmConfig(policy_loss_type="dppo")
    cfg.dppo.dppo_type, cfg.dppo.delta_low, cfg.dppo.delta_high = dppo_type, low, high
    lp = x["lp"].clone().requires_grad_(True)
    loss, metrics = ppo_utils.PolicyLossRegistry.get("dppo")(lp, x["old"], x["adv"], cfg, loss_mask=x["mask"].double(),
                                                             rollout_logprobs=x["rollout"] if rollout else None)
    loss.backward()
    return loss.detach(), lp.grad, metrics


def _exp64(delta, clip=20.0, out_dtype=None):
    return torch.clamp(delta, -clip, clip).exp().to(out_dtype or delta.dtype)


@pytest.mark.parametrize("dppo_type, low, high", [("binary_tv", 0.05, 0.1), ("binary_kl", 0.02, 0.01)])
@pytest.mark.parametrize("rollout", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_skyrl_dppo_equals_the_trust_region(dppo_type, low, high, rollout, seed, monkeypatch):
    x = _batch(10 + seed)
    divergence = "difference" if dppo_type == "binary_tv" else "binary_kl"
    corr = op.Correction(trust_region=op.TrustRegion(low, high, divergence=divergence))
    ref_key = "rollout" if rollout else "old"
    if dppo_type == "binary_kl":
        assert _away_from_bands(binary_kl(x[ref_key], x["lp"]), (low, high), x["mask"])
    l_o, g_o, out = _ours(x, corr, ref_key, aggregation="constant", constant_normalizer=1.0)
    fp32 = _skyrl(x, dppo_type, low, high, rollout)
    assert torch.allclose(l_o, fp32[0], rtol=1e-6, atol=1e-7)
    monkeypatch.setattr(ppo_utils, "safe_exp_delta", _exp64)
    l_t, g_t, metrics = _skyrl(x, dppo_type, low, high, rollout)
    frac = float(out.metrics["trust_region_masked_frac"])
    assert 0 < frac < 1 and abs(frac - metrics["clip_ratio"]) < 1e-12
    _close((l_o, g_o), (l_t, g_t), (dppo_type, rollout, seed))
