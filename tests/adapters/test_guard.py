"""offpolicy.adapters.guard: when it checks, what fires, that each finding warns once (the trainers' own runs are in
tests/adapters/test_trl.py and test_verl_cases.py)."""

import logging
import warnings

import pytest
import torch

from offpolicy.adapters.guard import Guard, GuardWarning, Suspect, mismatch_stats


def _batch(offset, n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    lq = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    mask = torch.rand(n, generator=g) < 0.8
    return lq + offset, lq, mask


def test_mismatch_stats_against_a_direct_computation():
    lp, lq, mask = _batch(0.0)
    lp = lp + torch.linspace(-0.2, 0.1, lp.numel(), dtype=torch.float64)
    d = (lp - lq)[mask]
    got = mismatch_stats(lp.float(), lq.float(), mask)
    assert got["tokens"] == float(mask.sum())
    assert got["k1"] == pytest.approx(float(-d.mean()), abs=1e-6)
    assert got["abs_log_ratio_mean"] == pytest.approx(float(d.abs().mean()), abs=1e-6)
    assert got["abs_log_ratio_max"] == pytest.approx(float(d.abs().max()), abs=1e-6)


def test_schedule_first_batches_then_one_in_every():
    guard = Guard([], first_batches=2, every=3)
    checked = []
    for _ in range(9):
        checked.append(guard.due())
        guard.observe(*_batch(0.0))
    assert checked == [True, True, False, False, True, False, False, True, False]


def test_each_finding_warns_once_through_warnings_logging_and_metrics(caplog):
    always = Suspect("sampler_temperature", "cause words", "fix words")
    measured = Suspect("compute_dtype", "dtype words", "dtype fix", min_abs_log_ratio_max=1e-3)
    guard = Guard([always, measured], first_batches=3)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING, logger="offpolicy"):
        warnings.simplefilter("always")
        assert guard.observe(*_batch(1e-5)) == {"guard/sampler_temperature": 1.0}  # below the dtype threshold
        assert guard.observe(*_batch(2e-3)) == {"guard/sampler_temperature": 1.0, "guard/compute_dtype": 1.0}
        assert guard.observe(*_batch(2e-3)) == {"guard/sampler_temperature": 1.0, "guard/compute_dtype": 1.0}
    messages = [str(w.message) for w in caught if issubclass(w.category, GuardWarning)]
    assert len(messages) == 2 and len(caplog.records) == 2
    assert messages[0].startswith("offpolicy guard [sampler_temperature]: cause words.") and "Fix: fix words" in \
        messages[0]
    assert "[compute_dtype]" in messages[1] and "max 2.00e-03" in messages[1]


def test_unexplained_mismatch_only_on_synced_batches_with_nothing_else_firing():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert Guard([]).observe(*_batch(0.05), synced=False) == {}  # drift after an optimizer step: expected
        assert Guard([]).observe(*_batch(1e-3)) == {}  # numerics
        assert Guard([]).observe(*_batch(0.05)) == {"guard/unexplained_mismatch": 1.0}
        assert Guard([Suspect("x", "c", "f")]).observe(*_batch(0.05)) == {"guard/x": 1.0}
    assert [str(w.message).split("]")[0] for w in caught] == ["offpolicy guard [unexplained_mismatch",
                                                             "offpolicy guard [x"]


def test_bad_schedule_is_named():
    with pytest.raises(ValueError, match="first_batches must be >= 0 and every >= 1"):
        Guard([], every=0)
