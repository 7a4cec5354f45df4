"""The kit must be able to fail: each deliberately wrong loss in tests/support/mutants.py is caught by the invariant that
its mistake breaks, and the correct version of the same code passes every invariant under the same configuration.

Failures are found without shrinking here (``shrink=False``) to keep the suite fast; one test shrinks and checks
the report a user reads.
"""

from __future__ import annotations

import pytest

from support.mutants import BUGS, dense_loss
from offpolicy import KLRejection, RatioRejection
from offpolicy.testing import INVARIANTS, InvariantViolation, LossConfig, check_all, family_configs, run_invariant
from offpolicy.testing.config import node_examples

MIS_HEAD_SC = LossConfig(weights="mis", score_centering=True, record="head")
MIS_SUPPORT_SC = LossConfig(weights="mis", score_centering=True, record="support")
MIS_SUPPORT = LossConfig(weights="mis", record="support")
MIS_HEAD = LossConfig(weights="mis", record="head")
TIS_HEAD_SC = LossConfig(weights="tis", score_centering=True, record="head")
TIS_SUPPORT_SC = LossConfig(weights="tis", score_centering=True, record="support")
TIS_SUPPORT = LossConfig(weights="tis", record="support")
TIS_HEAD = LossConfig(weights="tis", record="head")
NONE_SUPPORT_SC = LossConfig(weights="none", score_centering=True, record="support")
NONE_HEAD = LossConfig(weights="none", record="head")
TIS_SEQ = LossConfig(weights="tis", bounds=(0.0, 5.0), level="sequence", record="head")
MIS_GEO = LossConfig(weights="mis", level="geometric", record="support")
TIS_SEQ_MEAN = LossConfig(weights="tis", score_centering=True, record="head", aggregation="seq_mean_token_mean")
MIS_TOKEN_MEAN = LossConfig(weights="mis", record="support", aggregation="token_mean")
TIS_PPO = LossConfig(weights="tis", record="head", ppo_clip=(0.2, 0.28))
TIS_DUAL_CLIP = LossConfig(weights="tis", record="support", ppo_clip=(0.2, 0.2), dual_clip=3.0)
NONE_PPO_DELTA = LossConfig(weights="none", ppo_clip=(0.2, 0.2), ppo_delta=1.5)
CISPO_TRL = LossConfig(weights="none", record="support", cispo=(0.0, 1.28))
CISPO_SLIME = LossConfig(weights="mis", record="head", cispo=(0.8, 1.2))
CHAIN_SC = LossConfig(weights="mis", score_centering=True, record="support",
                      rejections=(RatioRejection(0.3, 4.0), KLRejection((-0.4, 0.4), "k1")))
SEQ_RULES = LossConfig(weights="tis", record="head",
                       rejections=(RatioRejection(0.5, 3.0, "geometric"), KLRejection(0.3, "k3", "seq_max")))
SEQ_SUM_RULES = LossConfig(weights="mis", record="head",
                           rejections=(RatioRejection(0.3, 3.0, "sequence"), KLRejection((-0.3, 0.3), "k1", "seq_sum")))
VETO_OPSM = LossConfig(weights="tis", veto=0.2, opsm_delta=0.2)
BN_TOKENS = LossConfig(weights="mis", score_centering=True, record="head", batch_normalize="tokens")
BN_SEQUENCES = LossConfig(weights="tis", record="support", batch_normalize="sequences")
GSPO_TOKEN = LossConfig(weights="tis", record="head", ppo_clip=(0.2, 0.2), ppo_ratio="gspo_token")
REJ_OUT_TOKEN = LossConfig(weights="reject", record="head", kl_rejection=KLRejection(0.5, "k2"),
                           rejected_in_normalizer=False, aggregation="token_mean")
REJ_OUT_SEQ = LossConfig(weights="mis", record="support", rejections=(KLRejection((-0.3, 0.3), "k1", "seq_mean"),),
                         rejected_in_normalizer=False, aggregation="seq_mean_token_mean")
#: The node examples (the kit's configurations of TOPR, Kimi15, KL-Cov, Clip-Cov, M2PO, seq_logprob_error, and
#: the route-flip rejection's, which holds a sequence-level staleness rejection too),
#: by the keyword that selects each.
EXAMPLES = {k: c for c in node_examples() for k in ("topr", "kimi15", "kl_cov", "clip_cov", "m2po", "seq_logprob_error",
                                                    "max_route_flips")
            if getattr(c, k) is not None}
