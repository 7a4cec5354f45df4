"""SAPO at the sequence level (docs/spec.md#sapo): ``Correction(sapo=(tau_pos, tau_neg), sapo_level="sequence")``
gates each sequence's geometric-mean ratio ``s_i = exp(mean_t log u_t)``, differentiated through every token.
Checked against the float64 reference (logits in, hostile drift included) and against a transcription of TRL 1.16's
``GRPOTrainer._compute_loss`` (``importance_sampling_level="sequence"``, ``loss_type="sapo"``) with per-token
advantages. AReaL's sequence-level SAPO is in tests/core/test_migrating_peers.py (``test_areal_sapo_sequence_level``).
"""

from __future__ import annotations

import pytest
import torch
from test_surrogates_and_kl_penalty import _batch, _check, _ours, _theirs

import offpolicy as op
from support.agreement import assert_matches_reference


def _trl_sapo_sequence(lp, old, adv, mask, tau_pos, tau_neg):
    """TRL 1.16 trl/trainer/grpo_trainer.py, ``GRPOTrainer._compute_loss`` with
    ``importance_sampling_level == "sequence"`` and ``loss_type == "sapo"``: ``log_importance_weights`` is the row's
    masked mean of ``per_token_logps - old_per_token_logps`` (``[B, 1]``), ``coef_1 = exp`` of it, the temperatures
    by ``advantages > 0`` per token, ``per_token_loss = -sigmoid(tau (coef_1 - 1)) * 4 / tau * advantages``
    (aggregated by ``_theirs`` as TRL's grpo / sapo branch: the mean over rows of each row's masked token mean).
    Temperatures in float64, as in ``test_surrogates_and_kl_penalty._trl_sapo``."""
    log_ratio = lp - old
    log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    coef_1 = torch.exp(log_importance_weights.unsqueeze(-1))
    temperatures = torch.where(adv > 0, torch.tensor(tau_pos, dtype=adv.dtype), torch.tensor(tau_neg, dtype=adv.dtype))
    soft_coef_1 = torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures
    return -soft_coef_1 * adv


@pytest.mark.parametrize("taus, drift, per_token_adv", [((1.0, 1.05), 0.2, False), ((0.5, 3.0), 1.5, True),
                                                         ((1.0, 1.05), 0.4, True)])
def test_trl_sapo_sequence_level(taus, drift, per_token_adv):
    """``loss_type="sapo"``, ``importance_sampling_level="sequence"``: offpolicy's ``sapo_level="sequence"`` with
    ``proximal_logprobs=old``, ``aggregation="seq_mean_token_mean"``; loss to 1e-12, gradient to 1e-10, also with
    advantages that vary along a sequence (TRL takes ``[B, T]`` advantages from subclasses)."""
    logp, old, roll, _, mask, adv = _batch(4, drift)
    if per_token_adv:
        adv = adv + 0.5 * torch.randn(adv.shape, generator=torch.Generator().manual_seed(5), dtype=adv.dtype)
    corr = op.Correction(sapo=taus, sapo_level="sequence")
    ours = _ours(logp, old, roll, mask, adv, corr, aggregation="seq_mean_token_mean")
    _check(ours, _theirs(lambda lp: _trl_sapo_sequence(lp, old, adv, mask, *taus), logp, "seq-mean-token-mean", mask))
    token = _ours(logp, old, roll, mask, adv, op.Correction(sapo=taus), aggregation="seq_mean_token_mean")
    assert not torch.allclose(ours[1], token[1], rtol=1e-3)  # the sequence gate is not the token gate


def _logits_batch(seed: int, b: int = 5, t: int = 6, vocab: int = 8, drift: float = 0.4):
    g = torch.Generator().manual_seed(seed)
    n = b * t
    z = 2 * torch.randn(n, vocab, generator=g, dtype=torch.float64)
    y = torch.randint(0, vocab, (n,), generator=g)
    lq = torch.log_softmax(z + 0.5 * torch.randn(n, vocab, generator=g, dtype=torch.float64), 1)[torch.arange(n), y]
    prox = (torch.log_softmax(z, 1)[torch.arange(n), y] + drift * torch.randn(n, generator=g, dtype=torch.float64))
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    adv[::7] = 0.0
    mask = torch.rand(n, generator=g) < 0.8
    return z, y, lq, prox.clamp(max=0.0), adv, mask, torch.arange(n) // t


@pytest.mark.parametrize("corr", [op.Correction(sapo=(1.0, 1.05), sapo_level="sequence"),
                                  op.Correction(sapo=(0.5, 2.0), sapo_level="sequence", weights="tis", veto=0.2,
                                                rejected_in_normalizer=False)],
                         ids=["plain", "tis-veto"])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("seed, drift", [(0, 0.4), (1, 3.0)])
def test_sapo_sequence_matches_the_reference(corr, aggregation, seed, drift):
    z, y, lq, prox, adv, mask, seq = _logits_batch(seed, drift=drift)
    kw = dict(loss_mask=mask, correction=corr, seq_ids=seq, proximal_logprobs=prox, aggregation=aggregation)
    assert_matches_reference(z, y, lq, adv, **kw)


def test_bad_level_and_missing_inputs_are_named():
    with pytest.raises(ValueError, match="Correction.sapo_level must be 'token' or 'sequence'"):
        op.Correction(sapo=(1.0, 1.05), sapo_level="geometric")
    with pytest.raises(ValueError, match="sapo_level='sequence' needs sapo"):
        op.Correction(sapo_level="sequence")
    z, y, lq, prox, adv, mask, _ = _logits_batch(0)
    with pytest.raises(ValueError, match="needs seq_ids"):
        op.policy_loss(z, y, lq, adv, proximal_logprobs=prox,
                       correction=op.Correction(sapo=(1.0, 1.05), sapo_level="sequence"))


def test_from_tree_round_trips():
    for corr in (op.Correction(sapo=(1.0, 1.05), sapo_level="sequence"), op.Correction(sapo=(1.0, 1.05))):
        assert op.Correction.from_tree(corr.tree) == corr
