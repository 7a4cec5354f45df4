"""offpolicy.adapters.guard: when it checks, what fires, that each finding warns once (the trainers' own runs are in
tests/adapters/test_trl.py and test_verl_cases.py)."""

import logging
import warnings

import pytest
import torch

from offpolicy.adapters.guard import (
    NARROWER_MEAN, NARROWER_MIN_TOKENS, ZERO_MIN_TOKENS, Guard, GuardWarning, Suspect, check_sampler_logprobs,
    mismatch_stats,
)


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


def test_checks_run_on_every_batch_by_default():
    """The guards' checks are O(N): every batch is checked, so a mistake that starts at batch 60 is named there
    (it used to wait for the one-in-50 sample)."""
    guard = Guard([Suspect("x", "c", "f", min_abs_log_ratio_max=0.5)])
    flagged = []
    for i in range(60):
        offset = 1.0 if i == 59 else 0.0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            flagged.append(bool(guard.observe(*_batch(offset))))
    assert flagged == [False] * 59 + [True] and len(caught) == 1 and "batch 60" in str(caught[0].message)


class _SyncCounter:
    """Counts host reads of tensor values (``tolist``, ``item``, ``float``, ``int``, ``bool``)."""

    NAMES = ("tolist", "item", "__float__", "__int__", "__bool__")

    def __init__(self, monkeypatch):
        self.count = 0
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)

            def counted(t, *a, _original=original, **k):
                self.count += 1
                return _original(t, *a, **k)
            monkeypatch.setattr(torch.Tensor, name, counted)


def test_each_check_reads_back_once(monkeypatch):
    """Cheap enough for every batch: one host synchronisation per call, whatever fires."""
    lp, lq, mask = _batch(0.0, n=256)
    counter = _SyncCounter(monkeypatch)
    Guard([]).observe(lp.float(), lq.float(), mask)
    assert counter.count == 1
    counter.count = 0
    check_sampler_logprobs(Guard([]), lq.float(), mask, name="lq", trainer_logprobs=lp.float())
    assert counter.count == 1
    counter.count = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_sampler_logprobs(Guard([]), torch.zeros(256), mask, name="lq")
    assert counter.count == 1


def test_a_suspect_fires_at_exactly_its_threshold_and_unexplained_strictly_above():
    """min_abs_log_ratio_max is reached when the measured maximum equals it (exact binary fractions)."""
    lq = torch.full((8,), -0.5, dtype=torch.float64)
    mask = torch.ones(8, dtype=torch.bool)
    step = 2.0 ** -10
    at = Suspect("at", "c", "f", min_abs_log_ratio_max=step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert Guard([at]).observe(lq + step, lq, mask) == {"guard/at": 1.0}
        assert Guard([at]).observe(lq + step / 2, lq, mask, synced=False) == {}
        # unexplained_mismatch: strictly above its mean
        assert Guard([], unexplained_abs_mean=step).observe(lq + step, lq, mask) == {}
        assert Guard([], unexplained_abs_mean=step).observe(lq + 2 * step, lq, mask) == {
            "guard/unexplained_mismatch": 1.0}


def _narrower(n):
    """``n`` trained tokens with ``lq - log p = NARROWER_MEAN * 2`` on every one (a top-p sampler's shape)."""
    lp = torch.full((n,), -1.0, dtype=torch.float64)
    return lp + 2 * NARROWER_MEAN, lp, torch.ones(n, dtype=torch.bool)


def test_narrower_sampler_from_exactly_its_minimum_token_count():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lq, lp, mask = _narrower(NARROWER_MIN_TOKENS - 1)
        assert check_sampler_logprobs(Guard([]), lq, mask, name="lq", trainer_logprobs=lp) == {}
        lq, lp, mask = _narrower(NARROWER_MIN_TOKENS)
        assert check_sampler_logprobs(Guard([]), lq, mask, name="lq", trainer_logprobs=lp) == {
            "guard/narrower_sampler": 1.0}


def test_zero_sampler_logprobs_need_a_run_of_tokens():
    """An honest lq of 0 (a token the sampler was sure of) on a one-token batch is no finding; ZERO_MIN_TOKENS
    trained tokens in a row at exactly 0, in one batch or across calls, are (the threshold itself fires)."""
    one = torch.ones(1, dtype=torch.bool)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert check_sampler_logprobs(Guard([]), torch.zeros(1), one, name="lq") == {}
        full = torch.ones(ZERO_MIN_TOKENS - 1, dtype=torch.bool)
        assert check_sampler_logprobs(Guard([]), torch.zeros(ZERO_MIN_TOKENS - 1), full, name="lq") == {}
        assert caught == []
        full = torch.ones(ZERO_MIN_TOKENS, dtype=torch.bool)
        assert check_sampler_logprobs(Guard([]), torch.zeros(ZERO_MIN_TOKENS), full, name="lq") == {
            "guard/sampler_logprobs_zero": 1.0}
        guard = Guard([])  # across calls: a run of one-token batches; a non-zero token resets the count
        got = [check_sampler_logprobs(guard, torch.tensor([v]), one, name="lq")
               for v in [0.0] * (ZERO_MIN_TOKENS - 1) + [-0.1] + [0.0] * ZERO_MIN_TOKENS]
        assert [bool(g) for g in got] == [False] * ZERO_MIN_TOKENS + [False] * (ZERO_MIN_TOKENS - 1) + [True]
    assert sum("[sampler_logprobs_zero]" in str(w.message) for w in caught) == 2  # one per guard


def test_nan_or_positive_sampler_logprobs_are_errors():
    mask = torch.ones(4, dtype=torch.bool)
    with pytest.raises(ValueError, match="lq must be the sampler's log-probabilities.*NaN"):
        check_sampler_logprobs(Guard([]), torch.tensor([-1.0, float("nan"), -2.0, -0.5]), mask, name="lq")
    with pytest.raises(ValueError, match="lq must be the sampler's log-probabilities.*0.5"):
        check_sampler_logprobs(Guard([]), torch.tensor([-1.0, 0.5, -2.0, -0.5]), mask, name="lq")
    # untrained positions are not read
    assert check_sampler_logprobs(Guard([]), torch.tensor([-1.0, 0.5, -2.0, float("nan")]),
                                  torch.tensor([True, False, True, False]), name="lq") == {}
