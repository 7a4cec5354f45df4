"""GPU benchmark of the fused-linear path (docs/spec.md#performance): full-vocabulary and support modes against the
measured bf16 matmul rate, the materialised-logits way, Liger-Kernel's fused-linear GRPO loss and Cut
Cross-Entropy (where they import).

What is timed (forward + backward, median of ``--reps`` after ``--warmup``; CUDA events):

* ``matmul``: ``torch.mm`` of ``[N, D] x [D, V]`` in the input dtype: the measured matmul rate (FLOP/s) that the
  fused full mode is compared to (target: at least 65%, docs/spec.md#performance).
* ``fused_full[_filter]`` (Triton backend) and ``fused_full_torch`` (chunked torch backend, cuBLAS): the
  log-probabilities of the target and ``K`` head candidates over the whole vocabulary, gradients of ``hidden``
  and ``weight``. FLOP count ``8 N D V`` (forward ``2 N D V``, backward ``6 N D V`` with recompute).
* ``fused_support`` (Triton) and ``fused_support_torch``: support mode (mask replay), ``O(N K D)``.
* ``materialised``: ``hidden @ weight.T`` then the logits path (``sparse_log_softmax``), autograd.
* ``liger_grpo``: ``liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss`` (no reference model, beta 0).
* ``cce`` / ``cce_exact``: ``cut_cross_entropy.linear_cross_entropy`` with its default gradient filter / none.

Peak memory above the inputs (``torch.cuda.max_memory_allocated``) is reported for each.

    python benchmarks/gpu_bench_linear.py                       # N=16384, D=4096, V=151936, K=128, bf16
    python benchmarks/gpu_bench_linear.py --n 8192 --d 2048
    python benchmarks/gpu_bench_linear.py --tile-sweep "128,128,64,8,3;64,128,64,4,3;128,256,64,8,3"
    TRITON_INTERPRET=1 python benchmarks/gpu_bench_linear.py --dry-run   # tiny shapes on CPU (tests run this)

Results go to benchmarks/results/linear_gpu_<host>_<date>.json and .csv (``--out`` to change the folder).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import socket
import statistics
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

from results_io import write_results  # beside this script

RESULTS = Path(__file__).resolve().parent / "results"


class Timer:
    """Median wall time of a callable: CUDA events on GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device, warmup: int, reps: int) -> None:
        self.device, self.warmup, self.reps = device, warmup, reps

    def __call__(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.reps):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


