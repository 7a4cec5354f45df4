"""The kit's pytest entry: ``pytest --pyargs offpolicy.testing``.

Environment:
    OFFPOLICY_LOSS: ``module:function``, the loss to check (:data:`offpolicy.testing.LossFn`), or several
        separated by commas. Unset: the project's own :func:`offpolicy.policy_loss` in every weight mode x score
        centering x record kind, and each member of the correction family (:func:`offpolicy.testing.every_config`).
    OFFPOLICY_CONFIG: what the function claims, e.g. ``"weights=mis,bounds=0.5:5,sc=1,record=support"``
        (:meth:`offpolicy.testing.LossConfig.parse`). Unset: the function's ``offpolicy_config`` attribute
        (set by :func:`offpolicy.testing.with_config`).
    OFFPOLICY_MAX_EXAMPLES: hypothesis examples per invariant (default 40).

One test per (target, invariant); invariants that do not apply to the claimed configuration are skipped with
the reason.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest

from offpolicy.testing import INVARIANTS, LossConfig, every_config, project_loss, run_invariant


def _load(spec: str):
    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise ValueError(f"OFFPOLICY_LOSS must be 'module:function', got {spec!r}")
    try:
        module = importlib.import_module(mod_name)
    except ModuleNotFoundError:
        # `pytest` (unlike `python -m pytest`) does not put the working directory on the path.
        sys.path.insert(0, os.getcwd())
        module = importlib.import_module(mod_name)
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _targets() -> list[tuple[str, object, LossConfig]]:
    specs = [x.strip() for x in os.environ.get("OFFPOLICY_LOSS", "").split(",") if x.strip()]
    if not specs:
        return [(f"policy_loss[{cfg.short()}]", project_loss(cfg), cfg) for cfg in every_config()]
    text = os.environ.get("OFFPOLICY_CONFIG")
    out = []
    for spec in specs:
        fn = _load(spec)
        if text:
            cfg = LossConfig.parse(text)
        elif isinstance(getattr(fn, "offpolicy_config", None), LossConfig):
            cfg = fn.offpolicy_config
        else:
            raise ValueError(
                f"{spec}: say what it computes with OFFPOLICY_CONFIG (e.g. 'weights=mis,sc=1,record=support') or "
                "decorate it with offpolicy.testing.with_config(LossConfig(...))"
            )
        out.append((spec, fn, cfg))
    return out


TARGETS = _targets()


@pytest.mark.parametrize("invariant", list(INVARIANTS))
@pytest.mark.parametrize("target", TARGETS, ids=[t[0] for t in TARGETS])
def test_invariant(target, invariant: str) -> None:
    _, fn, cfg = target
    result = run_invariant(fn, cfg, invariant)
    if result.status == "skip":
        pytest.skip(result.detail)
    if result.status == "fail":
        pytest.fail(result.detail, pytrace=False)
