"""Bad input gets a clear error naming the argument and what was expected."""

from __future__ import annotations

import pytest
import torch

import offpolicy as op

from support.batches import make_batch


@pytest.fixture
def batch():
    z, y, lq, cands = make_batch(6, 20, 4, "head", seed=0)
    return z.float(), y, lq, torch.randn(6), cands


def _call(batch, **over):
    z, y, lq, adv, cands = batch
    kw = dict(logits=z, tokens=y, sampler_logprobs=lq, advantages=adv, candidates=cands)
    kw.update(over)
    return op.policy_loss(**kw)


@pytest.mark.parametrize(
    "over,match",
    [
        (dict(logits=torch.randn(6)), "logits must be a \\[N, V\\]"),
        (dict(logits=torch.zeros(6, 20, dtype=torch.long)), "logits must be a floating-point"),
        (dict(logits=torch.randn(20, 6).t()), "unit stride"),
        (dict(tokens=torch.zeros(5, dtype=torch.long)), "tokens must have shape \\[N\\] = \\[6\\]"),
        (dict(tokens=torch.zeros(6)), "tokens must be an integer"),
        (dict(tokens=torch.full((6,), 20)), "tokens: id 20 is out of range for vocabulary size 20"),
        (dict(tokens=torch.full((6,), -2)), "tokens: id -2 is negative"),
        (dict(sampler_logprobs=torch.zeros(6, dtype=torch.long)), "sampler_logprobs must be a floating-point"),
        (dict(sampler_logprobs=torch.full((6,), float("nan"))), "sampler_logprobs: NaN on a trained token"),
        (dict(sampler_logprobs=torch.full((6,), float("-inf"))), "sampler_logprobs: -inf on a trained token"),
        (dict(sampler_logprobs=torch.full((6,), 0.5)), "sampler_logprobs: value 0.5 > 0"),
        (dict(advantages=torch.full((6,), float("inf"))), "advantages: NaN or inf"),
        (dict(advantages=torch.randn(6, 1)), "advantages must have shape"),
        (dict(loss_mask=torch.full((6,), 2)), "loss_mask must be bool"),
        (dict(temperature=0.0), "temperature must be finite and > 0"),
        (dict(temperature=torch.ones(5)), "temperature must be a float or a \\[N\\]"),
        (dict(temperature=torch.tensor([1.0, 1, 1, 1, 1, -1])), "temperature must be finite and > 0"),
        (dict(aggregation="mean"), "aggregation must be one of"),
        (dict(aggregation="seq_mean_token_mean"), "needs seq_ids"),
        (dict(aggregation="constant"), "constant_normalizer > 0"),
        (dict(correction=op.Correction(weights="mis", level="sequence")), "needs seq_ids"),
        (dict(correction=op.Correction(weights="mis", ppo_clip=(0.2, 0.2))), "proximal_logprobs go together"),
        (dict(correction="mis"), "correction must be an offpolicy.Correction"),
        (dict(candidates=(1, 2)), "candidates must be an offpolicy.Candidates"),
        (dict(num_loss_tokens=0), "num_loss_tokens must be > 0"),
        (dict(seq_ids=torch.zeros(6)), "seq_ids must be an integer"),
        (dict(groups=torch.zeros(3, dtype=torch.long)), "groups must have shape"),
        (dict(hidden=torch.randn(6, 4), weight=torch.randn(20, 4)), "either logits, or hidden and weight"),
        (dict(logits=None, hidden=torch.randn(6, 4), weight=torch.randn(20, 5)), "same D"),
        (dict(logits=None), "needs logits \\[N, V\\], or hidden"),
    ],
)
def test_bad_input(batch, over, match):
    with pytest.raises((ValueError, TypeError), match=match):
        _call(batch, **over)


def test_nan_logits_on_trained_token(batch):
    z = batch[0].clone()
    z[2, 5] = float("nan")
    with pytest.raises(ValueError, match="logits: NaN in row 2"):
        _call(batch, logits=z)
    mask = torch.ones(6, dtype=torch.bool)
    mask[2] = False
    assert torch.isfinite(_call(batch, logits=z, loss_mask=mask).loss)  # untrained rows may hold anything


