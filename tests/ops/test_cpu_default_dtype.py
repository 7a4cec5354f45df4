"""The native CPU backward under ``torch.set_default_dtype(torch.bfloat16)`` / ``float16`` (common in LLM scripts):
its per-worker fp32 scratch row must not follow the default dtype (a 2-byte row that the C loop fills with 4-byte
floats overflowed the heap). Run in a subprocess, so that memory corruption fails this test instead of killing the
test run. The gradient must equal, bit for bit, the one computed under the default fp32."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from offpolicy.ops import cpu_backend

pytestmark = pytest.mark.skipif(not cpu_backend.available(), reason="no C compiler: the CPU default is torch")

SCRIPT = textwrap.dedent("""
    import torch
    import offpolicy as op
    from offpolicy.ops import backend_registry

    def run(dtype):
        gen = torch.Generator().manual_seed(3)
        n, v = 24, 1031
        z = (torch.randn(n, v, generator=gen, dtype=torch.float32) * 2).to(dtype)
        y = torch.randint(0, v, (n,), generator=gen)
        q = torch.log_softmax(z.float(), 1)[torch.arange(n), y] - 0.1
        adv = torch.randn(n, generator=gen, dtype=torch.float32)
        leaf = z.clone().requires_grad_()
        out = op.policy_loss(leaf, y, q, adv, correction=op.Correction(weights="mis", bounds=(0.5, 2.0)))
        out.loss.backward()
        return out.loss.detach(), leaf.grad

    for dtype in (torch.bfloat16, torch.float16):
        assert backend_registry.choose(None, torch.device("cpu"), dtype).name == "cpu"
        want = run(dtype)
        for default in (torch.bfloat16, torch.float16):
            torch.set_default_dtype(default)
            try:
                got = run(dtype)
            finally:
                torch.set_default_dtype(torch.float32)
            assert got[1].dtype == dtype
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (dtype, default)
    print("same gradients")
""")


def test_policy_loss_under_a_16_bit_default_dtype():
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OFFPOLICY_CPU_NATIVE": "1"})
    assert res.returncode == 0 and "same gradients" in res.stdout, (
        f"exit {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
