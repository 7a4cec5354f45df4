"""The KL-to-reference penalty node (docs/spec.md#kl-penalty); its per-token terms are
:func:`offpolicy.loss.penalty.kl_penalty_terms`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from offpolicy.corrections.node import Keyword, finite
from offpolicy.corrections.rules import ESTIMATORS, estimator_names


@dataclass(frozen=True)
class KLPenalty:
    """A KL-to-reference penalty ``coef * k_t`` on every trained token (docs/spec.md#kl-penalty).

    ``k_t`` estimates ``KL(p || p_ref)`` on tokens drawn from ``p`` at ``rho = p_ref / p``: ``k1 = -log rho``,
    ``k2 = (log rho)^2 / 2``, ``k3 = rho - 1 - log rho`` (Schulman). ``importance_weighted=True`` multiplies it by
    the ratio ``p / pi_old`` (``pi_old`` = ``proximal_logprobs`` when given, else the sampler's), differentiable as
    in DeepSeek-V3.2, TRL's ``use_bias_correction_kl`` and slime's ``--use-unbiased-kl``: its gradient is then the
    unbiased gradient of the reverse KL on tokens drawn from ``pi_old``.
    """

    keywords: ClassVar[tuple[Keyword, ...]] = ()
    table_form: ClassVar[str] = '`kl_penalty=`'
    inputs: ClassVar[tuple[str, ...]] = ('reference_logprobs',)
    table_traits: ClassVar[str] = 'needs `reference_logprobs`'

    coef: float
    estimator: str = "k3"
    importance_weighted: bool = False
    anchor: ClassVar[str] = "docs/spec.md#kl-penalty"
    source: ClassVar[str] = ("KL to a reference model (Schulman's estimators); importance-weighted: DeepSeek-V3.2, "
                             "TRL use_bias_correction_kl, slime --use-unbiased-kl")

    def __post_init__(self) -> None:
        if not (finite(self.coef) and self.coef >= 0):
            raise ValueError(f"KLPenalty.coef must be a finite number >= 0, got {self.coef!r}")
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"KLPenalty.estimator must be one of {estimator_names()}, got {self.estimator!r}")
        if not isinstance(self.importance_weighted, bool):
            raise TypeError(f"KLPenalty.importance_weighted must be a bool, got {self.importance_weighted!r}")
