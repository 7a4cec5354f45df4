"""The corrections added from the peers' family (verl, slime, TRL), each against a number worked out by hand; the
float64 reference comparisons live with the others in test_loss_reference.py."""

from __future__ import annotations

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
