"""Every Triton kernel compiled for sm_80 / sm_90 / sm_100 through its real wrapper at the headline shapes, no GPU.

tools/aot_compile.py does the compiling (a stand-in Triton driver, meta tensors, Triton's bundled ptxas) in a
subprocess without ``TRITON_INTERPRET``; this module asserts on what it writes: every case compiles, no kernel
spills, shared memory fits the target, the bf16 matmul kernels use tensor cores, every kernel is covered.

Two Triton versions: the one this environment resolves, and the one the CUDA build of torch 2.13 pins (3.7.1),
from the side environment ``tools/setup_test_envs.sh`` makes (``.venv-triton``; ``OFFPOLICY_TRITON_VENV`` names
another). A missing side environment fails with the command that makes it, unless
``OFFPOLICY_SKIP_TRITON_PINNED=1`` (an explicit opt-out).

The results are cached per source hash (the kernel files, the tool, the Triton version) under
``~/.cache/offpolicy/aot-<hash>.json`` (``OFFPOLICY_AOT_CACHE`` names another folder): a cold run compiles about a
hundred kernels (minutes on a loaded machine), a warm one reads the file. ``OFFPOLICY_AOT_ONLY=<case substring>``
compiles only the matching cases (to bisect; the coverage tests then fail).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "aot_compile.py"
PINNED_TRITON = "3.7.1"
SKIP_PINNED = "OFFPOLICY_SKIP_TRITON_PINNED"
#: Compile only the cases whose name contains this (to bisect one kernel; the coverage test then fails).
ONLY = "OFFPOLICY_AOT_ONLY"
#: Kernels that must use tensor cores in bf16, and the PTX instruction checked (by target).
MATMUL_KERNELS = {"_linear_row_stats_kernel", "_linear_dense_grad_kernel"}
ROW_KERNELS = {"_row_stats_kernel", "_row_grad_kernel", "_row_loss_grad_kernel"}
SUPPORT_KERNELS = {"_support_stats_kernel", "_support_grad_kernel"}
FUSED_KERNELS = ROW_KERNELS | SUPPORT_KERNELS | {"_gathered_dot_kernel", "_gathered_grad_h_kernel",
                                                 "_gathered_grad_w_kernel"}


KERNELS = ROOT / "kernels"  # installed as offpolicy.kernels; the tool finds it in place when it is not installed


def _triton_version(python: str) -> str:
    out = subprocess.run([python, "-c", "import triton; print(triton.__version__)"], capture_output=True, text=True,
                         env=_env(), timeout=120)  # fmt: skip
    if out.returncode:
        raise RuntimeError(f"{python} cannot import triton: {out.stderr[-2000:]}")
    return out.stdout.strip()


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "VIRTUAL_ENV")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def source_hash(triton_version: str) -> str:
    """Hash of what decides the compiled code: the kernel modules, the tool and the Triton version."""
    h = hashlib.sha256(triton_version.encode())
    for path in [TOOL, *sorted(KERNELS.glob("*.py"))]:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


#: python -> (cache file, the running compile or None when the file was already there).
_RUNS: dict[str, tuple[Path, "subprocess.Popen | None", Path]] = {}


def _launch(python: str) -> None:
    """Start the tool for the Triton of ``python`` unless its cache file exists (or it already started): the two
    Tritons' compiles run side by side, one process each, so a cold suite pays about one of them in wall time."""
    if python in _RUNS:
        return
    version = _triton_version(python)
    cache = Path(os.environ.get("OFFPOLICY_AOT_CACHE", Path.home() / ".cache" / "offpolicy"))
    only = os.environ.get(ONLY, "")
    path = cache / f"aot-{source_hash(version + only)}.json"
    proc, tmp = None, path.with_suffix(f".{os.getpid()}.tmp")
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen([python, str(TOOL), "--out", str(tmp), "--only", only], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=_env(), cwd=str(ROOT.parent))
    _RUNS[python] = (path, proc, tmp)


def compile_results(python: str) -> dict:
    """The tool's records for the Triton of ``python``, from the cache or a fresh run."""
    _launch(python)
    path, proc, tmp = _RUNS[python]
    if proc is not None and not path.exists():
        out, err = proc.communicate(timeout=3000)
        assert proc.returncode == 0, f"aot_compile.py failed:\n{out[-3000:]}\n{err[-6000:]}"
        tmp.replace(path)
    return json.loads(path.read_text())


