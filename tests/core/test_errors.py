"""Bad input gets a clear error naming the argument and what was expected."""

from __future__ import annotations

import math

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
        (dict(logits=torch.randn(6)), "logits: expected a \\[N, V\\] fp32/bf16/fp16/float64 tensor, got"),
        (dict(logits=torch.zeros(6, 20, dtype=torch.long)), "logits: expected .* got torch.int64 tensor"),
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
        (dict(temperature=0.0), "temperature: expected a finite number > 0, got float 0.0"),
        (dict(temperature=torch.ones(5)), "temperature: expected a float or a float \\[N=6\\] tensor"),
        (dict(temperature=torch.tensor([1.0, 1, 1, 1, 1, -1])), "temperature: every entry must be finite and > 0"),
        (dict(aggregation="mean"), "aggregation must be one of"),
        (dict(aggregation="seq_mean_token_mean"), "needs seq_ids"),
        (dict(aggregation="constant"), "constant_normalizer > 0"),
        (dict(correction=op.Correction(weights="mis", level="sequence")), "needs seq_ids"),
        (dict(correction=op.Correction(weights="mis", ppo_clip=(0.2, 0.2))), "proximal_logprobs go together"),
        (dict(correction="mis"), "correction must be an offpolicy.Correction"),
        (dict(candidates=(1, 2)), "candidates must be an offpolicy.Candidates"),
        (dict(num_loss_tokens=0), "num_loss_tokens must be finite and > 0"),
        (dict(seq_ids=torch.zeros(6)), "seq_ids must be an integer"),
        (dict(groups=torch.zeros(3, dtype=torch.long)), "groups must have shape"),
        (dict(hidden=torch.randn(6, 4), weight=torch.randn(20, 4)), "either logits, or hidden and weight"),
        (dict(logits=None, hidden=torch.randn(6, 4), weight=torch.randn(20, 5)), "weight: expected a \\[V, D=4\\] tensor"),
        (dict(logits=None), "needs logits \\[N, V\\], or hidden"),
        # issue 22, finding 8
        (dict(tokens=torch.zeros(6, dtype=torch.uint32)), "tokens must be an integer"),
        (dict(seq_ids=torch.zeros(6, dtype=torch.uint64)), "seq_ids must be an integer"),
        (dict(temperature=1e-39), "temperature: 1e-39 is too small"),
        (dict(temperature=torch.full((6,), 1e-39)), "temperature: an entry of 1e-39 is too small"),
        (dict(temperature=torch.full((6,), 1 + 0j)), "temperature: expected a float or a float \\[N=6\\] tensor"),
        (dict(logits=torch.empty(6, 20, device="meta")), "logits: a meta tensor"),
    ],
)
def test_bad_input(batch, over, match):
    with pytest.raises((ValueError, TypeError), match=match):
        _call(batch, **over)


def test_nan_logits_on_trained_token(batch):
    z = batch[0].clone()
    z[2, 5] = float("nan")
    with pytest.raises(ValueError, match="logits: NaN or \\+inf in row 2"):
        _call(batch, logits=z)
    mask = torch.ones(6, dtype=torch.bool)
    mask[2] = False
    assert torch.isfinite(_call(batch, logits=z, loss_mask=mask).loss)  # untrained rows may hold anything


@pytest.mark.parametrize("peak", [0, 3], ids=["at the token", "elsewhere"])
def test_finite_logits_that_overflow_after_the_temperature(batch, peak):
    """Issue 22, finding 8: finite logits whose ``z / tau`` overflows fp32 were reported as "NaN or +inf" (the
    largest logit at the sampled token), or gave a loss of 0 without an error (the largest logit elsewhere)."""
    z = torch.zeros(6, 20)
    y = torch.full((6,), 3 - peak)
    z[:, 3] = 1e30
    with pytest.raises(ValueError, match="logits: row 0 is finite, but its largest \\|z\\| / temperature = 1e\\+40 "
                                         "overflows float32"):
        _call(batch, logits=z, tokens=y, candidates=None, temperature=1e-10)


def test_support_without_mass_is_not_an_overflow(batch):
    """A support whose logits are all ``-inf`` has no mass (``lse = +inf``) like an overflowing row, but its finite
    logits lie outside the support: it is the allowed ``p(y) = 0`` case, not an error."""
    z = torch.zeros(6, 20)
    z[:, :2] = -float("inf")
    y = torch.zeros(6, dtype=torch.int64)
    ids = torch.tensor([[0, 1]] * 6)
    cands = op.Candidates(ids, torch.log(torch.tensor([[0.5, 0.5]] * 6)), "support")
    out = _call(batch, logits=z, tokens=y, sampler_logprobs=torch.full((6,), math.log(0.5)), candidates=cands)
    assert torch.isfinite(out.loss)


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


