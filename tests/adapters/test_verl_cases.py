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
from verl.trainer.config.algorithm import RolloutCorrectionConfig
from verl.trainer.ppo.rollout_corr_helper import (
    compute_rollout_correction_and_rejection_mask, compute_rollout_correction_weights,
)
from verl.utils import tensordict_utils as tu
from verl.workers.config import ActorConfig
from verl.workers.config.actor import PolicyLossConfig
from verl.workers.utils.losses import ppo_loss

import offpolicy as op
from offpolicy.adapters import verl as adapter
from offpolicy.adapters.guard import Guard, GuardWarning

AGG_MODES = sorted(adapter.AGGREGATIONS)
EXACT = 1e30  # a rollout_is_threshold that truncates nothing (verl clamps the log-ratio to +-20 first)


def _config(loss_mode="offpolicy", agg="token-mean", policy_loss=None, **info):
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=2, ppo_mini_batch_size=4,
                      policy_loss=policy_loss or PolicyLossConfig(loss_mode=loss_mode), loss_agg_mode=agg,
                      clip_ratio=0.2,
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
    w = _weights(x, EXACT)
    with pytest.raises(ValueError, match="not an offpolicy loss"):
        adapter.policy_loss(x["old"], x["log_prob"], x["adv"], x["mask"], "token-mean", _config("vanilla"), w)
    with pytest.raises(ValueError, match="loss_agg_mode must be one of"):
        adapter.policy_loss(x["old"], x["log_prob"], x["adv"], x["mask"], "seq-sum", _config(), w)
    with pytest.raises(ValueError, match="batch_num_tokens.*dp_size > 1"):
        adapter.policy_loss(x["old"], x["log_prob"], x["adv"], x["mask"], "token-mean", _config(dp_size=2), w)
    zeroed = w.clone()
    zeroed[0, 0] = 0.0
    with pytest.raises(ValueError, match="weight <= 0"):
        adapter.policy_loss(x["old"], x["log_prob"], x["adv"], x["mask"], "token-mean", _config(), zeroed)
    with pytest.raises(ValueError, match="no proximal policy for the Correction's PPO-family surrogate"):
        adapter.register_correction("offpolicy_bad_ppo", adapter.PRESETS["offpolicy_ppo_mis"],
                                    old_log_prob_is_sampler=True)
    with pytest.raises(ValueError, match="score_centering"):
        adapter.register_correction("offpolicy_bad", op.Correction(weights="mis", score_centering=True))


# ---- what verl's own rollout_correction settings hand the loss ----

def _verl_weights(x, rollout_is, threshold):
    """The weights verl's trainer puts in the batch for ``algorithm.rollout_correction`` (None: it adds none)."""
    w, _, _ = compute_rollout_correction_and_rejection_mask(
        old_log_prob=x["old"], rollout_log_prob=x["rollout"], response_mask=x["mask"].float(), rollout_is=rollout_is,
        rollout_is_threshold=threshold)
    return None if w is None else w.batch["rollout_is_weights"]


def _true_loss(x, mode="offpolicy"):
    b, t = x["mask"].shape
    return op.policy_loss_from_logprobs(
        x["log_prob"].reshape(-1), x["rollout"].reshape(-1), x["adv"].reshape(-1),
        loss_mask=x["mask"].reshape(-1), correction=adapter.PRESETS[mode],
        seq_ids=torch.arange(b)[:, None].expand(b, t).reshape(-1)).loss


def test_rollout_is_null_is_an_error_naming_rollout_is_token():
    """verl's YAML default rollout_is: null adds no weights: old_log_prob (the trainer's recomputed policy) would be
    taken as the sampler's and no correction applied (issue 40 measured -1.449 against the true -1.721)."""
    assert RolloutCorrectionConfig().rollout_is == "sequence"  # the dataclass default; the YAML's is null
    loss_fn = get_policy_loss_fn("offpolicy")
    for seed in range(4):
        x = _batch(20 + seed, drift=1.0)
        assert _verl_weights(x, None, 2.0) is None
        with pytest.raises(ValueError, match=r"no rollout_is_weights.*no off-policy correction would be applied.*"
                                             r"rollout_is=token and rollout_is_threshold=1e30.*"
                                             r"loss_mode=offpolicy_old_is_sampler"):
            loss_fn(x["old"], x["log_prob"], x["adv"], x["mask"], "token-mean", _config(), None)


