"""A seeded fuzz of CSR candidate records (issue 40; the generator is ``tests/support/csr_fuzz.py``): broken
offsets, ids, log-probabilities, dtypes and devices (meta included), through construction, ``row_index``,
``take_rows``, ``cat`` and ``op.policy_loss`` with and without validation. Every outcome is a clear error or the
float64 reference's answer, and nothing reads or writes out of bounds (the whole fuzz runs in a child process, so
a crash is a failed test). The larger run under AddressSanitizer, eager and compiled, is ``tools/fuzz_csr_asan.py``
(its summary: ``benchmarks/results/fuzz_csr_asan.json``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from support.csr_fuzz import BREAKS

CASES = int(os.environ.get("OFFPOLICY_CSR_FUZZ_CASES", "72"))
ROOT = Path(__file__).resolve().parents[2]

_CHILD = """
import json, sys, warnings
sys.path.insert(0, sys.argv[2])
warnings.simplefilter("ignore")
from support.csr_fuzz import make_case, run_case, summarise
print(json.dumps(summarise([run_case(make_case(seed)) for seed in range(int(sys.argv[1]))])))
"""


def test_csr_fuzz_only_clear_errors_or_right_answers():
    res = subprocess.run([sys.executable, "-c", _CHILD, str(CASES), str(ROOT / "tests")], capture_output=True,
                         text=True, timeout=900)
    assert res.returncode == 0, (res.returncode, res.stdout[-2000:], res.stderr[-3000:])
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["failures"] == [], summary["failures"][:20]
    assert summary["cases"] == CASES
    # The fuzz reaches what it claims: every break, and both right answers and refusals through the loss.
    assert set(summary["breaks"]) == {str(b) for b in BREAKS}, sorted(set(map(str, BREAKS)) - set(summary["breaks"]))
    assert summary["paths"].get("policy_loss -> value", 0) >= CASES // 10
    assert summary["paths"].get("policy_loss -> error:ValueError", 0) >= CASES // 10
    assert summary["paths"].get("construct -> error:ValueError", 0) >= CASES // 20