#: Combinations no mutant targets, passed by the correct loss only: sequence-level weights under decoupled PPO and
#: CISPO, GSPO-token with sequence normalisation and a sequence aggregation, the veto with sequence weights.
COMBINED = [
    LossConfig(weights="tis", bounds=(0.0, 5.0), level="sequence", record="head", ppo_clip=(0.2, 0.2)),
    LossConfig(weights="reject", level="geometric", record="support", cispo=(0.8, 1.2), rejected_in_normalizer=False,
               aggregation="seq_mean_token_mean"),
    LossConfig(weights="tis", record="head", ppo_clip=(0.2, 0.2), ppo_ratio="gspo_token", batch_normalize="sequences",
               aggregation="seq_mean_token_mean"),
    LossConfig(weights="tis", bounds=(0.0, 5.0), level="sequence", batch_normalize="sequences", veto=0.1),
]

#: (bug, configuration, the invariant that must fail). Where a mistake breaks several invariants, the one named
#: is the most specific (docs/testing_kit.md lists every invariant each one fails).
CAUGHT = [
    ("sc_no_tail", MIS_HEAD_SC, "zero_drift"),          # the modelled tail is what makes head records drift-free
    ("sc_no_tail", MIS_SUPPORT_SC, "agreement"),        # support: -p_S adds no gradient, only loss value
    ("sc_unweighted", MIS_HEAD_SC, "zero_drift"),
    ("sc_unweighted", TIS_SUPPORT_SC, "zero_drift"),
    ("sc_skipped", NONE_SUPPORT_SC, "zero_drift"),
    ("sc_coef_not_detached", MIS_SUPPORT_SC, "agreement"),
    ("rho_no_floor", TIS_HEAD_SC, "hostile_finite"),
    ("mis_clip", MIS_HEAD_SC, "agreement"),             # consistent clipping keeps drift zero: only the oracle sees it
    ("weights_not_detached", MIS_SUPPORT, "plain_is_unbiased"),
    ("temperature_twice", TIS_HEAD, "agreement"),
    ("temperature_numerator_only", NONE_HEAD, "shift_invariance"),
    ("support_not_replayed", MIS_SUPPORT_SC, "support_replay"),
    ("sampler_grad_leak", MIS_SUPPORT_SC, "sampler_no_grad"),
    ("sign_error", TIS_SUPPORT, "plain_is_unbiased"),
    ("unclamped_ratio", MIS_HEAD, "hostile_finite"),
    ("no_inf_guard", MIS_HEAD_SC, "hostile_finite"),
    ("mask_ignored", TIS_SUPPORT_SC, "masking"),
    ("sequence_counts_untrained", TIS_SEQ, "masking"),  # placeholder lq = 0 on untrained rows moves the ratio
    ("geometric_as_sequence", MIS_GEO, "agreement"),
    ("sequence_as_token", TIS_SEQ, "agreement"),
    ("seq_mean_as_token_mean", TIS_SEQ_MEAN, "agreement"),
    ("mean_over_all_tokens", MIS_TOKEN_MEAN, "masking"),
    ("dual_clip_missing", TIS_DUAL_CLIP, "agreement"),      # needs u = p / pi_prox > c = 3 with A < 0
    ("dual_clip_positive_advantages", TIS_DUAL_CLIP, "agreement"),
    ("dual_clip_as_upper_bound", TIS_DUAL_CLIP, "agreement"),
    ("ppo_delta_ignored", NONE_PPO_DELTA, "agreement"),
    ("cispo_coef_attached", CISPO_TRL, "agreement"),       # same value, the gradient gains A log p grad u
    ("cispo_unclipped", CISPO_SLIME, "agreement"),
    ("rejection_chain_first_only", CHAIN_SC, "agreement"),  # consistent in w and c(v): drift stays zero
    ("kl_two_sided_as_upper", CHAIN_SC, "agreement"),
    ("sequence_rule_per_token", SEQ_RULES, "agreement"),      # geometric ratio band and seq_max k3
    ("sequence_rule_per_token", SEQ_SUM_RULES, "agreement"),  # summed ratio band and seq_sum k1
    ("opsm_any_advantage", VETO_OPSM, "agreement"),
    ("batch_norm_counts_untrained", BN_TOKENS, "masking"),    # consistent in w and c(v): drift stays zero
    ("batch_norm_sequences_as_tokens", BN_SEQUENCES, "agreement"),
    ("gspo_token_sequence_gradient", GSPO_TOKEN, "agreement"),  # same value; per-token advantages expose it
    ("rejected_kept_in_normalizer", REJ_OUT_TOKEN, "agreement"),
    ("rejected_kept_in_normalizer", REJ_OUT_SEQ, "agreement"),
    ("topr_negative_unclipped", EXAMPLES["topr"], "agreement"),
    ("kimi15_penalty_detached", EXAMPLES["kimi15"], "agreement"),  # same value, the penalty's gradient is lost
    ("kl_cov_penalty_signed", EXAMPLES["kl_cov"], "agreement"),
    ("clip_cov_unseeded_draw", EXAMPLES["clip_cov"], "agreement"),
    ("m2po_smallest_first", EXAMPLES["m2po"], "agreement"),
    ("seq_logprob_error_signed", EXAMPLES["seq_logprob_error"], "agreement"),
    ("staleness_sequence_as_token", EXAMPLES["max_route_flips"], "agreement"),
    ("route_flips_at_threshold", EXAMPLES["max_route_flips"], "agreement"),
]