def test_old_log_prob_is_sampler_is_an_explicit_opt_in():
    """A pipeline that writes the rollout log-probs into old_log_probs: loss_mode=offpolicy_old_is_sampler takes them
    as lq (the true loss); weights of 1 beside them are accepted, other weights mean old_log_prob is not the
    sampler's."""
    x = _batch(24, drift=1.0)
    loss_fn = get_policy_loss_fn(adapter.OLD_IS_SAMPLER_PRESET)
    cfg = _config(adapter.OLD_IS_SAMPLER_PRESET)
    got, _ = loss_fn(x["rollout"], x["log_prob"], x["adv"], x["mask"], "token-mean", cfg, None)
    assert math.isclose(float(got), float(_true_loss(x)), rel_tol=1e-6, abs_tol=1e-7)
    ones = _verl_weights({**x, "old": x["rollout"]}, "token", EXACT)
    got_ones, _ = loss_fn(x["rollout"], x["log_prob"], x["adv"], x["mask"], "token-mean", cfg, ones)
    assert float(got_ones) == float(got)
    with pytest.raises(ValueError, match=r"takes old_log_prob as the sampler's.*not 1"):
        loss_fn(x["old"], x["log_prob"], x["adv"], x["mask"], "token-mean", cfg, _weights(x, EXACT))


@pytest.mark.parametrize("threshold", [2.0, EXACT])
def test_rollout_is_sequence_names_its_cause_and_fix(threshold):
    """RolloutCorrectionConfig's default rollout_is=sequence: one weight per sequence cannot give per-token lq."""
    x = _batch(25, drift=1.0)
    w = _verl_weights(x, "sequence", threshold)
    with pytest.raises(ValueError, match=r"constant along each sequence.*rollout_is=sequence.*cannot give back.*"
                                         r"Fix: set algorithm.rollout_correction.rollout_is=token"):
        get_policy_loss_fn("offpolicy")(x["old"], x["log_prob"], x["adv"], x["mask"], "token-mean", _config(), w)
    # one trained token per sequence: the sequence weight is the token weight, and the loss is the true one
    one = {**x, "mask": torch.arange(x["mask"].shape[1])[None].expand_as(x["mask"]) == 0}
    got, _ = get_policy_loss_fn("offpolicy")(one["old"], one["log_prob"], one["adv"], one["mask"], "token-mean",
                                             _config(), _verl_weights(one, "sequence", EXACT))
    assert math.isclose(float(got), float(_true_loss(one)), rel_tol=1e-5, abs_tol=1e-7)


def test_token_weights_of_one_everywhere_are_not_sequence_weights():
    """A sampler bitwise equal to the trainer: every weight is exactly 1, under token or sequence mode alike."""
    x = _batch(26)
    x = {**x, "rollout": x["old"]}
    got, metrics = get_policy_loss_fn("offpolicy")(x["old"], x["log_prob"], x["adv"], x["mask"], "token-mean",
                                                   _config(), _verl_weights(x, "token", 2.0))
    assert math.isclose(float(got), float(_true_loss(x)), rel_tol=1e-6, abs_tol=1e-7)
    assert not any(k.startswith("offpolicy/guard/") for k in metrics)


def _run_batches(batches, config=None):
    """verl's loss on each ``(x, weights)``, fresh process guard; returns the batch numbers flagged and the warnings."""
    flagged = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, (x, w) in enumerate(batches, 1):
            _, metrics = get_policy_loss_fn("offpolicy")(x["old"], x["log_prob"], x["adv"], x["mask"], "token-mean",
                                                         config or _config(), w)
            if metrics.get("offpolicy/guard/rollout_is_threshold"):
                flagged.append(i)
    return flagged, [str(w.message) for w in caught if issubclass(w.category, GuardWarning)]


