"""CPU benchmark: op.policy_loss (chunked torch path) against the dense PyTorch way, side by side.

The dense way is what a user writes without this library: ``log_softmax`` of the full ``[N, V]`` logits in fp32,
``gather`` of the sampled token and the candidates, the same ``O(N K)`` loss, autograd backward. Both compute
forward + backward of an MIS + score-centering loss with a ``K``-candidate record.

Each case runs in a fresh subprocess so that peak resident memory (``ru_maxrss``) is its own. We report
time (best of ``--repeat``), peak memory above the inputs, and peak memory above the inputs *and* the gradient
(the SPEC section 8 target: at most 5% of the logits' size), and bytes moved per SPEC section 8's floor
(``3 V b`` per token: one read forward, one read and one write backward).

    python benchmarks/bench_cpu.py                  # N=4096, V=151936, fp32 and bf16 (a few minutes)
    python benchmarks/bench_cpu.py --n 256 --v 32768 --repeat 1   # quick

Results go to benchmarks/results/cpu_<host>_<date>.json and .csv.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

from results_io import write_results  # beside this script

RESULTS = Path(__file__).resolve().parent / "results"


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _inputs(n: int, v: int, k: int, dtype: str, kind: str):
    import torch

    import offpolicy as op

    gen = torch.Generator().manual_seed(0)
    # Filled in row chunks: no [N, V] fp32 transient, so that the peak-memory baseline is the inputs themselves.
    logits = torch.empty(n, v, dtype=getattr(torch, dtype))
    for lo in range(0, n, 64):
        logits[lo : lo + 64] = torch.randn(min(64, n - lo), v, generator=gen) * 2
    tokens = torch.randint(0, v, (n,), generator=gen)
    # k distinct ids per row, the sampled token first: positive steps whose total stays below v.
    steps = torch.randint(1, max(2, v // k), (n, k - 1), generator=gen)
    ids = torch.cat([tokens[:, None], (tokens[:, None] + steps.cumsum(1)) % v], 1)
    if kind == "support":
        lp = torch.log_softmax(torch.randn(n, ids.shape[1], generator=gen), 1)
        pos = (ids == tokens[:, None]).int().argmax(1)
        lq = lp.gather(1, pos[:, None])[:, 0]
    else:
        lp = torch.log_softmax(torch.randn(n, ids.shape[1], generator=gen), 1) - 1.0
        lq = torch.log_softmax(torch.randn(n, 50, generator=gen), 1)[:, 0]
    cands = op.Candidates(ids, lp, kind)
    adv = torch.randn(n, generator=gen)
    return logits, tokens, lq, adv, cands


def _dense_loss(logits, tokens, lq, adv, cands, tau):
    """The dense way: full fp32 log-softmax, gathers, the same MIS + SC loss, autograd."""
    import torch

    import offpolicy as op
    from offpolicy.loss.centering import centering_coefficients
    from offpolicy.corrections.weights import weight_function

    corr = op.Correction(weights="mis", score_centering=True)
    x = logits.float() / tau
    if cands.kind == "support":
        keep = torch.zeros_like(x, dtype=torch.bool).scatter_(1, cands.ids, True)
        x = x.masked_fill(~keep, float("-inf"))
    lp = torch.log_softmax(x, dim=-1)
    logp_y = lp.gather(1, tokens[:, None])[:, 0]
    logp_c = lp.gather(1, cands.ids)
    w = weight_function(logp_y.detach() - lq, corr)
    c = centering_coefficients(logp_c.detach(), cands.logprobs, cands.ids >= 0, cands.kind == "support", corr).coef
    return -(adv * (w * logp_y - (c * logp_c).sum(1))).mean()


def run_case(method: str, n: int, v: int, k: int, dtype: str, kind: str, repeat: int) -> dict:
    """Runs in the child process."""
    import torch

    import offpolicy as op

    torch.manual_seed(0)
    # Warm the process (lazy imports, op registration, allocator) on a tiny batch before the baseline.
    warm = _inputs(8, 64, 4, dtype, kind)
    warm[0].requires_grad_()
    (_dense_loss(*warm, 1.0) if method == "dense" else op.policy_loss(*warm).loss).backward()
    logits, tokens, lq, adv, cands = _inputs(n, v, k, dtype, kind)
    logits.requires_grad_()
    base = _peak_rss_bytes()
    times = []
    for _ in range(repeat):
        logits.grad = None
        t0 = time.perf_counter()
        if method == "dense":
            loss = _dense_loss(logits, tokens, lq, adv, cands, 1.0)
        else:
            loss = op.policy_loss(logits, tokens, lq, adv, cands,
                                  correction=op.Correction(weights="mis", score_centering=True)).loss
        loss.backward()
        times.append(time.perf_counter() - t0)
    peak = _peak_rss_bytes()
    logits_bytes = logits.numel() * logits.element_size()
    extra = max(0, peak - base)
    floor_bytes = 3 * v * logits.element_size() * n
    best = min(times)
    return {
        "method": method, "n": n, "v": v, "k": k, "dtype": dtype, "kind": kind, "threads": torch.get_num_threads(),
        "time_s": best, "times_s": times, "logits_bytes": logits_bytes,
        "peak_above_inputs_bytes": extra,
        "peak_above_inputs_and_grad_bytes": max(0, extra - logits_bytes),
        "peak_above_inputs_and_grad_frac_of_logits": max(0, extra - logits_bytes) / logits_bytes,
        "floor_bytes": floor_bytes, "effective_GBps": floor_bytes / best / 1e9, "loss": float(loss),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--v", type=int, default=151936)
    ap.add_argument("--k", type=int, default=128)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--kinds", default="head,support")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        method, dtype, kind = args.child.split(",")
        reps = 1 if method == "dense" else args.repeat
        print(json.dumps(run_case(method, args.n, args.v, args.k, dtype, kind, reps)))
        return
    rows = []
    for dtype in args.dtypes.split(","):
        for kind in args.kinds.split(","):
            for method in ("offpolicy", "dense"):
                cmd = [sys.executable, __file__, "--child", f"{method},{dtype},{kind}", "--n", str(args.n),
                       "--v", str(args.v), "--k", str(args.k), "--repeat", str(args.repeat)]
                res = subprocess.run(cmd, capture_output=True, text=True, check=True)
                row = json.loads(res.stdout.strip().splitlines()[-1])
                rows.append(row)
                print(f"{dtype:9s} {kind:8s} {method:10s} {row['time_s']:8.3f} s  "
                      f"extra above logits+grad {row['peak_above_inputs_and_grad_bytes'] / 2**20:9.1f} MiB "
                      f"({100 * row['peak_above_inputs_and_grad_frac_of_logits']:.1f}% of logits)  "
                      f"{row['effective_GBps']:.2f} GB/s of the 3Vb floor", flush=True)
    for dtype in args.dtypes.split(","):
        for kind in args.kinds.split(","):
            ours = next(r for r in rows if r["method"] == "offpolicy" and r["dtype"] == dtype and r["kind"] == kind)
            dense = next(r for r in rows if r["method"] == "dense" and r["dtype"] == dtype and r["kind"] == kind)
            ours["speedup_vs_dense"] = dense["time_s"] / ours["time_s"]
            print(f"{dtype:9s} {kind:8s} speed-up over dense: {ours['speedup_vs_dense']:.1f}x")
    meta = {
        "host": socket.gethostname(), "machine": platform.machine(), "processor": platform.processor(),
        "cpus": os.cpu_count(), "python": platform.python_version(), "date": dt.datetime.now().isoformat(),
        "torch": __import__("torch").__version__,
    }
    stem = args.out / f"cpu_{meta['host']}_{dt.date.today().isoformat()}"
    write_results(stem, {"meta": meta, "results": rows}, rows, drop=("times_s",))


if __name__ == "__main__":
    main()
