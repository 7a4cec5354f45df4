"""The examples run as shipped (each in its own process, as a user would start it) and print what they claim."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("script, expect", [
    ("qwen3_quickstart.py", "sc_abs_coef_sum"),
    ("megatron_forward_step.py", "step 5: reward"),
    ("dtensor_tensor_parallel.py", "equals the single-process loss"),
    ("verl_style_policy_loss.py", "seq-mean-token-sum-norm  loss"),
])
def test_example_runs(script, expect):
    needs = {"megatron_forward_step.py": "megatron.core", "qwen3_quickstart.py": "transformers"}
    if script in needs:
        pytest.importorskip(needs[script], reason=f"{needs[script]} is installed by the README's test set-up")
    out = subprocess.run([sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert expect in out.stdout, out.stdout
