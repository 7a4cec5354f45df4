"""docs/migrating.md's SkyRL rows against the installed skyrl==0.3.0's own policy losses (``ppo_policy_loss`` with
``off_policy_correction``, CISPO, GSPO) on float64 inputs, to 1e-6 relative (SkyRL exponentiates its log-ratios in
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

from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry  # noqa: E402
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
