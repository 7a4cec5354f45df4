"""GPU benchmark of the vocabulary pass: offpolicy's Triton kernels against the dense PyTorch way and Liger-Kernel.

One run (under 5 minutes on an H100/H200):

1. the device's copy bandwidth (a large device-to-device copy, read + write bytes) and bf16 matmul rate;
2. forward + backward of ``offpolicy.ops.sparse_log_softmax`` at ``N`` in {4096, 16384}, ``V = 151936``, bf16
   logits, head mode (target + K = 128 candidates, full-vocabulary softmax) and support mode (softmax over the
   K = 128 recorded ids), against torch eager dense (``log_softmax`` + gather + autograd), ``torch.compile`` of
   the same dense function, and Liger-Kernel's Triton GRPO loss (target only) when it imports;
3. a sweep of the kernels' tile width and warp count at the smaller ``N``.

Every timing is the median over ``--reps`` calls with the best and the spread (max - min) beside it, and the
ratio ``x_floor`` to the floor measured in the same run: one read of the logits and one write of their gradient
(``2 V b`` bytes per token, ``b`` = bytes per logit) at the measured copy bandwidth. It is also reported in GB/s
under the byte count of ``docs/spec.md#performance``, ``3 V b`` bytes per token (one read forward, one read and one
write backward), and as a fraction of the copy bandwidth;
peak memory is ``torch.cuda.max_memory_allocated`` above what was allocated before the call (the inputs).
Results go to ``benchmarks/results/gpu_bench_<device>_<date>.{json,csv}``.

``--dry-run`` runs every code path at tiny shapes on the CPU (Triton interpreter, fp16, ``torch.compile`` with
the ``eager`` backend) in seconds, so that the script cannot rot; its numbers mean nothing.

    pip install -e . --no-deps                      # offpolicy.kernels is mapped from kernels/ at install
    pip install --no-deps liger-kernel              # optional baseline
    python benchmarks/gpu_bench.py                  # on a GPU machine
    TRITON_INTERPRET=1 python benchmarks/gpu_bench.py --dry-run --out /tmp/bench
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from results_io import write_results  # beside this script

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Config:
    device: torch.device
    dry_run: bool
    ns: list[int]
    vocab: int
    k: int
    dtype: torch.dtype
    temperature: float
    warmup: int
    reps: int
    copy_bytes: int
    matmul_size: int
    compile_backend: str
    sweep_blocks: list[int]
    sweep_warps: list[int]
    budget_s: float
    start: float = field(default_factory=time.perf_counter)

    def out_of_time(self) -> bool:
        return time.perf_counter() - self.start > self.budget_s


def make_config(args: argparse.Namespace) -> Config:
    if args.dry_run:
        return Config(
            device=torch.device("cpu"), dry_run=True, ns=[8, 16], vocab=512, k=8, dtype=torch.float16,
            temperature=0.9, warmup=1, reps=2, copy_bytes=16 << 20, matmul_size=128, compile_backend="eager",
            sweep_blocks=[256, 512], sweep_warps=[4], budget_s=args.budget_s,
        )  # fmt: skip
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: run on a GPU machine, or use --dry-run")
    return Config(
        device=torch.device("cuda"), dry_run=False, ns=args.ns, vocab=args.vocab, k=args.k, dtype=torch.bfloat16,
        temperature=0.9, warmup=3, reps=args.reps, copy_bytes=4 << 30, matmul_size=8192, compile_backend="inductor",
        sweep_blocks=[2048, 4096, 8192, 16384], sweep_warps=[4, 8, 16], budget_s=args.budget_s,
    )  # fmt: skip


# ---------------------------------------------------------------- timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_stats_ms(device: torch.device, fn: Callable[[], object], warmup: int, reps: int) -> dict:
    """Wall times of ``fn`` in milliseconds over ``reps`` calls (CUDA events on a GPU): median, best, spread."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return {"median": statistics.median(times), "best": min(times), "spread": max(times) - min(times)}


def time_ms(device: torch.device, fn: Callable[[], object], warmup: int, reps: int) -> float:
    """Median wall time of ``fn`` in milliseconds."""
    return time_stats_ms(device, fn, warmup, reps)["median"]


