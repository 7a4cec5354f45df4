"""Fuzzing the public surface: every outcome is a clear error, or a finite result equal to the float64 reference.

Each case draws a batch (shapes from empty to odd, every record kind, a correction from the whole family, hostile
values), optionally breaks one argument, calls the public entry point and classifies what happens:

* ``error``: a ``ValueError`` / ``TypeError`` (or an adapter's ``RecordError``) whose message names the argument
  that was broken (for unbroken hostile inputs any argument of the call);
* ``finite``: the loss, its gradient and every metric are finite and the loss and gradient equal
  :func:`offpolicy.reference.reference_policy_loss` (float64: ``rtol=1e-9``; float32 logits: ``rtol=1e-4`` with an
  absolute floor scaled by the loss magnitude, plus fp32's error of about ``2**-23 |z / tau|`` per
  log-probability and score centering's tail conditioning, :func:`_centering_slack`);
* anything else (another exception type, an unnamed argument, NaN or inf without an error, a mismatch) fails.

A broken argument must give ``error``; an intact batch, however hostile, may give either, except that a batch
without hostile values must give ``finite``. Runs are seeded (``derandomize``) and bounded: the normal test command
runs ``OFFPOLICY_FUZZ_EXAMPLES`` (default 60) examples per entry point; set it higher for a nightly-style run.
"""

from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import offpolicy as op
from offpolicy import advantages as adv_mod
from offpolicy.adapters.common import RecordError
from offpolicy.reference import reference_policy_loss

