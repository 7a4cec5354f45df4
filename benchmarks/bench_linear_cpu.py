"""CPU benchmark of the fused-linear path: op.policy_loss(hidden=, weight=) against materialising the logits.

The materialised way: ``logits = hidden @ weight.T`` (autograd), then ``op.policy_loss(logits, ...)`` (the logits
path, chunked torch backend). The fused way: ``op.policy_loss(hidden=hidden, weight=weight, ...)``, which never
builds the ``[N, V]`` logits. Both run forward + backward of an MIS + score-centering loss with a ``K``-candidate
record (head or support), and produce the gradients of ``hidden`` and ``weight``.

Each case runs in a fresh subprocess so that its peak resident memory (``ru_maxrss``) is its own. Reported:
time (best of ``--repeat`` for the fused path, one run for the materialised one; forward alone and forward +
backward), peak memory above the inputs, and above the
inputs and the gradients (``dh``, ``dW``), and the FLOP rate under the fused path's count (support: ``8 N (1 + K) D``;
full: ``8 N D V`` with recompute).

Sections (``--sections``):
  main     fused vs materialised at --n/--d/--v/--k, dtypes x kinds (head mode may use --head-n, a smaller N)
  scaling  fused support mode at V = 32768 and V = 151936 with K fixed and the same candidate ids, then K = 32,
           128, 512: its cost follows K, not V
  filter   gradient filtering (--filter-eps values): fraction of blocks skipped and the gradient error against
           the exact backward, on Zipf-shaped logits (a bias that decays with the vocabulary rank, as real
           vocabularies roughly do, plus contextual logits), entropy reported

    python benchmarks/bench_linear_cpu.py                        # the full run (tens of minutes on 2 cores)
    python benchmarks/bench_linear_cpu.py --n 256 --v 8192 --d 256 --head-n 256 --repeat 1 --scaling-v 4096,8192

Results go to benchmarks/results/linear_cpu_<host>_<date>.json and .csv.
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

from results_io import cpu_model, write_results  # beside this script

RESULTS = Path(__file__).resolve().parent / "results"


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _randn(rows: int, cols: int, scale: float, dtype, gen):
    """Gaussian ``[rows, cols]`` in ``dtype``, drawn in row blocks: no full-size fp32 temporary raises the
    peak-memory baseline."""
    import torch

    out = torch.empty(rows, cols, dtype=dtype)
    for lo in range(0, rows, 4096):
        hi = min(rows, lo + 4096)
        out[lo:hi] = torch.randn(hi - lo, cols, generator=gen) * scale
    return out


def _inputs(n: int, d: int, v: int, k: int, dtype: str, kind: str, seed: int = 0, id_range: int | None = None):
    """hidden [N, D], weight [V, D], tokens, sampler logprobs, advantages, K distinct candidates (token first),
    all ids drawn from ``[0, id_range)`` (default: the whole vocabulary)."""
    import torch

    import offpolicy as op

    gen = torch.Generator().manual_seed(seed)
    dt_ = getattr(torch, dtype)
    hidden = _randn(n, d, 1.0, dt_, gen)
    weight = _randn(v, d, 2.0 / d**0.5, dt_, gen)
    gen = torch.Generator().manual_seed(seed + 1)  # ids independent of V: same draws at every vocabulary size
    r = v if id_range is None else min(v, id_range)
    tokens = torch.randint(0, r, (n,), generator=gen)
    steps = torch.randint(1, max(2, r // k), (n, k - 1), generator=gen)
    ids = torch.cat([tokens[:, None], (tokens[:, None] + steps.cumsum(1)) % r], 1)
    lp = torch.log_softmax(torch.randn(n, ids.shape[1], generator=gen), 1)
    if kind == "support":
        lq = lp[:, 0].clone()
    else:
        lp = lp - 1.0
        lq = lp[:, 0].clone()
    return hidden, weight, tokens, lq, torch.randn(n, generator=gen), op.Candidates(ids, lp, kind)


def _loss(method: str, hidden, weight, tokens, lq, adv, cands):
    import offpolicy as op

    corr = op.Correction(weights="mis", score_centering=True)
    if method == "fused":
        return op.policy_loss(hidden=hidden, weight=weight, tokens=tokens, sampler_logprobs=lq, advantages=adv,
                              candidates=cands, correction=corr).loss
    return op.policy_loss(hidden @ weight.T, tokens, lq, adv, cands, correction=corr).loss


def run_case(method: str, n: int, d: int, v: int, k: int, dtype: str, kind: str, repeat: int,
             id_range: int | None = None) -> dict:
    """Runs in the child process: one method, one shape."""
    import torch

    warm = _inputs(8, 16, 64, 4, dtype, kind)
    warm[0].requires_grad_()
    warm[1].requires_grad_()
    _loss(method, *warm).backward()
    hidden, weight, tokens, lq, adv, cands = _inputs(n, d, v, k, dtype, kind, id_range=id_range)
    hidden.requires_grad_()
    weight.requires_grad_()
    base = _peak_rss_bytes()
    times, fwd_times = [], []
    for _ in range(repeat):
        hidden.grad = weight.grad = None
        t0 = time.perf_counter()
        loss = _loss(method, hidden, weight, tokens, lq, adv, cands)
        t1 = time.perf_counter()
        loss.backward()
        times.append(time.perf_counter() - t0)
        fwd_times.append(t1 - t0)
    peak = _peak_rss_bytes()
    grad_bytes = sum(x.grad.numel() * x.grad.element_size() for x in (hidden, weight))
    logits_bytes = n * v * hidden.element_size()
    extra = max(0, peak - base)
    flops = 8 * n * (1 + k) * d if kind == "support" else 8 * n * d * v
    best = min(times)
    return {
        "section": "main", "method": method, "n": n, "d": d, "v": v, "k": k, "dtype": dtype, "kind": kind,
        "id_range": id_range if id_range is not None else v, "distinct_ids": int(cands.ids.unique().numel()),
        "threads": torch.get_num_threads(), "time_s": best, "times_s": times, "fwd_time_s": min(fwd_times),
        "logits_bytes": logits_bytes, "grad_bytes": grad_bytes, "peak_above_inputs_bytes": extra,
        "peak_above_inputs_and_grads_bytes": max(0, extra - grad_bytes),
        "peak_above_inputs_and_grads_frac_of_logits": max(0, extra - grad_bytes) / logits_bytes,
        "fused_flop_count": flops, "gflops_per_s": flops / best / 1e9, "loss": float(loss),
    }


def run_filter(n: int, d: int, v: int, eps_list: list[float], prior: float, scale: float, dtype: str,
               chunk_bytes: int) -> list[dict]:
    """Gradient filtering on Zipf-shaped logits: skip fraction and error against the exact backward."""
    import torch

    from offpolicy.ops import linear_sparse_log_softmax
    from offpolicy.ops.linear_op import linear_torch_backend as ltb

    gen = torch.Generator().manual_seed(1)
    dt_ = getattr(torch, dtype)
    h = torch.randn(n, d, generator=gen).to(dt_)
    w = (torch.randn(v, d, generator=gen) * (scale / d**0.5)).to(dt_)
    b = (-prior * torch.log1p(torch.arange(v, dtype=torch.float32))).to(dt_)
    y = torch.randint(0, 64, (n,), generator=gen)
    c = torch.randint(0, 256, (n, 16), generator=gen)
    out = linear_sparse_log_softmax(h, w, y, c, 1.0, bias=b)
    ids = torch.cat([y[:, None], c], 1)
    g = torch.randn(n, 17, generator=gen)
    inv = torch.ones(n)
    coef = -g.sum(1)
    dz_ids = g.clone()
    rows, cols = ltb.plan(n, v, d, chunk_bytes)
    blocks = -(-n // rows) * -(-v // cols)
    t0 = time.perf_counter()
    exact = ltb.backward(h, w, b, ids, dz_ids, inv, out.lse, coef, chunk_bytes=chunk_bytes)
    exact_s = time.perf_counter() - t0
    res = []
    for eps in eps_list:
        t0 = time.perf_counter()
        got = ltb.backward(h, w, b, ids, dz_ids, inv, out.lse, coef, chunk_bytes=chunk_bytes, grad_filter=eps)
        elapsed = time.perf_counter() - t0
        row = {"section": "filter", "n": n, "d": d, "v": v, "dtype": dtype, "eps": eps, "prior": prior,
               "block_rows": rows, "block_cols": cols, "blocks": blocks, "skipped_blocks": got[3],
               "chunk_bytes": chunk_bytes, "skipped_frac": got[3] / blocks,
               "mean_entropy_nats": float(out.entropy.mean()),
               "backward_s": elapsed, "exact_backward_s": exact_s}
        for name, a, r in (("dX", got[0], exact[0]), ("dW", got[1], exact[1]), ("db", got[2], exact[2])):
            a, r = a.double(), r.double()
            row[f"{name}_rel_fro_err"] = float((a - r).norm() / r.norm())
            row[f"{name}_max_abs_err_over_max"] = float((a - r).abs().max() / r.abs().max())
        res.append(row)
    return res


def _meta() -> dict:
    import torch

    return {
        "host": socket.gethostname(), "machine": platform.machine(), "processor": platform.processor() or cpu_model(),
        "cpus": os.cpu_count(), "python": platform.python_version(), "date": dt.datetime.now().isoformat(),
        "torch": torch.__version__, "threads": torch.get_num_threads(), "loadavg_start": os.getloadavg(),
    }


def _child(args, spec: str) -> list[dict]:
    # The materialised way runs once: it is the slow baseline, and its first run is also its peak-memory run.
    reps = 1 if json.loads(spec).get("method") == "materialised" else args.repeat
    cmd = [sys.executable, __file__, "--child", spec, "--repeat", str(reps)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"child {spec} failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--head-n", type=int, default=None, help="N for head mode (default --n)")
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--v", type=int, default=151936)
    ap.add_argument("--k", type=int, default=128)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--kinds", default="support,head")
    ap.add_argument("--methods", default="fused,materialised")
    ap.add_argument("--sections", default="main,scaling,filter")
    ap.add_argument("--scaling-v", default="32768,151936")
    ap.add_argument("--scaling-k", default="32,128,512", help="K values of the scaling section (at the largest V)")
    ap.add_argument("--filter-shape", default="1024,512,32768", help="N,D,V of the filter section")
    ap.add_argument("--filter-eps", default="1.52587890625e-05,0.000244140625,0.00390625")
    ap.add_argument("--filter-priors", default="1.0,1.5,2.0", help="Zipf exponents of the filter section's bias")
    ap.add_argument("--filter-chunk-bytes", default=f"{16 << 20},{1 << 20}",
                    help="block budgets of the filter section (one run each: wide and narrow blocks)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--tag", default="", help="suffix for the result file names")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        spec = json.loads(args.child)
        if spec["section"] == "filter":
            rows = run_filter(spec["n"], spec["d"], spec["v"], spec["eps"], spec["prior"], 3.0, spec["dtype"],
                              spec["chunk_bytes"])
        else:
            rows = [run_case(spec["method"], spec["n"], spec["d"], spec["v"], spec["k"], spec["dtype"],
                             spec["kind"], args.repeat, spec.get("id_range"))]
            rows[0]["section"] = spec["section"]
        print(json.dumps(rows))
        return
    meta = _meta()
    rows: list[dict] = []
    sections = args.sections.split(",")
    if "main" in sections:
        for dtype in args.dtypes.split(","):
            for kind in args.kinds.split(","):
                n = args.head_n if (kind == "head" and args.head_n) else args.n
                for method in args.methods.split(","):
                    spec = dict(section="main", method=method, n=n, d=args.d, v=args.v, k=args.k, dtype=dtype,
                                kind=kind)
                    row = _child(args, json.dumps(spec))[0]
                    rows.append(row)
                    print(f"main    {dtype:9s} {kind:8s} {method:12s} N={n:5d} {row['time_s']:8.2f} s "
                          f"(fwd {row['fwd_time_s']:.2f} s)  extra above inputs+grads "
                          f"{row['peak_above_inputs_and_grads_bytes'] / 2**20:9.1f} MiB "
                          f"({100 * row['peak_above_inputs_and_grads_frac_of_logits']:.1f}% of logits)", flush=True)
    if "scaling" in sections:
        # Same candidate draws (ids in [0, min V)) at each vocabulary size, then K varied at the largest V.
        id_range = min(int(x) for x in args.scaling_v.split(","))
        grid = [(int(x), args.k) for x in args.scaling_v.split(",")]
        grid += [(grid[-1][0], int(k)) for k in args.scaling_k.split(",") if int(k) != args.k]
        for v, k in grid:
            spec = dict(section="scaling", method="fused", n=args.n, d=args.d, v=v, k=k,
                        dtype=args.dtypes.split(",")[0], kind="support", id_range=id_range)
            row = _child(args, json.dumps(spec))[0]
            rows.append(row)
            print(f"scaling support fused V={v:7d} K={k:4d} ids in [0, {id_range}) ({row['distinct_ids']} distinct) "
                  f"{row['time_s']:8.2f} s (fwd {row['fwd_time_s']:.2f} s) extra above inputs+grads "
                  f"{row['peak_above_inputs_and_grads_bytes'] / 2**20:.1f} MiB", flush=True)
    if "filter" in sections:
        n, d, v = (int(x) for x in args.filter_shape.split(","))
        budgets = [int(x) for x in args.filter_chunk_bytes.split(",")]
        for prior, budget in ((float(p), b) for p in args.filter_priors.split(",") for b in budgets):
            spec = dict(section="filter", n=n, d=d, v=v, dtype="float32", prior=prior, chunk_bytes=budget,
                        eps=[float(x) for x in args.filter_eps.split(",")])
            for row in _child(args, json.dumps(spec)):
                rows.append(row)
                print(f"filter  prior={prior:.1f} eps={row['eps']:.3g} skipped {100 * row['skipped_frac']:.1f}% of "
                      f"{row['blocks']} [{row['block_rows']}x{row['block_cols']}] blocks, entropy "
                      f"{row['mean_entropy_nats']:.2f} nats, dX rel err {row['dX_rel_fro_err']:.2e}, dW rel err "
                      f"{row['dW_rel_fro_err']:.2e}, backward {row['backward_s']:.2f} s "
                      f"(exact {row['exact_backward_s']:.2f} s)", flush=True)
    for dtype in args.dtypes.split(","):
        for kind in args.kinds.split(","):
            pick = {r["method"]: r for r in rows
                    if r["section"] == "main" and r["dtype"] == dtype and r["kind"] == kind}
            if "fused" in pick and "materialised" in pick:
                pick["fused"]["speedup_vs_materialised"] = pick["materialised"]["time_s"] / pick["fused"]["time_s"]
                print(f"{dtype:9s} {kind:8s} fused speed-up over materialised: "
                      f"{pick['fused']['speedup_vs_materialised']:.2f}x")
    meta["loadavg_end"] = os.getloadavg()
    stem = args.out / f"linear_cpu_{meta['host']}_{dt.date.today().isoformat()}{args.tag}"
    write_results(stem, {"meta": meta, "args": vars(args) | {"out": str(args.out)}, "results": rows}, rows,
                  drop=("times_s",))


if __name__ == "__main__":
    main()
