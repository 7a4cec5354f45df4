"""The corrections added from the peers' family (verl, slime, TRL), each against a number worked out by hand; the
float64 reference comparisons live with the others in test_loss_reference.py."""

from __future__ import annotations

import math

import pytest
import torch

import offpolicy as op


def test_sequence_batch_normalisation_averages_sequence_means():
    """Weights (2, 2, 2 | 0.5) over two sequences: the token mean is 1.625, the mean of sequence means 1.25."""
    lq = [0.25, 0.25, 0.25, 0.5]
    logp = [0.5, 0.5, 0.5, 0.25]
    for mode, mean in (("tokens", 1.625), ("sequences", 1.25)):
        corr = op.Correction(weights="tis", bounds=3.0, batch_normalize=mode)
        out = op.policy_loss_from_logprobs(torch.tensor(logp, dtype=torch.float64).log(),
                                           torch.tensor(lq, dtype=torch.float64).log(),
                                           torch.ones(4, dtype=torch.float64), correction=corr,
                                           seq_ids=torch.tensor([0, 0, 0, 1]))
        assert out.token_weight.tolist() == pytest.approx([2 / mean, 2 / mean, 2 / mean, 0.5 / mean], rel=1e-12)
    with pytest.raises(ValueError, match="needs seq_ids"):
        op.policy_loss_from_logprobs(torch.tensor(logp).log(), torch.tensor(lq).log(), torch.ones(4),
                                     correction=op.Correction(weights="tis", batch_normalize="sequences"))


def _one(logp, lq, adv, corr, prox, seq=None, **kw):
    logp = torch.tensor(logp, dtype=torch.float64).log().requires_grad_()
    out = op.policy_loss_from_logprobs(logp, torch.tensor(lq, dtype=torch.float64).log(),
                                       torch.tensor(adv, dtype=torch.float64), correction=corr,
                                       proximal_logprobs=torch.tensor(prox, dtype=torch.float64).log(),
                                       seq_ids=seq, **kw)
    out.loss.backward()
    return out, logp.grad


def test_dual_clip_bounds_negative_advantages():
    """u = 10, A = -1, eps = 0.2, c = 3: PPO's surrogate is min(-10, -1.2) = -10 (loss 10); the dual clip bounds
    it by c A = -3 (loss 3, no gradient). A > 0 is untouched."""
    corr = op.Correction(ppo_clip=(0.2, 0.2), dual_clip=3.0)
    out, g = _one([0.5, 0.5], [0.5, 0.5], [-1.0, 1.0], corr, [0.05, 0.05])
    assert out.token_loss.tolist() == pytest.approx([3.0, -1.2], rel=1e-12)
    assert float(g[0]) == 0.0
    plain, _ = _one([0.5, 0.5], [0.5, 0.5], [-1.0, 1.0], op.Correction(ppo_clip=(0.2, 0.2)), [0.05, 0.05])
    assert plain.token_loss.tolist() == pytest.approx([10.0, -1.2], rel=1e-12)


def test_delta_caps_the_unclipped_branch():
    """TRL's two-sided clipping: A < 0 and u = 4 > delta = 2: min(min(u, delta) A, clip(u) A) = -2 (loss 2)."""
    corr = op.Correction(ppo_clip=(0.2, 0.2), ppo_delta=2.0)
    out, _ = _one([0.4], [0.4], [-1.0], corr, [0.1])
    assert out.token_loss.tolist() == pytest.approx([2.0], rel=1e-12)


def test_gspo_token_value_is_the_sequence_ratio_gradient_is_per_token():
    """One sequence, log(p / pi_prox) = (log 2, 0): s = exp(mean) = sqrt 2 (unclipped with wide eps), every token's
    surrogate value is s A, and d loss / d log p_t = -s A_t / T (each token its own gradient)."""
    corr = op.Correction(ppo_clip=(0.9, 9.0), ppo_ratio="gspo_token")
    out, g = _one([0.4, 0.3], [0.4, 0.3], [1.0, -2.0], corr, [0.2, 0.3], seq=torch.tensor([0, 0]))
    s = math.sqrt(2.0)
    assert out.token_loss.tolist() == pytest.approx([-s, 2 * s], rel=1e-12)
    assert g.tolist() == pytest.approx([-s / 2, 2 * s / 2], rel=1e-12)
    with pytest.raises(ValueError, match="needs seq_ids"):
        _one([0.4], [0.4], [1.0], corr, [0.2])


