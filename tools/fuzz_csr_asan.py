"""The seeded CSR-record fuzz (``tests/support/csr_fuzz.py``) at scale, under AddressSanitizer (issue 40).

    .venv/bin/python tools/fuzz_csr_asan.py --cases 5000 --compiled 120 --out benchmarks/results/fuzz_csr_asan.json

The parent builds nothing itself: it starts a child Python with the sanitizer's runtime preloaded
(``LD_PRELOAD`` = libasan + libstdc++, ``ASAN_OPTIONS=detect_leaks=0:abort_on_error=1``, see
/work/shared/ENVIRONMENT.md) and with the native CPU kernels (``kernels/vocab_pass_cpu.c``) compiled by
``src/offpolicy/ops/cpu_native.py`` with ``-fsanitize=address,undefined -fno-omit-frame-pointer -O1 -g`` through its
own variable ``OFFPOLICY_CPU_ARCH_FLAGS`` (appended after the default ``-O3``, so ``-O1`` wins) into a fresh build cache
(``OFFPOLICY_CACHE_DIR``): no change to the loader was needed. The child checks that the loaded library links
libasan and that the loss's CPU backend is the native one, runs ``--cases`` eager cases (every path of
:func:`support.csr_fuzz.run_case`) and ``--compiled`` cases through ``torch.compile`` with default arguments (half
head, half support records, built inside the compiled function), and prints a JSON summary. A sanitizer report
aborts the child (non-zero exit, the report on stderr), which the parent records as a failure. The parent writes
the summary with the exact command, the exit status and the tail of the child's stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SANITIZE = "-march=native -fsanitize=address,undefined -fno-omit-frame-pointer -O1 -g"


def _gcc_file(name: str) -> str:
    out = subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True, check=True)
    path = out.stdout.strip()
    if not os.path.isabs(path) or not os.path.exists(path):
        raise SystemExit(f"fuzz_csr_asan: gcc does not know {name} (got {path!r}); install gcc's libasan")
    return path


def child(cases: int, compiled_cases: int) -> None:
    """Run in the sanitized process: the checks of the set-up, then the fuzz; print the summary as JSON."""
    import warnings

    sys.path.insert(0, str(ROOT / "tests"))
    warnings.simplefilter("ignore")
    import torch

    from offpolicy.ops import backend_registry, cpu_native
    from support.csr_fuzz import compiled_loss, make_case, run_case, summarise

    lib = cpu_native.load()
    if lib is None:
        raise SystemExit(f"fuzz_csr_asan: the native kernels did not build: {cpu_native.unavailable_reason()}")
    path = cpu_native.library_path()
    needed = subprocess.run(["ldd", str(path)], capture_output=True, text=True).stdout
    backend = backend_registry.choose(None, torch.device("cpu"), torch.float32).name
    setup = {"library": str(path), "links_libasan": "libasan" in needed, "cpu_backend": backend,
             "torch": torch.__version__}
    if not setup["links_libasan"] or backend != "cpu":
        raise SystemExit(f"fuzz_csr_asan: not a sanitized native run: {setup}")
    t0 = time.perf_counter()
    eager = [run_case(make_case(seed)) for seed in range(cases)]
    t1 = time.perf_counter()
    compiled = []
    for kind in ("support", "head"):
        fn = compiled_loss(kind)
        compiled += [run_case(make_case(100_000 + seed, fixed=kind), compiled=fn)
                     for seed in range(compiled_cases // 2)]
    t2 = time.perf_counter()
    print(json.dumps({"setup": setup, "eager": summarise(eager), "compiled": summarise(compiled),
                      "seconds": {"eager": round(t1 - t0, 1), "compiled": round(t2 - t1, 1)}}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=5000, help="eager cases (seeds 0..cases-1)")
    ap.add_argument("--compiled", type=int, default=120, help="compiled cases (half head, half support)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "fuzz_csr_asan.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.cases, args.compiled)
        return 0
    env = dict(os.environ)
    env.update(LD_PRELOAD=f"{_gcc_file('libasan.so')} {_gcc_file('libstdc++.so')}",
               ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1",
               OFFPOLICY_CPU_ARCH_FLAGS=SANITIZE, OFFPOLICY_CPU_NATIVE="1",
               OFFPOLICY_CACHE_DIR=tempfile.mkdtemp(prefix="offpolicy-asan-"),
               PYTHONPATH=str(ROOT / "src"))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--cases", str(args.cases), "--compiled",
           str(args.compiled)]
    start = time.perf_counter()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    lines = res.stdout.strip().splitlines()
    summary = json.loads(lines[-1]) if res.returncode == 0 and lines else {}
    asan = [ln for ln in res.stderr.splitlines() if "AddressSanitizer" in ln or "runtime error:" in ln]
    report = {
        "command": " ".join(shlex.quote(a) for a in [".venv/bin/python", "tools/fuzz_csr_asan.py", "--cases",
                                                       str(args.cases), "--compiled", str(args.compiled)]),
        "sanitizer": {"flags": SANITIZE, "LD_PRELOAD": env["LD_PRELOAD"], "ASAN_OPTIONS": env["ASAN_OPTIONS"]},
        "returncode": res.returncode,
        "sanitizer_reports": asan[:20],
        "wall_seconds": round(time.perf_counter() - start, 1),
        **summary,
        "stderr_tail": res.stderr.splitlines()[-15:] if res.returncode else [],
    }
    failures = summary.get("eager", {}).get("failures", []) + summary.get("compiled", {}).get("failures", [])
    ok = res.returncode == 0 and not asan and not failures
    report["verdict"] = "only clear errors or right answers" if ok else "FAILED"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{report['verdict']}: {args.cases} eager + {args.compiled} compiled cases, exit {res.returncode}, "
          f"{len(asan)} sanitizer lines, {len(failures)} failures -> {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