# Issue 17 regressions: each case passed silently (or raised an unnamed error) before.
@pytest.mark.parametrize(
    "over,err,match",
    [
        (dict(num_loss_tokens=float("inf")), ValueError, "num_loss_tokens must be finite and > 0"),
        (dict(aggregation="seq_mean_token_mean", seq_ids=torch.zeros(6, dtype=torch.long),
              num_sequences=float("inf")), ValueError, "num_sequences must be finite and > 0"),
        (dict(aggregation="seq_mean_token_mean", seq_ids=torch.zeros(6, dtype=torch.long), num_sequences=0),
         ValueError, "num_sequences must be finite and > 0"),
        (dict(aggregation="constant", constant_normalizer=float("inf")), ValueError,
         "constant_normalizer must be finite and > 0"),
        (dict(aggregation="constant", constant_normalizer=0.0), ValueError, "constant_normalizer must be finite"),
        (dict(aggregation="constant", constant_normalizer="3"), TypeError, "constant_normalizer must be a number"),
        (dict(num_loss_tokens=True), TypeError, "num_loss_tokens must be a number"),
        (dict(temperature=True), ValueError, "temperature: expected a finite number > 0, got bool True"),
        (dict(temperature="1.0"), ValueError, "temperature: expected a finite number > 0, got str '1.0'"),
        (dict(validate="no"), TypeError, "validate must be a bool"),
        (dict(inplace_grad="no"), TypeError, "inplace_grad must be a bool"),
        (dict(versions=torch.tensor([1, 2, 2, 3, 5, 4]), current_version=3), ValueError,
         "current_version=3 is older than the batch's newest trained version 5"),
        (dict(current_version=2.5), TypeError, "current_version must be an int"),
        (dict(vocab_start=4), ValueError, "vocab_start=4 needs tp_group"),
        (dict(loss_mask=torch.full((6,), 2)), ValueError, "loss_mask must be bool"),
        (dict(correction=op.Correction(weights="tis", ppo_clip=(0.2, 0.2)),
              proximal_logprobs=torch.full((6,), 0.5)), ValueError, "proximal_logprobs: value 0.5 > 0"),
    ],
)
def test_broken_options_are_named(batch, over, err, match):
    with pytest.raises(err, match=match):
        _call(batch, **over)


def test_logits_of_one_column_or_no_rows_need_no_unit_stride():
    """V = 1 (or N = 0) logits are contiguous whatever their vocabulary stride says."""
    z = torch.randn(1, 4)[:, :1].expand(3, 1).clone().as_strided((3, 1), (1, 3))
    assert z.stride(1) != 1
    y, lq, adv = torch.zeros(3, dtype=torch.long), torch.zeros(3), torch.randn(3)
    assert torch.isfinite(op.policy_loss(z, y, lq, adv).loss)
    empty = torch.zeros(0, 5).as_strided((0, 5), (1, 7))
    out = op.policy_loss(empty, torch.zeros(0, dtype=torch.long), torch.zeros(0), torch.zeros(0))
    assert out.loss.item() == 0.0


def test_numpy_temperature_is_accepted(batch):
    np = pytest.importorskip("numpy")
    want = _call(batch, temperature=0.7).loss
    torch.testing.assert_close(_call(batch, temperature=np.float32(0.7)).loss, want, rtol=1e-6, atol=1e-6)


def test_from_csr_refuses_float_ids_and_lists():
    offsets, lp = torch.tensor([0, 2]), torch.tensor([-0.7, -0.7])
    with pytest.raises(TypeError, match="ids must be an integer tensor"):
        op.Candidates.from_csr(torch.tensor([0.5, 1.5]), offsets, lp, "support")
    with pytest.raises(TypeError, match="ids must be a torch.Tensor"):
        op.Candidates.from_csr([0, 1], offsets, lp, "support")
    with pytest.raises(TypeError, match="offsets must be a torch.Tensor"):
        op.Candidates.from_csr(torch.tensor([0, 1]), [0, 2], lp, "support")
    with pytest.raises(TypeError, match="logprobs must be a floating-point tensor"):
        op.Candidates.from_csr(torch.tensor([0, 1]), offsets, torch.tensor([0, 0]), "support")
    with pytest.raises(ValueError, match="offsets must be non-decreasing"):  # ends at nnz, a row of length -1
        op.Candidates.from_csr(torch.tensor([0, 1]), torch.tensor([0, 2, 1, 2]), lp, "support")