def test_cispo_is_a_stop_gradient_coefficient():
    """u = (3, 0.5), TRL's bounds (0, 2): coefficients (2, 0.5) multiply A log p; the gradient is -coef A / T."""
    corr = op.Correction(cispo=(0.0, 2.0))
    out, g = _one([0.3, 0.1], [0.3, 0.1], [1.0, 1.0], corr, [0.1, 0.2])
    assert out.token_loss.tolist() == pytest.approx([-2.0 * math.log(0.3), -0.5 * math.log(0.1)], rel=1e-12)
    assert g.tolist() == pytest.approx([-1.0, -0.25], rel=1e-12)


def test_rejected_tokens_leave_the_normaliser_on_request():
    """OPSM drops sequence 0 (A < 0, drifted): token_mean divides by 4 trained tokens by default, by the 2 kept
    with rejected_in_normalizer=False (verl's convention)."""
    logp = torch.tensor([0.1, 0.1, 0.5, 0.5], dtype=torch.float64).log()
    lq = torch.tensor([0.5, 0.5, 0.5, 0.5], dtype=torch.float64).log()
    adv = torch.tensor([-1.0, -1.0, 1.0, 1.0], dtype=torch.float64)
    seq = torch.tensor([0, 0, 1, 1])
    kept_sum = -2 * math.log(0.5)
    for switch, denom in ((True, 4), (False, 2)):
        corr = op.Correction(opsm_delta=0.5, rejected_in_normalizer=switch)
        out = op.policy_loss_from_logprobs(logp, lq, adv, correction=corr, seq_ids=seq)
        assert float(out.loss) == pytest.approx(kept_sum / denom, rel=1e-12)


@pytest.mark.parametrize("kwargs,match", [
    (dict(dual_clip=3.0), "dual_clip needs ppo_clip"),
    (dict(ppo_clip=(0.2, 0.2), dual_clip=1.0), "dual_clip must be"),
    (dict(ppo_delta=2.0), "ppo_delta needs ppo_clip"),
    (dict(ppo_clip=(0.2, 0.2), ppo_delta=0.5), "ppo_delta must be"),
    (dict(ppo_ratio="sequence"), "ppo_ratio must be"),
    (dict(ppo_ratio="gspo_token"), "needs ppo_clip"),
    (dict(cispo=(0.0, 2.0), ppo_clip=(0.2, 0.2)), "exclude each other"),
    (dict(cispo=(2.0, 1.0)), "cispo must be"),
    (dict(batch_normalize="no"), "batch_normalize must be"),
    (dict(rejected_in_normalizer=0), "rejected_in_normalizer must be a bool"),
    (dict(cispo=(0.0, 2.0), score_centering=True, weights="mis"), "cannot be combined"),
])
def test_bad_family_options(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        op.Correction(**kwargs)


def test_chained_rules_each_with_its_own_threshold_and_level():
    """verl-style chain: a token-level k1 band and a sequence-level k2 max. Sequence 0 holds a token with
    log r = -0.7 (k1 = 0.7 > 0.5: that token alone is rejected, its k2 = 0.245 passes); sequence 1 a token with
    log r = 0.8 (k2 = 0.32 > 0.3: the whole sequence is dropped); each rule's fraction has its own key."""
    lq = torch.full((6,), -1.5, dtype=torch.float64)
    logp = lq + torch.tensor([-0.7, 0.1, 0.0, 0.8, 0.0, 0.2], dtype=torch.float64)
    corr = op.Correction(rejections=(op.KLRejection((-0.5, 0.5), "k1", "token"),
                                     op.KLRejection(0.3, "k2", "seq_max")))
    out = op.policy_loss_from_logprobs(logp, lq, torch.ones(6, dtype=torch.float64), correction=corr,
                                       seq_ids=torch.tensor([0, 0, 1, 1, 2, 2]))
    assert out.token_weight.tolist() == [0.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    assert float(out.metrics["rejected_frac/rule1"]) == pytest.approx(2 / 6)
    assert "rejected_frac/rule0" not in out.metrics  # token-level rules are bounds folded into f


def test_ratio_rejection_and_two_sided_k1_errors():
    with pytest.raises(ValueError, match="RatioRejection needs"):
        op.RatioRejection(2.0, 1.0)
    with pytest.raises(ValueError, match="level must be one of"):
        op.RatioRejection(0.5, 2.0, "seq_max")
    with pytest.raises(ValueError, match=r"\(lo, hi\) with lo <= hi"):
        op.KLRejection((0.3, -0.3), "k1")
    with pytest.raises(TypeError, match="tuple of KLRejection / RatioRejection"):
        op.Correction(rejections=(0.5,))
