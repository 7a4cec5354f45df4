"""``op.presets`` (issue 44): every preset builds, equals its spelled-out keyword form (written here, apart from the
catalogue), runs through ``op.policy_loss`` with the loss of that spelled-out form and of the float64 reference; and
every verl 0.9.1 preset that maps onto offpolicy gives verl's loss, from a transcription of verl's rollout correction
and PPO loss built from the preset's config fields (the helpers of tests/core/test_migrating.py). That the recorded
fields are what verl's own ``RolloutCorrectionConfig.<name>()`` returns, and that every verl preset is listed, is
checked against the installed verl in tests/adapters/test_verl_cases.py::test_verl_presets_are_recorded_as_verl_builds_them,
and each mapped preset against verl's own loss code there (test_verl_presets_give_the_installed_verl_loss).
"""

from __future__ import annotations

import math

import pytest
import torch
from test_migrating import B, T, VERL_C, _check, _ours, _ppo, _rejected_some, _seq_sum, _theirs, _verl_rs_keep

import offpolicy as op
from offpolicy.reference import reference_policy_loss

from support.batches import make_batch

SPELLED = {
    "sc_mis": op.Correction(weights="mis", bounds=(0.5, 5.0), score_centering=True),
    "icepop": op.Correction(weights="mis", bounds=(0.5, 5.0)),
    "token_tis": op.Correction(weights="tis", bounds=2.0),
    "seq_tis": op.Correction(weights="tis", bounds=2.0, level="sequence"),
    "geo_rs_seq_tis": op.Correction(weights="tis", bounds=2.0, level="sequence", rejected_in_normalizer=False,
                                    rejections=(op.RatioRejection(1 / 1.001, 1 / 0.999, "geometric"),)),
}


def test_catalogue_is_the_spelled_out_forms():
    assert op.presets.names() == tuple(SPELLED)
    for name, spelled in SPELLED.items():
        preset = op.presets.get(name)
        assert op.presets.correction(name) == spelled, name
        assert op.Correction(**preset.keywords) == spelled, name
        assert op.presets.find(spelled) == name
        assert preset.evidence and preset.name == name
        with pytest.raises(TypeError):
            preset.keywords["weights"] = "none"  # read-only
    assert op.presets.find(op.Correction(weights="mis", bounds=(0.6, 5.0))) is None
    assert op.presets.correction("seq_tis", bounds=3.0) == op.Correction(weights="tis", bounds=3.0, level="sequence")
    for bad in ("nope", None, 3):
        with pytest.raises(ValueError, match="preset must be one of"):
            op.presets.correction(bad)


@pytest.mark.parametrize("name", list(SPELLED))
def test_every_preset_runs_through_policy_loss_like_its_keyword_form_and_the_reference(name):
    n = 30
    z, y, lq, cands = make_batch(n, 24, 4, "support" if name == "sc_mis" else "head", seed=3, mismatch=0.6)
    z = z.double().requires_grad_()
    g = torch.Generator().manual_seed(9)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.rand(n, generator=g) > 0.15
    kw = dict(candidates=cands, loss_mask=mask, seq_ids=torch.arange(n) // 5)
    out = op.policy_loss(z, y, lq.double(), adv, correction=op.presets.correction(name), **kw)
    (grad,) = torch.autograd.grad(out.loss, z)
    spelled = op.policy_loss(z, y, lq.double(), adv, correction=SPELLED[name], **kw)
    (grad_spelled,) = torch.autograd.grad(spelled.loss, z)
    assert out.loss.item() == spelled.loss.item() and torch.equal(grad, grad_spelled)
    ref, _, _ = reference_policy_loss(z, y, lq, adv, kw["candidates"], mask, correction=SPELLED[name],
                                      seq_ids=kw["seq_ids"])
    (grad_ref,) = torch.autograd.grad(ref, z)
    assert math.isclose(out.loss.item(), ref.item(), rel_tol=1e-10, abs_tol=1e-12)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-8, atol=1e-11)
    assert math.isfinite(out.loss.item()) and float(out.metrics["num_tokens"]) == float(mask.sum())


# ---------------------------------------------------------------------------------------------------------------
# verl 0.9.1's presets, against a transcription built from each preset's config fields
# ---------------------------------------------------------------------------------------------------------------


def _verl_is(log_rho, mask, rollout_is, threshold):
    """verl's ``rollout_is`` weight on ``log_rho [B, T]``: 1 without; per token or the sequence product, clamped
    log first; a number ``C`` truncates at ``C``, an entry ``"lo_hi"`` (IcePop) zeroes outside ``[lo, hi]``."""
    if rollout_is is None:
        return torch.ones_like(log_rho)
    lr = log_rho if rollout_is == "token" else _seq_sum(log_rho, mask).expand(B, T)
    rho = torch.exp(lr.clamp(-20.0, 20.0))
    if isinstance(threshold, str):
        lo, hi = (float(x) for x in threshold.split("_"))
        return torch.where((rho >= lo) & (rho <= hi), rho, torch.zeros_like(rho))
    return rho.clamp(max=threshold)