def make_inputs(n: int, d: int, v: int, k: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """hidden [N, D], weight [V, D] (logits of a few units), targets, K distinct candidate ids (target first)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen).to(device=device, dtype=dtype)
    weight = (torch.randn(v, d, generator=gen) * (2.0 / d**0.5)).to(device=device, dtype=dtype)
    targets = torch.randint(0, v, (n,), generator=gen)
    steps = torch.randint(1, max(2, v // k), (n, k - 1), generator=gen)
    cands = torch.cat([targets[:, None], (targets[:, None] + steps.cumsum(1)) % v], 1)
    return hidden, weight, targets.to(device), cands.to(device)


def _probe(out) -> torch.Tensor:
    """A scalar whose gradient reaches every finite output (the shape of the policy-loss gradient)."""
    c = out.candidates
    return out.target.sum() + 0.01 * torch.where(torch.isfinite(c), c, torch.zeros_like(c)).sum()


def _fused(hidden, weight, targets, cands, *, support: bool, backend: str, grad_filter=None, chunk_bytes=None):
    from offpolicy.ops import linear_sparse_log_softmax

    def step():
        h = hidden.detach().requires_grad_()
        w = weight.detach().requires_grad_()
        out = linear_sparse_log_softmax(h, w, targets, cands, 1.0, support=support, backend=backend,
                                        grad_filter=grad_filter, chunk_bytes=chunk_bytes)
        _probe(out).backward()

    return step


def _materialised(hidden, weight, targets, cands, *, support: bool, backend: str):
    from offpolicy.ops import sparse_log_softmax

    def step():
        h = hidden.detach().requires_grad_()
        w = weight.detach().requires_grad_()
        out = sparse_log_softmax(h @ w.T, targets, cands, 1.0, support=support, backend=backend)
        _probe(out).backward()

    return step


def _liger(hidden, weight, targets, seq_len: int):
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    n, d = hidden.shape
    b = n // seq_len
    loss_fn = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="grpo")
    mask = torch.ones(b, seq_len, device=hidden.device)
    adv = torch.randn(b, device=hidden.device)
    ids = targets[: b * seq_len].view(b, seq_len)

    def step():
        h = hidden[: b * seq_len].detach().view(b, seq_len, d).requires_grad_()
        w = weight.detach().requires_grad_()
        out = loss_fn(h, w, ids, mask, adv)
        (out[0] if isinstance(out, tuple) else out).backward()

    return step


def _cce(hidden, weight, targets, filter_eps):
    from cut_cross_entropy import linear_cross_entropy

    def step():
        h = hidden.detach().requires_grad_()
        w = weight.detach().requires_grad_()
        linear_cross_entropy(h, w, targets, filter_eps=filter_eps).backward()

    return step


def _measure(name: str, make: Callable[[], Callable[[], None]], timer: Timer, device: torch.device,
             input_bytes: int) -> dict:
    row: dict = {"case": name}
    try:
        fn = make()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        row["time_s"] = timer(fn)
        if device.type == "cuda":
            row["peak_above_inputs_bytes"] = torch.cuda.max_memory_allocated() - base
        row["status"] = "ok"
    except Exception as err:  # a baseline that does not import or run is reported, not fatal
        row["status"] = f"unavailable: {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
        row["traceback_tail"] = traceback.format_exc().splitlines()[-3:]
    row["input_bytes"] = input_bytes
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--v", type=int, default=151936)
    ap.add_argument("--k", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seq-len", type=int, default=1024, help="sequence length of the Liger batch view")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cases", default="matmul,fused_full,fused_full_filter,fused_full_torch,fused_support,"
                                        "fused_support_torch,materialised,liger_grpo,cce,cce_exact")
    ap.add_argument("--tile-sweep", default="", help="';'-separated BLOCK_N,BLOCK_V,BLOCK_D,warps,stages tile "
                                                   "shapes: fused_full is timed once per shape")
    ap.add_argument("--dry-run", action="store_true", help="tiny fp32 shapes on CPU (torch backend; the Triton "
                                                           "cases need TRITON_INTERPRET=1)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.dry_run:
        args.n, args.d, args.v, args.k, args.dtype, args.seq_len = 32, 16, 256, 4, "float32", 16
        args.warmup, args.reps = 0, 1
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    triton_ok = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    dtype = getattr(torch, args.dtype)
    n, d, v, k = args.n, args.d, args.v, args.k
    hidden, weight, targets, cands = make_inputs(n, d, v, k, dtype, device)
    input_bytes = sum(x.numel() * x.element_size() for x in (hidden, weight, targets, cands))
    timer = Timer(device, args.warmup, args.reps)
    flops_full = 8 * n * d * v
    flops_support = 8 * n * (k + 1) * d
    torch_chunk = (2 << 30) if device.type == "cuda" else None

    makers = {
        "matmul": lambda: (lambda: torch.mm(hidden, weight.T)),
        "fused_full": lambda: _fused(hidden, weight, targets, cands, support=False, backend=_need_triton(triton_ok)),
        "fused_full_filter": lambda: _fused(hidden, weight, targets, cands, support=False,
                                            backend=_need_triton(triton_ok), grad_filter=2.0**-12),
        "fused_full_torch": lambda: _fused(hidden, weight, targets, cands, support=False, backend="torch",
                                           chunk_bytes=torch_chunk),
        "fused_support": lambda: _fused(hidden, weight, targets, cands, support=True, backend=_need_triton(triton_ok)),
        "fused_support_torch": lambda: _fused(hidden, weight, targets, cands, support=True, backend="torch",
                                              chunk_bytes=torch_chunk),
        "materialised": lambda: _materialised(hidden, weight, targets, cands, support=False,
                                              backend="triton" if device.type == "cuda" else "torch"),
        "liger_grpo": lambda: _liger(_need_cuda(hidden), weight, targets, args.seq_len),
        "cce": lambda: _cce(_need_cuda(hidden), weight, targets, "high"),
        "cce_exact": lambda: _cce(_need_cuda(hidden), weight, targets, None),
    }
    rows = []
    for name in args.cases.split(","):
        row = _measure(name, makers[name], timer, device, input_bytes)
        if row["status"] == "ok":
            if name == "matmul":
                row["flops"] = 2 * n * d * v
            elif "support" in name:
                row["flops"] = flops_support
            else:
                row["flops"] = flops_full  # the nominal count of every full-vocabulary case (recompute included)
            row["flop_rate"] = row["flops"] / row["time_s"]
        rows.append(row)
        _print(row)
    for tiles in filter(None, args.tile_sweep.split(";")):
        os.environ["OFFPOLICY_LINEAR_TILES"] = tiles
        row = _measure(f"fused_full[{tiles}]", makers["fused_full"], timer, device, input_bytes)
        if row["status"] == "ok":
            row["flops"] = flops_full
            row["flop_rate"] = flops_full / row["time_s"]
        rows.append(row)
        _print(row)
    os.environ.pop("OFFPOLICY_LINEAR_TILES", None)
    mm = next((r for r in rows if r["case"] == "matmul" and r["status"] == "ok"), None)
    by = {r["case"]: r for r in rows if r["status"] == "ok"}
    for r in rows:
        if mm is not None and r["status"] == "ok" and r["case"] != "matmul":
            r["frac_of_matmul_rate"] = r["flop_rate"] / mm["flop_rate"]
        for base in ("fused_full", "materialised", "liger_grpo", "cce", "cce_exact"):
            if base in by and r["status"] == "ok" and r["case"] != base:
                r[f"speedup_vs_{base}"] = by[base]["time_s"] / r["time_s"]
    summary = {}
    if "fused_full" in by and mm is not None:
        summary["fused_full_frac_of_matmul_rate"] = by["fused_full"]["frac_of_matmul_rate"]
        summary["target_frac"] = 0.65
    if "fused_support" in by and "fused_full" in by:
        summary["support_speedup_vs_full"] = by["fused_full"]["time_s"] / by["fused_support"]["time_s"]
    for base in ("liger_grpo", "cce", "cce_exact"):
        if base in by and "fused_full" in by:
            summary[f"fused_full_speedup_vs_{base}"] = by[base]["time_s"] / by["fused_full"]["time_s"]
    for key, val in summary.items():
        print(f"{key}: {val:.3f}")
    meta = {
        "host": socket.gethostname(), "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "date": dt.datetime.now().isoformat(), "torch": torch.__version__, "python": platform.python_version(),
        "dry_run": args.dry_run, "n": n, "d": d, "v": v, "k": k, "dtype": args.dtype,
        "triton_interpret": os.environ.get("TRITON_INTERPRET", "0"),
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = None
    stem = args.out / (f"linear_gpu_{meta['host']}_{dt.date.today().isoformat()}" + ("_dryrun" if args.dry_run else ""))
    write_results(stem, {"meta": meta, "summary": summary, "results": rows}, rows, drop=("traceback_tail",))


def _need_triton(ok: bool) -> str:
    if not ok:
        raise RuntimeError("the Triton backend needs CUDA or TRITON_INTERPRET=1")
    return "triton"


def _need_cuda(x: torch.Tensor) -> torch.Tensor:
    if x.device.type != "cuda":
        raise RuntimeError("needs CUDA")
    return x


def _print(row: dict) -> None:
    if row["status"] != "ok":
        print(f"{row['case']:22s} {row['status']}")
        return
    mem = row.get("peak_above_inputs_bytes")
    mem_s = f"  peak above inputs {mem / 2**30:7.2f} GiB" if mem is not None else ""
    print(f"{row['case']:22s} {row['time_s'] * 1e3:10.2f} ms  {row['flop_rate'] / 1e12:8.2f} TFLOP/s{mem_s}",
          flush=True)


if __name__ == "__main__":
    main()
