"""The seeded CSR-record fuzz (``tests/support/csr_fuzz.py``) at scale, under AddressSanitizer (issue 40).

    .venv/bin/python tools/fuzz_csr_asan.py --cases 5000 --compiled 120 --shards 2

The parent builds nothing itself: it starts a child Python with the sanitizer's runtime preloaded
(``LD_PRELOAD`` = libasan + libstdc++, ``ASAN_OPTIONS=detect_leaks=0:abort_on_error=1``, see
/work/shared/ENVIRONMENT.md) and with the native CPU kernels (``kernels/vocab_pass_cpu.c``) compiled by
``src/offpolicy/ops/cpu_native.py`` with ``-fsanitize=address,undefined -fno-omit-frame-pointer -O1 -g`` through its
own variable ``OFFPOLICY_CPU_ARCH_FLAGS`` (appended after the default ``-O3``, so ``-O1`` wins) into a fresh build cache
(``OFFPOLICY_CACHE_DIR``): no change to the loader was needed. The child checks that the loaded library links
libasan and that the loss's CPU backend is the native one, runs its slice of ``--cases`` eager cases (``--shards`` children in parallel; every path of
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


def child(cases: int, compiled_cases: int, shard: int, shards: int, progress: Path | None) -> None:
    """Run in the sanitized process: the checks of the set-up, then this shard's cases (a contiguous block of
    the seeds; the compiled ones in shard 0); print the summary as JSON. ``progress``: a file that
    holds the summary so far, rewritten every 100 cases."""
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
    compiled = []
    if shard == 0:
        for kind in ("support", "head"):
            fn = compiled_loss(kind)
            compiled += [run_case(make_case(100_000 + seed, fixed=kind), compiled=fn)
                         for seed in range(compiled_cases // 2)]
    t1 = time.perf_counter()
    eager = []
    per = -(-cases // shards)  # a contiguous block of seeds (every third seed is unbroken: no stride may skip them)
    for seed in range(shard * per, min(cases, (shard + 1) * per)):
        eager.append(run_case(make_case(seed)))
        if progress is not None and len(eager) % 100 == 0:
            progress.write_text(json.dumps({"eager": summarise(eager), "compiled": summarise(compiled)}))
    t2 = time.perf_counter()
    print(json.dumps({"setup": setup, "eager": summarise(eager), "compiled": summarise(compiled),
                      "seconds": {"compiled": round(t1 - t0, 1), "eager": round(t2 - t1, 1)}}))


def _merge(parts: list[dict]) -> dict:
    """One summary of the shards' summaries."""
    out = {"cases": sum(p["cases"] for p in parts), "breaks": {}, "paths": {}, "failures": []}
    for p in parts:
        for key in ("breaks", "paths"):
            for k, v in p[key].items():
                out[key][k] = out[key].get(k, 0) + v
        out["failures"] += p["failures"]
    out["breaks"], out["paths"] = dict(sorted(out["breaks"].items())), dict(sorted(out["paths"].items()))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=5000, help="eager cases (seeds 0..cases-1)")
    ap.add_argument("--compiled", type=int, default=120, help="compiled cases (half head, half support)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "fuzz_csr_asan.json")
    ap.add_argument("--shards", type=int, default=2, help="child processes, each a slice of the seeds")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--progress", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args.cases, args.compiled, args.child, args.shards, args.progress)
        return 0
    env = dict(os.environ)
    env.update(LD_PRELOAD=f"{_gcc_file('libasan.so')} {_gcc_file('libstdc++.so')}",
               ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1",
               OFFPOLICY_CPU_ARCH_FLAGS=SANITIZE, OFFPOLICY_CPU_NATIVE="1",
               OFFPOLICY_CACHE_DIR=tempfile.mkdtemp(prefix="offpolicy-asan-"),
               PYTHONPATH=str(ROOT / "src"))
    start = time.perf_counter()
    procs = []
    for shard in range(args.shards):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(shard), "--shards", str(args.shards),
               "--cases", str(args.cases), "--compiled", str(args.compiled), "--progress",
               str(args.out.with_suffix(f".shard{shard}.partial.json"))]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      cwd=ROOT))
    results = [(p, *p.communicate()) for p in procs]
    codes = [p.returncode for p, _, _ in results]
    parts = [json.loads(out.strip().splitlines()[-1]) for p, out, _ in results
             if p.returncode == 0 and out.strip()]
    asan = [ln for _, _, err in results for ln in err.splitlines() if "AddressSanitizer" in ln or "runtime error:" in ln]
    summary = {}
    if len(parts) == len(procs):
        summary = {"setup": parts[0]["setup"], "eager": _merge([p["eager"] for p in parts]),
                   "compiled": _merge([p["compiled"] for p in parts]),
                   "seconds": {"per_shard": [p["seconds"] for p in parts]}}
    report = {
        "command": " ".join(shlex.quote(a) for a in [".venv/bin/python", "tools/fuzz_csr_asan.py", "--cases",
                                                       str(args.cases), "--compiled", str(args.compiled), "--shards",
                                                       str(args.shards)]),
        "sanitizer": {"flags": SANITIZE, "LD_PRELOAD": env["LD_PRELOAD"], "ASAN_OPTIONS": env["ASAN_OPTIONS"]},
        "returncodes": codes,
        "sanitizer_reports": asan[:20],
        "wall_seconds": round(time.perf_counter() - start, 1),
        **summary,
        "stderr_tail": [ln for _, _, err in results for ln in err.splitlines()[-15:]] if any(codes) else [],
    }
    for shard in range(args.shards):
        args.out.with_suffix(f".shard{shard}.partial.json").unlink(missing_ok=True)
    failures = summary.get("eager", {}).get("failures", []) + summary.get("compiled", {}).get("failures", [])
    ok = not any(codes) and summary and not asan and not failures
    report["verdict"] = "only clear errors or right answers" if ok else "FAILED"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{report['verdict']}: {args.cases} eager + {args.compiled} compiled cases, exits {codes}, "
          f"{len(asan)} sanitizer lines, {len(failures)} failures -> {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