def test_duplicate_id_zero_is_found():
    cands = op.Candidates(torch.tensor([[0, 0, -1]]), torch.tensor([[-1.0, -2.0, float("-inf")]]), "head")
    with pytest.raises(ValueError, match="duplicate id within row 0"):
        cands.validate(20, 1)


def test_bf16_renormalised_support_passes_the_sum_check():
    """A support row renormalised in fp32 and shipped in bf16 sums to one only within bf16's rounding."""
    gen = torch.Generator().manual_seed(10)
    k = 8
    lp32 = torch.log_softmax(torch.randn(1, k, generator=gen), dim=1)
    lp16 = lp32.to(torch.bfloat16)
    assert abs(float(lp16.double().exp().sum()) - 1.0) > 1e-3  # the old fixed tolerance refused it
    ids = torch.arange(k)[None]
    op.Candidates(ids, lp16, "support").validate(k, 1, torch.zeros(1, dtype=torch.long))
    unnormalised = (lp32 + math.log(0.9)).to(torch.bfloat16)  # a top-p = 0.9 record that was not renormalised
    with pytest.raises(ValueError, match="must sum to 1"):
        op.Candidates(ids, unnormalised, "support").validate(k, 1, torch.zeros(1, dtype=torch.long))


@pytest.mark.parametrize("fn", ["grpo", "rloo", "dr_grpo"])
@pytest.mark.parametrize(
    "rewards,groups,err,match",
    [
        ([0.1, 0.2], torch.tensor([0, 0]), TypeError, "rewards must be a floating-point torch.Tensor"),
        (torch.tensor([0.1, 0.2]), torch.tensor([0.0, 0.0]), TypeError, "group_ids must be an integer"),
        (torch.tensor([0.1, 0.2]), torch.tensor([0]), ValueError, "group_ids must have the shape of rewards"),
        (torch.tensor([0.1, float("nan")]), torch.tensor([0, 0]), ValueError, "rewards must be finite; sample 1"),
    ],
)
def test_advantages_broken_inputs(fn, rewards, groups, err, match):
    from offpolicy import advantages

    with pytest.raises(err, match=match):
        getattr(advantages, fn)(rewards, groups)


def test_advantages_keep_float64():
    from offpolicy import advantages

    r = torch.tensor([0.1, 0.2, 0.7], dtype=torch.float64)
    out = advantages.dr_grpo(r, torch.zeros(3, dtype=torch.long))
    assert out.dtype == torch.float64 and abs(float(out.sum())) < 1e-15


def test_plus_inf_logit_on_a_trained_row_is_refused(batch):
    """``+inf`` makes the row's softmax ``inf / inf``: refused on a trained row, ignored on an untrained one."""
    z = batch[0].clone()
    z[4, 7] = float("inf")
    with pytest.raises(ValueError, match="logits: NaN or \\+inf in row 4"):
        _call(batch, logits=z)
    mask = torch.ones(6, dtype=torch.bool)
    mask[4] = False
    out = _call(batch, logits=z, loss_mask=mask)
    assert torch.isfinite(out.loss) and all(bool(torch.isfinite(m).all()) for m in out.metrics.values())


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(score_centering="no"), "score_centering must be a bool"),
        (dict(rejected_in_normalizer=0), "rejected_in_normalizer must be a bool"),
        (dict(veto=True), "veto must be a number"),
        (dict(opsm_delta="0.1"), "opsm_delta must be a number"),
        (dict(max_log_ratio=True), "max_log_ratio must be a number"),
        (dict(weights="mis", bounds=(True, 5.0)), "bounds must be a pair of numbers"),
        (dict(weights="tis", bounds="2"), "bounds must be a pair of numbers"),
        (dict(ppo_clip=0.2), "ppo_clip must be a pair of numbers"),
        (dict(cispo=(0.0, "x")), "cispo must be a pair of numbers"),
        (dict(weights=["mis"]), "weights must be a string"),
    ],
)
def test_correction_options_of_the_wrong_type(kwargs, match):
    """Bools and strings used to pass as numbers and flags (``score_centering="no"`` switched centering on)."""
    with pytest.raises(TypeError, match=match):
        op.Correction(**kwargs)


