"""The native CPU backward under ``torch.set_default_dtype(torch.bfloat16)`` / ``float16`` (common in LLM scripts):
its per-worker fp32 scratch row must not follow the default dtype (a 2-byte row that the C loop fills with 4-byte
floats overflowed the heap). Run in a subprocess, so that memory corruption fails this test instead of killing the
test run. The gradient must equal, bit for bit, the one computed under the default fp32. Run again with the
kernels built under AddressSanitizer and UBSan (where GCC's ``libasan`` is installed), so that an out-of-bounds
access that happens not to crash still fails."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from offpolicy.ops import cpu_native
from offpolicy.ops.logits_op import cpu_backend

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


def run_script(env: dict[str, str]) -> None:
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300,
                         env={**os.environ, cpu_native.ENV_VAR: "1", **env})
    assert res.returncode == 0 and "same gradients" in res.stdout, (
        f"exit {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")


def test_policy_loss_under_a_16_bit_default_dtype():
    run_script({})


def _libasan() -> str | None:
    try:
        found = subprocess.run(["cc", "-print-file-name=libasan.so"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    path = Path(found.stdout.strip())
    return str(path.resolve()) if found.returncode == 0 and path.is_absolute() and path.exists() else None


@pytest.mark.skipif(_libasan() is None, reason="no libasan for the C compiler")
def test_policy_loss_under_a_16_bit_default_dtype_with_sanitizers(tmp_path):
    run_script({"LD_PRELOAD": _libasan(), "ASAN_OPTIONS": "detect_leaks=0", cpu_native.CACHE_ENV_VAR: str(tmp_path),
                cpu_native.ARCH_ENV_VAR: "-march=native -fsanitize=address,undefined -fno-sanitize-recover=all "
                                         "-fno-omit-frame-pointer"})