def test_default_threshold_that_starts_truncating_at_batch_3_is_named_at_batch_3(monkeypatch):
    """Every batch is checked (no more one-in-50 sampling): clean batches 1-2, verl's default threshold 2.0 biting
    from batch 3 on."""
    monkeypatch.setattr(adapter, "GUARD", Guard([adapter.TRUNCATED_WEIGHTS]))
    near = [_batch(30 + i, drift=0.05, step=0.05) for i in range(2)]
    far = [_batch(40 + i, drift=1.5) for i in range(60)]
    assert all(float(_weights(x, EXACT).max()) < 2.0 for x in near)
    flagged, messages = _run_batches([(x, _verl_weights(x, "token", 2.0)) for x in near + far])
    biting = [i for i, x in enumerate(near + far, 1) if bool((_weights(x, EXACT)[x["mask"]] > 2.0).any())]
    assert biting[0] == 3 and len(biting) > 50
    assert flagged == biting and len(messages) == 1
    assert "on batch 3" in messages[0] and "rollout_is_threshold=1e30" in messages[0]


def _one_truncated(seed, threshold):
    """A batch whose raw weights stay under ``threshold`` but for one trained token (log-ratio 1 there)."""
    x = _batch(seed, drift=0.02, step=0.02)
    x["rollout"] = x["rollout"].clone()
    x["rollout"][0, 0] = x["old"][0, 0] - 1.0
    assert int((_weights(x, EXACT) > threshold).sum()) == 1 and bool(x["mask"][0, 0])
    return x, _verl_weights(x, "token", threshold)


def test_a_threshold_truncating_one_token_per_batch_is_named(monkeypatch):
    """rollout_is_threshold=1.5, one token truncated per batch: named from the second batch (the same largest weight
    at a different old_log_prob), or from the first when the actor config carries the threshold."""
    monkeypatch.setattr(adapter, "GUARD", Guard([adapter.TRUNCATED_WEIGHTS]))
    batches = [_one_truncated(50 + i, 1.5) for i in range(4)]
    flagged, messages = _run_batches(batches)
    assert flagged == [2, 3, 4] and len(messages) == 1 and "1 of" in messages[0] and "exactly 1.5" in messages[0]
    monkeypatch.setattr(adapter, "GUARD", Guard([adapter.TRUNCATED_WEIGHTS]))
    cfg = _config(policy_loss=PolicyLossConfig(loss_mode="offpolicy", rollout_correction=RolloutCorrectionConfig(
        rollout_is="token", rollout_is_threshold=1.5)))
    flagged, _ = _run_batches(batches, cfg)
    assert flagged == [1, 2, 3, 4]


def test_honest_weights_repeated_across_epochs_stay_silent(monkeypatch):
    """ppo_epochs > 1 replays the same micro-batch: its largest weight recurs at the same old_log_prob, which is
    no truncation; nor are honest largest weights of distinct batches."""
    monkeypatch.setattr(adapter, "GUARD", Guard([adapter.TRUNCATED_WEIGHTS]))
    batches = [_batch(60 + i, drift=1.0) for i in range(3)]
    flagged, messages = _run_batches([(x, _weights(x, EXACT)) for x in batches] * 3)
    assert flagged == [] and messages == []