def test_every_bug_is_exercised():
    assert {bug for bug, _, _ in CAUGHT} == set(BUGS)
    assert {inv for _, _, inv in CAUGHT} <= set(INVARIANTS)


@pytest.mark.parametrize("bug,cfg,invariant", CAUGHT, ids=[f"{b}-{i}" for b, _, i in CAUGHT])
def test_mutant_is_caught(bug, cfg, invariant):
    result = run_invariant(dense_loss(cfg, bug), cfg, invariant, max_examples=150, shrink=False)
    assert result.status == "fail", f"{bug} was not caught by {invariant} under {cfg.describe()}"
    assert f"invariant '{invariant}' violated" in result.detail
    assert cfg.describe() in result.detail


# support.mutants.dense_loss models no trust region and none of SAPO / VESPO / GMPO (docs/spec.md#trust-region,
# #sapo): those family members are checked on the project's own loss (tests/core/test_logprob_loss.py,
# offpolicy.testing.test_loss_invariants) and against the reference (tests/core/test_surrogates_and_kl_penalty.py).
CONFIGS = sorted({cfg for _, cfg, _ in CAUGHT} | {TIS_PPO}
                 | {c for c in family_configs()
                    if c.trust_region is None and c.sapo is None and c.vespo is None and c.gmpo is None}
                 | set(COMBINED), key=lambda c: c.describe())


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.short() for c in CONFIGS])
def test_correct_dense_loss_passes(cfg):
    """The same code without the bug passes everything, so each catch above is the bug's doing; it runs over every
    configuration of ``family_configs()`` too (the family the kit runs the project's own loss over)."""
    report = check_all(dense_loss(cfg), cfg, max_examples=25, raise_on_failure=False)
    assert report.passed, str(report)
    applicable = [r.invariant for r in report.results if r.status == "pass"]
    assert "agreement" in applicable and "hostile_finite" in applicable


def test_shrunk_report_is_readable():
    """A shrunk failure names the invariant, the spec anchor, the configuration and a minimal example."""
    cfg = MIS_HEAD_SC
    with pytest.raises(InvariantViolation) as info:
        check_all(dense_loss(cfg, "sc_unweighted"), cfg, invariants=["zero_drift"], max_examples=40)
    text = str(info.value)
    assert "FAIL  zero_drift" in text
    assert "invariant 'zero_drift' violated (docs/spec.md#inv-zero-drift, docs/spec.md#inv-head-exact" in text
    assert "configuration: LossConfig(weights='mis', bounds=(0.5, 5), score_centering=True, record='head'" in text
    assert "function:      support.mutants.dense_loss[sc_unweighted]" in text
    assert "what failed:   sum_y q(y) d loss(y) / d logits (the drift) differs" in text
    example = text.split("shrunk example:")[1]
    vocab = int(example.split("V=")[1].split()[0])
    assert vocab <= 3, f"expected a shrunk example over a tiny vocabulary, got:\n{example}"
