"""Cost of a CSR support record (mask replay) against its width, side by side with the dense pass (issue #42).

    python benchmarks/bench_support_width.py --threads 1            # N = 128, D = 128, V = 8192, 9 repetitions
    python benchmarks/bench_support_width.py --quick --out /tmp/x   # tiny shapes, 2 repetitions (the smoke test)
    python benchmarks/bench_support_width.py --threads 1 --tag _after   # ..._t1_<date>_after.json: keeps an earlier file

For each support width (about 1%, 10%, 50%, 85% and 100% of V by default; every row of the batch has that width,
the sampled token inside), forward + backward of ``op.policy_loss`` (MIS weights, ``validate=False``: the op's cost;
the record's validation is timed once more as ``+validate``) on three paths:

* ``cpu``: logits, the native C loops (``backend="cpu"``);
* ``torch``: logits, the chunked PyTorch backend (``backend="torch"``);
* ``linear``: ``hidden [N, D]`` and ``weight [V, D]`` (the fused-linear path; the default CPU backend);

and, in the same repetition, two baselines for each: ``dense`` (``torch.log_softmax`` of the ``[N, V]`` logits,
or of ``hidden @ weight.T``, forward + backward at the sampled tokens) and ``norec`` (the same ``op.policy_loss``
without a record: the full-vocabulary pass at the sampled tokens). The order of the calls is shuffled in every
repetition. Reported: seconds (min / median / max) and the per-repetition ratios ``support / dense`` and
``support / norec`` (min / median / max), with the machine, ``torch.__version__``, the thread count and the load
average before and after, in one JSON (and a CSV of the rows) under ``benchmarks/results/`` (``--out``).
Timings from a machine shared with other jobs are noise: the file records the load so that a reader can tell.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_io import cpu_model, write_results  # noqa: E402

import offpolicy as op  # noqa: E402
from offpolicy.ops.logits_op import cpu_backend  # noqa: E402

WIDTHS = (0.01, 0.10, 0.50, 0.85, 1.00)
PATHS = ("cpu", "torch", "linear")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--n", type=int, default=128, help="tokens N")
    p.add_argument("--v", type=int, default=8192, help="vocabulary V")
    p.add_argument("--d", type=int, default=128, help="hidden size D (fused-linear path)")
    p.add_argument("--reps", type=int, default=9, help="timed repetitions (after one warm-up)")
    p.add_argument("--widths", default=",".join(str(w) for w in WIDTHS), help="support widths as fractions of V")
    p.add_argument("--paths", default=",".join(PATHS), help=f"subset of {','.join(PATHS)}")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="logits / weights dtype")
    p.add_argument("--quick", action="store_true", help="tiny shapes and 2 repetitions: checks that the script runs")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="output folder")
    p.add_argument("--tag", default="", help="suffix of the output files' name (a second run on one day keeps the first)")
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.v, args.d, args.reps = 16, 256, 16, 2
    return args


def make_batch(n: int, v: int, d: int, width: float, dtype: torch.dtype, seed: int = 0) -> dict:
    """Logits, hidden states, weight and a CSR support record whose every row holds ``round(width V)`` ids
    (at least 1) including the sampled token, with uniform sampler log-probabilities over the support."""
    gen = torch.Generator().manual_seed(seed)
    k = max(1, min(v, round(width * v)))
    hidden = torch.randn(n, d, generator=gen)
    weight = torch.randn(v, d, generator=gen) / d ** 0.5
    logits = (hidden @ weight.T).to(dtype)
    tokens = torch.randint(0, v, (n,), generator=gen)
    # the support: the token, then k - 1 other ids in random order (no per-row sort needed)
    other = torch.argsort(torch.rand(n, v, generator=gen), dim=1)
    other = other[other != tokens[:, None]].view(n, v - 1)[:, :k - 1]
    ids = torch.cat([tokens[:, None], other], dim=1).reshape(-1)
    offsets = torch.arange(n + 1, dtype=torch.int64) * k
    lq = torch.full((n * k,), -float(torch.log(torch.tensor(float(k)))))
    record = op.CSRCandidates(ids, offsets, lq, kind="support")
    return dict(k=k, logits=logits, hidden=hidden.to(dtype), weight=weight.to(dtype), tokens=tokens, record=record,
                sampler_logprobs=lq[:n].clone(), advantages=torch.randn(n, generator=gen))


def _loss(b: dict, path: str, record, validate: bool = False):
    kw = dict(tokens=b["tokens"], sampler_logprobs=b["sampler_logprobs"], advantages=b["advantages"],
              candidates=record, validate=validate)
    if path == "linear":
        h, w = b["hidden"].detach().requires_grad_(), b["weight"].detach().requires_grad_()
        return op.policy_loss(hidden=h, weight=w, **kw).loss
    z = b["logits"].detach().requires_grad_()
    return op.policy_loss(z, backend=path, **kw).loss


def _dense(b: dict, path: str):
    if path == "linear":
        h, w = b["hidden"].detach().requires_grad_(), b["weight"].detach().requires_grad_()
        z = h @ w.T
    else:
        z = b["logits"].detach().requires_grad_()
    lp = torch.log_softmax(z.float(), dim=1).gather(1, b["tokens"][:, None]).squeeze(1)
    return -(b["advantages"] * lp).sum()


def cases(b: dict, path: str) -> dict:
    """name -> a callable running forward + backward once."""
    return {
        "support": lambda: _loss(b, path, b["record"]).backward(),
        "norec": lambda: _loss(b, path, None).backward(),
        "dense": lambda: _dense(b, path).backward(),
        "support+validate": lambda: _loss(b, path, b["record"], validate=True).backward(),
    }


def spread(xs: list[float]) -> dict:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    widths = [float(w) for w in args.widths.split(",")]
    paths = [p for p in args.paths.split(",") if p]
    bad = [p for p in paths if p not in PATHS]
    if bad:
        raise SystemExit(f"--paths: unknown {bad}; expected a subset of {PATHS}")
    skipped = []
    if "cpu" in paths and not cpu_backend.available():  # no C compiler here: said in the results, not fatal
        paths.remove("cpu")
        skipped.append("cpu")
    rng = random.Random(0)
    load_before = os.getloadavg()
    started = time.perf_counter()
    rows = []
    for width in widths:
        b = make_batch(args.n, args.v, args.d, width, dtype)
        for path in paths:
            calls = cases(b, path)
            for fn in calls.values():  # warm-up (builds the C loops, maps the gradient buffers)
                fn()
            times: dict[str, list[float]] = {name: [] for name in calls}
            for _ in range(args.reps):
                order = list(calls)
                rng.shuffle(order)
                for name in order:
                    t0 = time.perf_counter()
                    calls[name]()
                    times[name].append(time.perf_counter() - t0)
            ratio_dense = [s / d for s, d in zip(times["support"], times["dense"])]
            ratio_norec = [s / d for s, d in zip(times["support"], times["norec"])]
            row = {"path": path, "width": width, "k": b["k"], "n": args.n, "v": args.v, "d": args.d,
                   "dtype": args.dtype,
                   **{f"{name}_s_median": statistics.median(ts) for name, ts in times.items()},
                   "support_over_dense_median": statistics.median(ratio_dense),
                   "support_over_norec_median": statistics.median(ratio_norec),
                   "support_over_dense": spread(ratio_dense), "support_over_norec": spread(ratio_norec),
                   "seconds": {name: spread(ts) for name, ts in times.items()}, "raw_seconds": times}
            rows.append(row)
            print(f"{path:6s} width {width:5.2f} (K = {b['k']:6d}): support {row['support_s_median']:.4f} s, "
                  f"dense {row['dense_s_median']:.4f} s, norec {row['norec_s_median']:.4f} s; support / dense "
                  f"{row['support_over_dense_median']:.2f} [{min(ratio_dense):.2f}, {max(ratio_dense):.2f}], "
                  f"support / norec {row['support_over_norec_median']:.2f}", flush=True)
    return {
        "benchmark": "bench_support_width",
        "args": vars(args),
        "machine": {"platform": platform.platform(), "cpu": cpu_model(), "cpu_count": os.cpu_count(),
                    "threads": args.threads, "torch": torch.__version__, "python": platform.python_version()},
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "wall_s": time.perf_counter() - started,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "skipped_paths": skipped,
        "results": rows,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    payload = run(args)
    tag = "quick" if args.quick else f"t{args.threads}"
    stem = Path(args.out) / f"support_width_{platform.node() or 'host'}_{tag}_{payload['date'][:10]}{args.tag}"
    write_results(stem, payload, payload["results"], drop=("support_over_dense", "support_over_norec", "seconds",
                                                           "raw_seconds"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
