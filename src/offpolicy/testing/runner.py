"""Running the invariants against a loss function: :func:`run_invariant`, :func:`check_all` (a
:class:`Report`), :func:`pytest_suite` and :func:`with_config`.
"""

from __future__ import annotations

import inspect
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from hypothesis import HealthCheck, Phase, Verbosity, given, settings

from offpolicy.loss.aggregation import SEQUENCE_AGGREGATIONS
from offpolicy.testing.config import LossConfig
from offpolicy.testing.harness import LossFn, _Fail
from offpolicy.testing.invariants import INVARIANTS, Invariant


#: Hypothesis examples per invariant unless told otherwise.
DEFAULT_MAX_EXAMPLES = 40


class InvariantViolation(AssertionError):
    """Raised by :func:`check_all` (and the pytest entries): names the invariant, the configuration, what failed
    and the shrunk example."""


@dataclass
class CheckResult:
    """The outcome of one invariant: ``status`` is ``"pass"``, ``"fail"`` or ``"skip"`` (not applicable)."""

    invariant: str
    status: str
    detail: str = ""
    examples: int = 0
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.status != "fail"


@dataclass
class Report:
    """All invariants' outcomes for one function and configuration."""

    target: str
    config: LossConfig
    results: list[CheckResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    @property
    def failed(self) -> list[str]:
        """Names of the violated invariants."""
        return [r.invariant for r in self.results if r.status == "fail"]

    def __getitem__(self, name: str) -> CheckResult:
        for r in self.results:
            if r.invariant == name:
                return r
        raise KeyError(name)

    def __str__(self) -> str:
        head = f"offpolicy.testing report for {self.target}\n  {self.config.describe()}"
        lines = [head]
        for r in self.results:
            inv = INVARIANTS[r.invariant]
            tag = {"pass": "PASS", "fail": "FAIL", "skip": "skip"}[r.status]
            extra = {"pass": f"  ({r.examples} examples, {r.seconds:.1f} s)", "fail": f"  ({r.seconds:.1f} s)",
                     "skip": f"  {r.detail}"}[r.status]
            lines.append(f"  {tag}  {r.invariant:<18} {inv.summary} [{inv.spec}]{extra}")
        for r in self.results:
            if r.status == "fail":
                lines.append("")
                lines.append(r.detail)
        return "\n".join(lines)


def _keywords(fn: Callable) -> set[str]:
    """The optional keywords (``loss_mask``, ``seq_ids``, ``proximal_logprobs``, ``versions``,
    ``current_version``, ``route_flips``) a loss function takes (all of them with ``**kwargs``)."""
    optional = {"loss_mask", "seq_ids", "proximal_logprobs", "versions", "current_version", "route_flips"}
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or extension callable: pass only the six positional arguments
        return set()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return optional
    return optional & {p.name for p in params if p.kind is not inspect.Parameter.POSITIONAL_ONLY}


def _target_name(fn: Callable) -> str:
    mod = getattr(fn, "__module__", None) or "?"
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return f"{mod}.{name}"


def run_invariant(
    fn: LossFn,
    config: LossConfig,
    invariant: str,
    *,
    max_examples: int | None = None,
    derandomize: bool = True,
    shrink: bool = True,
) -> CheckResult:
    """Check one invariant; never raises for a violation (see :class:`CheckResult`).

    Args:
        fn: the loss function (:data:`LossFn`).
        config: what it claims.
        invariant: a key of :data:`INVARIANTS`.
        max_examples: hypothesis examples (default :data:`DEFAULT_MAX_EXAMPLES`, or the
            ``OFFPOLICY_MAX_EXAMPLES`` environment variable).
        derandomize: a fixed example sequence (reproducible CI); False explores new examples on each run.
        shrink: shrink a failing example to a minimal one (False reports the first failing example as found:
            faster, less readable).
    """
    if invariant not in INVARIANTS:
        raise KeyError(f"unknown invariant {invariant!r}; expected one of {list(INVARIANTS)}")
    inv = INVARIANTS[invariant]
    takes = _keywords(fn)
    if config.needs_sequences and "seq_ids" not in takes:
        what = (f"level={config.level!r}" if config.level != "token" else
                f"aggregation={config.aggregation!r}" if config.aggregation in SEQUENCE_AGGREGATIONS else
                "a sequence-wise rule, normalisation or surrogate")
        raise ValueError(f"LossConfig({what}) works on packed sequences: the loss function {_target_name(fn)} must "
                         "take a seq_ids keyword ([N] int64 packed sequence ids)")
    for needed, keywords, what in ((config.needs_versions, ("versions", "current_version"),
                                    "a staleness rejection needs each token's policy version"),
                                   (config.needs_route_flips, ("route_flips",),
                                    "a route-flip rejection needs each token's MoE route-flip count")):
        if needed and not set(keywords) <= takes:
            raise ValueError(f"LossConfig: {what}: the loss function {_target_name(fn)} must take "
                             f"{' and '.join(keywords)} keywords ([N] int64{', and an int' * (len(keywords) > 1)})")
    if config.needs_proximal and "proximal_logprobs" not in takes:
        raise ValueError(f"LossConfig(surrogate {config.surrogate!r}) needs the proximal policy's log-probabilities: "
                         f"the loss function {_target_name(fn)} must take a proximal_logprobs keyword ([N] float)")
    reason = inv.applies(config)
    missing = [k for k in inv.needs if k not in takes]
    if reason is None and missing:
        reason = f"not applicable: the function takes no {' / '.join(missing)} keyword"
    if reason is not None:
        return CheckResult(invariant, "skip", reason)
    if max_examples is None:
        max_examples = int(os.environ.get("OFFPOLICY_MAX_EXAMPLES", DEFAULT_MAX_EXAMPLES))
    evaluated = [0]

    def body(case) -> None:
        inv.prop(fn, config, case)
        evaluated[0] += 1

    test = settings(
        max_examples=max_examples, deadline=None, database=None, derandomize=derandomize,
        suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet, report_multiple_bugs=False,
        phases=[Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else []),
    )(given(inv.strategy(config))(body))
    start = time.perf_counter()
    # The examples are tiny: intra-op parallelism only adds thread wake-ups (on a busy 2-core machine a
    # [5, 10] log-softmax took 30 ms with 2 threads and 2 us with 1), so check single-threaded.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        test()
    except _Fail as f:
        return CheckResult(invariant, "fail", _message(fn, config, inv, f), evaluated[0],
                           time.perf_counter() - start)
    except Exception as exc:  # hypothesis itself gave up (flaky function, unsatisfiable strategy, ...)
        return CheckResult(invariant, "fail", _message(fn, config, inv, _Fail(
            f"the check could not complete: {type(exc).__name__}: {exc}", "(no example)")), evaluated[0],
            time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    if evaluated[0] == 0:
        return CheckResult(invariant, "fail", _message(fn, config, inv, _Fail(
            "no example could be evaluated (every generated case was rejected)", "(no example)")), 0,
            time.perf_counter() - start)
    return CheckResult(invariant, "pass", "", evaluated[0], time.perf_counter() - start)


def _message(fn: Callable, cfg: LossConfig, inv: Invariant, f: _Fail) -> str:
    example = "\n".join("    " + line for line in f.example.splitlines())
    return (f"invariant '{inv.name}' violated ({inv.spec}: {inv.summary})\n"
            f"  function:      {_target_name(fn)}\n"
            f"  configuration: {cfg.describe()}\n"
            f"  what failed:   {f.what}\n"
            f"  shrunk example:\n{example}")


def check_all(
    fn: LossFn,
    config: LossConfig,
    invariants: Iterable[str] | None = None,
    *,
    max_examples: int | None = None,
    derandomize: bool = True,
    shrink: bool = True,
    raise_on_failure: bool = True,
) -> Report:
    """Check every applicable invariant (or those named) and return the :class:`Report`.

    With ``raise_on_failure`` (the default, for a one-line test) a violation raises
    :class:`InvariantViolation` whose message is the whole report.
    """
    names = list(INVARIANTS) if invariants is None else list(invariants)
    report = Report(_target_name(fn), config)
    for name in names:
        report.results.append(run_invariant(fn, config, name, max_examples=max_examples, derandomize=derandomize,
                                           shrink=shrink))
    if raise_on_failure and not report.passed:
        raise InvariantViolation(str(report))
    return report


def pytest_suite(fn: LossFn, config: LossConfig, name: str | None = None) -> type:
    """A pytest test class with one test per invariant (skipped where not applicable)::

        TestMyLoss = offpolicy.testing.pytest_suite(my_loss, LossConfig(weights="mis", score_centering=True,
                                                                         record="support"))
    """
    import pytest

    def make(inv_name: str):
        def test(self) -> None:
            result = run_invariant(fn, config, inv_name)
            if result.status == "skip":
                pytest.skip(result.detail)
            if result.status == "fail":
                pytest.fail(result.detail, pytrace=False)

        test.__name__ = f"test_{inv_name}"
        return test

    attrs = {f"test_{n}": make(n) for n in INVARIANTS}
    return type(name or "TestOffpolicyInvariants", (), attrs)


def with_config(config: LossConfig) -> Callable[[LossFn], LossFn]:
    """Decorator attaching the claimed configuration to a loss function (read by the pytest entry when
    ``OFFPOLICY_LOSS`` points at the function and ``OFFPOLICY_CONFIG`` is unset)."""

    def attach(fn: LossFn) -> LossFn:
        fn.offpolicy_config = config
        return fn

    return attach