def copy_bandwidth_gbps(cfg: Config) -> float:
    """Device copy bandwidth: ``2 * bytes / time`` (each byte read once and written once)."""
    src = torch.empty(cfg.copy_bytes // 4, dtype=torch.float32, device=cfg.device).fill_(1.0)
    dst = torch.empty_like(src)
    ms = time_ms(cfg.device, lambda: dst.copy_(src), cfg.warmup, max(cfg.reps, 5))
    return 2 * cfg.copy_bytes / (ms * 1e-3) / 1e9


def matmul_tflops(cfg: Config) -> float:
    n = cfg.matmul_size
    dtype = torch.bfloat16 if cfg.device.type == "cuda" else torch.float32
    a = torch.randn(n, n, dtype=dtype, device=cfg.device)
    b = torch.randn(n, n, dtype=dtype, device=cfg.device)
    ms = time_ms(cfg.device, lambda: a @ b, cfg.warmup, max(cfg.reps, 5))
    return 2 * n**3 / (ms * 1e-3) / 1e12


# ---------------------------------------------------------------- problem and methods


@dataclass
class Problem:
    logits: torch.Tensor  # [N, V]
    targets: torch.Tensor  # [N]
    cands: torch.Tensor  # [N, K]
    w_t: torch.Tensor  # [N] upstream gradient of the target log-probabilities
    w_c: torch.Tensor  # [N, K] upstream gradient of the candidates' log-probabilities
    support: bool


def make_problem(cfg: Config, n: int, support: bool, seed: int = 0) -> Problem:
    """Random logits (std 2); ``K`` distinct ids per row, ``(r + j * step) mod V`` with ``step * K < V``. In support
    mode the target is the first id of its support; in head mode it is uniform (it may be a candidate)."""
    gen = torch.Generator(device=cfg.device).manual_seed(seed)
    v, k = cfg.vocab, cfg.k
    logits = (torch.randn(n, v, generator=gen, device=cfg.device, dtype=torch.float32) * 2).to(cfg.dtype)
    start = torch.randint(0, v, (n, 1), generator=gen, device=cfg.device)
    step = torch.randint(1, max(2, v // k), (n, 1), generator=gen, device=cfg.device)
    cands = (start + torch.arange(k, device=cfg.device) * step) % v
    targets = cands[:, 0].clone() if support else torch.randint(0, v, (n,), generator=gen, device=cfg.device)
    w_t = torch.randn(n, generator=gen, device=cfg.device)
    w_c = torch.randn(n, k, generator=gen, device=cfg.device) * 0.1
    return Problem(logits.requires_grad_(), targets, cands, w_t, w_c, support)


def ours(cfg: Config, inplace: bool) -> Callable[[Problem], tuple[torch.Tensor, torch.Tensor]]:
    import offpolicy.ops as ops

    def run(p: Problem):
        out = ops.sparse_log_softmax(p.logits, p.targets, p.cands, cfg.temperature, support=p.support,
                                     inplace_grad=inplace, backend="triton")  # fmt: skip
        (g,) = torch.autograd.grad((out.target, out.candidates), p.logits, (p.w_t, p.w_c))
        return torch.cat([out.target[:, None], out.candidates], 1), g

    return run


def _dense(logits, targets, cands, temperature: float, support: bool):
    x = logits.float() / temperature
    if support:
        keep = torch.zeros_like(x, dtype=torch.bool).scatter_(1, cands, True)
        x = x.masked_fill(~keep, float("-inf"))
    logp = torch.log_softmax(x, dim=-1)
    return logp.gather(1, torch.cat([targets[:, None], cands], 1))


def dense(cfg: Config, compiled: bool) -> Callable[[Problem], tuple[torch.Tensor, torch.Tensor]]:
    fn = torch.compile(_dense, backend=cfg.compile_backend) if compiled else _dense

    def run(p: Problem):
        if compiled:
            torch._dynamo.mark_dynamic(p.logits, 0)  # one compilation for every N
        lp = fn(p.logits, p.targets, p.cands, cfg.temperature, p.support)
        (g,) = torch.autograd.grad(lp, p.logits, torch.cat([p.w_t[:, None], p.w_c], 1))
        return lp, g

    return run


def liger(cfg: Config) -> Callable[[Problem], tuple[torch.Tensor, torch.Tensor]]:
    """Liger-Kernel's Triton GRPO loss (``loss_type="grpo"``, ``beta = 0``, in place): target log-probabilities
    only. Liger takes ``[B, L + 1, V]`` logits and scores the first ``L`` positions of each sequence, so the
    ``N`` tokens are laid out as ``B = N / L`` sequences, and its input (built once, outside the timing) holds
    ``B`` extra unread rows."""
    from liger_kernel.transformers.grpo_loss import triton_grpo_loss

    inputs: dict[int, tuple] = {}

    def run(p: Problem):
        if id(p) not in inputs:
            n, v = p.logits.shape
            length = next(d for d in (1024, 256, 64, 16, 4, 2, 1) if n % d == 0)
            b = n // length
            z = p.logits.detach().view(b, length, v)
            z = torch.cat([z, z[:, -1:]], 1).requires_grad_()
            ids = p.targets.view(b, length)
            old = torch.zeros(b, length, device=z.device)
            inputs[id(p)] = (z, ids, old, p.w_t[:b].contiguous())
        z, ids, old, adv = inputs[id(p)]
        loss, _ = triton_grpo_loss(z, old, None, ids, adv, None, temperature=cfg.temperature, beta=0.0,
                                   inplace=True, loss_type="grpo", reduce=True)  # fmt: skip
        (g,) = torch.autograd.grad(loss, z)
        return loss, g

    return run


# ---------------------------------------------------------------- measurement


def measure(cfg: Config, name: str, mode: str, n: int, make: Callable, copy_gbps: float,
            reference: torch.Tensor | None = None) -> dict:  # fmt: skip
    """Time forward + backward of one method; ``reference`` ``[N, 1 + K]`` log-probabilities check its values."""
    v, b = cfg.vocab, torch.finfo(cfg.dtype).bits // 8
    row = {"method": name, "mode": mode, "n": n, "v": v, "k": cfg.k, "dtype": str(cfg.dtype).split(".")[-1],
           "status": "ok", "ms": None, "ms_best": None, "ms_spread": None, "floor_ms": None, "x_floor": None,
           "gbps": None, "frac_copy": None, "peak_extra_gib": None,
           "peak_extra_over_logits": None, "max_err_logp": None}  # fmt: skip
    if cfg.out_of_time():
        row["status"] = "skipped: time budget"
        return row
    try:
        fn = make()
        p = make_problem(cfg, n, mode == "support")
        lp, g = fn(p)  # the first call compiles, builds any cached input, and gives the value check
        if reference is not None:
            ok = torch.isfinite(reference)
            row["max_err_logp"] = float((lp.detach().double() - reference.double())[ok].abs().max())
        del lp, g
        sync(cfg.device)
        if cfg.device.type == "cuda":
            base = torch.cuda.memory_allocated()  # inputs (and Liger's relaid copy of them)
            torch.cuda.reset_peak_memory_stats()
        stats = time_stats_ms(cfg.device, lambda: fn(p), cfg.warmup, cfg.reps)
        row["ms"], row["ms_best"], row["ms_spread"] = stats["median"], stats["best"], stats["spread"]
        # The floor: one read of the logits and one write of their gradient at the measured copy bandwidth.
        row["floor_ms"] = 2 * n * v * b / (copy_gbps * 1e9) * 1e3
        row["x_floor"] = row["ms"] / row["floor_ms"]
        if cfg.device.type == "cuda":
            extra = torch.cuda.max_memory_allocated() - base
            row["peak_extra_gib"] = extra / 2**30
            row["peak_extra_over_logits"] = extra / (n * v * b)
        row["gbps"] = 3 * n * v * b / (row["ms"] * 1e-3) / 1e9
        row["frac_copy"] = row["gbps"] / copy_gbps
    except Exception as err:  # noqa: BLE001  (a baseline that fails is reported, not fatal)
        row["status"] = f"error: {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
    finally:
        if cfg.device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def sweep(cfg: Config, copy_gbps: float) -> list[dict]:
    """Tile width x warps for each kernel alone, at the smallest N (bf16 on a GPU)."""
    from offpolicy.kernels import logsoftmax as kernels

    n, v, b = cfg.ns[0], cfg.vocab, torch.finfo(cfg.dtype).bits // 8
    p = make_problem(cfg, n, False)
    z = p.logits.detach()
    inv = torch.full((n,), 1 / cfg.temperature, device=cfg.device)
    ids = torch.cat([p.targets[:, None], p.cands], 1)
    grad = torch.cat([p.w_t[:, None], p.w_c], 1)
    m, s, _ = kernels.row_stats(z, inv)
    lse = m + torch.log(s)
    out = torch.empty_like(z)
    rows = []
    for block in cfg.sweep_blocks:
        for warps in cfg.sweep_warps:
            for kernel, nbytes in (("row_stats", n * v * b), ("row_grad", 2 * n * v * b)):
                row = {"kernel": kernel, "block": block, "num_warps": warps, "n": n, "v": v, "status": "ok"}
                if cfg.out_of_time():
                    row["status"] = "skipped: time budget"
                elif kernel == "row_stats":
                    row["ms"] = time_ms(cfg.device, lambda: kernels.row_stats(z, inv, block=block, num_warps=warps),
                                        cfg.warmup, cfg.reps)  # fmt: skip
                else:
                    row["ms"] = time_ms(cfg.device, lambda: kernels.row_grad(z, ids, inv, lse, grad, grad.sum(1),
                                        out, block=block, num_warps=warps), cfg.warmup, cfg.reps)  # fmt: skip
                if "ms" in row:
                    row["gbps"] = nbytes / (row["ms"] * 1e-3) / 1e9
                    row["frac_copy"] = row["gbps"] / copy_gbps
                rows.append(row)
    return rows


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for dist in ("triton", "liger-kernel", "offpolicy"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    return out


def _short(row: dict) -> dict:
    return {k: (float(f"{v:.4g}") if isinstance(v, float) else v) for k, v in row.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON and CSV results")
    ap.add_argument("--ns", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 16384])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--k", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=270.0, help="skip what remains after this many seconds")
    ap.add_argument("--no-sweep", action="store_true")
    args = ap.parse_args(argv)
    if args.dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--dry-run needs TRITON_INTERPRET=1 in the environment (Triton's CPU interpreter)")
    cfg = make_config(args)
    torch.manual_seed(0)
    name = torch.cuda.get_device_name() if cfg.device.type == "cuda" else f"cpu-{platform.machine()}"
    print(f"device: {name}; dry run: {cfg.dry_run}", flush=True)
    copy_gbps = copy_bandwidth_gbps(cfg)
    tflops = matmul_tflops(cfg)
    print(f"copy bandwidth {copy_gbps:.0f} GB/s; matmul {tflops:.1f} TFLOP/s", flush=True)

    methods = [
        ("offpolicy", lambda: ours(cfg, inplace=False), ("head", "support")),
        ("offpolicy_inplace", lambda: ours(cfg, inplace=True), ("head", "support")),
        ("torch_eager_dense", lambda: dense(cfg, compiled=False), ("head", "support")),
        ("torch_compile_dense", lambda: dense(cfg, compiled=True), ("head", "support")),
        ("liger_grpo", lambda: liger(cfg), ("target_only",)),
    ]
    rows = []
    for n in cfg.ns:
        for mode in ("head", "support", "target_only"):
            reference = None
            if mode != "target_only" and not cfg.out_of_time():
                p = make_problem(cfg, n, mode == "support")
                with torch.no_grad():
                    reference = _dense(p.logits.double() if cfg.dry_run else p.logits, p.targets, p.cands,
                                       cfg.temperature, p.support)  # fmt: skip
                del p
            for method, make, modes in methods:
                if mode not in modes:
                    continue
                row = measure(cfg, method, mode, n, make, copy_gbps, None if method == "liger_grpo" else reference)
                rows.append(row)
                print(json.dumps(_short(row)), flush=True)
            del reference
    sweep_rows = [] if args.no_sweep else sweep(cfg, copy_gbps)
    for r in sweep_rows:
        print(json.dumps(_short(r)), flush=True)

    date = dt.datetime.now(dt.timezone.utc)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower() + ("-dryrun" if cfg.dry_run else "")
    stem = f"gpu_bench_{slug}_{date.strftime('%Y%m%dT%H%M%SZ')}"
    result = {
        "device": name, "dry_run": cfg.dry_run, "date": date.isoformat(), "host": platform.node(),
        "versions": versions(), "copy_gbps": copy_gbps, "matmul_tflops": tflops,
        "matmul_dtype": "bfloat16" if cfg.device.type == "cuda" else "float32",
        "byte_model": "3 * V * bytes_per_logit per token (docs/spec.md#performance)", "temperature": cfg.temperature,
        "reps": cfg.reps, "elapsed_s": time.perf_counter() - cfg.start,
        "config": {k: (str(v) if not isinstance(v, (int, float, bool, list)) else v) for k, v in asdict(cfg).items()},
        "rows": rows, "sweep": sweep_rows,
    }  # fmt: skip
    write_results(args.out / stem, result, [{"device": name, "date": result["date"], **r} for r in rows])
    print(f"in {result['elapsed_s']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
