"""Records never let malformed indices reach memory (issue 40).

Offsets that start at 0 and end at ``nnz`` but go up and down (``[0, 1, 2**40, 3, 4, 5, 6]``) were accepted by
``CSRCandidates``; ``row_index()`` then called ``torch.repeat_interleave(..., output_size=nnz)``, whose CPU kernel
wrote past its buffer (SIGSEGV or a glibc abort) through ``row_index``, ``take_rows``, ``policy_loss(...,
validate=False)`` and a compiled ``policy_loss``; ``cat`` carried the offsets on. Now the offsets are checked
where a record is built and ``row_index`` / ``take_rows`` are memory-safe on any record, even one whose offsets
were changed in place afterwards. The paths that crashed run in a child process, so a regression is a failed test
with the child's exit status, not a dead test run.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import offpolicy as op

BAD_OFFSETS = [
    ([0, 1, 2**40, 3, 4, 5, 6], r"non-decreasing; offsets\[3\] < offsets\[2\]"),
    ([0, 1, -3, 3, 4, 5, 6], r"non-decreasing; offsets\[2\] < offsets\[1\]"),
    ([0, 4, 3, 2, 4, 5, 6], r"non-decreasing; offsets\[2\] < offsets\[1\]"),
    ([1, 1, 2, 3, 4, 5, 6], "must start at 0 and end at nnz = 6, got 1 and 6"),
    ([0, 1, 2, 3, 4, 5, 2**40], "must start at 0 and end at nnz = 6"),
    ([0, 1, 2, 3, 4, 5, 7], "must start at 0 and end at nnz = 6"),
]


@pytest.mark.parametrize("offsets,match,dtype", [(o, m, d) for o, m in BAD_OFFSETS for d in (torch.int64, torch.int32)
                                                  if d == torch.int64 or max(abs(x) for x in o) < 2**31])
def test_bad_offsets_are_refused_where_the_record_is_built(offsets, match, dtype):
    with pytest.raises(ValueError, match=match):
        op.CSRCandidates(torch.arange(6), torch.tensor(offsets, dtype=dtype), torch.full((6,), -2.0))


def test_records_without_values_are_built_unchecked():
    """Meta and fake tensors have no values to check: the record is built (shapes only) and its row index has the
    right shape; the compiled loss checks the values in its graph (tests/ops/test_compile.py)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    rec = op.CSRCandidates(torch.empty(6, dtype=torch.int64, device="meta"),
                           torch.empty(4, dtype=torch.int64, device="meta"), torch.empty(6, device="meta"))
    assert rec.row_index().shape == (6,) and rec.row_index().device.type == "meta"
    with FakeTensorMode():
        fake = op.CSRCandidates(torch.empty(6, dtype=torch.int64), torch.empty(4, dtype=torch.int64),
                                torch.empty(6))
        assert fake.row_index().shape == (6,)


def _record(n=6):
    return op.CSRCandidates(torch.arange(n), torch.arange(n + 1), torch.full((n,), -2.0), "head")


def test_row_index_is_right_on_valid_records():
    rec = op.CSRCandidates(torch.arange(7), torch.tensor([0, 0, 3, 3, 4, 7, 7]), torch.full((7,), -2.0))
    assert rec.row_index().tolist() == [1, 1, 1, 3, 4, 4, 4]
    rec32 = op.CSRCandidates(torch.arange(7, dtype=torch.int32), torch.tensor([0, 0, 3, 3, 4, 7, 7],
                             dtype=torch.int32), torch.full((7,), -2.0))
    assert rec32.row_index().dtype == torch.int64 and rec32.row_index().tolist() == [1, 1, 1, 3, 4, 4, 4]
    empty = op.CSRCandidates(torch.zeros(0, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), torch.zeros(0))
    assert empty.row_index().shape == (0,)


