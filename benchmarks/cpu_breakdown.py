"""Where the CPU path's time goes, at N = 4096, V = 151936 (fp32 logits), each figure over several calls.

1. first touch: allocate a logits-sized buffer and copy the logits into it (the floor), against copying into a
   buffer whose pages are already mapped (what a reused gradient buffer costs);
2. one chunk of the forward (``rows`` x V fp32, cache-sized), pass by pass, with 2 and with 1 intra-op threads: on
   a 2-core machine shared with other jobs, a parallel region waits for a descheduled thread. The passes include
   the bf16 max and upcast, and ``exp`` against ``exp2`` (the backend takes ``exp2`` of ``(x - m) log2 e``); and
   the bf16 row statistics of one chunk as the backend's eager passes against one torch.compile'd loop;
3. the two CPU backends' contract functions on ``--pass-rows`` rows (several chunks: the PyTorch backend's
   per-call scratch buffers are amortised), one thread, in ns per element: ``full_stats`` and ``full_grad`` of the
   native ``cpu`` backend (the fused C loops) against the chunked PyTorch backend, fp32 and bf16 logits;
4. the primitive alone (``offpolicy.ops.sparse_log_softmax``, full vocabulary, K = 128), forward and backward,
   with and without the value checks (``validate=False``), against the floor of the same call, on each CPU
   backend.

    python benchmarks/cpu_breakdown.py --note "shared machine"

Writes benchmarks/results/cpu_breakdown_<host>_<date>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_cpu import _floor_s  # beside this script: the floor, as the main benchmark times it

RESULTS = Path(__file__).resolve().parent / "results"


def _stats(xs: list[float]) -> dict:
    return {"median_ms": 1e3 * statistics.median(xs), "best_ms": 1e3 * min(xs),
            "spread_ms": 1e3 * (max(xs) - min(xs))}


def _time(fn, calls: int) -> list[float]:
    fn()
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def first_touch(logits: torch.Tensor, calls: int) -> dict:
    fresh, warm = [], []
    mapped = torch.empty_like(logits)
    mapped.copy_(logits)
    for _ in range(calls):
        fresh.append(_floor_s(logits))
        t0 = time.perf_counter()
        mapped.copy_(logits)
        warm.append(time.perf_counter() - t0)
    return {"fresh_buffer": _stats(fresh), "mapped_buffer": _stats(warm)}


def chunk_passes(v: int, rows: int, calls: int) -> dict:
    z = torch.randn(rows, v) * 2
    z16 = z.bfloat16()
    x, e = torch.empty_like(z), torch.empty_like(z)
    m = z.amax(dim=1, keepdim=True)
    passes = {  # in this order: "sub" leaves x = z - m (<= 0, the range the exponentials see) for the next three
        "amax": lambda: z.amax(dim=1),
        "amax_bf16": lambda: z16.amax(dim=1),
        "upcast_bf16": lambda: x.copy_(z16),
        "sub": lambda: torch.sub(z, m, out=x),
        "exp": lambda: torch.exp(x, out=e),
        "exp2": lambda: torch.exp2(x, out=e),
        "scale": lambda: torch.mul(x, 1.4426950408889634, out=e),
        "sum": lambda: e.sum(dim=1),
        "mul_sum": lambda: x.mul_(e).sum(dim=1),
    }
    out = {}
    threads = torch.get_num_threads()
    for n_threads in sorted({threads, 1}, reverse=True):
        torch.set_num_threads(n_threads)
        out[f"threads_{n_threads}"] = {name: _stats(_time(fn, calls)) for name, fn in passes.items()}
    torch.set_num_threads(threads)
    out["bf16_stats_eager_vs_compiled"] = _stats_eager_vs_compiled(z16, calls)
    return out


def _eager_stats(z16: torch.Tensor, x: torch.Tensor, e: torch.Tensor):
    """The CPU backend's forward passes over one bf16 chunk (offpolicy.ops.logits_op.torch_backend.full_stats, tau = 1)."""
    m = x.copy_(z16).amax(dim=1)
    x.sub_(m[:, None]).mul_(1.4426950408889634)
    torch.exp2(x, out=e)
    return m, e.sum(dim=1), x.mul_(e).sum(dim=1)


def _fused_stats(z16: torch.Tensor):
    x = z16.float()
    m = x.amax(dim=1, keepdim=True)
    y = (x - m) * 1.4426950408889634
    e = torch.exp2(y)
    return m, e.sum(dim=1), (e * y).sum(dim=1)


