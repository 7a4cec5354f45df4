"""The correction family: the :class:`Correction` keyword configuration and the typed nodes of the
:class:`~offpolicy.corrections.tree.CorrectionTree` it builds."""

from offpolicy.corrections.correction import Correction
from offpolicy.corrections.kl_penalty import KLPenalty
from offpolicy.corrections.normalisation import SequenceMean, TokenMean
from offpolicy.corrections.rules import (M2PO, OPSM, KLRejection, RatioRejection, RouteFlipRejection, SeqLogprobError,
                                        StalenessRejection, Veto, VetoHigh)
from offpolicy.corrections.surrogates import (CISPO, GMPO, PPO, SAPO, TOPR, VESPO, ClipCov, Kimi15, KLCov, RatioSurrogate,
                                             ScoreFunction)
from offpolicy.corrections.tree import CorrectionTree, ScoreCentering
from offpolicy.corrections.trust_region import TrustRegion
from offpolicy.corrections.weighting import (MIS, TIS, GeometricLevel, NoWeights, Reject, SegmentLevel, SequenceLevel,
                                             TokenLevel, Weighting)

__all__ = ["CISPO", "ClipCov", "GMPO", "M2PO", "MIS", "OPSM", "PPO", "SAPO", "TIS", "TOPR", "VESPO", "Correction", "CorrectionTree",
           "GeometricLevel", "Kimi15", "KLCov", "KLPenalty", "KLRejection", "NoWeights", "RatioRejection", "RatioSurrogate", "RouteFlipRejection", "Reject",
           "ScoreCentering", "ScoreFunction", "SegmentLevel", "SeqLogprobError", "StalenessRejection", "SequenceLevel", "SequenceMean", "TokenLevel", "TokenMean",
           "TrustRegion", "Veto", "VetoHigh", "Weighting"]
