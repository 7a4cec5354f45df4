"""offpolicy.adapters.verl against the installed verl==0.9.1, on CPU. These run inside .venv-trainers (verl pins a
transformers range that excludes TRL's): tests/adapters/test_verl.py runs this file there in a subprocess."""

import itertools
import math
import subprocess
import sys
import warnings

import pytest
import torch

try:
    import verl  # noqa: F401  (loads the verl.plugins entry points)
except ImportError:
    pytest.skip("runs inside .venv-trainers, through tests/adapters/test_verl.py (tools/setup_test_envs.sh builds it)",
                allow_module_level=True)

from tensordict import TensorDict
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, get_policy_loss_fn
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights
from verl.utils import tensordict_utils as tu
from verl.workers.config import ActorConfig
from verl.workers.config.actor import PolicyLossConfig
from verl.workers.utils.losses import ppo_loss

import offpolicy as op
from offpolicy.adapters import verl as adapter
from offpolicy.adapters.guard import Guard, GuardWarning

AGG_MODES = sorted(adapter.AGGREGATIONS)
EXACT = 1e30  # a rollout_is_threshold that truncates nothing (verl clamps the log-ratio to +-20 first)


def _config(loss_mode="offpolicy", agg="token-mean", **info):
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=2, ppo_mini_batch_size=4,
                      policy_loss=PolicyLossConfig(loss_mode=loss_mode), loss_agg_mode=agg, clip_ratio=0.2,
                      clip_ratio_low=0.2, clip_ratio_high=0.2)
    cfg.global_batch_info.update(info)
    return cfg


def _batch(seed, b=5, t=7, vocab=11, drift=0.3, step=0.3):
    """``[B, T]`` rollout / proximal (``drift`` away) / trainer (``step`` from the proximal) log-probs of sampled
    tokens from three nearby distributions."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(b, t, vocab, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, vocab, (b, t), generator=g)

    def lp(x):
        return torch.log_softmax(x, -1).gather(-1, tokens[..., None])[..., 0]

    mask = torch.ones(b, t, dtype=torch.bool)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask &= torch.arange(t)[None] < lengths[:, None]
    adv = torch.randn(b, generator=g, dtype=torch.float64)[:, None].expand(b, t).clone()
    old = z + drift * torch.randn(z.shape, generator=g, dtype=torch.float64)
    return {
        "log_prob": lp(old + step * torch.randn(z.shape, generator=g, dtype=torch.float64)).float(),
        "old": lp(old).float(),
        "rollout": lp(z).float(), "adv": adv.float(), "mask": mask,
    }


def _weights(x, threshold):
    w, _ = compute_rollout_correction_weights(x["old"] - x["rollout"], x["mask"].float(), "token", threshold)
    return w


def test_entry_point_registers_the_loss_in_a_fresh_interpreter():
    code = ("import sys, verl; from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R; "
            "print('offpolicy' in R, 'offpolicy.adapters.verl' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "True"]
    assert get_policy_loss_fn("offpolicy") is adapter.policy_loss
    assert set(adapter.PRESETS) <= set(POLICY_LOSS_REGISTRY)


def test_sampler_logprobs_recovered_from_rollout_is_weights():
    x = _batch(0, drift=2.0)
    lq, prox = adapter.sampler_logprobs(x["old"], _weights(x, EXACT), x["mask"])
    err = (lq - x["rollout"])[x["mask"]].abs().max()
    assert float(err) < 2e-6, float(err)
    assert torch.equal(prox, x["old"])


@pytest.mark.parametrize("agg", AGG_MODES)
def test_ppo_loss_end_to_end_equals_policy_loss_from_logprobs(agg):
    """verl's own ppo_loss (unpadding, global batch info, registry) around the registered loss."""
    x = _batch(1)
    b, t = x["mask"].shape
    prompt_len = torch.tensor([2, 3, 1, 2, 3])[:b]
    p = 3
    att = torch.zeros(b, p + t, dtype=torch.long)
    for i in range(b):
        att[i, p - prompt_len[i]:p] = 1
    att[:, p:] = x["mask"].long()
    # verl's model output: log-probs of every position, unpadded and concatenated; position j predicts token j+1.
    flat, spans = [], []
    for i in range(b):
        seq_len = int(prompt_len[i] + x["mask"][i].sum())
        row = torch.zeros(seq_len)
        n = int(x["mask"][i].sum())
        row[seq_len - n - 1: seq_len - 1] = x["log_prob"][i, :n]
        spans.append((sum(len(r) for r in flat) + seq_len - n - 1, n))
        flat.append(row)
    leaf = torch.cat(flat).requires_grad_(True)
    data = TensorDict({"prompts": torch.zeros(b, p, dtype=torch.long), "responses": torch.zeros(b, t, dtype=torch.long),
                       "attention_mask": att, "response_mask": x["mask"].long(), "old_log_probs": x["old"],
                       "advantages": x["adv"], "rollout_is_weights": _weights(x, EXACT)}, batch_size=[b])
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=None, global_batch_size=None)
    cfg = _config(agg=agg)
    loss, metrics = ppo_loss(cfg, {"log_probs": leaf}, data)
    loss.backward()

    lp = x["log_prob"].clone().requires_grad_(True)
    m = x["mask"]
    if agg == "token-mean":
        norm = {"aggregation": "token_mean"}
    elif agg == "token-sum":
        norm = {"aggregation": "constant", "constant_normalizer": 1.0}
    elif agg == "seq-mean-token-sum-norm":
        norm = {"aggregation": "seq_mean_token_sum", "num_sequences": float(b * t)}
    else:
        norm = {"aggregation": adapter.AGGREGATIONS[agg]}
    ref = op.policy_loss_from_logprobs(lp.reshape(-1), x["rollout"].reshape(-1), x["adv"].reshape(-1),
                                       loss_mask=m.reshape(-1), correction=adapter.PRESETS["offpolicy"],
                                       seq_ids=torch.arange(b)[:, None].expand(b, t).reshape(-1), **norm)
    ref.loss.backward()
    assert torch.allclose(loss.detach(), ref.loss.detach(), rtol=1e-5, atol=1e-7), (float(loss), float(ref.loss))
    got_grad = torch.stack([torch.cat([leaf.grad[s:s + n], torch.zeros(t - n)]) for s, n in spans])
    assert torch.allclose(got_grad, lp.grad, rtol=1e-5, atol=1e-7)
    assert "offpolicy/kl_k3" in metrics and "actor/pg_loss" in metrics


