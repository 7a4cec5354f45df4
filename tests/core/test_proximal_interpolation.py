"""``op.interpolated_proximal_logprobs`` against a float64 transcription of AReaL's
``compute_prox_logp_approximations`` (inclusionAI/AReaL, areal/trainer/ppo/actor.py, commit
4aef98d8d818af55b43621aaadba047ae10f4e77, PR #600)."""

from __future__ import annotations

import pytest
import torch

import offpolicy as op


def areal_prox(old_logp, logprobs, versions, current_version, method, eps=1e-10):
    """Transcribed from AReaL's compute_prox_logp_approximations (eps: AReaL's 1e-10 inside the log)."""
    v_proximal = current_version - 1
    v_behave = versions.double()
    v_theta = float(current_version)
    generated_tokens_mask = versions >= 0
    version_diff = v_theta - v_behave
    version_gap = v_proximal - v_behave
    alpha = torch.where((version_diff > 0) & generated_tokens_mask, version_gap / version_diff,
                        torch.zeros_like(v_behave))
    alpha = torch.clamp(alpha, 0.0, 1.0)
    if method == "loglinear":
        return old_logp + alpha * (logprobs - old_logp)
    p_arithmetic = (1 - alpha) * torch.exp(old_logp) + alpha * torch.exp(logprobs)
    return torch.log(p_arithmetic + eps)


@pytest.mark.parametrize("method", ["loglinear", "linear"])
def test_matches_areal_transcription(method):
    g = torch.Generator().manual_seed(0)
    n = 53
    lq = -torch.rand(n, generator=g, dtype=torch.float64) * 6
    lp = -torch.rand(n, generator=g, dtype=torch.float64) * 6
    versions = torch.randint(-1, 9, (n,), generator=g)
    got = op.interpolated_proximal_logprobs(lq, lp, versions, 7, method)
    want = areal_prox(lq, lp, versions, 7, method, eps=0.0)
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    if method == "linear":
        # AReaL's +1e-10 moves log x by at most 1e-10 / x.
        bound = 1e-10 / torch.exp(got) + 1e-12
        assert bool(((areal_prox(lq, lp, versions, 7, method) - got).abs() <= bound).all())


def test_edges():
    lq = torch.tensor([-1.0, -2.0, -3.0, -4.0], dtype=torch.float64)
    lp = torch.tensor([-5.0, -6.0, -7.0, -1e4], dtype=torch.float64)
    # v_t = v - 1 (proximal): lq; v_t = v or newer, or a prompt token (-1): lq; v_t = v - 2: the midpoint.
    out = op.interpolated_proximal_logprobs(lq, lp, torch.tensor([6, 7, -1, 5]), 7)
    assert out.tolist() == [-1.0, -2.0, -3.0, -4.0 + 0.5 * (-1e4 + 4.0)]
    lin = op.interpolated_proximal_logprobs(lq, lp, torch.tensor([6, 7, -1, 5]), 7, "linear")
    assert torch.isfinite(lin).all() and lin[:3].tolist() == [-1.0, -2.0, -3.0]
    with pytest.raises(ValueError, match="method"):
        op.interpolated_proximal_logprobs(lq, lp, torch.tensor([1, 2, 3, 4]), 7, "cubic")
    with pytest.raises(ValueError, match="versions"):
        op.interpolated_proximal_logprobs(lq, lp, torch.tensor([1, 2]), 7)
    with pytest.raises(TypeError, match="current_version"):
        op.interpolated_proximal_logprobs(lq, lp, torch.tensor([1, 2, 3, 4]), 7.0)
