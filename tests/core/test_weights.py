"""The weight function's bounds, in the fast path and the reference."""

from __future__ import annotations

import pytest
import torch

import offpolicy as op


@pytest.mark.parametrize("weights", ["mis", "reject"])
@pytest.mark.parametrize("bounds", [(1.0, 2.0), (0.5, 1.0)])
def test_ratio_bounds_are_inclusive(weights, bounds):
    """``log r = 0`` exactly at a bound ``L = 1`` or ``U = 1`` is kept (weight 1), in the fast path and the
    reference alike; just outside the bound it is masked."""
    from offpolicy.reference import f as reference_f

    lq = torch.tensor([-1.25, -0.5, -2.0], dtype=torch.float64)
    corr = op.Correction(weights=weights, bounds=bounds)
    outside = -1e-12 if bounds[0] == 1.0 else 1e-12
    logp = lq + torch.tensor([0.0, 0.0, outside], dtype=torch.float64)
    out = op.policy_loss_from_logprobs(logp, lq, torch.ones(3, dtype=torch.float64), correction=corr)
    assert out.token_weight.tolist() == [1.0, 1.0, 0.0]
    assert reference_f(torch.exp(logp - lq), corr).tolist() == [1.0, 1.0, 0.0]
