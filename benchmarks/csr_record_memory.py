"""Memory of the loss on a CSR record against the padded one, at a real vocabulary (docs/spec.md#record-memory).

Counts every storage the ops create during ``op.policy_loss(...)`` forward and backward (a ``TorchDispatchMode``;
a storage from the op that made it until it is freed; views and in-place results are not new memory), at peak,
minus the logits' gradient itself. ``OFFPOLICY_REUSE_GRAD=0`` so that the gradient buffer is a fresh allocation
on both paths. The workload is the one of ``tests/core/test_csr_records.py::test_csr_memory_bound_at_a_real_vocabulary``:
``V = 151,936``, ``N = 64`` fp32 logits, supports of 2 to 39 ids with one row in 16 holding 3,000 and one 300,
MIS with score centering, validation on.

    python benchmarks/csr_record_memory.py

Then each layout's forward + backward is timed (``--calls`` calls after one warm-up, median and min, without the
meter), the two layouts alternating; on a shared machine the times are indicative only (the load average is
recorded). Results go to benchmarks/results/csr_memory_<date>.json.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import offpolicy as op
from offpolicy.testing.memory import LiveBytes

RESULTS = Path(__file__).resolve().parent / "results"


def batch(kind: str, n: int = 64, v: int = 151_936, seed: int = 81):
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(2, 40, (n,), generator=gen)
    sizes[::16] = 3000
    sizes[5] = 300
    z = torch.randn(n, v, generator=gen) * 2
    y = torch.randint(0, v, (n,), generator=gen)
    ids, lqs = [], []
    for t, k in enumerate(sizes.tolist()):
        s = torch.randperm(v, generator=gen)[:k]
        s = torch.cat([y[t:t + 1], s[s != y[t]]])[:k]
        lqs.append(torch.log_softmax(torch.randn(k, generator=gen), 0) - (0.0 if kind == "support" else 1.0))
        ids.append(s)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])
    rec = op.CSRCandidates(torch.cat(ids), offsets, torch.cat(lqs), kind)
    lq = torch.full((n,), -3.0)
    return z, y, lq, rec, torch.randn(n, generator=gen)


def main() -> None:
    calls = int(sys.argv[sys.argv.index("--calls") + 1]) if "--calls" in sys.argv else 5
    os.environ["OFFPOLICY_REUSE_GRAD"] = "0"
    load_before = os.getloadavg()
    rows = []
    corr = op.Correction(weights="mis", score_centering=True)
    for kind in ("head", "support"):
        z, y, lq, rec, adv = batch(kind)
        n = z.shape[0]
        k_max = int(rec.lengths.max())
        for layout, r in (("csr", rec), ("padded", rec.to_padded())):
            leaf = z.clone().requires_grad_()
            meter = LiveBytes()
            with meter:
                op.policy_loss(leaf, y, lq, adv, r, None, 1.0, corr).loss.backward()
            extra = meter.peak - leaf.numel() * 4
            rows.append({"kind": kind, "layout": layout, "N": n, "V": z.shape[1], "nnz": rec.nnz, "K_max": k_max,
                         "extra_bytes": extra, "extra_bytes_per_recorded_id": extra / rec.nnz,
                         "padded_record_bytes": n * k_max * 12})
        times = {"csr": [], "padded": []}
        records = {"csr": rec, "padded": rec.to_padded()}
        for i in range(calls + 1):
            for layout in ("csr", "padded"):
                leaf = z.clone().requires_grad_()
                t0 = time.perf_counter()
                op.policy_loss(leaf, y, lq, adv, records[layout], None, 1.0, corr).loss.backward()
                if i:  # the first call of each builds and warms up
                    times[layout].append(time.perf_counter() - t0)
        for r in rows[-2:]:
            r["seconds_median"] = statistics.median(times[r["layout"]])
            r["seconds_min"] = min(times[r["layout"]])
            print(r, flush=True)
    meta = {"date": dt.datetime.now(dt.timezone.utc).isoformat(), "torch": torch.__version__,
            "machine": platform.machine(), "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
            "load_before": load_before, "load_after": os.getloadavg(),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"csr_memory_{dt.date.today().isoformat()}.json"
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