@pytest.mark.parametrize("seed", range(3))
def test_verl_agreement_metrics_match_offpolicy(seed):
    """verl's own ``calculate_debug_metrics`` (verl/utils/debug/metrics.py: Pearson of the masked probabilities, max /
    mean / std of ``|p - q|``) and ``compute_offpolicy_metrics``' ``chi2_token`` (rollout_corr_helper.py) against
    ``op.policy_loss_from_logprobs``' ``prob_pearson``, ``prob_abs_diff_*`` and ``chi2_token`` on the same batch
    (tests/core/test_metrics_agreement.py checks the transcription and the float64 literal forms)."""
    from verl.protocol import DataProto
    from verl.trainer.ppo.rollout_corr_helper import compute_offpolicy_metrics
    from verl.utils.debug.metrics import calculate_debug_metrics

    g = torch.Generator().manual_seed(seed)
    b, t = 6, 9
    roll = torch.log(torch.rand(b, t, generator=g, dtype=torch.float64) * 0.95 + 0.02)
    old = (roll + 0.4 * torch.randn(b, t, generator=g, dtype=torch.float64)).clamp(max=0.0)
    mask = torch.arange(t)[None] < torch.randint(2, t + 1, (b,), generator=g)[:, None]
    data = DataProto.from_dict(tensors={"rollout_log_probs": roll, "old_log_probs": old,
                                        "response_mask": mask.long(), "responses": torch.zeros(b, t).long()})
    theirs = calculate_debug_metrics(data)
    chi2 = compute_offpolicy_metrics(old, roll, mask.double())["chi2_token"]
    out = op.policy_loss_from_logprobs(old.reshape(-1), roll.reshape(-1), torch.ones(b * t, dtype=torch.float64),
                                       loss_mask=mask.reshape(-1))
    pairs = {"prob_pearson": theirs["training/rollout_actor_probs_pearson_corr"],
             "prob_abs_diff_max": theirs["training/rollout_probs_diff_max"],
             "prob_abs_diff_mean": theirs["training/rollout_probs_diff_mean"],
             "prob_abs_diff_std": theirs["training/rollout_probs_diff_std"], "chi2_token": chi2}
    for key, value in pairs.items():
        # verl's masked_mean adds 1e-8 to the token count (chi2_token).
        assert math.isclose(float(out.metrics[key]), value, rel_tol=1e-8, abs_tol=1e-9), (key, value)


def test_verl_presets_are_recorded_as_verl_builds_them():
    """``op.presets.VERL_PRESETS`` lists every ``RolloutCorrectionConfig`` preset of the installed verl (each class
    method that returns one), and each record's fields are what verl's own method returns at its defaults
    (tests/core/test_presets.py checks each mapped record's loss against verl's formulas)."""
    recorded = op.presets.VERL_PRESETS
    built = {}
    for name, member in vars(RolloutCorrectionConfig).items():
        if isinstance(member, classmethod):
            cfg = getattr(RolloutCorrectionConfig, name)()
            if isinstance(cfg, RolloutCorrectionConfig):
                built[name] = cfg
    assert set(built) == set(recorded), (set(built) ^ set(recorded))
    for name, cfg in built.items():
        fields = {key: getattr(cfg, key) for key in recorded[name].fields}
        assert fields == dict(recorded[name].fields), (name, fields)


