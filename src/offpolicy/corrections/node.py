"""What every correction node shares: the error that names its argument, the jump points it reports to the test
kit, and the number checks of the nodes' ``__post_init__``.

A node is a frozen dataclass (:mod:`~offpolicy.corrections.weighting`, :mod:`~offpolicy.corrections.rules`,
:mod:`~offpolicy.corrections.surrogates`, :mod:`~offpolicy.corrections.normalisation`,
:mod:`~offpolicy.corrections.tree`) that validates its own arguments, carries its fast torch function, its traits as
class attributes, its spec ``anchor`` and published ``source``, and ``jumps()``: where its output is discontinuous.
It also declares, once, how it is reached and what it reads: ``keywords`` (the :class:`Keyword` s of
:class:`~offpolicy.Correction` that build it), ``inputs`` (the loss inputs it needs beyond the log-probabilities,
sampler log-probabilities and advantages), ``table_traits`` (the traits column of docs/spec.md#correction-table)
and ``example`` (the keywords of one configuration the test kit runs). :mod:`~offpolicy.corrections.registry`
derives the keyword API, its validation, the kit's matrix and the spec's table from these declarations.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple, Protocol

from torch import Tensor


class NodeError(ValueError):
    """A node's argument is invalid: ``"{node}.{arg} {reason}"``. The keyword constructor
    (:class:`~offpolicy.Correction`) re-raises it naming its own keyword."""

    def __init__(self, node: str, arg: str, reason: str) -> None:
        super().__init__(f"{node}.{arg} {reason}")
        self.node, self.arg, self.reason = node, arg, reason


class Reductions(Protocol):
    """The per-sequence reductions a node reads (``seg`` in the nodes' functions). The loss pipeline hands in
    :class:`offpolicy.loss.segments.Segments`; the corrections declare only this protocol, so that they import
    nothing from the loss layer above them.

    Attributes:
        index: ``[N]`` int64 sequence index of each token; ``num``: the number of sequences; ``active``: ``[N]`` bool,
        the tokens that count; ``group``: the context-parallel process group, or None.
    """

    index: Tensor
    num: int
    active: Tensor
    group: Any

    def sum(self, x: Tensor) -> Tensor: ...  # ``[num]`` per-sequence sum over active tokens

    def mean(self, x: Tensor) -> Tensor: ...  # ``[num]``

    def max(self, x: Tensor) -> Tensor: ...  # ``[num]``

    def min(self, x: Tensor) -> Tensor: ...  # ``[num]``

    def partial_sum(self, x: Tensor) -> Tensor: ...  # ``[num]``, this rank's share, differentiable

    def broadcast(self, per_seq: Tensor) -> Tensor: ...  # ``[N]``


class Keyword(NamedTuple):
    """One keyword of :class:`~offpolicy.Correction` that a node class declares.

    Attributes:
        name: the keyword (``"sapo"``, ``"veto"``).
        args: the node's constructor arguments it fills, in order: a ``"pair"`` / ``"four"`` value is spread over
            them, a ``"number"`` / ``"string"`` / ``"int"`` value fills the one named.
        kind: ``"pair" | "four" | "number" | "int" | "string"``: the value's type, checked by the keyword API,
            parsed by the kit's ``OFFPOLICY_CONFIG``.
        default: the keyword's default (None: the node is off).
        role: ``"select"``: setting it selects the node (at most one surrogate may be selected);
            ``"modifier"``: it sets an argument of a node another keyword selects (``dual_clip`` of ``ppo_clip``).
        doc: the keyword form in the spec's table when not the plain ``name=``.
        choices: the values a ``"string"`` keyword takes (checked before the node is built).
        alt_args: a second spelling of a ``"pair"`` keyword: a value of this many numbers fills these arguments
            instead (a peer's order, verl's ``(clip_cov_ratio, clip_cov_lb, clip_cov_ub)``); the arguments not in
            ``args`` belong to single-argument keywords of the same node, which :class:`~offpolicy.Correction` sets
            from it, so that both spellings give the same (equal) correction.
    """

    name: str
    args: tuple[str, ...]
    kind: str = "number"
    default: object = None
    role: str = "select"
    doc: str = ""
    choices: tuple[str, ...] = ()
    alt_args: tuple[str, ...] = ()

    def form(self) -> str:
        """The keyword as the spec's table writes it."""
        return self.doc or f"`{self.name}=`"


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
