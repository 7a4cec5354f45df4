"""The correction tree: each node refuses an invalid argument with an error naming it, the combination rules
refuse invalid trees (read from the nodes' traits), the keyword API names its keyword for the same mistakes, and
the keyword form and the tree round-trip for every configuration the kit runs."""

from __future__ import annotations

import math

import pytest

import offpolicy as op
from offpolicy.corrections import (CISPO, GMPO, MIS, OPSM, PPO, SAPO, TIS, VESPO, CorrectionTree, GeometricLevel,
                                   KLRejection, NoWeights, RatioRejection, RatioSurrogate, Reject, ScoreCentering,
                                   ScoreFunction, SequenceLevel, SequenceMean, TokenLevel, TokenMean, TrustRegion,
                                   Veto, Weighting)
from offpolicy.corrections.node import NodeError
from offpolicy.testing import every_config


@pytest.mark.parametrize("build,arg", [
    (lambda: TIS(0.0, math.inf), "TIS.upper"),
    (lambda: TIS(0.0, float("nan")), "TIS.upper"),
    (lambda: MIS(2.0, 1.0), "MIS.lower"),
    (lambda: MIS(-0.1, 1.0), "MIS.lower"),
    (lambda: Reject(0.0, 0.0), "Reject.lower"),
    (lambda: MIS(True, 2.0), "MIS.lower"),
    (lambda: Veto(1.0), "Veto.threshold"),
    (lambda: Veto(0.0), "Veto.threshold"),
    (lambda: OPSM(-1.0), "OPSM.delta"),
    (lambda: OPSM(math.inf), "OPSM.delta"),
    (lambda: PPO(1.0, 0.2), "PPO.eps_lo"),
    (lambda: PPO(0.2, -0.1), "PPO.eps_hi"),
    (lambda: PPO(0.2, 0.2, dual_clip=1.0), "PPO.dual_clip"),
    (lambda: PPO(0.2, 0.2, delta=0.5), "PPO.delta"),
    (lambda: PPO(0.2, 0.2, ratio="sequence"), "PPO.ratio"),
    (lambda: CISPO(2.0, 1.0), "CISPO.lo"),
    (lambda: SAPO(1.0, 0.0), "SAPO.tau_neg"),
    (lambda: VESPO(-1.0, 3.0, 3.0, 2.0), "VESPO.k_pos"),
    (lambda: VESPO(2.0, 3.0, 3.0, 0.0), "VESPO.lam_neg"),
    (lambda: GMPO(0.4, -0.4), "GMPO.eps_hi"),
    (lambda: CorrectionTree(max_log_ratio=41.0), "CorrectionTree.max_log_ratio"),
    (lambda: CorrectionTree(max_log_ratio=0.0), "CorrectionTree.max_log_ratio"),
])
def test_each_node_names_its_bad_argument(build, arg):
    with pytest.raises(NodeError, match=arg.replace(".", r"\.")) as info:
        build()
    node, name = arg.split(".")
    assert (info.value.node, info.value.arg) == (node, name)


@pytest.mark.parametrize("build,match", [
    (lambda: Weighting(NoWeights(), SequenceLevel()), "needs weights="),
    (lambda: Weighting("mis"), "Weighting.mode must be one of"),
    (lambda: Weighting(MIS(), "token"), "Weighting.level must be one of"),
    (lambda: CorrectionTree(weighting=Weighting(MIS(), GeometricLevel()), centering=ScoreCentering()),
     "token-level weights only"),
    (lambda: CorrectionTree(surrogate=PPO(0.2, 0.2), centering=ScoreCentering()),
     "cannot be combined with ppo_clip or cispo"),
    (lambda: CorrectionTree(centering=ScoreCentering(), trust_region=TrustRegion(0.1, 0.1, on="weights")),
     "cannot be combined with trust_region"),
    (lambda: CorrectionTree(surrogate=SAPO(1.0, 1.05), trust_region=TrustRegion(0.1, 0.1)),
     "trust_region cannot be combined with sapo"),
    (lambda: CorrectionTree(surrogate=GMPO(0.4, 0.4), trust_region=TrustRegion(0.1, 0.1, on="weights")),
     "trust_region cannot be combined with gmpo"),
    (lambda: CorrectionTree(trust_region=TrustRegion(0.1, 0.1)), "goes with surrogate=RatioSurrogate"),
    (lambda: CorrectionTree(surrogate=RatioSurrogate()), "RatioSurrogate needs it"),
    (lambda: CorrectionTree(surrogate=RatioSurrogate(), trust_region=TrustRegion(0.1, 0.1, on="weights")),
     "RatioSurrogate needs it"),
    (lambda: CorrectionTree(surrogate="ppo"), "CorrectionTree.surrogate must be"),
    (lambda: CorrectionTree(normalisation=True), "CorrectionTree.normalisation must be None or"),
    (lambda: CorrectionTree(rejections=(0.5,)), "CorrectionTree.rejections must be a tuple"),
    (lambda: CorrectionTree(rejections=(Veto(0.1), Veto(0.2)), rule_names=("a", "a")), "rule_names must name"),
    (lambda: CorrectionTree(rejections=(Veto(0.1),), rule_names=()), "rule_names must name"),
    (lambda: CorrectionTree(rejected_in_normalizer=0), "rejected_in_normalizer must be a bool"),
])
def test_invalid_trees_cannot_be_built(build, match):
    with pytest.raises((ValueError, TypeError), match=match):
        build()