@pytest.mark.parametrize(
    "ids,lp,kind,match",
    [
        ([[0, 1], [2, 2]], [[-1.0, -2.0], [-1.0, -2.0]], "head", "duplicate id within row 1"),
        ([[0, 0], [2, 3]], [[-1.0, -2.0], [-1.0, -2.0]], "head", "duplicate id within row 0"),
        ([[3, 0, 0], [2, 3, -1]], [[-1.0, -2.0, -3.0], [-1.0, -2.0, float("-inf")]], "head", "duplicate id within row 0"),
        ([[0, 25], [2, 3]], [[-1.0, -2.0], [-1.0, -2.0]], "head", "id 25 is out of range"),
        ([[0, -3], [2, 3]], [[-1.0, -2.0], [-1.0, -2.0]], "head", "padding must be -1"),
        ([[0, -1], [2, 3]], [[-1.0, -2.0], [-1.0, -2.0]], "head", "padding entries .* must hold -inf"),
        ([[0, 1], [2, 3]], [[-1.0, float("nan")], [-1.0, -2.0]], "head", "NaN found"),
        ([[0, 1], [2, 3]], [[0.5, -2.0], [-1.0, -2.0]], "head", "above 0"),
        ([[0, 1], [2, 3]], [[-0.1, -0.2], [-1.0, -2.0]], "head", "mass 1.7.* > 1"),
        ([[0, 1], [2, 3]], [[-1.0, -2.0], [-1.0, -2.0]], "support", "must sum to 1"),
    ],
)
def test_bad_candidates(ids, lp, kind, match):
    cands = op.Candidates(torch.tensor(ids), torch.tensor(lp), kind)
    with pytest.raises(ValueError, match=match):
        cands.validate(20, 2, torch.tensor([0, 2]))


def test_candidates_construction_errors():
    with pytest.raises(ValueError, match="kind must be one of"):
        op.Candidates(torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 2), "top_p")
    with pytest.raises(ValueError, match="must be \\[N, K\\]"):
        op.Candidates(torch.zeros(2, dtype=torch.long), torch.zeros(2))
    with pytest.raises(TypeError, match="int32 or int64"):
        op.Candidates(torch.zeros(2, 2), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="shape of ids"):
        op.Candidates(torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 3))


def test_support_errors(batch):
    z, y, lq, adv, _ = batch
    ids = torch.tensor([[y[i].item(), (y[i].item() + 1) % 20] for i in range(6)])
    lp = torch.log(torch.tensor([[0.6, 0.4]] * 6))
    lp_y = lp[:, 0]
    ok = op.Candidates(ids, lp, "support")
    assert torch.isfinite(op.policy_loss(z, y, lp_y, adv, ok).loss)
    outside = op.Candidates(torch.roll(ids, 1, 0), lp, "support")
    with pytest.raises(ValueError, match="sampled token of row 0 .* outside its recorded support"):
        op.policy_loss(z, y, lp_y, adv, outside)
    ids2, lp2 = ids.clone(), lp.clone()
    ids2[3], lp2[3] = -1, float("-inf")
    with pytest.raises(ValueError, match="row 3 is empty but its token is trained"):
        op.policy_loss(z, y, lp_y, adv, op.Candidates(ids2, lp2, "support"))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(weights="foo"), "weights must be one of"),
        (dict(level="batch"), "level must be one of"),
        (dict(weights="mis", bounds=(5.0, 0.5)), "0 <= lower <= upper"),
        (dict(weights="mis", bounds=2.0), "must be a pair"),
        (dict(weights="none", bounds=(0.5, 2)), "meaningless"),
        (dict(level="sequence"), "needs weights="),
        (dict(weights="mis", level="sequence", score_centering=True), "token-level weights only"),
        (dict(weights="mis", level="geometric", score_centering=True), "token-level weights only"),
        (dict(score_centering=True, ppo_clip=(0.2, 0.2)), "cannot be combined with ppo_clip"),
        (dict(veto=2.0), "veto must be in"),
        (dict(opsm_delta=-1.0), "opsm_delta"),
        (dict(ppo_clip=(1.5, 0.2)), "ppo_clip"),
        (dict(max_log_ratio=0.0), "max_log_ratio"),
    ],
)
def test_bad_correction(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        op.Correction(**kwargs)


def test_bad_kl_rejection():
    with pytest.raises(ValueError, match="estimator"):
        op.KLRejection(0.1, "k4")
    with pytest.raises(ValueError, match="level"):
        op.KLRejection(0.1, "k3", "batch")
    with pytest.raises(ValueError, match="finite"):
        op.KLRejection(float("nan"))
