"""``offpolicy.testing``: a property-based test kit for policy-gradient losses with off-policy corrections.

Point it at your own loss implementation through one adapter signature and a declared configuration::

    from offpolicy.testing import LossConfig, check_all

    def my_loss(logits, tokens, sampler_logprobs, candidates, advantages, temperature):
        ...  # call your framework's loss; return the per-token loss [N]

    check_all(my_loss, LossConfig(weights="mis", bounds=(0.5, 5.0), score_centering=True, record="support"))

or run ``OFFPOLICY_LOSS=mypkg.losses:my_loss OFFPOLICY_CONFIG="weights=mis,sc=1,record=support" pytest --pyargs
offpolicy.testing``. See :mod:`offpolicy.testing.invariants` for the invariants (the properties in
:mod:`~offpolicy.testing.properties`, their tolerances in :mod:`~offpolicy.testing.tolerances`, the runner in
:mod:`~offpolicy.testing.runner`) and :mod:`offpolicy.testing.strategies` for the hypothesis strategies (public,
reusable in your own tests).
Requires ``hypothesis`` (``pip install offpolicy[test]``).
"""

from offpolicy.testing import strategies
from offpolicy.testing.project import project_loss
from offpolicy.testing.harness import LossFn
from offpolicy.testing.invariants import INVARIANTS, Invariant
from offpolicy.testing.memory import LiveBytes
from offpolicy.testing.runner import (
    DEFAULT_MAX_EXAMPLES,
    CheckResult,
    InvariantViolation,
    Report,
    check_all,
    pytest_suite,
    run_invariant,
    with_config,
)
from offpolicy.testing.config import LossConfig, every_config, family_configs

__all__ = [
    "DEFAULT_MAX_EXAMPLES",
    "INVARIANTS",
    "CheckResult",
    "Invariant",
    "InvariantViolation",
    "LiveBytes",
    "LossConfig",
    "LossFn",
    "Report",
    "check_all",
    "every_config",
    "family_configs",
    "project_loss",
    "pytest_suite",
    "run_invariant",
    "strategies",
    "with_config",
]