@pytest.mark.parametrize("kwargs,match", [
    (dict(weights="mis", bounds=(5.0, 0.5)), r"Correction\.bounds must be \(lower, upper\) with 0 <= lower <= upper < inf, got \(5\.0, 0\.5\) \(MIS\.lower"),
    (dict(ppo_clip=(1.5, 0.2)), r"Correction\.ppo_clip must be \(eps_lo, eps_hi\) with eps_lo in \[0, 1\).* \(PPO\.eps_lo"),
    (dict(ppo_clip=(0.2, 0.2), ppo_delta=0.5), r"Correction\.ppo_delta must be a finite number > 1, got 0\.5"),
    (dict(vespo=(2.0, 3.0, 3.0, 0.0)), r"Correction\.vespo must be .*VESPO\.lam_neg"),
    (dict(veto=1.5), r"Correction\.veto must be in \(0, 1\), got 1\.5"),
    (dict(max_log_ratio=50.0), r"Correction\.max_log_ratio must be in \(0, 40\]"),
])
def test_the_keywords_name_themselves_for_a_node_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        op.Correction(**kwargs)


def test_a_tree_built_by_hand_runs_like_its_keywords():
    tree = CorrectionTree(weighting=Weighting(TIS(0.0, 3.0), TokenLevel()),
                          rejections=(Veto(1e-3), KLRejection(0.5, "k2"), RatioRejection(0.2, 4.0, "geometric")),
                          surrogate=CISPO(0.0, 2.0), normalisation=SequenceMean())
    corr = op.Correction.from_tree(tree)
    assert corr == op.Correction(weights="tis", bounds=(0.0, 3.0), veto=1e-3, cispo=(0.0, 2.0),
                                 batch_normalize="sequences", kl_rejection=KLRejection(0.5, "k2"),
                                 rejections=(RatioRejection(0.2, 4.0, "geometric"),))
    assert corr.tree.rejections == tree.rejections and corr.tree.surrogate == tree.surrogate
    assert tree.rule_names == ("veto", "kl", "ratio") and corr.tree.rule_names == ("veto", "kl", "rule0")
    assert tree.needs_sequences and [n for n, _ in tree.sequence_rules] == ["veto", "ratio"]
    assert isinstance(CorrectionTree().surrogate, ScoreFunction) and CorrectionTree().normalisation is None
    assert TokenMean().needs_sequences is False


def test_every_kit_configuration_round_trips_through_its_tree():
    for cfg in every_config():
        corr = cfg.correction
        back = op.Correction.from_tree(corr.tree)
        assert back.tree == corr.tree, cfg.describe()
        assert back == op.Correction.from_tree(back.tree)


def test_surrogate_names_and_traits():
    assert [PPO(0.2, 0.2).name, PPO(0.2, 0.2, dual_clip=3.0).name, PPO(0.2, 0.2, ratio="gspo_token").name] == [
        "ppo", "ppo_dual_clip", "gspo_token"]
    assert PPO(0.2, 0.2, ratio="gspo_token").needs_sequences and not PPO(0.2, 0.2).needs_sequences
    assert [c.centerable for c in (ScoreFunction, PPO, CISPO, SAPO, VESPO, GMPO, RatioSurrogate)] == [
        True, False, False, False, False, False, False]
    assert RatioSurrogate.proximal_optional and not RatioSurrogate.needs_proximal
    assert PPO(0.2, 0.28, delta=2.0).jumps()[0].at == (math.log(0.8), math.log(1.28), math.log(2.0))
