"""offpolicy.adapters.skyrl against the installed skyrl==0.3.0 (its ppo_utils, registry and AlgorithmConfig), on
CPU. These run inside .venv-trainers: tests/adapters/test_skyrl.py runs this file there in a subprocess.

skyrl 0.3.0's ``skyrl.backends/__init__`` imports its Tinker types, which pydantic refuses on Python < 3.12
(``typing.TypedDict``); the adapter's ``ppo_utils()`` imports SkyRL's loss registry past it, so these tests import
nothing from ``skyrl.backends`` before the adapter has."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

try:
    import skyrl  # noqa: F401
except ImportError:
    pytest.skip("runs inside .venv-trainers, through tests/adapters/test_skyrl.py (tools/setup_test_envs.sh builds "
                "it)", allow_module_level=True)

import offpolicy as op  # noqa: E402
from offpolicy.adapters import skyrl as adapter  # noqa: E402

PolicyLossRegistry = adapter.ppo_utils().PolicyLossRegistry
apply_loss_reduction_to_advantages_minibatch = adapter.ppo_utils().apply_loss_reduction_to_advantages_minibatch
from skyrl.train.config import AlgorithmConfig  # noqa: E402

DOCS = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"


def test_docs_snippet_registers_in_a_fresh_interpreter():
    """docs/integrations.md's SkyRL snippet, exactly as written, in a fresh interpreter (Python 3.11 here: skyrl
    0.3.0's own skyrl.backends/__init__ fails under pydantic there; the adapter imports past it)."""
    section = DOCS.read_text().split("## SkyRL", 1)[1]
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    check = ("\nfrom skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry\n"
             "print('offpolicy' in PolicyLossRegistry.list_available())\n")
    proc = subprocess.run([sys.executable, "-c", snippet + check], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["True"]
    if sys.version_info < (3, 12):  # the work-around was needed: skyrl's own import of the registry fails
        plain = subprocess.run([sys.executable, "-c", "import skyrl.backends.skyrl_train.utils.ppo_utils"],
                               capture_output=True, text=True)
        assert plain.returncode != 0 and "TypedDict" in plain.stderr


def _batch(seed, b=4, t=6, vocab=9, drift=0.4, step=0.1):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(b, t, vocab, generator=g, dtype=torch.float64)
    tok = torch.randint(0, vocab, (b, t), generator=g)

    def lp(x):
        return torch.log_softmax(x, -1).gather(-1, tok[..., None])[..., 0].float()

    old = z + drift * torch.randn(z.shape, generator=g, dtype=torch.float64)
    mask = torch.arange(t)[None] < torch.randint(1, t + 1, (b,), generator=g)[:, None]
    adv = torch.randn(b, 1, generator=g).expand(b, t).clone()
    return {"rollout": lp(z), "old": lp(old), "lp": lp(old + step * torch.randn(z.shape, generator=g,
                                                                              dtype=torch.float64)),
            "adv": adv, "mask": mask.float()}


def _run(name, x, config, adv):
    lp = x["lp"].clone().requires_grad_(True)
    loss, metrics = PolicyLossRegistry.get(name)(lp, x["old"], adv, config, loss_mask=x["mask"],
                                                 rollout_logprobs=x["rollout"])
    loss.backward()
    return loss.detach(), lp.grad, metrics


def test_registry_and_rollout_is_equality():
    """SkyRL's rollout_is (rollout-ratio masked to (1 - eps_l, 1 + eps_h), REINFORCE) is token MIS on lq."""
    adapter.register("offpolicy_test_mis", op.Correction(weights="mis", bounds=(0.8, 1.2)))
    assert "offpolicy_test_mis" in PolicyLossRegistry.list_available()
    x = _batch(0)
    adv = apply_loss_reduction_to_advantages_minibatch(x["adv"], x["mask"], "token_mean", 4, 6)
    theirs = _run("rollout_is", x, AlgorithmConfig(policy_loss_type="rollout_is", eps_clip_low=0.2,
                                                   eps_clip_high=0.2), adv)
    ours = _run("offpolicy_test_mis", x, AlgorithmConfig(policy_loss_type="offpolicy_test_mis"), adv)
    r = (x["lp"] - x["rollout"]).exp()[x["mask"].bool()]
    assert bool(((r < 0.8) | (r > 1.2)).any()) and bool(((r > 0.8) & (r < 1.2)).any())
    assert torch.allclose(ours[0], theirs[0], rtol=1e-5, atol=1e-7)
    assert torch.allclose(ours[1], theirs[1], rtol=1e-5, atol=1e-7)
    assert "offpolicy/kl_k3" in ours[2]


def test_regular_ppo_with_token_tis_equality_and_token_mean_semantics():
    """SkyRL regular PPO x token TIS (cap 2) is offpolicy's decoupled PPO with TIS [0, 2]; with SkyRL's token_mean
    advantage scaling the sum equals offpolicy's token mean."""
    corr = op.Correction(weights="tis", bounds=(0.0, 2.0), ppo_clip=(0.2, 0.2))
    adapter.register("offpolicy_test_ppo_tis", corr)
    x = _batch(1, drift=0.8, step=0.05)
    adv = apply_loss_reduction_to_advantages_minibatch(x["adv"], x["mask"], "token_mean", 4, 6)
    cfg = AlgorithmConfig(policy_loss_type="regular", eps_clip_low=0.2, eps_clip_high=0.2)
    cfg.off_policy_correction.tis_ratio_type = "token"
    cfg.off_policy_correction.token_tis_ratio_clip_high = 2.0
    theirs = _run("regular", x, cfg, adv)
    ours = _run("offpolicy_test_ppo_tis", x, AlgorithmConfig(policy_loss_type="offpolicy_test_ppo_tis"), adv)
    assert bool(((x["old"] - x["rollout"]).exp()[x["mask"].bool()] > 2.0).any())  # the cap is exercised
    assert torch.allclose(ours[0], theirs[0], rtol=1e-5, atol=1e-7)
    assert torch.allclose(ours[1], theirs[1], rtol=1e-5, atol=1e-7)
    lp = x["lp"].clone().requires_grad_(True)
    m = x["mask"].bool().reshape(-1)
    ref = op.policy_loss_from_logprobs(lp.reshape(-1), x["rollout"].reshape(-1), x["adv"].reshape(-1), loss_mask=m,
                                       correction=corr, proximal_logprobs=x["old"].reshape(-1))
    assert torch.allclose(ours[0], ref.loss.detach(), rtol=1e-5, atol=1e-7)


def test_errors_are_named():
    x = _batch(2)
    adapter.register("offpolicy", op.Correction(weights="mis", bounds=(0.5, 5.0)))
    with pytest.raises(ValueError, match="rollout_logprobs is required"):
        adapter.policy_loss(x["lp"], x["old"], x["adv"], AlgorithmConfig(policy_loss_type="offpolicy"), x["mask"])
    with pytest.raises(ValueError, match="not an offpolicy loss"):
        adapter.policy_loss(x["lp"], x["old"], x["adv"], AlgorithmConfig(policy_loss_type="regular"), x["mask"],
                            x["rollout"])
    with pytest.raises(ValueError, match="score_centering"):
        adapter.register("bad", op.Correction(weights="mis", score_centering=True))


# ---- guards (offpolicy.adapters.guard) ----

@pytest.fixture
def fresh_guard(monkeypatch):
    from offpolicy.adapters.guard import Guard
    monkeypatch.setattr(adapter, "GUARD", Guard([adapter.SKYRL_CORRECTION_IGNORED]))
    if "offpolicy_test_guard" not in PolicyLossRegistry.list_available():
        adapter.register("offpolicy_test_guard", op.Correction(weights="mis", bounds=(0.5, 5.0)))


def _guard_run(config, x=None):
    import warnings
    from offpolicy.adapters.guard import GuardWarning
    x = x if x is not None else _batch(7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metrics = [_run(config.policy_loss_type, x, config, x["adv"])[2] for _ in range(3)]
    return [str(w.message) for w in caught if issubclass(w.category, GuardWarning)], metrics


def test_guard_warns_once_that_skyrl_off_policy_correction_is_not_applied(fresh_guard):
    """SkyRL's own token TIS set beside the offpolicy loss: warned once (cause, setting, fix) and in the metrics;
    the default config is silent."""
    from skyrl.train.config.config import OffPolicyCorrectionConfig
    config = AlgorithmConfig(policy_loss_type="offpolicy_test_guard",
                             off_policy_correction=OffPolicyCorrectionConfig(tis_ratio_type="token"))
    messages, metrics = _guard_run(config)
    assert len(messages) == 1 and "[skyrl_off_policy_correction]" in messages[0]
    assert "off_policy_correction.tis_ratio_type='token'" in messages[0] and "Fix: unset it" in messages[0]
    assert metrics[0]["offpolicy/guard/skyrl_off_policy_correction"] == 1.0


def test_guard_stays_silent_on_a_correct_run(fresh_guard):
    messages, metrics = _guard_run(AlgorithmConfig(policy_loss_type="offpolicy_test_guard"))
    assert messages == [] and not any(k.startswith("offpolicy/guard/") for m in metrics for k in m)


def test_guard_on_rollout_logprobs_that_are_not_log_probs(fresh_guard, monkeypatch):
    """All-zero rollout_logprobs (a placeholder) warn once 32 trained tokens in a row are 0 (24 per call here: the
    second call); a positive one (probabilities passed) is an error."""
    config = AlgorithmConfig(policy_loss_type="offpolicy_test_guard")
    x = {**_batch(8), "mask": torch.ones(4, 6)}
    messages, metrics = _guard_run(config, {**x, "rollout": torch.zeros_like(x["rollout"])})
    assert len(messages) == 1 and "[sampler_logprobs_zero]" in messages[0]
    assert [m.get("offpolicy/guard/sampler_logprobs_zero", 0.0) for m in metrics] == [0.0, 1.0, 1.0]
    from offpolicy.adapters.guard import Guard
    monkeypatch.setattr(adapter, "GUARD", Guard([adapter.SKYRL_CORRECTION_IGNORED]))
    with pytest.raises(ValueError, match=r"rollout_logprobs must be the sampler's log-probabilities"):
        _guard_run(config, {**x, "rollout": x["rollout"].exp()})


def test_guard_warns_on_a_top_p_sampler_the_loss_cannot_replay(fresh_guard):
    """Rollouts at top_p = 0.9 (SkyRL passes no support): lq > log p on every token, warned as narrower_sampler."""
    g = torch.Generator().manual_seed(9)
    z = 2.0 * torch.randn(4, 16, 50, generator=g, dtype=torch.float64)
    p = torch.softmax(z, -1)
    sp, order = p.sort(-1, descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool).scatter(-1, order, (sp.cumsum(-1) - sp) < 0.9)
    lq_all = torch.log_softmax(z.masked_fill(~keep, float("-inf")), -1)
    tok = torch.multinomial(lq_all.exp().reshape(-1, 50), 1, generator=g).reshape(4, 16, 1)
    lp = torch.log_softmax(z, -1).gather(-1, tok)[..., 0].float()
    x = {"rollout": lq_all.gather(-1, tok)[..., 0].float(), "old": lp, "lp": lp, "adv": torch.ones(4, 16),
         "mask": torch.ones(4, 16)}
    messages, metrics = _guard_run(AlgorithmConfig(policy_loss_type="offpolicy_test_guard"), x)
    assert len(messages) == 1 and "[narrower_sampler]" in messages[0]
    assert metrics[0]["offpolicy/guard/narrower_sampler"] == 1.0
