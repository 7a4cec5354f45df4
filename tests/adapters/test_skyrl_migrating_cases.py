"""docs/migrating.md's SkyRL rows against the installed skyrl==0.3.0's own policy losses (``ppo_policy_loss`` with
``off_policy_correction``, CISPO, GSPO, SAPO) on float64 inputs, to 1e-6 relative (SkyRL exponentiates its log-ratios in
float32; tests/core/test_migrating_peers.py holds the float64 transcription to 1e-12): the transcription in tests/core/test_migrating_peers.py is
checked here against SkyRL's code. Runs inside .venv-trainers (tests/adapters/test_skyrl.py runs this file there);
``skyrl.backends`` is mapped to its folder as in tests/adapters/test_skyrl_cases.py."""

import os
import sys
import types
from pathlib import Path

import pytest
import torch

try:
    import skyrl
except ImportError:
    pytest.skip("runs inside .venv-trainers, through tests/adapters/test_skyrl.py (tools/setup_test_envs.sh builds "
                "it)", allow_module_level=True)

_backends = types.ModuleType("skyrl.backends")
_backends.__path__ = [os.path.join(os.path.dirname(skyrl.__file__), "backends")]
sys.modules.setdefault("skyrl.backends", _backends)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))

from skyrl.backends.skyrl_train.utils.ppo_utils import (  # noqa: E402
    PolicyLossRegistry,
    apply_loss_reduction_to_advantages_minibatch,
)
from skyrl.train.config import AlgorithmConfig  # noqa: E402
from test_migrating import _batch  # noqa: E402
from test_migrating_peers import SKYRL_CASES  # noqa: E402

import offpolicy as op  # noqa: E402


def _config(loss_type, case=None):
    cfg = AlgorithmConfig(policy_loss_type=loss_type, eps_clip_low=0.2, eps_clip_high=0.28, clip_ratio_c=3.0)
    if loss_type == "gspo":
        cfg.eps_clip_low, cfg.eps_clip_high = 3e-3, 4e-3
    cfg.cispo.cispo_eps_clip_low, cfg.cispo.cispo_eps_clip_high = 0.2, 0.28
    if case is not None:
        tis, cap, metric, lo, hi, band, outlier_low = case
        opc = cfg.off_policy_correction
        opc.tis_ratio_type = tis
        if tis == "token":
            opc.token_tis_ratio_clip_high = cap
        elif tis == "sequence":
            opc.sequence_tis_ratio_clip_high = cap
        opc.sequence_mask_metric = metric
        if metric == "geometric":
            opc.geo_mask_low, opc.geo_mask_high = lo, hi
        elif metric == "product":
            opc.product_mask_low, opc.product_mask_high = lo, hi
        if band is not None:
            opc.token_mask_is_threshold_low, opc.token_mask_is_threshold_high = band
        opc.outlier_token_is_threshold_low = outlier_low
    return cfg


def _compare(loss_type, case, corr, seed, anchor="old"):
    logp, old, roll, mask, adv = _batch(seed)
    n = float(mask.sum())
    leaf = logp.clone().requires_grad_()
    theirs, _ = PolicyLossRegistry.get(loss_type)(leaf, old, adv / n, _config(loss_type, case),
                                                 loss_mask=mask.double(), rollout_logprobs=roll)
    theirs.backward()
    ours_leaf = logp.clone().requires_grad_()
    ours = op.policy_loss_from_logprobs(
        ours_leaf.reshape(-1), roll.reshape(-1), adv.reshape(-1), loss_mask=mask.reshape(-1), correction=corr,
        seq_ids=torch.arange(mask.shape[0])[:, None].expand_as(mask).reshape(-1),
        proximal_logprobs=(old if anchor == "old" else roll).reshape(-1))
    ours.loss.backward()
    # SkyRL exponentiates every log-ratio in float32 (safe_exp_delta), so agreement is to float32 rounding.
    assert abs(ours.loss.item() - theirs.item()) <= 1e-6 * max(1.0, abs(theirs.item()))
    torch.testing.assert_close(ours_leaf.grad, leaf.grad, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("case", sorted(SKYRL_CASES, key=str))
@pytest.mark.parametrize("loss_type", ["regular", "dual_clip"])
def test_skyrl_off_policy_correction_rows(case, loss_type):
    """Each off_policy_correction row on SkyRL's regular / dual-clip PPO loss, token_mean-scaled advantages."""
    corr = op.Correction(ppo_clip=(0.2, 0.28), dual_clip=3.0 if loss_type == "dual_clip" else None,
                         **SKYRL_CASES[case])
    _compare(loss_type, case, corr, 90 + len(str(case)))


def test_skyrl_cispo_and_gspo_rows():
    """CISPO (0.3.0: anchored at ``old``) and GSPO-token."""
    _compare("cispo", None, op.Correction(cispo=(0.8, 1.28)), 97)
    _compare("gspo", None, op.Correction(ppo_clip=(3e-3, 4e-3), ppo_ratio="gspo_token"), 97)


@pytest.mark.parametrize("taus, case", [((1.0, 1.05), None), ((0.5, 3.0), None),
                                        ((1.0, 1.05), ("token", 2.0, None, None, None, None, None))])
def test_skyrl_sapo_row(taus, case):
    """``policy_loss_type="sapo"``, ``sapo.tau_pos`` / ``tau_neg``, ``loss_reduction="sequence_mean"`` (SkyRL's
    own ``apply_loss_reduction_to_advantages_minibatch`` scales the advantages, ``reduce_loss`` sums): the gate
    ``4 / tau sigmoid(tau (r - 1))`` of ``r = p / old`` (log clamped to 20) with ``tau_pos`` where ``A > 0`` is
    ``Correction(sapo=taus)``, ``aggregation="seq_mean_token_mean"``; with ``off_policy_correction`` the row's
    weights on ``old / rollout`` (token TIS here). SkyRL's SAPO computes in float64 (no ``safe_exp_delta``):
    1e-12 loss, 1e-10 gradient without the correction; its TIS ratio is float32."""
    logp, old, roll, mask, adv = _batch(98)
    cfg = _config("sapo", case)
    cfg.sapo.tau_pos, cfg.sapo.tau_neg = taus
    cfg.loss_reduction = "sequence_mean"
    scaled = apply_loss_reduction_to_advantages_minibatch(adv, mask.double(), "sequence_mean",
                                                          micro_batch_size=mask.shape[0], max_seq_len=mask.shape[1])
    leaf = logp.clone().requires_grad_()
    theirs, _ = PolicyLossRegistry.get("sapo")(leaf, old, scaled, cfg, loss_mask=mask.double(),
                                               rollout_logprobs=roll if case is not None else None)
    theirs.backward()
    corr = op.Correction(sapo=taus, **(SKYRL_CASES[case] if case is not None else {}))
    ours_leaf = logp.clone().requires_grad_()
    ours = op.policy_loss_from_logprobs(
        ours_leaf.reshape(-1), (roll if case is not None else old).reshape(-1), adv.reshape(-1),
        loss_mask=mask.reshape(-1), correction=corr, aggregation="seq_mean_token_mean",
        seq_ids=torch.arange(mask.shape[0])[:, None].expand_as(mask).reshape(-1), proximal_logprobs=old.reshape(-1))
    ours.loss.backward()
    loss_tol, grad_tol = (1e-12, 1e-10) if case is None else (1e-6, 1e-6)
    assert abs(ours.loss.item() - theirs.item()) <= loss_tol * max(1.0, abs(theirs.item()))
    torch.testing.assert_close(ours_leaf.grad, leaf.grad, rtol=grad_tol, atol=1e-13 if case is None else 1e-9)