def _pinned_available() -> str | None:
    venv = Path(os.environ.get("OFFPOLICY_TRITON_VENV", ROOT / ".venv-triton"))
    python = venv / "bin" / "python"
    return str(python) if python.exists() and os.environ.get(SKIP_PINNED) != "1" else None


def _pinned_python() -> str:
    venv = Path(os.environ.get("OFFPOLICY_TRITON_VENV", ROOT / ".venv-triton"))
    python = venv / "bin" / "python"
    if os.environ.get(SKIP_PINNED) == "1":
        pytest.skip(f"{SKIP_PINNED}=1: the compile test with Triton {PINNED_TRITON} opted out")
    if not python.exists():
        pytest.fail(f"{venv} is missing: make it with `bash tools/setup_test_envs.sh` (Triton {PINNED_TRITON}, what "
                    f"the CUDA build of torch 2.13 pins), or set {SKIP_PINNED}=1 to opt out", pytrace=False)
    return str(python)


@pytest.fixture(scope="module", params=["installed", "torch-pinned"])
def results(request) -> dict:
    if request.param == "installed" and _pinned_available():
        _launch(_pinned_available())  # the pinned Triton compiles beside the installed one
    python = sys.executable if request.param == "installed" else _pinned_python()
    res = compile_results(python)
    if request.param == "torch-pinned":
        assert res["triton"] == PINNED_TRITON, f"{python} has Triton {res['triton']}, expected {PINNED_TRITON}"
    return res


def _label(r: dict) -> str:
    return f"{r['kernel'] or r['case']} [{r['case']}, {r['dtype']}, {r['target']}, Triton {r['triton']}]"


def test_every_case_compiles(results):
    failed = [f"{_label(r)}: {r['error']}" for r in results["records"] if r["error"]]
    assert not failed, "\n".join(failed)


def test_no_kernel_spills(results):
    """No spill stores or loads (ptxas -v with Triton's own flags, from Triton's log)."""
    missing = [_label(r) for r in results["records"] if r["kernel"] and "spill_stores" not in r]
    assert not missing, f"no ptxas log read for: {missing}"
    spills = [f"{_label(r)}: {r['registers']} registers, {r['spill_stores']} B spill stores, {r['spill_loads']} B "
              f"spill loads, {r['stack']} B stack" for r in results["records"]
              if r["kernel"] and (r["spill_stores"] or r["spill_loads"])]  # fmt: skip
    assert not spills, "\n".join(spills)


def test_shared_memory_within_the_target(results):
    over = [f"{_label(r)}: {r['shared']} > {r['max_shared']} B" for r in results["records"]
            if r["kernel"] and r["shared"] > r["max_shared"]]  # fmt: skip
    assert not over, "\n".join(over)


def test_matmuls_use_tensor_cores(results):
    """bf16 and fp32 (tf32x3: input_precision="ieee" would be an FMA loop)."""
    mm = [r for r in results["records"] if r["kernel"] in MATMUL_KERNELS]
    assert {(r["target"], r["dtype"]) for r in mm} == {(t, d) for t in ("sm_80", "sm_90", "sm_100")
                                                       for d in ("bf16", "fp32")}  # fmt: skip
    scalar = [_label(r) for r in mm if not r["tensor_core"]]
    assert not scalar, f"no tensor-core instruction (mma.sync / wgmma / tcgen05) in: {scalar}"


def test_fp_fusion_is_explicit(results):
    """Every launch sets FMA contraction (the tool compiles with Triton 3.10's default, off): on in the row and
    gathered kernels, off in the fused-linear vocabulary kernels and the quantisers (each rounding as written); the
    row kernels pin ``x = z * inv_temp`` as one rounded product (``fma.rn(z, it, 0)``), as torch computes it."""
    wrong = [f"{_label(r)}: fusion {r['enable_fp_fusion']}" for r in results["records"]
             if r["kernel"] and r["enable_fp_fusion"] != (r["kernel"] in FUSED_KERNELS)]  # fmt: skip
    assert not wrong, "\n".join(wrong)
    unpinned = [_label(r) for r in results["records"] if r["kernel"] in ROW_KERNELS and r["rounded_products"] < 1]
    assert not unpinned, f"x = z * inv_temp not pinned in: {unpinned}"