def _stats_eager_vs_compiled(z16: torch.Tensor, calls: int) -> dict:
    """The same row statistics of one bf16 chunk, one intra-op thread: the backend's eager passes against one
    loop that torch.compile (Inductor's C++ backend) generates from the same math. A measured direction for the
    bf16 forward, not a path the library takes (it would need a C++ compiler at run time)."""
    x, e = torch.empty(z16.shape), torch.empty(z16.shape)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        res = {"elements": z16.numel(), "eager": _stats(_time(lambda: _eager_stats(z16, x, e), calls))}
        try:
            compiled = torch.compile(_fused_stats, dynamic=False)
            t0 = time.perf_counter()
            compiled(z16)
            res["compile_s"] = time.perf_counter() - t0
            res["compiled"] = _stats(_time(lambda: compiled(z16), calls))
            ref, got = _eager_stats(z16, x, e), compiled(z16)
            res["compiled_max_rel_diff_s"] = float(((got[1] - ref[1]) / ref[1]).abs().max())
        except Exception as exc:  # no C++ compiler, or Inductor unavailable: say so in the results
            res["compiled"] = f"unavailable: {type(exc).__name__}: {exc}"[:300]
    finally:
        torch.set_num_threads(threads)
    return res


def backend_passes(v: int, rows: int, calls: int) -> dict:
    """``full_stats`` and ``full_grad`` of ``rows x V`` logits on each CPU backend, one thread, ns per element."""
    from offpolicy.ops.logits_op import cpu_backend, torch_backend

    backends = {"torch": torch_backend}
    if cpu_backend.available():
        backends["cpu"] = cpu_backend
    gen = torch.Generator().manual_seed(2)
    out: dict = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            z = (torch.randn(rows, v, generator=gen) * 2).to(dtype)
            inv = torch.full((rows,), 1.0)
            ids = torch.randint(0, v, (rows, 129), generator=gen)
            g = torch.randn(rows, 129, generator=gen)
            m, s, _, _ = torch_backend.full_stats(z, inv, None)
            lse = m + torch.log(s)
            dz = torch.empty_like(z)
            for name, mod in backends.items():
                per = 1e9 / z.numel()
                st = _time(lambda: mod.full_stats(z, inv, None), calls)
                gr = _time(lambda: mod.full_grad(z, ids, inv, lse, g, g.sum(1), dz), calls)
                out[f"{name}/{str(dtype).removeprefix('torch.')}"] = {
                    "full_stats_ns_per_elem": per * statistics.median(st),
                    "full_grad_ns_per_elem": per * statistics.median(gr),
                    "full_stats": _stats(st), "full_grad": _stats(gr)}
    finally:
        torch.set_num_threads(threads)
    return out


def primitive(logits: torch.Tensor, k: int, calls: int, backend: str) -> dict:
    from offpolicy.ops import sparse_log_softmax

    n, v = logits.shape
    gen = torch.Generator().manual_seed(1)
    y = torch.randint(0, v, (n,), generator=gen)
    c = torch.randint(0, v, (n, k), generator=gen)
    g_t, g_c = torch.randn(n, generator=gen), torch.randn(n, k, generator=gen)
    leaf = logits.requires_grad_()
    out = {}
    for validate in (True, False):
        floors, fwd, bwd = [], [], []
        for _ in range(calls + 1):
            leaf.grad = None
            floors.append(_floor_s(logits))
            t0 = time.perf_counter()
            res = sparse_log_softmax(leaf, y, c, validate=validate, backend=backend)
            t1 = time.perf_counter()
            torch.autograd.backward((res.target, res.candidates), (g_t, g_c))
            t2 = time.perf_counter()
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
        floors, fwd, bwd = floors[1:], fwd[1:], bwd[1:]  # the first call maps the reused gradient buffer
        out[f"validate_{validate}"] = {"floor": _stats(floors), "forward": _stats(fwd), "backward": _stats(bwd),
                                       "x_floor_median": statistics.median(
                                           [(f + b) / fl for f, b, fl in zip(fwd, bwd, floors)])}
    leaf.requires_grad_(False)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--v", type=int, default=151936)
    ap.add_argument("--k", type=int, default=128)
    ap.add_argument("--rows", type=int, default=13, help="rows of the chunk in part 2 (8 MiB at V = 151936)")
    ap.add_argument("--pass-rows", type=int, default=128, help="rows of part 3")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--note", default="")
    ap.add_argument("--tag", default="", help="suffix of the result file")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    load_start = os.getloadavg()
    logits = torch.randn(args.n, args.v) * 2
    from offpolicy.ops.logits_op import cpu_backend

    cpu_backends = (["cpu"] if cpu_backend.available() else []) + ["torch"]
    result = {
        "meta": {"host": socket.gethostname(), "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
                 "python": platform.python_version(), "torch": torch.__version__,
                 "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                 "command": "python benchmarks/cpu_breakdown.py " + " ".join(sys.argv[1:]), "note": args.note,
                 "loadavg_start": load_start},
        "first_touch": first_touch(logits, args.calls),
        "chunk_passes": chunk_passes(args.v, args.rows, 10 * args.calls),
        "backend_passes": backend_passes(args.v, args.pass_rows, 2 * args.calls),
        "primitive": {b: primitive(logits, args.k, args.calls, b) for b in cpu_backends},
    }
    result["meta"]["loadavg_end"] = os.getloadavg()
    print(json.dumps(result, indent=1))
    path = args.out / f"cpu_breakdown_{result['meta']['host']}_{dt.date.today().isoformat()}{args.tag}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