def test_take_rows_refuses_an_index_out_of_range():
    rec = _record()
    for bad, shown in ((torch.tensor([0, 6]), 6), (torch.tensor([-1, 2]), -1), (torch.tensor([2**40]), 2**40)):
        with pytest.raises(ValueError, match=f"take_rows: index {shown} is out of range for a record of 6 rows"):
            rec.take_rows(bad)
    with pytest.raises(TypeError, match="take_rows: index must be a 1-D integer tensor"):
        rec.take_rows(torch.tensor([0.0, 1.0]))
    with pytest.raises(TypeError, match="take_rows: index must be a 1-D integer tensor"):
        rec.take_rows(torch.tensor([[0, 1]]))
    assert rec.take_rows(torch.zeros(0, dtype=torch.int64)).num_rows == 0


#: Every path that wrote past a buffer, on a record whose offsets were changed in place after it was built (the
#: construction check cannot see that): each must end in a clear error or a value, never a signal.
_CHILD = textwrap.dedent("""
    import torch, offpolicy as op
    n, v = 6, 20
    rec = op.CSRCandidates(torch.arange(6), torch.arange(7), torch.full((6,), -3.0), "head")
    rec.offsets[2] = 2**40  # in place, after the construction check
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(n, v, generator=gen)
    y = torch.randint(0, v, (n,), generator=gen)
    lq, adv = torch.full((n,), -2.0), torch.ones(n)

    def outcome(name, fn):
        try:
            res = fn()
            print(name, "| value", flush=True)
            return res
        except (ValueError, TypeError, IndexError, RuntimeError) as e:
            print(name, "|", type(e).__name__, str(e).splitlines()[0], flush=True)

    row = outcome("row_index", rec.row_index)
    assert row is not None and int(row.min()) >= 0 and int(row.max()) < n, row
    outcome("take_rows", lambda: rec.take_rows(torch.tensor([0, 1, 2, 3])))
    outcome("cat", lambda: op.CSRCandidates.cat([rec, rec]))
    outcome("to_padded", rec.to_padded)
    outcome("validate", lambda: rec.validate(v, n))
    for backend in ("cpu", "torch"):
        for validate in (True, False):
            for sc in (False, True):
                corr = op.Correction(weights="tis", score_centering=sc)
                outcome(f"policy_loss {backend} validate={validate} sc={sc}", lambda: op.policy_loss(
                    z.clone().requires_grad_(), y, lq, adv, rec, backend=backend, correction=corr,
                    validate=validate).loss.backward())
    # a support record takes the fused support pass (its C loops index by the offsets): the same in-place change
    sup = op.CSRCandidates(torch.arange(12) % v, torch.arange(0, 13, 2), torch.full((12,), -0.6931), "support")
    sup.offsets[3] = 2**40
    for backend in ("cpu", "torch"):
        for validate in (True, False):
            outcome(f"support policy_loss {backend} validate={validate}", lambda: op.policy_loss(
                z.clone().requires_grad_(), torch.arange(0, 12, 2), lq, adv, sup, backend=backend,
                validate=validate).loss.backward())
    outcome("policy_loss_from_logprobs", lambda: op.policy_loss_from_logprobs(
        torch.full((n,), -1.0), lq, adv, rec, torch.full((6,), -1.0), validate=False))
    print("done", flush=True)
""")


def test_mutated_offsets_never_reach_memory():
    res = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, (res.returncode, res.stdout[-3000:], res.stderr[-3000:])
    lines = dict(line.split(" | ", 1) for line in res.stdout.splitlines() if " | " in line)
    assert "done" in res.stdout
    assert lines["take_rows"].startswith("ValueError candidates.offsets must be non-decreasing")
    assert lines["cat"].startswith("ValueError candidates.offsets must be non-decreasing")
    assert lines["validate"].startswith("ValueError candidates.offsets must be non-decreasing")
    assert lines["support policy_loss cpu validate=False"].startswith("ValueError candidates.offsets must"), lines
    for key in ("policy_loss cpu validate=True sc=False", "policy_loss torch validate=True sc=True",
                "support policy_loss cpu validate=True"):
        assert lines[key].startswith("ValueError candidates.offsets must be non-decreasing"), lines[key]
