"""``op.advantages``: GRPO, RLOO and Dr. GRPO against hand-worked values."""

from __future__ import annotations

import pytest
import torch

import offpolicy as op


def test_advantages():
    r = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.5])
    g = torch.tensor([0, 0, 0, 0, 9, 9])
    a = op.advantages.grpo(r, g)
    top = r[:4] - 0.75
    torch.testing.assert_close(a[:4], (top / (top.square().mean().sqrt() + 1e-6)).float())
    assert torch.equal(a[4:], torch.zeros(2))
    torch.testing.assert_close(op.advantages.dr_grpo(r, g)[:4], top)
    loo = op.advantages.rloo(r, g)
    torch.testing.assert_close(loo[0], torch.tensor(1.0 - 2.0 / 3.0))
    torch.testing.assert_close(loo[1], torch.tensor(0.0 - 1.0))
    assert torch.equal(op.advantages.per_token(a, torch.tensor([0, 0, 2])), a[[0, 0, 2]])
    with pytest.raises(ValueError, match="finite"):
        op.advantages.grpo(torch.tensor([float("nan")]), torch.tensor([0]))
    with pytest.raises(ValueError, match="group_ids must have the shape of rewards \\[B\\]"):
        op.advantages.rloo(r, g[:3])


@pytest.mark.parametrize("seq_ids", [torch.tensor([0.0, 1.7]), torch.tensor([0, 1], dtype=torch.uint32), [0, 1]],
                         ids=["float", "uint32", "list"])
def test_per_token_refuses_ids_that_are_not_integers(seq_ids):
    """Issue 22, finding 8: float ids were truncated to another sample's index."""
    with pytest.raises(TypeError, match="seq_ids must be an integer"):
        op.advantages.per_token(torch.randn(3), seq_ids)