def _verl_preset_loss(fields, lp, old, roll, mask, adv, clip=(0.2, 0.28)):
    """Per-token loss and kept mask of verl's preset ``fields``: decoupled mode measures weights and rejections on
    ``pi_old / pi_rollout`` and multiplies PPO's dual-clipped loss on ``p / pi_old``; bypass ``reinforce``
    measures them on the current ``p / pi_rollout`` (detached) in ``-A w log p``; bypass ``ppo_clip`` is PPO on
    ``p / pi_rollout``. Rejected tokens leave ``response_mask``."""
    bypass, reinforce = fields["bypass_mode"], fields["loss_type"] == "reinforce"
    log_rho = (lp.detach() - roll) if bypass else (old - roll)
    keep = torch.ones_like(mask)
    if fields["rollout_rs"] is not None:
        keep = _verl_rs_keep(log_rho, mask, fields["rollout_rs"], str(fields["rollout_rs_threshold"]))
    w = _verl_is(log_rho, mask, fields["rollout_is"], fields["rollout_is_threshold"])
    if bypass and reinforce:
        return -adv * w * lp, keep
    anchor = roll if bypass else old
    return w * _ppo(torch.exp(lp - anchor), adv, clip[0], clip[1], c=VERL_C), keep


def _verl_batch(seed, drift):
    """``[B, T]`` log-probs: the trainer's old policy ``drift`` from the sampler's, the current one ``drift`` from
    the old."""
    g = torch.Generator().manual_seed(seed)
    roll = torch.log(torch.rand(B, T, generator=g, dtype=torch.float64) * 0.9 + 0.05)
    old = (roll + drift * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    logp = (old + drift * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    mask = torch.arange(T)[None, :] < torch.tensor([7, 3, 5, 2, 6])[:, None]
    adv = torch.randn(B, generator=g, dtype=torch.float64)[:, None].expand(B, T).clone()
    return logp, old, roll, mask, adv


MAPPED = [name for name, vp in op.presets.VERL_PRESETS.items() if vp.keywords is not None]


@pytest.mark.parametrize("name", MAPPED)
def test_verl_preset_gives_verl_loss(name):
    vp = op.presets.VERL_PRESETS[name]
    rs = vp.fields["rollout_rs"]
    drift = {"seq_mean_k1": 0.002, "seq_mean_k3": 0.14}.get(rs, 0.3)
    for seed in range(60):  # the first batch whose rejection keeps some but not all tokens (none: any batch)
        logp, old, roll, mask, adv = _verl_batch(seed, drift)
        _, keep = _verl_preset_loss(vp.fields, logp, old, roll, mask, adv)
        kept = int((keep & mask).sum())
        if rs is None or 0 < kept < int(mask.sum()):
            break
    if rs is not None:
        _rejected_some(keep, mask)
    corr, proximal = op.presets.verl(name, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=VERL_C)
    assert proximal == vp.proximal
    theirs = _theirs(lambda lp: _verl_preset_loss(vp.fields, lp, old, roll, mask, adv), logp, "token-mean", mask)
    _check(_ours(logp, old, roll, mask, adv, corr, proximal={"old": "old", "rollout": "roll", None: None}[proximal]),
           theirs)
    for preset in op.presets.PRESETS.values():  # the catalogue's verl names are the rows it equals, PPO aside
        if name in preset.verl:
            assert corr == preset.correction(**({"ppo_clip": (0.2, 0.28), "dual_clip": VERL_C} if vp.ppo else {}))


def test_verl_presets_not_reproduced_say_why():
    missing = [name for name, vp in op.presets.VERL_PRESETS.items() if vp.keywords is None]
    assert missing == ["bypass_ppo_clip_geo_rs", "bypass_ppo_clip_k3_rs"]
    for name in missing:
        with pytest.raises(ValueError, match="not reproduced by a Correction: bypass mode's PPO with rollout_rs"):
            op.presets.verl(name)
    with pytest.raises(ValueError, match="verl preset must be one of"):
        op.presets.verl("decoupled_geo_rs_seq_tis_v2")
    with pytest.raises(ValueError, match="clip_ratio_c"):
        op.presets.verl("disabled", clip_ratio_c=float("nan"))
    named = {v for p in op.presets.PRESETS.values() for v in p.verl}
    assert named <= set(MAPPED)


def test_api_doc_example_runs():
    """docs/api.md's ``op.presets`` block runs as written, and its comments name what it returns."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    section = text[text.index("## Presets (`op.presets`)"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace = {"op": op}
    exec(compile(code, "docs/api.md", "exec"), namespace)
    assert namespace["proximal"] == "old" and namespace["corr"].ppo_clip == (0.2, 0.28)
    assert "('sc_mis', 'icepop', 'token_tis', 'seq_tis', 'geo_rs_seq_tis')" in code
    assert str(op.presets.names()) in code
