"""The correction family: the :class:`Correction` configuration and the importance weights and rejections it
selects."""

from offpolicy.corrections.correction import Correction, KLPenalty, KLRejection, RatioRejection
from offpolicy.corrections.trust_region import TrustRegion

__all__ = ["Correction", "KLPenalty", "KLRejection", "RatioRejection", "TrustRegion"]