@pytest.mark.parametrize("agg", AGG_MODES)
def test_equals_verl_vanilla_with_token_is_where_they_coincide(agg):
    """verl vanilla PPO x TIS weights (rollout_is=token, threshold 2) is offpolicy's decoupled PPO with TIS [0, 2]
    when the dual clip (ratio_c = 3) does not bite."""
    adapter.register_correction("offpolicy_test_ppo_tis", op.Correction(weights="tis", bounds=(0.0, 2.0),
                                                                        ppo_clip=(0.2, 0.2)))
    x = _batch(2, drift=0.6, step=0.1)
    assert float((x["log_prob"] - x["old"]).exp().max()) < 3.0
    results = []
    for mode, weights in (("vanilla", _weights(x, 2.0)), ("offpolicy_test_ppo_tis", _weights(x, EXACT))):
        lp = x["log_prob"].clone().requires_grad_(True)
        loss, _ = get_policy_loss_fn(mode)(x["old"], lp, x["adv"], x["mask"], agg, _config(mode, agg), weights)
        loss.backward()
        results.append((loss.detach(), lp.grad))
    assert bool((_weights(x, EXACT) > 2.0).any())  # the truncation is exercised
    (l_v, g_v), (l_o, g_o) = results
    assert torch.allclose(l_v, l_o, rtol=1e-5, atol=1e-7), (float(l_v), float(l_o))
    assert torch.allclose(g_v, g_o, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("agg, mode", list(itertools.product(AGG_MODES, ["offpolicy", "offpolicy_seq_mis"])))
def test_data_parallel_exactness_under_global_batch_info(agg, mode):
    """Two ranks with verl's global_batch_info, gradients averaged as DDP/FSDP do, equal one rank on the batch."""
    x = _batch(3, b=6)
    w = _weights(x, EXACT)
    t = x["mask"].shape[1]
    info = {"batch_num_tokens": int(x["mask"].sum()), "global_batch_size": 6, "loss_scale_factor": None}

    lp = x["log_prob"].clone().requires_grad_(True)
    full, _ = adapter.policy_loss(x["old"], lp, x["adv"], x["mask"], agg, _config(mode, agg, dp_size=1, **info), w)
    full.backward()
    shards, grads = [], []
    for rows in (slice(0, 2), slice(2, 6)):  # unequal shards
        lpr = x["log_prob"][rows].clone().requires_grad_(True)
        loss, _ = adapter.policy_loss(x["old"][rows], lpr, x["adv"][rows], x["mask"][rows], agg,
                                      _config(mode, agg, dp_size=2, **info), w[rows])
        loss.backward()
        shards.append(loss.detach())
        grads.append(lpr.grad / 2)  # DDP averages over the 2 ranks
    assert math.isclose(float(sum(shards) / 2), float(full), rel_tol=1e-5, abs_tol=1e-7)
    assert torch.allclose(torch.cat(grads), lp.grad, rtol=1e-5, atol=1e-7)
    assert t == lp.shape[1]


@pytest.mark.parametrize("threshold", [2.0, 1.5])
def test_guard_warns_when_verl_truncated_the_weights(threshold, monkeypatch):
    """verl's rollout_is_threshold left at its default 2.0 (or any finite one that bites) under the offpolicy loss:
    lq recovered from the truncated weights is wrong, and the loss differs; the guard warns once, naming the fix,
    and logs offpolicy/guard/rollout_is_threshold. The exact threshold is silent."""
    monkeypatch.setattr(adapter, "GUARD", Guard([adapter.TRUNCATED_WEIGHTS], first_batches=3))
    x = _batch(2, drift=0.6, step=0.1)
    loss_fn = get_policy_loss_fn("offpolicy")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exact, clean = loss_fn(x["old"], x["log_prob"], x["adv"], x["mask"], "token-mean", _config(), _weights(x, EXACT))
        assert [w for w in caught if issubclass(w.category, GuardWarning)] == []
        assert not any(k.startswith("offpolicy/guard/") for k in clean)
        for _ in range(2):
            cut, metrics = loss_fn(x["old"], x["log_prob"], x["adv"], x["mask"], "token-mean", _config(),
                                   _weights(x, threshold))
            assert metrics["offpolicy/guard/rollout_is_threshold"] == 1.0
    assert abs(float(cut) - float(exact)) > 1e-5  # the silently different loss
    messages = [str(w.message) for w in caught if issubclass(w.category, GuardWarning)]
    assert len(messages) == 1 and "rollout_is_threshold=1e30" in messages[0], messages
    assert f"have weight exactly {threshold:g}" in messages[0]


def test_bad_configurations_are_named():
    x = _batch(4)
    with pytest.raises(ValueError, match="not an offpolicy loss"):
        adapter.policy_loss(x["old"], x["log_prob"], x["adv"], x["mask"], "token-mean", _config("vanilla"), None)
    with pytest.raises(ValueError, match="loss_agg_mode must be one of"):
        adapter.policy_loss(x["old"], x["log_prob"], x["adv"], x["mask"], "seq-sum", _config(), None)
    with pytest.raises(ValueError, match="batch_num_tokens.*dp_size > 1"):
        adapter.policy_loss(x["old"], x["log_prob"], x["adv"], x["mask"], "token-mean", _config(dp_size=2), None)
    zeroed = _weights(x, EXACT)
    zeroed[0, 0] = 0.0
    with pytest.raises(ValueError, match="weight <= 0"):
        adapter.policy_loss(x["old"], x["log_prob"], x["adv"], x["mask"], "token-mean", _config(), zeroed)
    with pytest.raises(ValueError, match="ppo_clip needs the proximal policy"):
        adapter.policy_loss(x["old"], x["log_prob"], x["adv"], x["mask"], "token-mean",
                            _config("offpolicy_ppo_mis"), None)
    with pytest.raises(ValueError, match="score_centering"):
        adapter.register_correction("offpolicy_bad", op.Correction(weights="mis", score_centering=True))
