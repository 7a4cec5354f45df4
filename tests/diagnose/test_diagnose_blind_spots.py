"""Rules of diagnose's record checks that planted changes once slipped past the suite (issue 40 blind spots): the
position shift's direction and its "twice as often" margin (with and without candidates), and the relative part of
the sampled-vs-candidate tolerance. Records are built line by line, so each rule is hit at its edge."""

from __future__ import annotations

import pytest
import torch

from offpolicy.diagnose import TrainerScores, from_lines
from offpolicy.diagnose.record_checks import ENTRY_ATOL, ENTRY_RTOL, alignment, record_checks
from offpolicy.diagnose.semantics import shifted_logprobs

TOKENS = list(range(10, 22))  # 12 distinct tokens in one sequence


def _lq(i: int) -> float:
    return -0.1 * (i + 1)


def _rows(kinds: list[str]) -> tuple[list[list[int]], list[list[float]]]:
    """One head row per token: ``own`` holds the token itself at ``lq``; ``next`` / ``previous`` the neighbour at
    ``lq`` (its own token absent); ``none`` neither (an unrelated id at ``lq``)."""
    ids, lps = [], []
    for i, k in enumerate(kinds):
        at = {"own": TOKENS[i], "next": TOKENS[min(i + 1, len(TOKENS) - 1)], "previous": TOKENS[max(i - 1, 0)],
              "none": 40}[k]
        ids.append([at, 47])
        lps.append([_lq(i), -6.0])
    return ids, lps


def _record(kinds: list[str], lq=None):
    ids, lps = _rows(kinds)
    return from_lines([{"group": "g", "version": 0, "input_ids": [1], "tokens": TOKENS,
                        "sampler_logprobs": lq or [_lq(i) for i in range(len(TOKENS))], "temperature": 1.0,
                        "candidates": {"kind": "head", "ids": ids, "logprobs": lps}}])


@pytest.mark.parametrize("side", ["next", "previous"])
def test_position_shift_names_its_direction(side):
    """Rows that hold the next (previous) token's entry at lq are a shift *to the next (previous)* token."""
    kinds = [side] * len(TOKENS)
    kinds[-1 if side == "next" else 0] = "none"  # the edge row has no such neighbour
    f = alignment(_record(kinds))
    assert not f.ok and f.mistake == "position_shift"
    assert f"hold the {side} token" in f.message
    assert f.evidence[f"rows_matching_{side}_token"] == len(TOKENS) - 1
    other = "previous" if side == "next" else "next"
    assert f.evidence[f"rows_matching_{other}_token"] == 0


@pytest.mark.parametrize("own,neighbour,named", [(3, 6, False), (3, 7, True), (4, 7, False), (2, 5, True),
                                                  (0, 3, True), (0, 2, False)])
def test_position_shift_needs_twice_as_many_neighbour_matches(own, neighbour, named):
    """Named only when neighbour matches outnumber own matches more than twice over (and at least 3): exactly
    twice (3 vs 6) is not a shift, one more (3 vs 7) is."""
    kinds = ["own"] * own + ["next"] * neighbour
    kinds += ["none"] * (len(TOKENS) - len(kinds))
    f = alignment(_record(kinds))
    assert f.evidence["rows_matching_own_token"] == own and f.evidence["rows_matching_next_token"] == neighbour
    assert (not f.ok) == named, f.message
    assert (f.mistake == "position_shift") == named


@pytest.mark.parametrize("side", ["next", "previous"])
def test_shift_without_candidates_names_its_direction(side):
    """No candidates: lq at t equals the trainer's log-prob of the token at t + 1 (t - 1)."""
    lp = torch.tensor([_lq(i) for i in range(len(TOKENS))], dtype=torch.float64)
    lq = torch.roll(lp, -1 if side == "next" else 1)
    rec = from_lines([{"group": "g", "version": 0, "input_ids": [1], "tokens": TOKENS,
                       "sampler_logprobs": [float(v) - 1.0 for v in lq], "temperature": 1.0}])
    f = shifted_logprobs(rec, TrainerScores(lp - 1.0))
    assert not f.ok and f.mistake == "position_shift" and f"log-prob of the {side} token" in f.message
    assert f.evidence[f"median_abs_error_{side}"] < 1e-6


def _consistency(lq_value: float, gap: float):
    """Every row holds its own token at ``lq_value + gap`` while ``lq = lq_value``."""
    ids, lps = _rows(["own"] * len(TOKENS))
    lps = [[lq_value + gap, row[1]] for row in lps]
    rec = from_lines([{"group": "g", "version": 0, "input_ids": [1], "tokens": TOKENS,
                       "sampler_logprobs": [lq_value] * len(TOKENS), "temperature": 1.0,
                       "candidates": {"kind": "head", "ids": ids, "logprobs": lps}}])
    return next(f for f in record_checks(rec) if f.check == "consistency")


def test_sampled_candidate_tolerance_has_a_relative_part():
    """``|entry - lq| <= 1e-3 + 1e-3 |lq|``: at lq = -20 a gap of 0.015 is within (absolute part alone: 1e-3, it
    would not be), 0.03 is not; at lq = -0.1 a gap of 0.0015 is already out."""
    assert ENTRY_ATOL == 1e-3 and ENTRY_RTOL == 1e-3
    assert _consistency(-20.0, 0.015).ok
    assert _consistency(-20.0, -0.015).ok
    bad = _consistency(-20.0, 0.03)
    assert not bad.ok and bad.mistake == "sampled_candidate_mismatch"
    assert not _consistency(-0.1, 0.0015).ok
    assert _consistency(-0.1, 0.0009).ok
