"""The CSR constructor of ``Candidates``."""

from __future__ import annotations

import math

import pytest
import torch

import offpolicy as op


def test_from_csr_round_trip():
    ids = torch.tensor([3, 1, 4, 7, 2])
    lp = torch.log(torch.tensor([0.5, 0.5, 1.0, 0.3, 0.7]))
    offsets = torch.tensor([0, 2, 2, 3, 5])
    c = op.Candidates.from_csr(ids, offsets, lp, "support")
    assert c.ids.tolist() == [[3, 1], [-1, -1], [4, -1], [7, 2]]
    assert torch.equal(c.logprobs[1], torch.full((2,), -math.inf))
    c.validate(10, 4, torch.tensor([1, 0, 4, 2]))
    wide = op.Candidates.from_csr(ids, offsets, lp, "support", width=3)
    assert wide.width == 3
    with pytest.raises(ValueError, match="more than width=1"):
        op.Candidates.from_csr(ids, offsets, lp, width=1)
    with pytest.raises(ValueError, match="start at 0 and end at nnz=5"):
        op.Candidates.from_csr(ids, torch.tensor([0, 2, 4]), lp)
    with pytest.raises(ValueError, match="non-decreasing"):
        op.Candidates.from_csr(ids, torch.tensor([0, 3, 2, 5]), lp)
