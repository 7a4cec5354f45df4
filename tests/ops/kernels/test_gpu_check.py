"""tools/gpu_check.py, the prepared GPU run, end to end at tiny shapes in Triton's interpreter (so it cannot rot).

It runs as a GPU user would run it, without the install: a subprocess with only the checkout's ``src`` on
``PYTHONPATH`` and the kernels found in place.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_gpu_check_dry_run(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV",)}
    env["PYTHONPATH"] = str(ROOT / "src")
    proc = subprocess.run([sys.executable, "-P", str(ROOT / "tools" / "gpu_check.py"), "--dry-run", "--out",
                           str(tmp_path)], env=env, capture_output=True, text=True, timeout=600,
                          cwd=str(tmp_path))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = tmp_path.glob("gpu_check_*.json")
    data = json.loads(path.read_text())
    assert data["dry_run"] and data["failed"] == []
    assert {"torch", "triton", "cuda", "device", "python"} <= set(data["versions"])
    names = {r["check"] for r in data["checks"]}
    for dtype in ("fp16", "fp32"):
        assert {f"logits[{dtype},head]", f"logits[{dtype},support]", f"linear[{dtype}]", f"quantisers[{dtype}]",
                f"two_pass_loss[{dtype}]"} <= names
    rows = {r["check"]: r for r in data["checks"]}
    assert all(rows[f"quantisers[{d}]"][f"{f}_bit_exact"] for d in ("fp16", "fp32") for f in ("fp8", "nvfp4", "mxfp4"))
    assert rows["logits[fp32,head]"]["grad_err"] < 1e-5
    two_pass = rows["two_pass_loss[fp32]"]
    assert two_pass["two_pass_launches"] == 8 and two_pass["mis_grad_err"] < 1e-5
    assert two_pass["mis_sc_grad_err"] < 1e-5 and two_pass["mis_sc_top_p_grad_err"] < 1e-5  # the study's configurations
    assert two_pass["mis_sc_top_p_csr_grad_err"] < 1e-5  # a CSR support record: the support kernels
    assert two_pass["support_kernel_launches"] == ["support_stats", "support_grad"]
    perf = data["perf"]
    assert perf["copy_gbps"] > 0 and perf["matmul_tflops"] > 0
    assert {"offpolicy", "torch_dense", "torch_compile"} <= set(perf["logits"]["rows"])
    assert {"offpolicy", "torch_dense"} <= set(perf["linear"]["rows"])
    two = perf["two_pass"]["rows"]
    assert {"three_pass", "three_pass[head K]", "two_pass[mis+sc, head K]"} <= set(two)
    assert any(k.startswith("two_pass[warps=") for k in two)
    assert all("median_s" in r for r in two.values()), two
    assert all("median_s" in r for r in perf["logits"]["rows"].values() if "error" not in r)
    width = perf["support_width"]["rows"]
    assert {"dense", "dense_torch", "support[1 V]"} <= set(width) and all("median_s" in r for r in width.values()), width


def test_gpu_check_exits_non_zero_when_a_check_fails(tmp_path):
    """With no time left every check is recorded as failed ("out of time"), the JSON is still written, and the
    exit status is 1."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV",)}
    env["PYTHONPATH"] = str(ROOT / "src")
    proc = subprocess.run([sys.executable, "-P", str(ROOT / "tools" / "gpu_check.py"), "--dry-run", "--budget-s", "0",
                           "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=300,
                          cwd=str(tmp_path))  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = tmp_path.glob("gpu_check_*.json")
    data = json.loads(path.read_text())
    assert data["failed"] and all(r["error"] == "out of time" for r in data["checks"])