def test_atomics_are_relaxed(results):
    """acq_rel atomics put a fence around every 16-byte add; nothing in a kernel reads what they add."""
    fenced = [f"{_label(r)}: {r['acq_rel_atomics']}" for r in results["records"] if r["kernel"]
              and r["acq_rel_atomics"]]  # fmt: skip
    assert not fenced, "acq_rel atomics in:\n" + "\n".join(fenced)


def test_row_kernels_load_16_bytes_and_order_their_stores(results):
    rows = [r for r in results["records"] if r["kernel"] in ROW_KERNELS]
    assert rows
    scalar = [_label(r) for r in rows if not r["vector_loads"]]
    assert not scalar, f"no 16-byte vector loads in: {scalar}"
    unordered = [_label(r) for r in rows if r["kernel"] in ("_row_grad_kernel", "_row_loss_grad_kernel")
                 and r["barriers"] < 2]
    assert not unordered, f"the barriers ordering the id stores are missing in: {unordered}"


def test_the_two_pass_kernel_holds_one_row_per_sm(results):
    """The two-pass kernel re-reads each row from L2 only while the rows in flight fit there: 32 warps (1024
    threads) at more than 32 registers each fill an SM's 65,536 registers, so one program (one row) per SM."""
    two = [r for r in results["records"] if r["kernel"] == "_row_loss_grad_kernel"]
    assert {r["target"] for r in two} == {"sm_80", "sm_90", "sm_100"}
    wrong = [f"{_label(r)}: {r['num_warps']} warps, {r['registers']} registers" for r in two
             if r["num_warps"] != 32 or not 32 < r["registers"] <= 64]  # fmt: skip
    assert not wrong, "\n".join(wrong)


def test_the_hot_path_has_no_host_sync(results):
    """The fused-linear backend's forward and backward ran on meta tensors: a nonzero() or item() would raise."""
    cases = [r for r in results["records"] if r["case"].startswith("linear_backend_")]
    assert {r["case"] for r in cases} == {"linear_backend_backward", "linear_backend_full_stats"}
    assert not [r for r in cases if r["error"]]


def test_every_kernel_is_compiled_for_every_target(results):
    names = {n for path in KERNELS.glob("*.py") for n in re.findall(r"^def (_\w+_kernel)\(", path.read_text(), re.M)}
    assert len(names) >= 11
    for target in ("sm_80", "sm_90", "sm_100"):
        seen = {r["kernel"] for r in results["records"] if r["target"] == target}
        assert names <= seen, f"{target}: never compiled: {sorted(names - seen)}"


def test_the_launches_are_the_headline_grids(results):
    """The records come from the wrappers' real launches (one program per row at N = 16384, V = 151936)."""
    stats = [r for r in results["records"] if r["kernel"] == "_row_stats_kernel" and r["case"] == "row_stats[int64]"]
    assert stats and all(r["grid"] == [results["shapes"]["N"], 1, 1] for r in stats)


def test_support_kernels_compile_at_every_width(results):
    """The CSR support kernels (kernels/support_logsoftmax.py) through their wrappers at N = 16384, V = 151936: rows
    of K = 256 ids and rows of the whole vocabulary (nnz = N V above 2**31: 64-bit entry offsets), with and without
    the entries' upstream gradient, one program per row, on every target."""
    sup = [r for r in results["records"] if r["kernel"] in SUPPORT_KERNELS]
    for target in ("sm_80", "sm_90", "sm_100"):
        cases = {r["case"] for r in sup if r["target"] == target}
        assert {"support_stats[int64]", "support_stats[int64,K=V]", "support_grad[int64,K=V,g_ids]"} <= cases, target
    n = results["shapes"]["N"]
    wrong = [_label(r) for r in sup if r["case"].startswith(("support_stats[int64", "support_grad[int64"))
             and r["grid"] != [n, 1, 1]]  # fmt: skip
    assert not wrong, f"not one program per row: {wrong}"
