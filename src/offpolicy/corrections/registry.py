"""What the node classes declare, gathered: the keyword API, the kit's matrix and the spec's table derive from here.

Each node class (:mod:`~offpolicy.corrections.weighting`, :mod:`~offpolicy.corrections.rules`,
:mod:`~offpolicy.corrections.surrogates`, :mod:`~offpolicy.corrections.normalisation`,
:mod:`~offpolicy.corrections.tree`, ...) declares once its ``keywords``
(:class:`~offpolicy.corrections.node.Keyword`), the ``inputs`` it reads, its traits (``table_traits``) and, where
the kit can feed it, an ``example``. From those:

* :data:`WEIGHT_MODES`, :data:`LEVELS`, :data:`NORMALISATIONS`: the names ``Correction(weights=..., level=...,
  batch_normalize=...)`` picks a class by;
* :data:`KEYWORDS`: every node keyword -> ``(class, Keyword)``, from which :class:`~offpolicy.Correction` builds its
  extra fields, checks their types, builds the nodes and reads them back (``from_tree``);
  :data:`SURROGATE_KEYWORDS` and :data:`RULE_KEYWORDS` are its selecting keywords by kind;
* :func:`correction_table`: the rows of docs/spec.md#correction-table (a test compares them with the spec).

The float64 oracle (:mod:`offpolicy.reference`) reads none of this.
"""

from __future__ import annotations

from offpolicy.corrections.kl_penalty import KLPenalty
from offpolicy.corrections.node import Keyword
from offpolicy.corrections.normalisation import NORMALISATION_CLASSES
from offpolicy.corrections.rules import RULE_CLASSES
from offpolicy.corrections.surrogates import SURROGATE_CLASSES
from offpolicy.corrections.tree import CorrectionTree, ScoreCentering
from offpolicy.corrections.trust_region import TrustRegion
from offpolicy.corrections.weighting import LEVEL_CLASSES, MODE_CLASSES, Weighting

#: ``Correction(weights=...)`` -> weight mode class.
WEIGHT_MODES: dict[str, type] = {c.name: c for c in MODE_CLASSES}
#: ``Correction(level=...)`` and ``RatioRejection(level=...)`` -> level class.
LEVELS: dict[str, type] = {c.name: c for c in LEVEL_CLASSES}
#: ``Correction(batch_normalize=...)`` (a string) -> normalisation class (``True`` means ``"tokens"``).
NORMALISATIONS: dict[str, type] = {c.name: c for c in NORMALISATION_CLASSES}

#: Every node class, in the order of docs/spec.md#correction-table.
NODE_CLASSES: tuple[type, ...] = (Weighting, *MODE_CLASSES, *LEVEL_CLASSES, *RULE_CLASSES, *SURROGATE_CLASSES,
                                  *NORMALISATION_CLASSES, ScoreCentering, TrustRegion, KLPenalty, CorrectionTree)


def declared(cls: type, attr: str, default=None):
    """``cls``'s own declaration of ``attr`` (not one inherited from a base class)."""
    return cls.__dict__.get(attr, default)


#: Every keyword a node class declares -> ``(class, Keyword)``, in node order.
KEYWORDS: dict[str, tuple[type, Keyword]] = {k.name: (cls, k) for cls in NODE_CLASSES
                                             for k in declared(cls, "keywords", ())}
#: The selecting keyword of each surrogate class that has one -> class (at most one may be set).
SURROGATE_KEYWORDS: dict[str, type] = {name: cls for name, (cls, k) in KEYWORDS.items()
                                       if cls in SURROGATE_CLASSES and k.role == "select"}
#: The selecting keyword of each rule class that has one -> class.
RULE_KEYWORDS: dict[str, type] = {name: cls for name, (cls, k) in KEYWORDS.items()
                                  if cls in RULE_CLASSES and k.role == "select"}


def selector(cls: type) -> Keyword | None:
    """The keyword that selects ``cls`` (None where no keyword does)."""
    return next((k for k in declared(cls, "keywords", ()) if k.role == "select"), None)


def correction_table() -> list[str]:
    """The lines of docs/spec.md#correction-table, header included, from the node classes' declarations."""
    lines = ["| node | module | keyword form | traits |", "|---|---|---|---|"]
    for cls in NODE_CLASSES:
        kws = declared(cls, "keywords", ())
        form = ", ".join(k.form() for k in kws) if kws else declared(cls, "table_form")
        module = cls.__module__.rsplit(".", 1)[-1] + ".py"
        cells = (f"`{cls.__name__}`", f"`{module}`", form, declared(cls, "table_traits"))
        lines.append("|" + "|".join(f" {c} " if c else " " for c in cells) + "|")
    return lines


__all__ = ["KEYWORDS", "LEVELS", "NODE_CLASSES", "NORMALISATIONS", "RULE_KEYWORDS", "SURROGATE_KEYWORDS",
           "WEIGHT_MODES", "correction_table", "declared", "selector"]
