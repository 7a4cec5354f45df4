"""offpolicy.testing: its strategies, its checkers on the project's own loss and on the float64 oracle, and its
entry points (check_all, pytest_suite, ``pytest --pyargs offpolicy.testing``).

The project's ``policy_loss`` runs through every weight mode x score centering x record kind: this is where the
invariants docs/spec.md#inv-zero-drift to #inv-support and #inv-hostile are checked on the library itself.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings

import offpolicy as op
from hypothesis import strategies as st

from offpolicy.reference import reference_policy_loss
from offpolicy.fleet.sampler import support_mask as sampler_support_mask
from offpolicy.testing import (
    INVARIANTS,
    InvariantViolation,
    LossConfig,
    check_all,
    every_config,
    project_loss,
    pytest_suite,
    run_invariant,
)
from offpolicy.testing import strategies as S

SUPPORT = Path(__file__).resolve().parents[1] / "support"  # holds mutants.py, imported by name


def reference_loss(cfg: LossConfig):
    """The float64 oracle itself through the adapter signature: it must satisfy every invariant the kit states
    (otherwise the kit's properties, not the implementations, would be wrong)."""

    def oracle(logits, tokens, sampler_logprobs, candidates, advantages, temperature, loss_mask=None, seq_ids=None,
               proximal_logprobs=None, versions=None, current_version=None, route_flips=None):
        z = logits.double()
        prox = None if proximal_logprobs is None else proximal_logprobs.detach()
        loss, token_loss, _ = reference_policy_loss(z, tokens, sampler_logprobs.detach(), advantages.detach(),
                                                    candidates, loss_mask, temperature, cfg.correction, seq_ids,
                                                    aggregation="constant", constant_normalizer=1.0,
                                                    proximal_logprobs=prox, versions=versions,
                                                    current_version=current_version, route_flips=route_flips)
        first = (torch.arange(token_loss.shape[0]) == 0).double()
        return token_loss + (loss - loss.detach()) * first

    return oracle


# ----------------------------------------------------------------------------------------------------------------
# The project's loss and the oracle pass everything
# ----------------------------------------------------------------------------------------------------------------

ALL = every_config()


def _project_passes(cfg: LossConfig):
    """Run every invariant on ``op.policy_loss`` under ``cfg``; return the report (all applicable ones passed,
    the ones that apply to every configuration among them)."""
    report = check_all(project_loss(cfg), cfg, max_examples=40, raise_on_failure=False)
    assert report.passed, str(report)
    ran = {r.invariant for r in report.results if r.status == "pass"}
    assert {"agreement", "shift_invariance", "sampler_no_grad", "hostile_finite", "masking"} <= ran
    return report, ran


@pytest.mark.parametrize("cfg", ALL, ids=[c.short() for c in ALL])
def test_project_policy_loss_passes_every_invariant(cfg):
    """The weight-mode matrix and each member of the family (surrogates, rejection chains, normalisations): every
    invariant that holds for the configuration runs and passes; the others are skipped for a stated reason."""
    report, ran = _project_passes(cfg)
    plain = (cfg.weights in ("tis", "mis") and cfg.surrogate == "score_function" and not cfg.batch_normalize
             and not cfg.correction.rejection_rules and not cfg.has_sequence_rejections
             and cfg.trust_region is None and not cfg.correction.tree.mask_rules)
    assert ("zero_drift" in ran) == (cfg.score_centering and not cfg.has_sequence_rejections)
    assert ("support_replay" in ran) == (cfg.record == "support")
    assert ("plain_is_unbiased" in ran) == plain
    for r in report.results:
        assert r.status != "skip" or r.detail.startswith("not applicable: "), (r.invariant, r.detail)


def test_every_config_covers_the_family():
    """The kit's enumeration holds each surrogate and each rule kind, normalisation and normaliser convention."""
    cfgs = every_config()
    corrs = [c.correction for c in cfgs]
    assert {c.surrogate for c in cfgs} == {"score_function", "ppo", "ppo_dual_clip", "gspo_token", "cispo",
                                           "trust_region", "sapo", "vespo", "gmpo", "topr", "kimi15", "kl_cov",
                                           "clip_cov"}
    assert any(c.m2po is not None for c in cfgs) and any(c.seq_logprob_error is not None for c in cfgs)
    mask_rules = {(type(r).__name__, r.level) for c in corrs for _, r in c.tree.mask_rules if hasattr(r, "level")}
    assert {("StalenessRejection", "sequence"), ("RouteFlipRejection", "token")} <= mask_rules  # fed by the kit
    assert any(c.ppo_delta is not None for c in cfgs)
    kinds = {(r.kind, getattr(r, "estimator", None), r.level, isinstance(getattr(r, "threshold", 0), tuple))
             for c in corrs for _, r in c.rejection_rules}
    assert ("kl", "k1", "token", True) in kinds and ("ratio", None, "token", False) in kinds
    assert any(len(c.rejections) >= 2 for c in corrs)  # a chain
    assert any(level != "token" for _, _, level, _ in kinds)
    assert {"veto", "opsm"} <= {name for c in corrs for name in c.sequence_rules}
    assert {c.batch_normalize for c in cfgs} >= {False, "tokens", "sequences"}
    assert any(not c.rejected_in_normalizer for c in cfgs)
    trs = [c.trust_region for c in cfgs if c.trust_region is not None]
    assert {t.divergence for t in trs} == {"difference", "binary_kl", "binary_kl_max"}
    assert {t.on for t in trs} == {"update", "weights"} and any(t.per_sequence for t in trs)


SEQUENCE_LEVEL = [
    LossConfig(weights=w, level=level, record=rec)
    for w, level, rec in [("tis", "sequence", "head"), ("mis", "sequence", "support"), ("mis", "geometric", None),
                          ("reject", "geometric", "support"), ("tis", "geometric", "head")]
]


@pytest.mark.parametrize("cfg", SEQUENCE_LEVEL, ids=[c.describe() for c in SEQUENCE_LEVEL])
def test_project_policy_loss_passes_at_sequence_level(cfg):
    """Batches packed into random sequences (seq_ids); masking then also checks that untrained tokens stay out
    of the sequence ratio."""
    report, _ = _project_passes(cfg)
    assert "level=" in report["plain_is_unbiased"].detail or cfg.weights == "reject"


AGGREGATED = [
    LossConfig(weights="mis", score_centering=True, record="support", aggregation="token_mean"),
    LossConfig(weights="mis", score_centering=True, record="head", aggregation="seq_mean_token_mean"),
    LossConfig(weights="tis", record="head", aggregation="seq_mean_token_sum"),
    LossConfig(weights="tis", level="geometric", record="support", aggregation="constant", constant_normalizer=3.0),
]


@pytest.mark.parametrize("cfg", AGGREGATED, ids=[c.describe() for c in AGGREGATED])
def test_project_policy_loss_passes_aggregated(cfg):
    """The function returns the aggregated scalar; expectations over outcomes undo the uniform row scaling."""
    _, ran = _project_passes(cfg)
    assert ("zero_drift" in ran) == cfg.score_centering


@pytest.mark.parametrize("cfg", [
    LossConfig(weights="mis", score_centering=True, record="head", dtype=torch.float32),
    LossConfig(weights="tis", record="support", ppo_clip=(0.2, 0.2), dual_clip=3.0, dtype=torch.float32),
    LossConfig(weights="mis", score_centering=True, record="support", dtype=torch.float32,
               rejections=(op.RatioRejection(0.3, 4.0), op.KLRejection((-0.4, 0.4), "k1"))),
], ids=lambda c: c.short())
def test_project_policy_loss_passes_in_float32(cfg):
    report = check_all(project_loss(cfg), cfg, max_examples=40, raise_on_failure=False)
    assert report.passed, str(report)


@pytest.mark.parametrize("cfg", [
    LossConfig(weights="mis", score_centering=True, record="head"),
    LossConfig(weights="tis", bounds=(0.5, 1.5), score_centering=True, record="support"),
    LossConfig(weights="reject", bounds=(0.7, 3.0), score_centering=True, record="head"),
    LossConfig(weights="none"),
    LossConfig(weights="mis", level="sequence", record="support"),
    LossConfig(weights="tis", record="support", ppo_clip=(0.2, 0.2), dual_clip=3.0),
    LossConfig(weights="tis", record="head", ppo_clip=(0.2, 0.2), ppo_ratio="gspo_token"),
    LossConfig(weights="none", record="support", cispo=(0.0, 1.28)),
    LossConfig(weights="mis", score_centering=True, record="support",
               rejections=(op.RatioRejection(0.3, 4.0), op.KLRejection((-0.4, 0.4), "k1"))),
], ids=lambda c: c.short())
def test_the_oracle_satisfies_the_kit(cfg):
    report = check_all(reference_loss(cfg), cfg, max_examples=25, raise_on_failure=False)
    assert report.passed, str(report)


# ----------------------------------------------------------------------------------------------------------------
# Strategies
# ----------------------------------------------------------------------------------------------------------------


def test_sglang_support_rule_by_hand():
    lp = torch.tensor([[math.log(0.2), math.log(0.5), math.log(0.3)]])
    # Sorted: 0.5 (id 1), 0.3 (id 2), 0.2 (id 0); mass before: 0, 0.5, 0.8.
    assert S.sglang_support(lp, top_p=0.5).tolist() == [[False, True, True]]  # 0.5 <= 0.5 keeps rank 1
    assert S.sglang_support(lp, top_p=0.49).tolist() == [[False, True, False]]
    assert S.sglang_support(lp, top_p=0.0).tolist() == [[False, True, False]]  # the top token always stays
    assert S.sglang_support(lp, top_p=1.0, top_k=2).tolist() == [[False, True, True]]
    assert S.sglang_support(lp).tolist() == [[True, True, True]]
    ties = torch.log(torch.tensor([[0.25, 0.25, 0.25, 0.25]]))
    assert S.sglang_support(ties, top_k=2).tolist() == [[True, True, False, False]]  # lower ids first
    underflow = torch.tensor([[0.0, -200.0, -1e4]])  # float32 probability of -200 and -1e4 is 0
    assert S.sglang_support(underflow).tolist() == [[True, False, False]]
    with pytest.raises(ValueError, match="top_k"):
        S.sglang_support(lp, top_k=0)


@settings(max_examples=60, deadline=None)
@given(
    v=st.integers(1, 12),
    rows=st.integers(1, 4),
    scale=st.sampled_from([0.1, 1.0, 5.0, 30.0]),
    top_p=st.one_of(st.just(1.0), st.floats(0.01, 1.0)),
    top_k=st.one_of(st.just(-1), st.integers(1, 12)),
    seed=st.integers(0, 2**16),
    ties=st.booleans(),
)
def test_sglang_support_matches_the_reference_sampler(v, rows, scale, top_p, top_k, seed, ties):
    """The kit's supports are the ones offpolicy.fleet.sampler realises (SGLang semantics), ties and underflow included."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, v, generator=gen, dtype=torch.float64) * scale
    if ties:
        z = z.round()
    lp = torch.log_softmax(z, dim=1)
    mine = S.sglang_support(lp, top_p, top_k)
    theirs = sampler_support_mask(lp, top_k=None if top_k == -1 else top_k, top_p=top_p)
    assert torch.equal(mine, theirs)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), record=st.sampled_from(S.RECORDS))
def test_problems_are_valid_batches(data, record):
    prob = data.draw(S.problems(record))
    n, v = prob.logits.shape
    assert 1 <= n <= 5 and 2 <= v <= 10
    assert torch.isfinite(prob.logits).all() and torch.isfinite(prob.sampler_logprobs).all()
    assert torch.equal(prob.sampler_logprobs, prob.sampler_logq.gather(1, prob.tokens[:, None])[:, 0])
    if record is None:
        assert prob.candidates is None
        return
    prob.candidates.validate(v, n, prob.tokens)  # raises on an invalid record
    assert prob.candidates.kind == record
    if record == "support":
        q = prob.sampler_logq.exp()
        assert torch.allclose(q.sum(1), torch.ones(n, dtype=torch.float64))
        ids = prob.candidates.ids
        for t in range(n):
            kept = {int(i) for i in ids[t] if i >= 0}
            assert kept == {int(i) for i in torch.nonzero(q[t] > 0).reshape(-1)}


@settings(max_examples=30, deadline=None)
@given(data=st.data(), record=st.sampled_from(S.RECORDS), complete=st.sampled_from([True, False, None]))
def test_positions_describe_the_sampler_exactly(data, record, complete):
    pos = data.draw(S.positions(record, complete=complete))
    q = pos.sampler_logq.exp()
    assert abs(float(q.sum()) - 1.0) < 1e-12
    prob = pos.expand(1.0)
    assert prob.num_tokens == int((q > 0).sum())
    if pos.kind == "head" and pos.cand_ids.shape[0] < pos.logits.shape[0]:
        # The true tail is rho * p outside the head (docs/spec.md#inv-head-exact's exactness condition).
        p = torch.softmax(pos.logits / pos.temperature, 0)
        tail = torch.ones_like(q, dtype=torch.bool)
        tail[pos.cand_ids] = False
        rho = (1 - q[~tail].sum()) / (1 - p[~tail].sum())
        assert torch.allclose(q[tail], rho * p[tail], rtol=1e-10, atol=0)
        assert float(q[tail].sum()) >= S.MIN_TAIL_MASS


@settings(max_examples=30, deadline=None)
@given(data=st.data(), bounds=st.sampled_from([(0.5, 5.0), (0.0, 2.0), (0.8, 1.25)]),
       record=st.sampled_from(S.RECORDS))
def test_positions_with_ratio_bounds_keep_every_ratio_inside(data, bounds, record):
    pos = data.draw(S.positions(record, complete=True, ratio_bounds=bounds))
    x = pos.logits / pos.temperature
    if record == "support":
        x = x.masked_fill(~torch.isfinite(pos.sampler_logq), -math.inf)
    lp = torch.log_softmax(x, 0)
    can = torch.isfinite(pos.sampler_logq)
    r = (lp - pos.sampler_logq)[can].exp()
    assert bool((r >= bounds[0]).all()) and bool((r <= bounds[1]).all())


@pytest.mark.parametrize("cfg", [
    LossConfig(weights="none", score_centering=True, record="head"),
    LossConfig(weights="none", score_centering=True, record="support"),
    LossConfig(weights="mis", score_centering=True, record="head"),
    LossConfig(weights="mis", score_centering=True, record="support"),
    LossConfig(weights="tis", bounds=(0.5, 2.0), record="head"),
], ids=lambda c: c.describe())
def test_hostile_problems_have_a_finite_oracle_and_valid_records(cfg):
    """Hostile examples are hostile but legal: valid records, and the spec's own loss is finite on them. Checked on
    fresh draws, and on a fixed example sequence that must also cover every hostile feature (coverage of random
    draws would make the test flaky: a -inf logit is rare where f(0) != 0 keeps it off recorded tokens)."""
    seen = set()

    def check(prob):
        n, v = prob.logits.shape
        if prob.candidates is not None:
            prob.candidates.validate(v, n, prob.tokens)
        assert torch.isfinite(prob.sampler_logprobs).all()
        z = prob.logits.clone().requires_grad_()
        loss, token_loss, _ = reference_policy_loss(z, prob.tokens, prob.sampler_logprobs, prob.advantages,
                                                    prob.candidates, None, prob.temperature, cfg.correction,
                                                    aggregation="constant", constant_normalizer=1.0)
        assert torch.isfinite(token_loss).all()
        (g,) = torch.autograd.grad(loss, z)
        assert torch.isfinite(g).all()
        seen.update(prob.notes["hostile"].split(","))
        if n == 0:
            seen.add("N=0")
        if n and bool((prob.logits == -math.inf).any()):
            seen.add("-inf logits")

    strategy = S.hostile_problems(cfg.record, zero_weight_at_zero_ratio=cfg.weight_at_zero == 0.0)
    settings(max_examples=40, deadline=None)(given(strategy)(check))()
    seen.clear()
    settings(max_examples=60, deadline=None, derandomize=True, database=None)(given(strategy)(check))()
    assert {"big", "neg_inf", "degenerate", "extreme", "N=0", "-inf logits"} <= seen


@settings(max_examples=30, deadline=None)
@given(data=st.data(), n=st.integers(0, 9))
def test_small_strategies(data, n):
    packed = data.draw(S.with_sequences(S.problems(num_tokens=(n, n))))
    assert torch.equal(packed.seq_ids, packed.seq_ids.sort().values) and "seq_ids" in packed.describe()
    seq = data.draw(S.packed_sequences(n))
    assert seq.shape == (n,)
    if n:
        assert int(seq[0]) == 0 and bool((seq.diff() >= 0).all()) and bool((seq.diff() <= 1).all())
    mask = data.draw(S.loss_masks(n, allow_empty=False))
    assert mask.dtype == torch.bool and (n == 0 or bool(mask.any()))
    adv = data.draw(S.advantages(n))
    assert adv.shape == (n,) and bool((adv.abs() <= 3).all())
    assert bool((data.draw(S.advantages(n, constant=1.5)) == 1.5).all())
    tau = data.draw(S.temperatures())
    assert 0.05 <= tau <= 10.0
    z, s = data.draw(S.mismatched_logits(2, 5, mismatch=0.0))
    # only the outlier token differs, by 6 (to rounding: s = z - 6 need not give s - z == -6 exactly)
    assert torch.equal(z, s) or bool(torch.isclose((s - z).abs(), torch.tensor(6.0, dtype=s.dtype)).any())


# ----------------------------------------------------------------------------------------------------------------
# Configuration and entry points
# ----------------------------------------------------------------------------------------------------------------


def test_config_parse_and_errors():
    cfg = LossConfig.parse("weights=mis, bounds=0.5:4, sc=1, record=support, dtype=float32")
    assert cfg == LossConfig(weights="mis", bounds=(0.5, 4.0), score_centering=True, record="support",
                             dtype=torch.float32)
    assert LossConfig.parse("weights=tis,bounds=3,record=none") == LossConfig(weights="tis", bounds=3.0)
    assert LossConfig.parse("weights=mis,level=geometric").correction.level == "geometric"
    with pytest.raises(ValueError, match="level"):
        LossConfig(weights="mis", level="sentence")
    with pytest.raises(ValueError, match="token-level weights only"):
        LossConfig(weights="mis", level="sequence", score_centering=True, record="head")
    cfg = LossConfig.parse("weights=tis,aggregation=constant,constant_normalizer=4")
    assert cfg.aggregation == "constant" and cfg.constant_normalizer == 4.0
    assert "constant_normalizer=4" in cfg.describe()
    with pytest.raises(ValueError, match="aggregation must be None or one of"):
        LossConfig(aggregation="mean")
    with pytest.raises(ValueError, match="constant_normalizer goes with"):
        LossConfig(aggregation="constant")
    with pytest.raises(ValueError, match="constant_normalizer goes with"):
        LossConfig(constant_normalizer=2.0)
    with pytest.raises(ValueError, match=r"score_centering=True\) needs record"):
        LossConfig(score_centering=True)
    with pytest.raises(ValueError, match="record must be"):
        LossConfig(record="top_p")
    with pytest.raises(ValueError, match="unknown key 'weight'"):
        LossConfig.parse("weight=mis")
    with pytest.raises(ValueError, match="bounds"):
        LossConfig(weights="mis", bounds=(2.0, 1.0))
    cfg = LossConfig.parse("weights=tis,ppo_clip=0.2:0.28,dual_clip=3,ppo_delta=2,batch_normalize=sequences")
    assert cfg == LossConfig(weights="tis", ppo_clip=(0.2, 0.28), dual_clip=3.0, ppo_delta=2.0,
                             batch_normalize="sequences")
    assert cfg.surrogate == "ppo_dual_clip" and cfg.needs_proximal and cfg.needs_sequences
    assert "dual_clip=3.0" in cfg.describe() and cfg.short() == "tis-None+ppo_dual_clip+delta2+bn-sequences"
    cfg = LossConfig.parse("weights=mis,cispo=0:1.28,rejected_in_normalizer=0,aggregation=token_mean,"
                           "batch_normalize=1")
    assert cfg.cispo == (0.0, 1.28) and cfg.rejected_in_normalizer is False and cfg.batch_normalize is True
    with pytest.raises(ValueError, match="holds rule objects"):
        LossConfig.parse("rejections=x")
    with pytest.raises(ValueError, match="rejected_in_normalizer=False\\) changes only the aggregation"):
        LossConfig(rejected_in_normalizer=False)
    with pytest.raises(ValueError, match="dual_clip needs ppo_clip"):
        LossConfig(dual_clip=3.0)
    with pytest.raises(ValueError, match="score_centering=True cannot be combined with ppo_clip or cispo"):
        LossConfig(score_centering=True, record="head", cispo=(0.0, 2.0))
    assert LossConfig(rejections=[op.RatioRejection(0.5, 2.0)]).rejections == (op.RatioRejection(0.5, 2.0),)


def test_not_applicable_invariants_are_skipped_with_a_reason():
    cfg = LossConfig(weights="none", record="head")
    fn = project_loss(cfg)
    assert run_invariant(fn, cfg, "zero_drift").detail.startswith("not applicable: the configuration does not")
    assert "only tis and mis" in run_invariant(fn, cfg, "plain_is_unbiased").detail
    assert "only support records" in run_invariant(fn, cfg, "support_replay").detail
    with pytest.raises(KeyError, match="unknown invariant"):
        run_invariant(fn, cfg, "drift")

    def no_mask(logits, tokens, lq, cands, adv, tau):
        return fn(logits, tokens, lq, cands, adv, tau)

    result = run_invariant(no_mask, cfg, "masking")
    assert result.status == "skip" and result.detail == "not applicable: the function takes no loss_mask keyword"


def test_sequence_levels_need_seq_ids_and_keywords_are_read_from_the_signature():
    cfg = LossConfig(weights="mis", level="sequence")
    full = project_loss(cfg)

    def no_seq_ids(logits, tokens, lq, cands, adv, tau, loss_mask=None):
        return full(logits, tokens, lq, cands, adv, tau, loss_mask=loss_mask)

    with pytest.raises(ValueError, match="must take a seq_ids keyword"):
        check_all(no_seq_ids, cfg)
    with pytest.raises(ValueError, match="must take a proximal_logprobs keyword"):
        check_all(no_seq_ids, LossConfig(weights="mis", cispo=(0.0, 2.0)))
    with pytest.raises(ValueError, match="a sequence-wise rule, normalisation or surrogate"):
        check_all(no_seq_ids, LossConfig(weights="mis", batch_normalize="sequences"))
    with pytest.raises(ValueError, match=r"aggregation='seq_mean_token_sum'\) works on packed sequences"):
        check_all(no_seq_ids, LossConfig(weights="mis", aggregation="seq_mean_token_sum"))

    def forwarding(*args, **kwargs):
        return full(*args, **kwargs)

    report = check_all(forwarding, cfg, invariants=["agreement", "masking"], max_examples=10)
    assert [r.status for r in report.results] == ["pass", "pass"]


def test_wrong_return_and_exceptions_are_failures_with_the_example():
    cfg = LossConfig()

    def scalar_loss(logits, tokens, lq, cands, adv, tau):
        return logits.sum()

    def raising_loss(logits, tokens, lq, cands, adv, tau):
        raise RuntimeError("shape mismatch in my kernel")

    r = run_invariant(scalar_loss, cfg, "agreement", max_examples=5)
    assert r.status == "fail" and "expected per-token [N]" in r.detail and "shrunk example" in r.detail
    r = run_invariant(raising_loss, cfg, "hostile_finite", max_examples=5)
    assert r.status == "fail" and "raised RuntimeError: shape mismatch in my kernel" in r.detail

    def per_token_loss(logits, tokens, lq, cands, adv, tau):
        return torch.zeros_like(adv)

    r = run_invariant(per_token_loss, LossConfig(aggregation="token_mean"), "agreement", max_examples=5)
    assert r.status == "fail" and "expected a scalar (LossConfig.aggregation is set)" in r.detail


def test_check_all_raises_the_whole_report():
    cfg = LossConfig(weights="mis", record="head")

    def detached(logits, tokens, lq, cands, adv, tau):
        return project_loss(cfg)(logits, tokens, lq, cands, adv, tau).detach()

    with pytest.raises(InvariantViolation) as info:
        check_all(detached, cfg, invariants=["agreement", "sampler_no_grad"], max_examples=10)
    text = str(info.value)
    assert "FAIL  agreement" in text and "PASS  sampler_no_grad" in text
    assert "not differentiable with respect to the logits" in text


TestProjectLossSuite = pytest_suite(project_loss(LossConfig(weights="tis", score_centering=True, record="support")),
                                    LossConfig(weights="tis", score_centering=True, record="support"),
                                    name="TestProjectLossSuite")


def test_pytest_suite_builds_one_test_per_invariant():
    assert {name for name in dir(TestProjectLossSuite) if name.startswith("test_")} == {f"test_{n}" for n in INVARIANTS}


def test_pyargs_entry_points_at_user_functions(tmp_path):
    """`pytest --pyargs offpolicy.testing` from a user's directory, pointed at two functions at once (two
    invariants each, to keep the subprocess short)."""
    env = {"OFFPOLICY_LOSS": "mutants:correct_mis_support, mutants:unweighted_mis_support",
           "OFFPOLICY_MAX_EXAMPLES": "40", "PYTHONPATH": os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "offpolicy.testing", "-q", "-p", "no:cacheprovider", "-rfE",
         "-k", "zero_drift or sampler_no_grad"],
        cwd=tmp_path, env={**os.environ, **env}, capture_output=True, text=True, timeout=600,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    # pytest appends " - <message>" to the summary line when the terminal is wide enough: compare the node id only.
    failed = [line.split()[1] for line in out.stdout.splitlines() if line.startswith("FAILED ")]
    assert failed == ["test_loss_invariants.py::test_invariant[mutants:unweighted_mis_support-zero_drift]"], text
    assert "invariant 'zero_drift' violated" in out.stdout
    assert "function:      mutants.dense_loss[sc_unweighted]" in out.stdout
    assert re.search(r"1 failed, 3 passed", out.stdout), text


def test_pyargs_targets_from_the_environment(monkeypatch):
    from offpolicy.testing import test_loss_invariants as entry

    monkeypatch.delenv("OFFPOLICY_LOSS", raising=False)
    targets = entry._targets()
    assert len(targets) == len(every_config()) and targets[0][0] == "policy_loss[none-head]"
    monkeypatch.syspath_prepend(str(SUPPORT))
    monkeypatch.setenv("OFFPOLICY_LOSS", "mutants:dense_loss")
    with pytest.raises(ValueError, match="OFFPOLICY_CONFIG"):
        entry._targets()
    monkeypatch.setenv("OFFPOLICY_CONFIG", "weights=tis,bounds=3,record=head")
    ((name, fn, cfg),) = entry._targets()
    assert name == "mutants:dense_loss" and cfg == LossConfig(weights="tis", bounds=3.0, record="head")
    monkeypatch.setenv("OFFPOLICY_LOSS", "mutants")
    with pytest.raises(ValueError, match="module:function"):
        entry._targets()


def test_example_check_my_loss_runs():
    """examples/check_my_loss.py: the framework-style loss passes, its unweighted-centering variant drifts."""
    import importlib.util

    path = SUPPORT.parents[1] / "examples" / "check_my_loss.py"
    spec = importlib.util.spec_from_file_location("check_my_loss", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(max_examples=10) == 0


def test_the_kit_keeps_examples_off_the_jumps_a_trait_names():
    """``_near_discontinuity`` reads the registry's traits: a ratio on a MIS bound is flagged (``masks_outside``:
    the weight jumps there), the same ratio under TIS (continuous clamp) is not; a one-sided KL threshold jumps at
    its threshold only, not at an implicit lower end 0; the veto jumps at ``log veto``."""
    from offpolicy.testing.harness import _Fed
    from offpolicy.testing.tolerances import _near_discontinuity

    def fed(log_r, seq=None):
        # V = 2 uniform logits: log p(y) = log 1/2 at every token; lq puts log p - lq at log_r.
        n = len(log_r)
        return _Fed(logits=torch.zeros(n, 2, dtype=torch.float64), tokens=torch.zeros(n, dtype=torch.long),
                    lq=math.log(0.5) - torch.tensor(log_r, dtype=torch.float64), cands=None,
                    adv=torch.ones(n, dtype=torch.float64), tau=1.0,
                    seq_ids=None if seq is None else torch.tensor(seq))

    on_bound, inside = fed([math.log(5.0), 0.0]), fed([math.log(4.0), 0.0])
    for weights, flagged in (("mis", True), ("reject", True), ("tis", False), ("none", False)):
        bounds = None if weights == "none" else (0.5, 5.0)
        cfg = LossConfig(weights=weights, bounds=bounds, record=None, dtype=torch.float64)
        assert _near_discontinuity(on_bound, cfg) is flagged, weights
        assert _near_discontinuity(inside, cfg) is False, weights
    one_sided = LossConfig(weights="none", record=None, dtype=torch.float64,
                           kl_rejection=op.KLRejection(0.5, "k1"))
    assert _near_discontinuity(fed([0.0, 0.25]), one_sided) is False  # k1 = 0 is no jump of a one-sided band
    assert _near_discontinuity(fed([-0.5, 0.25]), one_sided) is True
    veto = LossConfig(weights="tis", record=None, dtype=torch.float64, veto=0.5)
    assert _near_discontinuity(fed([math.log(0.5), 0.0], seq=[0, 0]), veto) is True
    assert _near_discontinuity(fed([math.log(0.25), 0.0], seq=[0, 0]), veto) is False
