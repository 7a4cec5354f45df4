"""The correction family: the :class:`Correction` configuration and the importance weights and rejections it
selects."""

from offpolicy.corrections.correction import Correction, KLPenalty, KLRejection, RatioRejection

__all__ = ["Correction", "KLPenalty", "KLRejection", "RatioRejection"]
