"""Names of the keyword API (:class:`~offpolicy.Correction`) -> node classes.

The nodes themselves (:mod:`~offpolicy.corrections.weighting`, :mod:`~offpolicy.corrections.rules`,
:mod:`~offpolicy.corrections.surrogates`, :mod:`~offpolicy.corrections.normalisation`,
:mod:`~offpolicy.corrections.tree`) hold the fast functions, traits, jumps, anchors and sources; these maps only let
``Correction(weights="mis", level="geometric", batch_normalize="sequences")`` pick a class by its name, and let
error messages and the test kit's configuration matrix list the names (the KL estimators' and KL levels' names
are :data:`offpolicy.corrections.rules.ESTIMATORS` and :data:`~offpolicy.corrections.rules.KL_LEVELS`). The float64 oracle
(:mod:`offpolicy.reference`) reads none of this.
"""

from __future__ import annotations

from offpolicy.corrections.normalisation import NORMALISATION_CLASSES
from offpolicy.corrections.weighting import LEVEL_CLASSES, MODE_CLASSES

#: ``Correction(weights=...)`` -> weight mode class.
WEIGHT_MODES: dict[str, type] = {c.name: c for c in MODE_CLASSES}
#: ``Correction(level=...)`` and ``RatioRejection(level=...)`` -> level class.
LEVELS: dict[str, type] = {c.name: c for c in LEVEL_CLASSES}
#: ``Correction(batch_normalize=...)`` (a string) -> normalisation class (``True`` means ``"tokens"``).
NORMALISATIONS: dict[str, type] = {c.name: c for c in NORMALISATION_CLASSES}

__all__ = ["LEVELS", "NORMALISATIONS", "WEIGHT_MODES"]
