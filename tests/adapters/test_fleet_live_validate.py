"""offpolicy.adapters.fleet_live.validate: an engine group's answer checked on the trainer's side with the vLLM
adapter's own record checks (support records as the live engines return them), plus the fleet's own facts."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from offpolicy.adapters.common import RecordError, TurnRecord, csr_record
from offpolicy.adapters.fleet_live import ServedTurn
from offpolicy.adapters.fleet_live.validate import check_answer

CTX = (3, 4, 5)


def support_turn(version: int = 2) -> ServedTurn:
    """Two sampled tokens (7, 9) with their top-p supports {7, 8} and {9}, renormalised."""
    half = math.log(0.5)
    cands = csr_record([[7, 8], [9]], [[half, half], [0.0]])
    rec = TurnRecord(CTX, torch.tensor([7, 9]), torch.tensor([half, 0.0]), cands, 1.0, 0.9, None,
                     versions=(str(version),) * 2)
    return ServedTurn("s0", "g", version, rec)


def check(turn, **kw):
    args = {"newest_version": 3, "max_tokens": 4, "vocab_size": 16} | kw
    check_answer([turn], [("s0", list(CTX))], "g", **args)


def test_a_good_support_answer_passes():
    check(support_turn())


def with_cands(rows, values):
    t = support_turn()
    return dataclasses.replace(t, record=dataclasses.replace(t.record, candidates=csr_record(rows, values)))


@pytest.mark.parametrize("turn,message", [
    (with_cands([[7, 8], [9]], [[-0.1, -0.1], [0.0]]), "sums to probability"),
    (with_cands([[8], [9]], [[0.0], [0.0]]), "outside its support"),
    (with_cands([[7, 8]], [[math.log(0.5)] * 2]), "candidate record of 1 rows for 2 tokens"),
    (with_cands([[7, 80], [9]], [[math.log(0.5)] * 2, [0.0]]), "out of range for vocabulary size 16"),
    (with_cands([[7, 8], [9]], [[math.log(0.5), float("nan")], [0.0]]), "NaN log-probability"),
])
def test_bad_support_records_are_refused(turn, message):
    with pytest.raises(RecordError, match=message):
        check(turn)


def test_fleet_facts_are_checked():
    t = support_turn()
    with pytest.raises(RecordError, match="served version 2 is newer than the newest published \\(1\\)"):
        check(t, newest_version=1)
    with pytest.raises(RecordError, match="2 tokens, expected 1 to max_tokens=1"):
        check(t, max_tokens=1)
    with pytest.raises(RecordError, match="turn stamped with group 'h'"):
        check(dataclasses.replace(t, group="h"))
    with pytest.raises(RecordError, match="answered for sessions"):
        check_answer([t], [("s1", list(CTX))], "g", newest_version=3, max_tokens=4)
    with pytest.raises(RecordError, match="not a list of ServedTurn"):
        check_answer({"s0": t}, [("s0", list(CTX))], "g", newest_version=3, max_tokens=4)
    with pytest.raises(RecordError, match="served version -1 is not an integer >= 0"):
        check(dataclasses.replace(t, version=-1))
