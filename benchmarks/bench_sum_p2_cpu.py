"""CPU benchmark of ``sum_p2=True``: the vocabulary pass with and without the extra ``q = sum exp(2 (x - m))``
accumulator, side by side in one run.

For each case (primitive, backend, dtype) the two calls alternate, ``--repeats`` pairs after one warm-up pair, each
timed with ``perf_counter``; the ratio of each pair (with / without) is reported as min, median and max, with the
median times. The calls are forwards without gradient (the statistics pass, where ``sum_p2`` adds its work; the
backward is unchanged).

    python benchmarks/bench_sum_p2_cpu.py --note "machine loaded by other helpers"

Results go to benchmarks/results/<machine>_<date>_sum_p2.json (with the command line, the load average before and
after, and the note).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from results_io import cpu_model  # beside this script

RESULTS = Path(__file__).resolve().parent / "results"


def _case(primitive: str, backend: str, dtype: str, n: int, v: int, d: int, repeats: int) -> dict:
    import torch

    from offpolicy.ops import linear_sparse_log_softmax, sparse_log_softmax

    gen = torch.Generator().manual_seed(0)
    dt_ = getattr(torch, dtype)
    y = torch.randint(0, v, (n,), generator=gen)
    if primitive == "logits":
        z = (torch.randn(n, v, generator=gen) * 3).to(dt_)

        def call(flag: bool):
            return sparse_log_softmax(z, y, temperature=0.9, backend=backend, sum_p2=flag)
    else:
        h = torch.randn(n, d, generator=gen).to(dt_)
        w = (torch.randn(v, d, generator=gen) / d**0.5).to(dt_)

        def call(flag: bool):
            return linear_sparse_log_softmax(h, w, y, temperature=0.9, backend=backend, sum_p2=flag)

    times = {False: [], True: []}
    with torch.no_grad():
        for i in range(repeats + 1):
            for flag in (False, True) if i % 2 == 0 else (True, False):  # alternate the order within pairs
                t0 = time.perf_counter()
                call(flag)
                times[flag].append(time.perf_counter() - t0)
    base, with_q = times[False][1:], times[True][1:]
    ratios = [b / a for a, b in zip(base, with_q)]
    return {"primitive": primitive, "backend": backend, "dtype": dtype, "n": n, "v": v,
            "d": d if primitive == "linear" else None, "repeats": repeats,
            "median_s_without": statistics.median(base), "median_s_with": statistics.median(with_q),
            "ratio_min": min(ratios), "ratio_median": statistics.median(ratios), "ratio_max": max(ratios),
            "ratios": ratios}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--v", type=int, default=32768)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--machine", default="vm")
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    load_before = os.getloadavg()
    rows = []
    for primitive, backend, dtype in (("logits", "cpu", "float32"), ("logits", "cpu", "bfloat16"),
                                      ("logits", "torch", "float32"), ("logits", "torch", "bfloat16"),
                                      ("linear", "torch", "float32")):
        v = args.v if primitive == "logits" else args.v // 4
        row = _case(primitive, backend, dtype, args.n, v, args.d, args.repeats)
        print(f"{primitive:6s} {backend:5s} {dtype:8s} ratio median {row['ratio_median']:.3f} "
              f"[{row['ratio_min']:.3f}, {row['ratio_max']:.3f}]  {row['median_s_without'] * 1e3:.2f} ms",
              flush=True)
        rows.append(row)
    payload = {"command": " ".join([sys.executable.split("/")[-1], *sys.argv]), "machine": args.machine,
               "cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
               "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               "load_before": load_before, "load_after": os.getloadavg(), "note": args.note, "rows": rows}
    date = dt.date.today().isoformat()
    out = RESULTS / f"{args.machine}_{date}_sum_p2.json"
    out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