def _preset_batch(seed, drift):
    """float64 ``[B, T]`` log-probs: the old policy ``drift`` from the rollout's, the current ``drift`` from the old."""
    g = torch.Generator().manual_seed(seed)
    b, t = 6, 8
    roll = torch.log(torch.rand(b, t, generator=g, dtype=torch.float64) * 0.9 + 0.05)
    old = (roll + drift * torch.randn(b, t, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    cur = (old + drift * torch.randn(b, t, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    mask = torch.arange(t)[None] < torch.tensor([8, 3, 5, 2, 6, 7])[:, None]
    adv = torch.randn(b, generator=g, dtype=torch.float64)[:, None].expand(b, t).clone()
    return cur, old, roll, mask, adv


def _verl_preset_loss(name, cur, old, roll, mask, adv):
    """verl's own loss for ``RolloutCorrectionConfig.<name>()``: decoupled mode computes the weights and rejection
    mask with ``compute_rollout_correction_and_rejection_mask`` on (old, rollout) and runs the vanilla PPO loss;
    bypass mode runs the ``bypass_mode`` loss (which computes them on the current policy itself). token-mean;
    returns (loss, grad, kept tokens)."""
    rc = getattr(RolloutCorrectionConfig, name)()
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=2, ppo_mini_batch_size=4,
                      policy_loss=PolicyLossConfig(loss_mode="bypass_mode" if rc.bypass_mode else "vanilla",
                                                   rollout_correction=rc),
                      loss_agg_mode="token-mean", clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28)
    leaf = cur.clone().requires_grad_(True)
    if rc.bypass_mode:
        from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask as both
        _, kept, _ = both(cur, roll, mask.long(), rc.rollout_is, rc.rollout_is_threshold, False, rc.rollout_rs,
                          rc.rollout_rs_threshold)
        loss, _ = get_policy_loss_fn("bypass_mode")(roll, leaf, adv, mask.long(), "token-mean", cfg, None)
    else:
        weights, kept, _ = compute_rollout_correction_and_rejection_mask(
            old, roll, mask.long(), rc.rollout_is, rc.rollout_is_threshold, rc.rollout_is_batch_normalize,
            rc.rollout_rs, rc.rollout_rs_threshold)
        w = None if weights is None else weights.batch["rollout_is_weights"]
        loss, _ = get_policy_loss_fn("vanilla")(old, leaf, adv, kept, "token-mean", cfg, w)
    loss.backward()
    return loss.detach(), leaf.grad, kept.bool()


@pytest.mark.parametrize("name", [n for n, vp in op.presets.VERL_PRESETS.items() if vp.keywords is not None])
def test_verl_presets_give_the_installed_verl_loss(name):
    """Each verl 0.9.1 preset that ``op.presets.verl`` reproduces, against verl's own rollout-correction and policy
    loss code at the preset's defaults (clip 0.2 / 0.28, clip_ratio_c 3): loss and gradient. The batch is the first
    whose rejection (if any) keeps some but not all tokens. verl adds 1e-8 to its token counts."""
    vp = op.presets.VERL_PRESETS[name]
    drift = {"seq_mean_k1": 0.002, "seq_mean_k3": 0.14}.get(vp.fields["rollout_rs"], 0.3)
    for seed in range(60):
        cur, old, roll, mask, adv = _preset_batch(seed, drift)
        loss, grad, kept = _verl_preset_loss(name, cur, old, roll, mask, adv)
        if vp.fields["rollout_rs"] is None or 0 < int((kept & mask).sum()) < int(mask.sum()):
            break
    if vp.fields["rollout_rs"] is not None:
        assert 0 < int((kept & mask).sum()) < int(mask.sum()), name
    corr, proximal = op.presets.verl(name, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    b, t = mask.shape
    leaf = cur.clone().requires_grad_(True)
    prox = {"old": old, "rollout": roll, None: None}[proximal]
    out = op.policy_loss_from_logprobs(leaf.reshape(-1), roll.reshape(-1), adv.reshape(-1),
                                       loss_mask=mask.reshape(-1), correction=corr,
                                       seq_ids=torch.arange(b)[:, None].expand(b, t).reshape(-1),
                                       proximal_logprobs=None if prox is None else prox.reshape(-1))
    out.loss.backward()
    assert math.isclose(out.loss.item(), loss.item(), rel_tol=1e-7, abs_tol=1e-10), (name, out.loss.item(), loss.item())
    torch.testing.assert_close(leaf.grad, grad, rtol=1e-7, atol=1e-10, msg=name)


@pytest.mark.parametrize("ratio, lb, ub", [(0.0002, 1.0, 5.0), (0.1, 0.05, 5.0), (0.3, -0.5, 2.0)])
@pytest.mark.parametrize("seed", range(3))
def test_verl_clip_cov_with_the_same_seed(ratio, lb, ub, seed):
    """verl's ``compute_policy_loss_clip_cov`` draws its clipped tokens with ``torch.randperm`` on the global CPU
    generator: after ``torch.manual_seed(seed)`` that draw is ``Correction(clip_cov=(lb, ub), clip_cov_seed=seed)``'s,
    so the token-sum loss and its gradient match (docs/spec.md#clip-cov)."""
    from verl.trainer.ppo.core_algos import compute_policy_loss_clip_cov
    g = torch.Generator().manual_seed(100 + seed)
    b, t, vocab = 4, 8, 7
    z = torch.randn(b * t, vocab, generator=g, dtype=torch.float64)
    y = torch.randint(0, vocab, (b * t,), generator=g)
    old = (torch.log_softmax(z, 1)[torch.arange(b * t), y]
           + 0.3 * torch.randn(b * t, generator=g, dtype=torch.float64)).clamp(max=0.0)
    adv = 2 * torch.randn(b * t, generator=g, dtype=torch.float64)
    mask = torch.rand(b * t, generator=g) < 0.85
    z1, z2 = z.clone().requires_grad_(), z.clone().requires_grad_()
    lp = torch.log_softmax(z2, 1)[torch.arange(b * t), y]
    cfg = _config(agg="token-sum", policy_loss=PolicyLossConfig(loss_mode="clip_cov", clip_cov_ratio=ratio,
                                                                 clip_cov_lb=lb, clip_cov_ub=ub))
    torch.manual_seed(seed)
    theirs, metrics = compute_policy_loss_clip_cov(old.view(b, t), lp.view(b, t), adv.view(b, t),
                                                   mask.view(b, t).double(), "token-sum", cfg)
    theirs.backward()
    corr = op.Correction(clip_cov=(lb, ub), clip_cov_ratio=ratio, clip_cov_seed=seed)
    out = op.policy_loss(z1, y, old, adv, loss_mask=mask, proximal_logprobs=old, aggregation="constant",
                         constant_normalizer=1.0, correction=corr)
    out.loss.backward()
    assert metrics["actor/pg_clipfrac"] > 0
    torch.testing.assert_close(out.loss.detach(), theirs.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(z1.grad, z2.grad, rtol=1e-10, atol=1e-13)


# ---------------------------------------------------------------------------------------------------------------
# verl's other policy losses (gpg, dro, gspo, sapo, geo_mean), run as verl's own registered functions
# ---------------------------------------------------------------------------------------------------------------


def _loss_cfg(loss_mode, agg, **policy_loss):
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=2, ppo_mini_batch_size=4,
                      policy_loss=PolicyLossConfig(loss_mode=loss_mode, **policy_loss), loss_agg_mode=agg,
                      clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, tau_pos=1.0, tau_neg=1.05)
    return cfg


def _verl_named_loss(loss_mode, agg, cur, old, mask, adv, **policy_loss):
    """verl 0.9.1's registered ``loss_mode`` function on float64 ``[B, T]`` inputs: (loss, d loss / d cur)."""
    leaf = cur.clone().requires_grad_(True)
    loss, _ = get_policy_loss_fn(loss_mode)(old, leaf, adv, mask.double(), agg,
                                            _loss_cfg(loss_mode, agg, **policy_loss), None)
    loss.backward()
    return loss.detach(), leaf.grad


def _ours_named(cur, old, mask, adv, corr, aggregation, proximal=True, **kw):
    b, t = mask.shape
    leaf = cur.clone().requires_grad_(True)
    out = op.policy_loss_from_logprobs(leaf.reshape(-1), old.reshape(-1), adv.reshape(-1),
                                       loss_mask=mask.reshape(-1), correction=corr, aggregation=aggregation,
                                       seq_ids=torch.arange(b)[:, None].expand(b, t).reshape(-1),
                                       proximal_logprobs=old.reshape(-1) if proximal else None, **kw)
    out.loss.backward()
    return out.loss.detach(), leaf.grad


def _token_adv(seed, mask):
    """A per-token advantage that varies along each sequence (verl's losses take ``[B, T]`` advantages)."""
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(mask.shape, generator=g, dtype=torch.float64)


NAMED = {
    # loss_mode: (offpolicy Correction, offpolicy aggregation, verl loss_agg_mode, proximal, extra kwargs)
    "gpg": (op.Correction(), "token_mean", "token-mean", False, {}),
    "dro": (op.Correction(kl_penalty=op.KLPenalty(0.3, "k2")), "token_mean", "token-mean", False, {"dro_beta": 0.3}),
    "gspo": (op.Correction(ppo_clip=(0.2, 0.28), ppo_ratio="gspo_token"), "seq_mean_token_mean",
             "seq-mean-token-mean", True, {}),
    "sapo": (op.Correction(sapo=(1.0, 1.05)), "seq_mean_token_mean", "seq-mean-token-mean", True, {}),
    "geo_mean": (op.Correction(gmpo=(0.2, 0.28)), "seq_mean_token_mean", "token-mean", True, {}),
}


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("loss_mode", sorted(NAMED))
def test_verl_named_losses_are_reproduced(loss_mode, seed):
    """verl 0.9.1's ``gpg`` (-A log p), ``dro`` (-A log p + beta/2 (log p - log old)^2, offpolicy's k2 KL penalty
    with the old log-probs as reference), ``gspo`` (GSPO-token: sg[s_i] p / sg[p], clamped at log 10), ``sapo`` and
    ``geo_mean`` (GMPO), each run as verl's own registered function, against offpolicy: loss and gradient to 1e-9
    relative (1e-7 for gspo, sapo and geo_mean: verl adds 1e-8 to their per-sequence token counts, offpolicy does
    not). Advantages vary along each sequence except for
    geo_mean, whose verl code takes the sequence's mean advantage."""
    corr, ours_agg, verl_agg, proximal, extra = NAMED[loss_mode]
    cur, old, _, mask, adv = _preset_batch(seed, 0.1)
    if loss_mode != "geo_mean":
        adv = _token_adv(seed, mask)
    want, want_grad = _verl_named_loss(loss_mode, verl_agg, cur, old, mask, adv, **extra)
    kw = {"reference_logprobs": old.reshape(-1)} if loss_mode == "dro" else {}
    got, got_grad = _ours_named(cur, old, mask, adv, corr, ours_agg, proximal, **kw)
    tol = 1e-9 if verl_agg == "token-mean" and loss_mode != "geo_mean" else 1e-7
    assert math.isclose(got.item(), want.item(), rel_tol=tol, abs_tol=1e-12), (loss_mode, got.item(), want.item())
    torch.testing.assert_close(got_grad, want_grad, rtol=tol, atol=1e-12, msg=loss_mode)


def _sequence_gspo(cur, old, mask, adv, low=0.2, high=0.28):
    """GSPO at sequence level, float64 transcription of arXiv 2507.18071 eq. (5) with per-token advantages: the
    ratio ``s_i = exp(mean_t log(p / old))`` is differentiated through (no stop-gradient), each token loses
    ``-min(s_i A_t, clip(s_i, 1 - low, 1 + high) A_t)``; mean over each sequence's tokens, then over sequences.
    Returns (loss, d loss / d cur)."""
    leaf = cur.clone().requires_grad_(True)
    m = mask.double()
    n = m.sum(-1)
    s = torch.exp(((leaf - old) * m).sum(-1) / n)[:, None]
    per_token = -torch.minimum(s * adv, s.clamp(1 - low, 1 + high) * adv)
    loss = ((per_token * m).sum(-1) / n).mean()
    loss.backward()
    return loss.detach(), leaf.grad


def test_verl_gspo_is_gspo_token_and_not_sequence_level_gspo():
    """verl 0.9.1's ``gspo`` is GSPO-token (``sg[s_i] p / sg[p]``). Sequence-level GSPO has the same loss value, and
    the same gradient when the advantage is constant along each sequence; with advantages that vary within a
    sequence, its gradient spreads the sequence's summed advantage over every token (``-s_i / |y_i|^2 sum_j A_j``)
    where GSPO-token's is per token (``-s_i A_t / |y_i|``): the gradients differ, by more than 10% of their norm
    on this batch. offpolicy reproduces verl's (GSPO-token); sequence-level GSPO is not reproduced."""
    cur, old, _, mask, adv_const = _preset_batch(0, 0.05)
    adv_var = _token_adv(0, mask)
    for adv, same_grad in ((adv_const, True), (adv_var, False)):
        verl_loss, verl_grad = _verl_named_loss("gspo", "seq-mean-token-mean", cur, old, mask, adv)
        seq_loss, seq_grad = _sequence_gspo(cur, old, mask, adv)
        assert math.isclose(seq_loss.item(), verl_loss.item(), rel_tol=1e-7), (seq_loss.item(), verl_loss.item())
        gap = float((seq_grad - verl_grad)[mask].norm() / verl_grad[mask].norm())
        if same_grad:
            assert gap < 1e-7, gap
        else:
            assert gap > 0.1, gap