def test_max_log_ratio_that_overflows_fp32_is_refused():
    """``max_log_ratio=100`` let fp32 ratios reach ``e^100 = inf`` (inf KL and chi2 metrics, a NaN MIS loss)."""
    with pytest.raises(ValueError, match="max_log_ratio must be in \\(0, 40\\]"):
        op.Correction(max_log_ratio=100.0)
    z = torch.tensor([[10.0, -10.0], [0.0, 0.0]])
    corr = op.Correction(weights="mis", bounds=(0.0, 1e40), max_log_ratio=40.0)
    out = op.policy_loss(z, torch.tensor([0, 1]), torch.tensor([-90.0, -0.69]), torch.tensor([1.0, -1.0]),
                         correction=corr)
    assert torch.isfinite(out.loss) and all(bool(torch.isfinite(m).all()) for m in out.metrics.values())


def test_nan_entropy_on_a_trained_token_is_refused():
    lp, lq, adv = torch.tensor([-1.0, -1.0]), torch.tensor([-1.0, -0.7]), torch.tensor([1.0, -1.0])
    with pytest.raises(ValueError, match="entropy: NaN or inf on trained token 0"):
        op.policy_loss_from_logprobs(lp, lq, adv, entropy=torch.tensor([float("nan"), 1.0]))
    out = op.policy_loss_from_logprobs(lp, lq, adv, entropy=torch.tensor([float("nan"), 1.0]),
                                       loss_mask=torch.tensor([False, True]))
    assert float(out.metrics["entropy"]) == 1.0


def test_hidden_whose_logit_overflows_to_plus_inf_is_refused(batch):
    """The fused-linear path has no logits to read for an overflow, so its NaN entropy is what flags a row whose
    ``hidden @ weight.T`` reaches ``+inf`` (finite inputs, fp32 overflow): the sampled token, not the one at
    ``+inf``, would otherwise get ``log p = -inf`` without a word."""
    _, y, lq, adv, cands = batch
    gen = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(6, 4, generator=gen), torch.randn(20, 4, generator=gen)
    hidden[2] = torch.tensor([3e38, 0.0, 0.0, 0.0])
    weight[:, 0] = -1.0
    tok = int(y[2])
    weight[(tok + 1) % 20, 0] = 10.0  # row 2's logit there is 3e39: +inf in fp32; every other logit is -3e38
    assert torch.isposinf(hidden[2] @ weight.T).sum() == 1
    with pytest.raises(ValueError, match="hidden @ weight.T .* in row 2"):
        op.policy_loss(hidden=hidden, weight=weight, tokens=y, sampler_logprobs=lq, advantages=adv, candidates=cands)


@pytest.mark.parametrize(
    "over",
    [dict(temperature=0.0), dict(temperature=True), dict(temperature="1.0"), dict(temperature=torch.ones(5)),
     dict(temperature=torch.full((6,), 1 + 0j)), dict(temperature=torch.tensor([1.0, 1, 1, 1, 1, -1])),
     dict(temperature=1e-39), dict(logits=torch.randn(20, 6).t())],
    ids=["zero", "bool", "str", "short", "complex", "negative_entry", "too_small", "strided"],
)
def test_policy_loss_and_the_primitive_refuse_alike(batch, over):
    """One check per argument, shared by both boundaries: the same bad temperature or strided logits raise the same
    exception type with the same message from ``op.policy_loss`` and from ``op.sparse_log_softmax``."""
    z, y, _, _, cands = batch
    kw = {"logits": z, "temperature": 1.0, **over}
    with pytest.raises(ValueError) as from_loss:
        _call(batch, **over)
    with pytest.raises(ValueError) as from_op:
        op.sparse_log_softmax(kw["logits"], y, cands.ids, kw["temperature"])
    assert type(from_loss.value) is type(from_op.value)
    assert str(from_loss.value) == str(from_op.value)
    assert str(from_loss.value).startswith("logits:" if "logits" in over else "temperature:")


@pytest.mark.parametrize(
    "over,match",
    [(dict(logits=torch.randn(20, 6).t()), "logits: expected unit stride"),
     (dict(tokens=torch.zeros(6)), "tokens must be an integer"),
     (dict(temperature=True), "temperature: expected a finite number > 0"),
     (dict(temperature=torch.ones(5)), "temperature: expected a float or a float \\[N=6\\] tensor"),
     (dict(logits=torch.randn(1, 20).expand(6, 20), inplace_grad=True), "inplace_grad=True .* overlap")],
    ids=["strided", "float_tokens", "bool_temperature", "short_temperature", "overlapping_inplace"],
)
def test_validate_false_keeps_the_checks_without_a_host_sync(batch, over, match):
    """``validate=False`` (and tracing) skips the value checks only: what the log-softmax reads is checked from
    shapes, dtypes and strides, which costs no host sync (the primitives do the same with ``validate=False``)."""
    with pytest.raises((ValueError, TypeError), match=match):
        _call(batch, validate=False, **over)