EXAMPLES = int(os.environ.get("OFFPOLICY_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
CLEAR_ERRORS = (ValueError, TypeError, RecordError)
FIXTURES = Path(__file__).resolve().parents[1] / "support" / "fixtures"

CORRECTIONS = [
    op.Correction(),
    op.Correction(weights="tis"),
    op.Correction(weights="tis", bounds=(0.5, 2.0), score_centering=True),
    op.Correction(weights="mis", score_centering=True),
    op.Correction(weights="mis", bounds=(0.5, 5.0)),
    op.Correction(weights="reject", score_centering=True),
    op.Correction(weights="mis", level="sequence", bounds=(0.1, 10.0)),
    op.Correction(weights="reject", level="geometric"),
    op.Correction(weights="tis", veto=1e-4),
    op.Correction(weights="mis", kl_rejection=op.KLRejection(0.5, "k3", "token"), score_centering=True),
    op.Correction(weights="tis", kl_rejection=op.KLRejection(1.0, "k2", "seq_mean")),
    op.Correction(weights="mis", opsm_delta=0.3),
    op.Correction(weights="tis", batch_normalize=True, score_centering=True),
]
AGGREGATIONS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant"]


@dataclass
class Case:
    """One call's arguments (float64 or float32 logits) and what was done to them."""

    logits: torch.Tensor
    tokens: torch.Tensor
    lq: torch.Tensor
    adv: torch.Tensor
    candidates: op.Candidates | None
    mask: torch.Tensor | None
    temperature: float
    correction: op.Correction
    seq_ids: torch.Tensor | None
    aggregation: str
    hostile: list[str] = field(default_factory=list)

    def kwargs(self) -> dict:
        kw = dict(candidates=self.candidates, loss_mask=self.mask, temperature=self.temperature,
                  correction=self.correction, seq_ids=self.seq_ids, aggregation=self.aggregation)
        if self.aggregation == "constant":
            kw["constant_normalizer"] = 3.0
        return kw


@st.composite
def cases(draw: st.DrawFn, dtype: torch.dtype = torch.float64) -> Case:
    """A batch sampled from a mismatched sampler, with optional hostile values (named in ``Case.hostile``)."""
    n = draw(st.integers(0, 7))
    v = draw(st.integers(1, 13))
    kind = draw(st.sampled_from([None, "head", "support"]))
    corr = draw(st.sampled_from(CORRECTIONS))
    if corr.score_centering and kind is None:
        kind = "head"
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    tau = draw(st.sampled_from([1.0, 0.7, 0.05, 10.0]))
    z = torch.randn(n, v, generator=gen, dtype=torch.float64) * draw(st.sampled_from([0.5, 3.0, 30.0]))
    sampler = z / tau + torch.randn(n, v, generator=gen, dtype=torch.float64) * 0.5
    logq = torch.log_softmax(sampler, dim=1)
    hostile: list[str] = []
    k = draw(st.integers(0, v)) if kind == "head" else v
    if kind == "support":
        keep = torch.rand(n, v, generator=gen) < 0.6
        keep[torch.arange(n), logq.argmax(dim=1)] = True
        logq = torch.log_softmax(logq.masked_fill(~keep, -math.inf), dim=1)
    probs = logq.exp()
    y = torch.multinomial(probs, 1, generator=gen)[:, 0] if n else torch.zeros(0, dtype=torch.int64)
    lq = logq[torch.arange(n), y] if n else torch.zeros(0, dtype=torch.float64)
    candidates = None
    if kind == "head":
        top = logq.topk(k, dim=1)
        candidates = op.Candidates(top.indices, top.values, "head")
    elif kind == "support":
        width = int(keep.sum(1).max()) if n else 0
        order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :width]
        ids = torch.where(keep.gather(1, order), order, torch.full_like(order, -1))
        lqc = torch.where(ids >= 0, logq.gather(1, order), torch.full_like(logq[:, :width], -math.inf))
        candidates = op.Candidates(ids, lqc, "support")
    mask = None
    if draw(st.booleans()):
        mask = torch.rand(n, generator=gen) < draw(st.sampled_from([0.0, 0.5, 1.0]))
    seq_ids = torch.sort(torch.randint(0, max(n // 2, 1), (n,), generator=gen)).values
    aggregation = draw(st.sampled_from(AGGREGATIONS))
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    if n and draw(st.booleans()):
        what = draw(st.sampled_from(["neg_inf_logits", "huge_logits", "zero_advantage", "underflow"]))
        hostile.append(what)
        if what == "neg_inf_logits":
            # -inf outside the sampled token and the record: the trainer rules those tokens out.
            keep_ids = torch.zeros(n, v + 1, dtype=torch.bool)
            keep_ids[torch.arange(n), y] = True
            if candidates is not None:
                keep_ids.scatter_(1, torch.where(candidates.ids >= 0, candidates.ids, v), True)
            z = torch.where(keep_ids[:, :v] | (torch.rand(n, v, generator=gen) < 0.5), z, -math.inf)
        elif what == "huge_logits":
            z = z * 1e3
        elif what == "zero_advantage":
            adv = torch.zeros(n, dtype=torch.float64)
        else:
            z = z + torch.where(torch.rand(n, v, generator=gen) < 0.3, -800.0, 0.0).double()
    return Case(z.to(dtype), y, lq, adv, candidates, mask, tau, corr, seq_ids, aggregation, hostile)


def _finite_and_equal(case: Case) -> None:
    """Run the fast path and the reference on fresh leaves; both finite and equal."""
    z_fast = case.logits.clone().requires_grad_()
    out = op.policy_loss(z_fast, case.tokens, case.lq.to(case.logits.dtype), case.adv.to(case.logits.dtype),
                         **case.kwargs())
    out.loss.backward()
    z_ref = case.logits.detach().double().clone().requires_grad_()
    kw = case.kwargs()
    ref, _, _ = reference_policy_loss(z_ref, case.tokens, case.lq, case.adv, kw.pop("candidates"),
                                      kw.pop("loss_mask"), kw.pop("temperature"), kw.pop("correction"),
                                      kw.pop("seq_ids"), kw.pop("aggregation"),
                                      constant_normalizer=kw.pop("constant_normalizer", None))
    ref.backward()
    assert torch.isfinite(out.loss), f"non-finite loss {out.loss} without an error ({case.hostile})"
    assert bool(torch.isfinite(z_fast.grad).all()), f"non-finite gradient without an error ({case.hostile})"
    bad = [k for k, m in out.metrics.items() if not bool(torch.isfinite(m).all())]
    assert not bad, f"non-finite metrics {bad} ({case.hostile})"
    if case.logits.dtype == torch.float64:
        rtol, atol = 1e-9, 1e-11 + _centering_slack(case)
    else:
        # fp32 log-probabilities are off by about 2**-23 * |z / tau| (the scaled logits' magnitude, not the
        # log-probability's), and the gradient by that over tau; score centering adds its tail conditioning.
        finite = case.logits[torch.isfinite(case.logits)]
        scale = float(finite.abs().max()) / case.temperature if finite.numel() else 0.0
        logit_slack = 4 * float(case.adv.abs().max()) * scale * 2.0**-23 if case.adv.numel() else 0.0
        rtol, atol = 1e-4, 1e-5 * (1.0 + float(ref.detach().abs())) + _centering_slack(case) + logit_slack
    torch.testing.assert_close(out.loss.detach().double(), ref.detach(), rtol=rtol, atol=atol)
    grad_atol = atol * 10 if case.logits.dtype == torch.float64 else atol * 10 + logit_slack / case.temperature
    torch.testing.assert_close(z_fast.grad.double(), z_ref.grad, rtol=rtol, atol=grad_atol)


def _centering_slack(case: Case) -> float:
    """What rounding of the log-probabilities may move the loss by through score centering's tail ratio.

    ``rho = (1 - Q_H) / (1 - P_H)`` divides by the trainer's tail mass; ``P_H``, a sum of ``K`` probabilities,
    carries an absolute error of about ``K * eps`` (``2**-23`` in fp32, ``2**-52`` in float64), so ``rho`` (and ``alpha = rho f(1 / rho)``, and every
    coefficient ``c(v) = m(v) - alpha p(v)``) moves by ``rho * K * 2**-23 / (1 - P_H)`` relative: the condition
    number of the tail, not an error of the implementation (the float64 comparison pins the formula). The slack is
    that bound times ``max |A| * sum_v p(v) |log p(v)|`` per row (what a change of ``alpha`` moves the loss by),
    with a factor 4 for the sampler-side rounding.
    """
    cands = case.candidates
    if not case.correction.score_centering or cands is None or cands.kind != "head" or not cands.ids.numel():
        return 0.0
    lp = torch.log_softmax(case.logits.double() / case.temperature, dim=1)
    valid = cands.ids >= 0
    lpc = torch.where(valid, lp.gather(1, cands.ids.clamp_min(0)), torch.full_like(lp[:, :1], -math.inf))
    p = lpc.exp()
    tail_p = (1.0 - p.sum(1)).clamp_min(1e-6)
    tail_q = (1.0 - cands.logprobs.double().exp().sum(1)).clamp_min(1e-6)
    rho = tail_q / tail_p
    spread = (p * torch.where(valid, -lpc, torch.zeros_like(lpc))).sum(1) + 1.0
    hi = max(1.0, case.correction.upper if math.isfinite(case.correction.upper) else 1.0)
    eps = torch.finfo(case.logits.dtype).eps / 2
    per_row = 4 * hi * torch.maximum(rho, torch.ones_like(rho)) * cands.width * eps / tail_p * spread
    return float(case.adv.abs().max()) * float(per_row.max())


def _error_names(err: BaseException, names: tuple[str, ...]) -> bool:
    text = str(err)
    return any(name in text for name in names)


ARGUMENTS = ("logits", "tokens", "sampler_logprobs", "advantages", "candidates", "loss_mask", "temperature",
             "correction", "seq_ids", "aggregation", "constant_normalizer", "num_loss_tokens")


@FUZZ
@given(cases(torch.float64))
def test_policy_loss_float64(case):
    """Intact batches (hostile ones included) give a finite result equal to the reference, or a clear error."""
    try:
        _finite_and_equal(case)
    except CLEAR_ERRORS as err:
        assert case.hostile, f"a clean batch was refused: {err}"
        assert _error_names(err, ARGUMENTS), f"the error names no argument: {err}"


@FUZZ
@given(cases(torch.float32))
def test_policy_loss_float32(case):
    try:
        _finite_and_equal(case)
    except CLEAR_ERRORS as err:
        assert case.hostile, f"a clean batch was refused: {err}"
        assert _error_names(err, ARGUMENTS), f"the error names no argument: {err}"


def _break(case: Case, how: str) -> tuple[dict, str]:
    """Arguments of ``op.policy_loss`` with one of them broken; returns them and the argument's name."""
    args = dict(logits=case.logits, tokens=case.tokens, sampler_logprobs=case.lq, advantages=case.adv,
                **case.kwargs())
    n, v = case.logits.shape
    if how == "tokens_out_of_range":
        args["tokens"] = case.tokens.clone().fill_(v)
        return args, "tokens"
    if how == "tokens_negative":
        args["tokens"] = case.tokens.clone().fill_(-2)
        return args, "tokens"
    if how == "tokens_float":
        args["tokens"] = case.tokens.double()
        return args, "tokens"
    if how == "tokens_short":
        args["tokens"] = case.tokens[:-1]
        return args, "tokens"
    if how == "lq_nan":
        args["sampler_logprobs"] = torch.full_like(case.lq, math.nan)
        args["loss_mask"] = None
        return args, "sampler_logprobs"
    if how == "lq_positive":
        args["sampler_logprobs"] = case.lq.abs() + 1.0
        args["loss_mask"] = None
        return args, "sampler_logprobs"
    if how == "adv_nan":
        args["advantages"] = torch.full_like(case.adv, math.nan)
        args["loss_mask"] = None
        return args, "advantages"
    if how == "logits_nan":
        args["logits"] = torch.full_like(case.logits, math.nan)
        args["loss_mask"] = None
        return args, "logits"
    if how == "logits_int":
        args["logits"] = case.logits.to(torch.int64)
        return args, "logits"
    if how == "logits_3d":
        args["logits"] = case.logits[None]
        return args, "logits"
    if how == "temperature_zero":
        args["temperature"] = 0.0
        return args, "temperature"
    if how == "temperature_negative":
        args["temperature"] = -1.0
        return args, "temperature"
    if how == "temperature_nan":
        args["temperature"] = math.nan
        return args, "temperature"
    if how == "mask_wrong_length":
        args["loss_mask"] = torch.ones(n + 1, dtype=torch.bool)
        return args, "loss_mask"
    if how == "mask_two":
        args["loss_mask"] = torch.full((n,), 2, dtype=torch.int64)
        return args, "loss_mask"
    if how == "seq_ids_float":
        args["seq_ids"] = case.seq_ids.double()
        return args, "seq_ids"
    if how == "aggregation_unknown":
        args["aggregation"] = "mean"
        return args, "aggregation"
    if how == "constant_normalizer_inf":
        args["aggregation"], args["constant_normalizer"] = "constant", math.inf
        return args, "constant_normalizer"
    if how == "num_loss_tokens_zero":
        args["aggregation"], args["num_loss_tokens"] = "token_mean", 0
        args.pop("constant_normalizer", None)
        return args, "num_loss_tokens"
    if how == "num_loss_tokens_inf":
        args["aggregation"], args["num_loss_tokens"] = "token_mean", math.inf
        args.pop("constant_normalizer", None)
        return args, "num_loss_tokens"
    if how == "correction_not_a_correction":
        args["correction"] = {"weights": "mis"}
        return args, "correction"
    if how == "centering_without_record":
        args["candidates"] = None
        args["correction"] = op.Correction(weights="mis", score_centering=True)
        return args, "candidates"
    if how == "candidates_out_of_range":
        cands = case.candidates
        ids = cands.ids.clone()
        ids[..., 0] = v + 3
        args["candidates"] = op.Candidates(ids, cands.logprobs, cands.kind)
        args["loss_mask"] = None
        return args, "candidates"
    if how == "candidates_wrong_rows":
        cands = case.candidates
        args["candidates"] = op.Candidates(cands.ids[:-1], cands.logprobs[:-1], cands.kind)
        return args, "candidates"
    raise AssertionError(how)


BREAKS = ["tokens_out_of_range", "tokens_negative", "tokens_float", "tokens_short", "lq_nan", "lq_positive",
          "adv_nan", "logits_nan", "logits_int", "logits_3d", "temperature_zero", "temperature_negative",
          "temperature_nan", "mask_wrong_length", "mask_two", "seq_ids_float", "aggregation_unknown",
          "constant_normalizer_inf", "num_loss_tokens_zero", "num_loss_tokens_inf", "correction_not_a_correction",
          "centering_without_record", "candidates_out_of_range", "candidates_wrong_rows"]
NEEDS_ROWS = {"tokens_out_of_range", "tokens_negative", "tokens_short", "lq_nan", "lq_positive", "adv_nan",
              "logits_nan", "mask_two", "candidates_out_of_range", "candidates_wrong_rows"}
NEEDS_RECORD = {"candidates_out_of_range", "candidates_wrong_rows"}


@FUZZ
@given(cases(torch.float64), st.sampled_from(BREAKS))
def test_policy_loss_broken_argument_is_named(case, how):
    """One broken argument gives a ValueError / TypeError that names it."""
    n = case.logits.shape[0]
    if (how in NEEDS_ROWS and n == 0) or (how in NEEDS_RECORD and (case.candidates is None
                                                                   or case.candidates.ids.shape[1] == 0)):
        how = "temperature_zero"
    args, name = _break(case, how)
    with pytest.raises(CLEAR_ERRORS) as info:
        op.policy_loss(**args)
    assert name in str(info.value), f"{how}: the error does not name {name!r}: {info.value}"


@FUZZ
@given(cases(torch.float64), st.booleans())
def test_policy_loss_from_logprobs_equals_policy_loss(case, hostile_lp):
    """The log-probability entry point on the primitive's output equals ``policy_loss`` (or both refuse)."""
    kw = case.kwargs()
    tau = kw.pop("temperature")
    cands = kw["candidates"]
    lp = op.sparse_log_softmax(case.logits, case.tokens, cands.ids if cands is not None else None,
                               tau, support=cands is not None and cands.kind == "support")
    target = lp.target.clone()
    if hostile_lp and target.numel():
        target[0] = -math.inf
    try:
        out = op.policy_loss_from_logprobs(target, case.lq, case.adv,
                                           candidate_logprobs=lp.candidates if cands is not None else None, **kw)
    except CLEAR_ERRORS as err:
        assert case.hostile or hostile_lp, f"a clean batch was refused: {err}"
        assert _error_names(err, ARGUMENTS + ("logprobs", "candidate_logprobs")), str(err)
        return
    assert torch.isfinite(out.loss), f"non-finite loss without an error ({case.hostile}, -inf lp: {hostile_lp})"
    if not hostile_lp:
        ref = op.policy_loss(case.logits, case.tokens, case.lq, case.adv, temperature=tau, **kw)
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-12, atol=1e-12)


PRIMITIVE_BREAKS = {
    "targets_out_of_range": lambda z, y, c: dict(logits=z, targets=torch.full_like(y, z.shape[1]), candidate_ids=c),
    "targets_negative": lambda z, y, c: dict(logits=z, targets=torch.full_like(y, -3), candidate_ids=c),
    "targets_float": lambda z, y, c: dict(logits=z, targets=y.double(), candidate_ids=c),
    "candidate_ids_out_of_range": lambda z, y, c: dict(logits=z, targets=y,
                                                       candidate_ids=torch.full_like(c, z.shape[1] + 1)),
    "temperature_zero": lambda z, y, c: dict(logits=z, targets=y, candidate_ids=c, temperature=0.0),
    "temperature_negative": lambda z, y, c: dict(logits=z, targets=y, candidate_ids=c, temperature=-2.0),
    "support_without_ids": lambda z, y, c: dict(logits=z, targets=y, candidate_ids=None, support=True),
    "skip_not_bool": lambda z, y, c: dict(logits=z, targets=y, candidate_ids=c, skip=torch.zeros_like(y)),
}
PRIMITIVE_NAMES = {"targets_out_of_range": "targets", "targets_negative": "targets", "targets_float": "targets",
                   "candidate_ids_out_of_range": "candidate_ids", "temperature_zero": "temperature",
                   "temperature_negative": "temperature", "support_without_ids": "candidate_ids",
                   "skip_not_bool": "skip"}


@FUZZ
@given(st.integers(1, 6), st.integers(2, 12), st.integers(1, 4), st.sampled_from(sorted(PRIMITIVE_BREAKS)),
       st.integers(0, 2**31 - 1))
def test_sparse_log_softmax_broken_argument_is_named(n, v, k, how, seed):
    """The exported primitive checks its inputs like the loss does."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(n, v, generator=gen)
    y = torch.randint(0, v, (n,), generator=gen)
    c = torch.randint(0, v, (n, k), generator=gen)
    with pytest.raises(CLEAR_ERRORS) as info:
        op.sparse_log_softmax(**PRIMITIVE_BREAKS[how](z, y, c))
    assert PRIMITIVE_NAMES[how] in str(info.value), f"{how}: {info.value}"


@FUZZ
@given(st.integers(0, 6), st.integers(1, 12), st.integers(0, 5), st.sampled_from([None, "head", "support"]),
       st.integers(0, 2**31 - 1), st.sampled_from([1.0, 0.3, 4.0]))
def test_sparse_log_softmax_matches_dense_float64(n, v, k, kind, seed, tau):
    """Valid inputs: the primitive equals a dense float64 log-softmax, gradients included (fresh leaves)."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(n, v, generator=gen, dtype=torch.float64) * 3
    y = torch.randint(0, v, (n,), generator=gen)
    support = kind == "support"
    ids = torch.randint(-1, v, (n, k), generator=gen) if kind == "head" else None
    if support:  # a support holds distinct ids, the sampled token among them, padded with -1
        order = torch.argsort(torch.rand(n, v, generator=gen), dim=1)
        order = torch.where(order == y[:, None], order[:, :1], order)
        order[:, 0] = y
        ids = torch.where(torch.rand(n, v, generator=gen) < 0.5, order, torch.full_like(order, -1))
        ids[:, 0] = y
    z1 = z.clone().requires_grad_()
    out = op.sparse_log_softmax(z1, y, ids, tau, support=support)
    w = torch.randn(n, 1 + (ids.shape[1] if ids is not None else 0), generator=gen, dtype=torch.float64)
    got = torch.cat([out.target[:, None], out.candidates], dim=1)
    (torch.where(torch.isfinite(got), got, torch.zeros_like(got)) * w).sum().backward()
    z2 = z.clone().requires_grad_()
    x = z2 / tau
    if support:
        mask = torch.zeros(n, v + 1, dtype=torch.bool).scatter_(1, torch.where(ids >= 0, ids, v), True)[:, :v]
        x = x.masked_fill(~mask, -math.inf)
    lp = torch.log_softmax(x, dim=1)
    all_ids = y[:, None] if ids is None else torch.cat([y[:, None], ids], dim=1)
    want = torch.where(all_ids >= 0, lp.gather(1, all_ids.clamp_min(0)), torch.full_like(w, -math.inf))
    (torch.where(torch.isfinite(want), want, torch.zeros_like(want)) * w).sum().backward()
    torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(z1.grad, z2.grad, rtol=1e-10, atol=1e-12)


CANDIDATE_BREAKS = {
    "ids_float": (lambda: op.Candidates(torch.zeros(2, 3), torch.zeros(2, 3), "head"), "ids"),
    "kind_unknown": (lambda: op.Candidates(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3), "top"), "kind"),
    "logprobs_shape": (lambda: op.Candidates(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 2)), "logprobs"),
    "ids_list": (lambda: op.Candidates([[0, 1]], torch.zeros(1, 2)), "ids"),
    "csr_float_ids": (lambda: op.Candidates.from_csr(torch.tensor([0.5, 1.5]), torch.tensor([0, 2]),
                                                     torch.tensor([-0.7, -0.7]), "support"), "ids"),
    "csr_list_ids": (lambda: op.Candidates.from_csr([0, 1], torch.tensor([0, 2]), torch.tensor([-0.7, -0.7]),
                                                    "support"), "ids"),
    "csr_offsets_decreasing": (lambda: op.Candidates.from_csr(torch.tensor([0, 1]), torch.tensor([0, 2, 1]),
                                                              torch.tensor([-0.7, -0.7]), "support"), "offsets"),
}


@pytest.mark.parametrize("how", sorted(CANDIDATE_BREAKS))
def test_candidates_broken_argument_is_named(how):
    make, name = CANDIDATE_BREAKS[how]
    with pytest.raises(CLEAR_ERRORS) as info:
        make()
    assert name in str(info.value), f"{how}: {info.value}"


ADVANTAGE_FNS = {"grpo": adv_mod.grpo, "rloo": adv_mod.rloo, "dr_grpo": adv_mod.dr_grpo}


@FUZZ
@given(st.sampled_from(sorted(ADVANTAGE_FNS)), st.integers(0, 12), st.integers(1, 4), st.integers(0, 2**31 - 1),
       st.sampled_from(["ok", "list", "float_groups", "short_groups", "nan_rewards"]))
def test_advantages(name, n, groups, seed, how):
    """Advantage estimators: finite on valid rewards, a named error on broken ones."""
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.rand(n, generator=gen, dtype=torch.float64)
    gids = torch.randint(0, groups, (n,), generator=gen)
    fn = ADVANTAGE_FNS[name]
    if how == "ok":
        out = fn(rewards, gids)
        assert out.shape == rewards.shape and bool(torch.isfinite(out).all())
        for g in torch.unique(gids).tolist():  # every estimator centres each group: its advantages sum to 0
            assert abs(float(out[gids == g].sum())) < 1e-9, (name, g, out[gids == g])
        return
    broken = {"list": (rewards.tolist(), gids, "rewards"), "float_groups": (rewards, gids.double(), "group_ids"),
              "short_groups": (rewards, gids[:-1] if n else torch.zeros(1, dtype=torch.long), "group_ids"),
              "nan_rewards": (torch.full((max(n, 1),), math.nan, dtype=torch.float64),
                              torch.zeros(max(n, 1), dtype=torch.long), "rewards")}[how]
    with pytest.raises(CLEAR_ERRORS) as info:
        fn(broken[0], broken[1])
    assert broken[2] in str(info.value), f"{name}/{how}: {info.value}"


def _mutations(obj, path=()):
    """Every way of deleting one key or replacing one leaf with a wrong type in a JSON-like object."""
    if isinstance(obj, dict):
        for key, val in obj.items():
            yield ("delete", path + (key,))
            yield from _mutations(val, path + (key,))
    elif isinstance(obj, list):
        for i, val in enumerate(obj[:3]):
            yield from _mutations(val, path + (i,))
    else:
        yield ("retype", path)


def _apply(obj, mutation):
    kind, path = mutation
    obj = copy.deepcopy(obj)
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    if kind == "delete":
        del parent[path[-1]]
    else:
        old = parent[path[-1]]
        parent[path[-1]] = "x" if not isinstance(old, str) else {"unexpected": 1}
    return obj


def _parser_cases():
    from offpolicy.adapters import sglang, vllm

    out = []
    for engine, parse, stem in [("sglang", sglang.parse_response, "sglang_head"),
                                ("sglang", sglang.parse_response, "sglang_support"),
                                ("vllm", vllm.parse_generate_response, "vllm_generate_head"),
                                ("vllm", vllm.parse_generate_response, "vllm_generate_support"),
                                ("vllm", vllm.parse_completion_response, "vllm_completions_head")]:
        req_path, resp_path = FIXTURES / f"{stem}_request.json", FIXTURES / f"{stem}_response.json"
        if req_path.exists() and resp_path.exists():
            out.append((engine, parse, json.loads(req_path.read_text()), json.loads(resp_path.read_text()), stem))
    return out


@pytest.mark.parametrize("engine, parse, request_body, response, stem", _parser_cases(),
                         ids=lambda x: x if isinstance(x, str) else "")
def test_engine_parsers_refuse_malformed_responses(engine, parse, request_body, response, stem):
    """Deleting any field of a recorded response, or giving it a wrong type, is refused with a clear error or
    parsed (optional fields such as ``finish_reason``); never a KeyError, AttributeError, IndexError or another
    exception type."""
    parse(response, request_body)
    failures = []
    for mutation in _mutations(response):
        try:
            parse(_apply(response, mutation), request_body)
        except CLEAR_ERRORS:
            continue
        except Exception as err:  # noqa: BLE001 - the point is to catch every other type
            failures.append(f"{mutation}: {type(err).__name__}: {err}")
    assert not failures, f"{engine} {stem}:\n" + "\n".join(failures[:20])


CORRECTION_VALUES = [True, False, "no", 0, 1, -1.0, 0.3, 2.0, 1e30, math.nan, math.inf, None, (0.5, 5.0), (5.0, 0.5),
                     (0.2, 0.2), [0.0, 2.0], (True, 2.0), (0.1,), "token", "sequence", "tokens"]
CORRECTION_FIELDS = ["weights", "bounds", "level", "score_centering", "veto", "opsm_delta", "batch_normalize",
                     "ppo_clip", "max_log_ratio", "dual_clip", "ppo_delta", "ppo_ratio", "cispo",
                     "rejected_in_normalizer"]


@FUZZ
@given(cases(torch.float64), st.sampled_from(["none", "tis", "mis", "reject"]), st.sampled_from(CORRECTION_FIELDS),
       st.sampled_from(CORRECTION_VALUES))
def test_correction_options(case, weights, name, value):
    """Any value in any field of ``Correction``: a ``ValueError`` / ``TypeError`` naming the field, or a correction
    whose loss on a clean batch is finite and equals the reference (gradients included, fresh leaves)."""
    try:
        corr = op.Correction(**{"weights": weights, name: value})
    except CLEAR_ERRORS as err:
        assert name in str(err), f"Correction({name}={value!r}): the error does not name it: {err}"
        return
    prox = case.lq.clone() if corr.surrogate.needs_proximal else None
    if corr.score_centering and case.candidates is None:
        return  # refused by policy_loss naming candidates: test_policy_loss_broken_argument_is_named
    z_fast = case.logits.clone().requires_grad_()
    kw = dict(candidates=case.candidates, loss_mask=case.mask, temperature=case.temperature, correction=corr,
              seq_ids=case.seq_ids)
    try:
        out = op.policy_loss(z_fast, case.tokens, case.lq, case.adv, proximal_logprobs=prox, **kw)
    except CLEAR_ERRORS as err:
        assert case.hostile, f"Correction({name}={value!r}) refused a clean batch: {err}"
        assert _error_names(err, ARGUMENTS + ("proximal_logprobs",)), str(err)
        return
    out.loss.backward()
    assert torch.isfinite(out.loss), f"Correction({name}={value!r}): non-finite loss {out.loss}"
    assert bool(torch.isfinite(z_fast.grad).all()), f"Correction({name}={value!r}): non-finite gradient"
    bad = [k for k, m in out.metrics.items() if not bool(torch.isfinite(m).all())]
    assert not bad, f"Correction({name}={value!r}): non-finite metrics {bad}"
    z_ref = case.logits.detach().clone().requires_grad_()
    ref, _, _ = reference_policy_loss(z_ref, case.tokens, case.lq, case.adv, proximal_logprobs=prox, **kw)
    ref.backward()
    torch.testing.assert_close(out.loss.detach(), ref.detach(), rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(z_fast.grad, z_ref.grad, rtol=1e-9, atol=1e-10)


@FUZZ
@given(cases(torch.float64), st.integers(1, 6), st.booleans(),
       st.sampled_from(["ok", "hidden_nan_untrained", "weight_wrong_d", "bias_wrong_v", "hidden_int",
                        "logits_and_hidden", "weight_missing"]))
def test_policy_loss_hidden_weight_bias(case, d, with_bias, how):
    """The fused-linear input: valid ``hidden x weight (+ bias)`` equals ``policy_loss`` on the logits it makes
    (gradients of hidden, weight and bias against autograd through those logits); broken ones are named."""
    n, v = case.logits.shape
    gen = torch.Generator().manual_seed(n * 31 + v * 7 + d)
    hidden = torch.randn(n, d, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, d, generator=gen, dtype=torch.float64)
    bias = torch.randn(v, generator=gen, dtype=torch.float64) if with_bias else None
    kw = dict(candidates=case.candidates, loss_mask=case.mask, temperature=case.temperature,
              correction=case.correction, seq_ids=case.seq_ids, aggregation=case.aggregation)
    if case.aggregation == "constant":
        kw["constant_normalizer"] = 3.0
    broken = {"weight_wrong_d": (dict(hidden=hidden, weight=weight[:, :-1] if d > 1 else weight.repeat(1, 2),
                                      bias=bias), "hidden"),
              "bias_wrong_v": (dict(hidden=hidden, weight=weight, bias=torch.zeros(v + 1, dtype=torch.float64)),
                               "bias"),
              "hidden_int": (dict(hidden=hidden.long(), weight=weight, bias=bias), "hidden"),
              "logits_and_hidden": (dict(logits=case.logits, hidden=hidden, weight=weight), "logits"),
              "weight_missing": (dict(hidden=hidden), "weight")}
    if how in broken:
        args, name = broken[how]
        with pytest.raises(CLEAR_ERRORS) as info:
            op.policy_loss(tokens=case.tokens, sampler_logprobs=case.lq, advantages=case.adv, **args, **kw)
        assert name in str(info.value), f"{how}: {info.value}"
        return
    if how == "hidden_nan_untrained" and n:
        hidden[0] = math.nan
        mask = torch.ones(n, dtype=torch.bool) if case.mask is None else case.mask.clone()
        mask[0] = False
        kw["loss_mask"] = mask
    leaves = [t.clone().requires_grad_() for t in (hidden, weight)] + ([bias.clone().requires_grad_()]
                                                                       if with_bias else [])
    try:
        out = op.policy_loss(tokens=case.tokens, sampler_logprobs=case.lq, advantages=case.adv, hidden=leaves[0],
                             weight=leaves[1], bias=leaves[2] if with_bias else None, **kw)
    except CLEAR_ERRORS as err:
        assert how != "ok" or case.hostile, f"a clean batch was refused: {err}"
        assert _error_names(err, ARGUMENTS + ("hidden", "weight", "bias")), str(err)
        return
    out.loss.backward()
    assert torch.isfinite(out.loss) and all(bool(torch.isfinite(x.grad).all()) for x in leaves), how
    ref_leaves = [t.clone().requires_grad_() for t in (hidden, weight)] + ([bias.clone().requires_grad_()]
                                                                           if with_bias else [])
    h_ref = ref_leaves[0]
    if how == "hidden_nan_untrained":  # an untrained row's value does not matter: give the reference a finite one
        h_ref = torch.where(torch.isnan(h_ref), torch.zeros_like(h_ref), h_ref)
    logits = h_ref @ ref_leaves[1].T + (ref_leaves[2] if with_bias else 0.0)
    want = op.policy_loss(logits, case.tokens, case.lq, case.adv, **kw)
    want.loss.backward()
    torch.testing.assert_close(out.loss.detach(), want.loss.detach(), rtol=1e-9, atol=1e-11)
    for got, ref in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad, ref.grad, rtol=1e-8, atol=1e-10)


MEGATRON_BREAKS = ["ok", "loss_mask_two", "vocab_size_wide", "labels_float", "missing_advantages",
                   "unknown_key", "lq_wrong_shape", "candidates_alone", "labels_out_of_range"]


@FUZZ
@given(st.integers(1, 3), st.integers(1, 5), st.integers(2, 9), st.sampled_from(MEGATRON_BREAKS),
       st.integers(0, 2**31 - 1))
def test_megatron_loss_func(b, s, v, how, seed):
    """The Megatron adapter's ``loss_func`` (one process, no groups): a valid micro-batch's loss equals
    ``policy_loss`` on the flattened batch; a broken one is refused naming the key or option."""
    from offpolicy.adapters.megatron import make_loss_func

    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, v, (b, s), generator=gen)
    z = torch.randn(b, s, v, generator=gen, dtype=torch.float64)
    lq = torch.log_softmax(z + 0.3 * torch.randn(b, s, v, generator=gen, dtype=torch.float64), -1)
    batch = dict(labels=labels, sampler_logprobs=lq.gather(2, labels[..., None])[..., 0],
                 advantages=torch.randn(b, s, generator=gen, dtype=torch.float64),
                 loss_mask=torch.rand(b, s, generator=gen) < 0.7)
    options: dict = {}
    named = {"loss_mask_two": "loss_mask", "vocab_size_wide": "vocab_size", "labels_float": "tokens",
             "missing_advantages": "advantages", "unknown_key": "unknown keys", "lq_wrong_shape": "sampler_logprobs",
             "candidates_alone": "candidate_ids", "labels_out_of_range": "tokens"}
    if how == "loss_mask_two":
        batch["loss_mask"] = torch.full((b, s), 2)
    elif how == "vocab_size_wide":
        options["vocab_size"] = v + 1
    elif how == "labels_float":
        batch["labels"] = labels.double()
    elif how == "missing_advantages":
        del batch["advantages"]
    elif how == "unknown_key":
        batch["tokens"] = labels
    elif how == "lq_wrong_shape":
        batch["sampler_logprobs"] = batch["sampler_logprobs"][:, :1].repeat(1, s + 1)
    elif how == "candidates_alone":
        batch["candidate_ids"] = labels[..., None]
    elif how == "labels_out_of_range":
        batch["labels"] = torch.full((b, s), v)
    if how == "ok":
        loss, count, _ = make_loss_func(batch, use_parallel_state=False, **options)(z.clone())
        flat = {k: x.reshape(-1) for k, x in batch.items()}
        want = op.policy_loss(z.reshape(-1, v), flat["labels"], flat["sampler_logprobs"], flat["advantages"],
                              loss_mask=flat["loss_mask"], num_loss_tokens=1.0)
        torch.testing.assert_close(loss, want.loss, rtol=1e-12, atol=1e-12)
        assert int(count) == int(batch["loss_mask"].sum())
        return
    with pytest.raises(CLEAR_ERRORS) as info:
        make_loss_func(batch, use_parallel_state=False, **options)(z.clone())
    assert named[how] in str(info.value), f"{how}: {info.value}"
