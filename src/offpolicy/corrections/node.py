"""What every correction node shares: the error that names its argument, the jump points it reports to the test
kit, and the number checks of the nodes' ``__post_init__``.

A node is a frozen dataclass (:mod:`~offpolicy.corrections.weighting`, :mod:`~offpolicy.corrections.rules`,
:mod:`~offpolicy.corrections.surrogates`, :mod:`~offpolicy.corrections.normalisation`,
:mod:`~offpolicy.corrections.tree`) that validates its own arguments, carries its fast torch function, its traits as
class attributes, its spec ``anchor`` and published ``source``, and ``jumps()``: where its output is discontinuous.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple


class NodeError(ValueError):
    """A node's argument is invalid: ``"{node}.{arg} {reason}"``. The keyword constructor
    (:class:`~offpolicy.Correction`) re-raises it naming its own keyword."""

    def __init__(self, node: str, arg: str, reason: str) -> None:
        super().__init__(f"{node}.{arg} {reason}")
        self.node, self.arg, self.reason = node, arg, reason


class Jump(NamedTuple):
    """Values of a per-token or per-sequence statistic at which a node's output jumps (the test kit keeps its
    examples off them: rounding alone may put a value on either side).

    Attributes:
        quantity: which statistic (all from detached float64 log-probabilities, on trained tokens):
            ``"log_r"``: the log-ratio the weights act on (``log pi_prox - lq`` under a proximal policy, else
            ``log p - lq``); ``"kl"``: ``detail``'s KL estimator of the clamped ``log_r``; ``"neg_log_p_ratio"``:
            ``lq - log p`` of the current policy; ``"log_u"``: ``log p - log pi_prox``.
        at: the jump points.
        level: how tokens are reduced per sequence before comparing: ``"token"`` (none), ``"sequence"`` / ``"sum"``
            (sum), ``"geometric"`` / ``"mean"`` (mean), ``"max"``, ``"min"``, ``"segment"`` (sum per segment).
        detail: the estimator's name for ``"kl"``.
    """

    quantity: str
    at: tuple[float, ...]
    level: str = "token"
    detail: str | None = None


def log_bound(x: float) -> float:
    """``log x`` of a ratio bound, ``-inf`` for 0 (an open lower end)."""
    return math.log(x) if x > 0 else -math.inf


def real(x: object) -> bool:
    """A real number that is not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def finite(x: object) -> bool:
    """A finite real number that is not a bool."""
    return real(x) and math.isfinite(x)


def check(node: str, arg: str, ok: bool, expected: str, value: object) -> None:
    """Raise :class:`NodeError` ``"{node}.{arg} must be {expected}, got {value!r}"`` unless ``ok``."""
    if not ok:
        raise NodeError(node, arg, f"must be {expected}, got {value!r}")
