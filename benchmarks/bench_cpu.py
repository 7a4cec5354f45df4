"""CPU benchmark: ``op.policy_loss`` on logits (the CPU default, the native ``cpu`` backend, and the chunked PyTorch
fallback) against the machine's floor and the dense PyTorch way, forward + backward of an MIS + score-centering loss
with a ``K``-candidate record.

* floor: allocate a logits-sized buffer and copy the logits into it: one read of the logits, one write of a fresh
  gradient-sized buffer (its page faults included), the least any forward + backward must move;
* mapped-pages floor: the same copy into a buffer whose pages are already mapped (allocated once per process),
  measured right after the floor. On a VM the page faults are most of the floor and vary from call to call; this
  second floor shows how far ours is from the bare read + write;
* ours (``offpolicy``): ``op.policy_loss(logits, ...)`` then ``loss.backward()`` with the default backend (``cpu``,
  the fused C loops, where they build), the gradient released between calls (``logits.grad = None``), as a
  training step does; ``offpolicy-torch``: the same with ``backend="torch"``, the fallback where no C compiler is;
* dense: what a user writes without this library: ``log_softmax`` of the full ``[N, V]`` logits in fp32,
  ``gather`` of the sampled token and the candidates, the same ``O(N K)`` loss
  (``op.policy_loss_from_logprobs``), autograd backward.

Each (dtype, record) case runs in fresh subprocesses: one for each of ours (first one call whose peak resident memory
above the inputs is the memory figure, then ``--calls`` calls, each preceded by a floor measurement), one for
dense (``--dense-calls`` calls, each preceded by a floor measurement). Ratios to the floor are per call (ours_i /
floor_i, measured back to back) and reported as median with min and max; times as median, best and spread
(max - min). The memory bound of ``docs/spec.md#performance``: peak above the inputs *and* the gradient at most 5% of
the logits' size.

    python benchmarks/bench_cpu.py --note "machine shared with other jobs"      # N=4096, V=151936, 4 cases
    python benchmarks/bench_cpu.py --n 256 --v 32768 --calls 2 --dense-calls 1  # quick

Results go to benchmarks/results/cpu_<host>_<date><tag>.json and .csv (with the command line, the load average
before and after, and the note).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from results_io import cpu_model, write_results  # beside this script

RESULTS = Path(__file__).resolve().parent / "results"
CORRECTION = dict(weights="mis", score_centering=True)


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


def _dense_loss(logits, tokens, lq, adv, cands):
    """The dense way: full fp32 log-softmax, gathers, the same MIS + SC loss from the log-probabilities."""
    import torch

    import offpolicy as op

    x = logits.float()
    if cands.kind == "support":
        keep = torch.zeros_like(x, dtype=torch.bool).scatter_(1, cands.ids, True)
        x = x.masked_fill(~keep, float("-inf"))
    lp = torch.log_softmax(x, dim=-1)
    return op.policy_loss_from_logprobs(lp.gather(1, tokens[:, None])[:, 0], lq, adv, candidates=cands,
                                        candidate_logprobs=lp.gather(1, cands.ids),
                                        correction=op.Correction(**CORRECTION)).loss


def _ours_loss(logits, tokens, lq, adv, cands, backend=None):
    import offpolicy as op

    return op.policy_loss(logits, tokens, lq, adv, cands, correction=op.Correction(**CORRECTION),
                          backend=backend).loss


#: method -> the ``backend=`` of ``op.policy_loss`` (None: the default for CPU tensors)
OURS = {"offpolicy": None, "offpolicy-torch": "torch"}


def _floor_s(logits) -> float:
    import torch

    t0 = time.perf_counter()
    buf = torch.empty_like(logits)
    buf.copy_(logits)
    elapsed = time.perf_counter() - t0
    del buf
    return elapsed


def _summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "best": min(xs), "spread": max(xs) - min(xs), "all": xs}


def run_case(method: str, n: int, v: int, k: int, dtype: str, kind: str, calls: int) -> dict:
    """Runs in the child process: the memory call (ours only), then ``calls`` pairs (floor, method)."""
    import torch

    if method == "dense":
        loss_fn = _dense_loss
    else:
        def loss_fn(*inputs):
            return _ours_loss(*inputs, backend=OURS[method])
    warm = _inputs(8, 64, 4, dtype, kind)  # lazy imports, op registration, allocator
    warm[0].requires_grad_()
    loss_fn(*warm).backward()
    logits, tokens, lq, adv, cands = _inputs(n, v, k, dtype, kind)
    logits.requires_grad_()
    logits_bytes = logits.numel() * logits.element_size()
    row = {"method": method, "n": n, "v": v, "k": k, "dtype": dtype, "kind": kind,
           "threads": torch.get_num_threads(), "logits_bytes": logits_bytes}
    if method != "dense":
        from offpolicy.ops import backend_registry

        row["backend"] = backend_registry.choose(OURS[method], logits.device, logits.dtype).name
        base = _peak_rss_bytes()
        loss_fn(logits, tokens, lq, adv, cands).backward()
        extra = max(0, _peak_rss_bytes() - base)
        row.update(peak_above_inputs_bytes=extra, peak_above_inputs_and_grad_bytes=max(0, extra - logits_bytes),
                   peak_above_inputs_and_grad_frac_of_logits=max(0, extra - logits_bytes) / logits_bytes)
    floors, mapped_floors, totals, fwds, bwds = [], [], [], [], []
    mapped = torch.empty_like(logits, requires_grad=False)
    mapped.copy_(logits.detach())  # its pages are mapped from here on
    for _ in range(calls):
        logits.grad = None
        floors.append(_floor_s(logits))
        t0 = time.perf_counter()
        mapped.copy_(logits.detach())
        mapped_floors.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        loss = loss_fn(logits, tokens, lq, adv, cands)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        totals.append(t2 - t0)
        fwds.append(t1 - t0)
        bwds.append(t2 - t1)
    ratios = [t / f for t, f in zip(totals, floors)]
    mapped_ratios = [t / f for t, f in zip(totals, mapped_floors)]
    row.update(floor_s=_summary(floors), mapped_floor_s=_summary(mapped_floors), time_s=_summary(totals),
               forward_s=_summary(fwds), backward_s=_summary(bwds), x_floor=_summary(ratios),
               x_mapped_floor=_summary(mapped_ratios), loss=float(loss))
    return row


def _line(row: dict) -> str:
    t, f, r = row["time_s"], row["floor_s"], row["x_floor"]
    mem = ""
    if "peak_above_inputs_and_grad_frac_of_logits" in row:
        mem = (f"  extra above logits+grad {row['peak_above_inputs_and_grad_bytes'] / 2**20:.0f} MiB "
               f"({100 * row['peak_above_inputs_and_grad_frac_of_logits']:.1f}% of logits)")
    return (f"{row['dtype']:9s} {row['kind']:8s} {row['method']:15s} time {t['median']:.3f} s (best {t['best']:.3f}, "
            f"spread {t['spread']:.3f})  floor {f['median']:.3f} s  x floor {r['median']:.2f} "
            f"[{min(r['all']):.2f}, {max(r['all']):.2f}]  x mapped-pages floor {row['x_mapped_floor']['median']:.2f}"
            f"{mem}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--v", type=int, default=151936)
    ap.add_argument("--k", type=int, default=128)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--kinds", default="head,support")
    ap.add_argument("--methods", default="offpolicy,offpolicy-torch,dense")
    ap.add_argument("--calls", type=int, default=5, help="timed calls of ours, each after a floor measurement")
    ap.add_argument("--dense-calls", type=int, default=2, help="timed calls of the dense way")
    ap.add_argument("--note", default="", help="saved with the results (e.g. whether the machine was shared)")
    ap.add_argument("--tag", default="", help="suffix of the result files")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        method, dtype, kind = args.child.split(",")
        calls = args.dense_calls if method == "dense" else args.calls
        print(json.dumps(run_case(method, args.n, args.v, args.k, dtype, kind, calls)))
        return
    load_start = os.getloadavg()
    rows = []
    for dtype in args.dtypes.split(","):
        for kind in args.kinds.split(","):
            for method in args.methods.split(","):
                cmd = [sys.executable, __file__, "--child", f"{method},{dtype},{kind}", "--n", str(args.n),
                       "--v", str(args.v), "--k", str(args.k), "--calls", str(args.calls),
                       "--dense-calls", str(args.dense_calls)]
                res = subprocess.run(cmd, capture_output=True, text=True, check=True)
                row = json.loads(res.stdout.strip().splitlines()[-1])
                rows.append(row)
                print(_line(row), flush=True)
            case = [r for r in rows if r["dtype"] == dtype and r["kind"] == kind]
            dense = next((r for r in case if r["method"] == "dense"), None)
            ours_rows = [r for r in case if r["method"] in OURS] if dense is not None else []
            for ours in ours_rows:
                ours["speedup_vs_dense"] = dense["time_s"]["median"] / ours["time_s"]["median"]
                print(f"{dtype:9s} {kind:8s} {ours['method']} speed-up over dense (medians): "
                      f"{ours['speedup_vs_dense']:.2f}x", flush=True)
    import torch

    from offpolicy.ops import cpu_native

    meta = {
        "host": socket.gethostname(), "machine": platform.machine(), "processor": platform.processor() or cpu_model(),
        "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/bench_cpu.py " + " ".join(sys.argv[1:]),
        "loadavg_start": load_start, "loadavg_end": os.getloadavg(), "note": args.note,
        "cpu_native": "built" if cpu_native.load() is not None else cpu_native.unavailable_reason(),
    }
    flat = []
    for r in rows:
        f = {key: val for key, val in r.items() if not isinstance(val, dict)}
        for key in ("time_s", "floor_s", "mapped_floor_s", "forward_s", "backward_s", "x_floor", "x_mapped_floor"):
            for stat in ("median", "best", "spread"):
                f[f"{key}_{stat}"] = r[key][stat]
        flat.append(f)
    stem = args.out / f"cpu_{meta['host']}_{dt.date.today().isoformat()}{args.tag}"
    write_results(stem, {"meta": meta, "results": rows}, flat)


if __name__ == "__main__":
    main()
