"""Compile every Triton kernel of ``offpolicy.kernels`` for GPUs this machine does not have, through its real wrapper.

A stand-in Triton driver answers the JIT's questions (target, current device and stream, shared memory per block)
and records launches instead of running them; the project's own wrappers are then called on ``device="meta"``
tensors of the headline shapes (N = 16384 tokens, V = 151936, K = 256 ids per row, D = 4096; quantisers
4096 x 4096; CSR support rows of K ids and of V ids), so the specialisations, tiles, ``num_warps`` and grids a GPU run would use are compiled to cubins
with Triton's bundled ptxas. Registers, spills and stack come from Triton's own ptxas log (``ptxas -v`` with its
flags), shared memory from the kernel's metadata, tensor-core use from the PTX (``mma.sync`` on sm_80,
``wgmma.mma_async`` on sm_90, ``tcgen05.mma`` on sm_100).

    python tools/aot_compile.py --out results.json [--targets sm_90,sm_100] [--only linear]
    python tools/aot_compile.py --markdown results.json [more.json]     # the table in docs/performance.md
    python tools/aot_compile.py --out r.json --only 'row_stats[int32]' --targets sm_90 --dump /tmp/k   # PTX, cubin

``TRITON_DEFAULT_FP_FUSION`` is 0 unless set (Triton 3.10's default; earlier versions ignore it), so a launch
that does not set ``enable_fp_fusion`` shows. Must run without ``TRITON_INTERPRET`` (the interpreter patches ``triton.language`` in place); exits 2 if it is
set. Exits 0 when every case compiled, whatever the checks say: the JSON records each kernel's numbers and the
caller (tests/ops/test_aot_compile.py) asserts on them. Triton's cache goes to a fresh temporary folder, so each
kernel is compiled (and its ptxas log read) in this process.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Target name -> (compute capability, shared memory per block opt-in, bytes).
TARGETS = {"sm_80": (80, 166_912), "sm_90": (90, 232_448), "sm_100": (100, 232_448)}
#: Tensor-core instruction (a PTX prefix) by compute capability.
TENSOR_CORE_PTX = {80: "mma.sync", 90: "wgmma.mma_async", 100: "tcgen05.mma"}
#: Headline shapes.
N, V, K, D = 16384, 151936, 256, 4096
QUANT_SHAPE = (4096, 4096)
#: A row count with N * V below 2**31: the 32-bit offset variant of the row kernels.
N_INT32 = 8192


@dataclass
class Case:
    """One wrapper call; ``matmul`` marks kernels whose tl.dot must use tensor cores."""

    name: str
    dtype: str
    call: Callable[[], object]
    matmul: bool = False


class _Utils:
    def __init__(self, shared: int):
        self.shared = shared
        self.handles: list[tuple[str, bytes]] = []

    def get_device_properties(self, device):
        return {"max_shared_mem": self.shared, "multiprocessor_count": 132, "max_num_regs": 65536,
                "warpSize": 32, "sm_clock_rate": 1_980_000, "mem_clock_rate": 2_619_000, "mem_bus_width": 5120}

    def load_binary(self, name, kernel, shared, device):
        self.handles.append((name, kernel))
        return len(self.handles), len(self.handles), 0, 0, 1024  # module, function, n_regs, n_spills, max threads

    def unload_module(self, module):
        pass


def make_driver(capability: int, shared: int, launches: list):
    """A ``triton.runtime.driver`` stand-in for one target; launches append ``(kernel name, grid)`` to ``launches``."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    class _Launcher:
        def __init__(self, src, metadata):
            self.name = metadata.name

        def __call__(self, g0, g1, g2, *args):
            launches.append((self.name, (g0, g1, g2)))

    class StandInDriver(DriverBase):
        launcher_cls = _Launcher

        def __init__(self):
            self.utils = _Utils(shared)
            self.target = GPUTarget("cuda", capability, 32)

        @classmethod
        def is_active(cls):
            return True

        def map_python_to_cpp_type(self, ty):
            return ty

        def get_current_target(self):
            return self.target

        def get_current_device(self):
            return capability  # one JIT cache per target: the caches are keyed by device

        def set_current_device(self, device):
            pass

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("meta")

        def get_device_interface(self):
            return torch.cuda

        def get_benchmarker(self):
            raise RuntimeError("the stand-in driver runs nothing")

        def get_empty_cache_for_benchmark(self):
            raise RuntimeError("the stand-in driver runs nothing")

        def clear_cache(self, cache):
            pass

    return StandInDriver()


def cases() -> list[Case]:
    """Every wrapper call at the headline shapes, bf16 and fp32."""
    import torch

    from offpolicy.kernels import blockwise_quant as Q
    from offpolicy.kernels import linear_logsoftmax as L
    from offpolicy.kernels import logsoftmax as S
    from offpolicy.kernels import support_logsoftmax as SP
    from offpolicy.ops.linear_op import linear_triton_backend as LB

    meta = torch.device("meta")

    def t(*shape, dtype=torch.float32):
        return torch.empty(*shape, dtype=dtype, device=meta)

    out: list[Case] = []
    for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        for n, tag in ((N, "int64"), (N_INT32, "int32")):
            z = t(n, V, dtype=dt)
            vec = t(n)
            out.append(Case(f"row_stats[{tag}]", name, lambda z=z, v=vec: S.row_stats(z, v)))
            out.append(Case(f"row_stats[{tag},skip,sum_p2]", name,
                            lambda z=z, v=vec, n=n: S.row_stats(z, v, t(n, dtype=torch.bool), sum_p2=True)))
            ids, g = t(n, K, dtype=torch.int64), t(n, K)
            out.append(Case(f"row_grad[{tag}]", name, lambda z=z, v=vec, i=ids, g=g: S.row_grad(z, i, v, v, g, v, z)))
            y = t(n, dtype=torch.int64)
            out.append(Case(f"row_loss_grad[{tag},skip,band,exp]", name, lambda z=z, v=vec, y=y, n=n: S.row_loss_grad(
                z, y, v, t(n, dtype=torch.bool), v, v, torch.empty_like(z), band=(-0.7, 1.6),
                exp_clip=(20.0, float("-inf"), float("inf")))))
            out.append(Case(f"row_loss_grad[{tag}]", name,
                            lambda z=z, v=vec, y=y: S.row_loss_grad(z, y, v, None, v, v, torch.empty_like(z))))
            # score centering over a head record (MIS + SC, the study's configuration; and with f = 1)
            head = (t(n, K, dtype=torch.int64), t(n, K))
            out.append(Case(f"row_loss_grad[{tag},skip,band,exp,head]", name,
                            lambda z=z, v=vec, y=y, n=n, h=head: S.row_loss_grad(
                                z, y, v, t(n, dtype=torch.bool), v, v, torch.empty_like(z), band=(-0.7, 1.6),
                                exp_clip=(20.0, float("-inf"), float("inf")), head=h)))
            out.append(Case(f"row_loss_grad[{tag},head]", name, lambda z=z, v=vec, y=y, h=head: S.row_loss_grad(
                z, y, v, None, v, v, torch.empty_like(z), head=h)))
        # CSR support rows (mask replay): K ids per row, and every row the whole vocabulary (nnz = N V >= 2**31)
        for n, nnz, tag in ((N, N * K, "int64"), (N_INT32, N_INT32 * K, "int32"), (N, N * V, "int64,K=V")):
            z, vec, off, ids = t(n, V, dtype=dt), t(n), t(n + 1, dtype=torch.int64), t(nnz, dtype=torch.int64)
            skip = t(n, dtype=torch.bool) if tag == "int32" else None
            out.append(Case(f"support_stats[{tag}{',skip' if skip is not None else ''}]", name,
                            lambda z=z, v=vec, o=off, i=ids, sk=skip: SP.support_stats(z, o, i, v, sk)))
            for g_ids in (True, False):
                out.append(Case(f"support_grad[{tag}{',g_ids' if g_ids else ''}]", name,
                                lambda z=z, v=vec, o=off, i=ids, n=n, nnz=nnz, g=g_ids: SP.support_grad(
                                    t(nnz), o, i, t(n, dtype=torch.int64), v, t(nnz) if g else None, v,
                                    t(n, dtype=torch.bool), z)))
        h, w, b = t(N, D, dtype=dt), t(V, D, dtype=dt), t(V, dtype=dt)
        vec, rows = t(N), t(N, dtype=torch.int64)
        acc_h, acc_w, acc_b = t(N, D), t(V, D), t(V)
        out.append(Case("linear_row_stats", name, lambda h=h, w=w, v=vec: L.linear_row_stats(h, w, None, v),
                        matmul=True))
        out.append(Case("linear_row_stats[bias,sum_p2]", name,
                        lambda h=h, w=w, b=b, v=vec: L.linear_row_stats(h, w, b, v, sum_p2=True), matmul=True))
        for eps in (None, 1e-6):
            out.append(Case(f"linear_dense_grad[filter={eps is not None}]", name,
                            lambda h=h, w=w, r=rows, v=vec, e=eps, ah=acc_h, aw=acc_w:
                            L.linear_dense_grad(h, w, None, r, v, v, v, ah, aw, None, eps=e), matmul=True))
        out.append(Case("linear_dense_grad[bias,dh only]", name,
                        lambda h=h, w=w, b=b, r=rows, v=vec, ah=acc_h, ab=acc_b:
                        L.linear_dense_grad(h, w, b, r, v, v, v, ah, None, ab), matmul=True))
        ids = t(N, K, dtype=torch.int64)
        # The backend's whole backward and forward on meta tensors: a host sync (nonzero, item) raises here.
        out.append(Case("linear_backend_backward", name, lambda h=h, w=w, b=b, i=ids, v=vec: LB.backward(
            h, w, b, i, t(N, K), v, v, v, chunk_bytes=1 << 30, grad_filter=1e-6), matmul=True))
        out.append(Case("linear_backend_full_stats", name, lambda h=h, w=w, i=ids, v=vec: LB.full_stats(
            h, w, None, i, v, 1 << 30), matmul=True))
        out.append(Case("gathered_dot", name, lambda h=h, w=w, b=b, i=ids: L.gathered_dot(h, w, b, i)))
        out.append(Case("gathered_grad", name, lambda h=h, w=w, i=ids, ah=acc_h, aw=acc_w, ab=acc_b:
                        L.gathered_grad(h, w, i, t(N, K), ah, aw, ab)))
        x = t(*QUANT_SHAPE, dtype=dt)
        out.append(Case("quantize_fp8", name, lambda x=x: Q.quantize_fp8(x)))
        out.append(Case("quantize_nvfp4", name, lambda x=x: Q.quantize_fp4(x, "nvfp4")))
        out.append(Case("quantize_mxfp4", name, lambda x=x: Q.quantize_fp4(x, "mxfp4")))
    rows_, cols_ = QUANT_SHAPE
    out.append(Case("dequantize_fp8", "u8", lambda: Q.dequantize_fp8(t(rows_, cols_, dtype=torch.uint8),
                                                                     t(rows_ // 128, cols_ // 128))))
    for fmt, group in (("nvfp4", 16), ("mxfp4", 32)):
        out.append(Case(f"dequantize_{fmt}", "u8", lambda f=fmt, g=group: Q.dequantize_fp4(
            t(rows_, cols_ // 2, dtype=torch.uint8), t(rows_, cols_ // g, dtype=torch.uint8),
            t((), dtype=torch.float32) if f == "nvfp4" else None, cols_, f)))
    return out


_ZERO32 = re.compile(r"mov\.b32\s+(%r\d+), 0f00000000;")
_ZERO64 = re.compile(r"mov\.b64\s+(%rd\d+), \{(%r\d+), (%r\d+)\};")
_FMA = re.compile(r"fma\.rn\.f32(x2)?\s+%r\w+, %r\w+, %r\w+, (0f00000000|%r\w+);")


def rounded_products(ptx: str) -> int:
    """``fma.rn(a, b, 0)`` instructions (``f32``, or packed ``f32x2`` on sm_100 with a pair of zeros): products
    rounded once that contraction cannot fuse into the next addition."""
    zero32 = set(_ZERO32.findall(ptx))
    zero64 = {d for d, a, b in _ZERO64.findall(ptx) if a in zero32 and b in zero32}
    return sum(1 for packed, c in _FMA.findall(ptx)
               if c == "0f00000000" or (c in zero64 if packed else c in zero32))  # fmt: skip

_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas(log: str) -> dict:
    """Registers, stack frame and spill bytes (per thread) from a ``ptxas -v`` log of one kernel."""
    used = _PTXAS_USED.findall(log)
    spill = _PTXAS_SPILL.findall(log)
    if not used or not spill:
        return {}
    stack, stores, loads = (int(x) for x in spill[-1])
    return {"registers": int(used[-1]), "stack": stack, "spill_stores": stores, "spill_loads": loads}


def _jit_functions():
    from triton.runtime.jit import JITFunction

    from offpolicy.kernels import blockwise_quant, linear_logsoftmax, logsoftmax, support_logsoftmax

    return [f for mod in (logsoftmax, linear_logsoftmax, blockwise_quant, support_logsoftmax) for f in vars(mod).values()
            if isinstance(f, JITFunction) and f.fn.__name__.endswith("_kernel")]


def _compiled(device: int) -> dict:
    """Every compiled kernel in the JIT caches of ``device``: id -> CompiledKernel."""
    found = {}
    for fn in _jit_functions():
        if device in fn.device_caches:
            for k in fn.device_caches[device][0].values():
                found[id(k)] = k
    return found


def run_case(case: Case, capability: int, shared: int, launches: list, dump: str | None = None) -> list[dict]:
    """Compile ``case`` for one target; one record per kernel it launched (or one error record). With ``dump``, each
    new kernel's PTX and cubin go to that folder as ``<kernel>.<case>.<dtype>.sm_<cc>.{ptx,cubin}`` (read the SASS
    with the bundled ``nvdisasm`` or ``cuobjdump -sass``)."""
    import triton

    before = _compiled(capability)
    log = io.StringIO()
    t0 = time.perf_counter()
    error = None
    try:
        with contextlib.redirect_stdout(log):
            case.call()
    except Exception as exc:  # noqa: BLE001 - a failure to compile is what this tool reports
        error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:400]
    seconds = time.perf_counter() - t0
    new = [k for i, k in _compiled(capability).items() if i not in before]
    base = {"case": case.name, "dtype": case.dtype, "target": f"sm_{capability}", "triton": triton.__version__,
            "max_shared": shared, "seconds": round(seconds, 2)}
    grids = {}
    for name, grid in launches:
        grids.setdefault(name, list(grid))
    launches.clear()
    if not new:  # an error before any compile, or only kernels compiled by an earlier case
        return [{**base, "kernel": None, "error": error, "launched": sorted(grids)}]
    logs = _split_logs(log.getvalue())
    records = []
    for k in new:
        md = k.metadata
        ptx = k.asm.get("ptx", "")
        tc = TENSOR_CORE_PTX.get(capability)
        rec = {**base, "kernel": md.name, "num_warps": md.num_warps, "num_stages": md.num_stages,
               "enable_fp_fusion": md.enable_fp_fusion, "shared": md.shared, "grid": grids.get(md.name),
               "tensor_core": bool(tc and tc in ptx), "matmul": case.matmul, "vector_loads": "ld.global.v4" in ptx,
               "barriers": ptx.count("bar.sync") + ptx.count("barrier.sync"), "acq_rel_atomics": ptx.count(".acq_rel"),
               "rounded_products": rounded_products(ptx),
               "error": error}
        rec.update(logs.get(md.name, {}))
        records.append(rec)
        if dump:
            stem = os.path.join(dump, re.sub(r"[^\w.,=-]+", "_", f"{md.name}.{case.name}.{case.dtype}.sm_{capability}"))
            with open(stem + ".ptx", "w") as f:
                f.write(ptx)
            with open(stem + ".cubin", "wb") as f:
                f.write(k.asm.get("cubin", b""))
    return records


def _split_logs(text: str) -> dict:
    """Triton's printed ptxas logs (knobs.nvidia.dump_ptxas_log) by kernel name."""
    out = {}
    for chunk in re.split(r"(?m)^(?=\S+ info\s+: Compiling entry function)", text):
        m = re.search(r"Compiling entry function '([^']+)'", chunk)
        if m:
            parsed = parse_ptxas(chunk)
            if parsed:
                out[m.group(1)] = parsed
    return out


def markdown(paths: list[str]) -> str:
    """One table row per kernel and dtype (the case with the most registers), a column per target and Triton:
    ``registers / spill stores (B) / shared memory (KiB)``."""
    cols, cells = [], {}
    for path in paths:
        data = json.loads(open(path).read())
        for r in data["records"]:
            if not r["kernel"]:
                continue
            col = f"{r['target']}, Triton {r['triton']}"
            cols += [col] if col not in cols else []
            key = (r["kernel"].strip("_").removesuffix("_kernel"), r["dtype"])
            best = cells.get((key, col))
            if best is None or (r.get("registers") or 0) > (best.get("registers") or 0):
                cells[key, col] = r
    keys = sorted({k for k, _ in cells})
    lines = ["| kernel | dtype | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for key in keys:
        row = []
        for col in cols:
            r = cells.get((key, col))
            if r is None:
                row.append("-")
            elif r.get("registers") is None:
                row.append("fails to compile" if r["error"] else "-")
            else:
                row.append(f"{r['registers']} / {r['spill_stores']} / {r['shared'] / 1024:.0f}"
                           + (" (fails)" if r["error"] else ""))
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def _kernels_in_place() -> None:
    """``offpolicy.kernels`` from this checkout's ``kernels/`` when offpolicy is not installed (``PYTHONPATH=src``)."""
    import offpolicy

    try:
        import offpolicy.kernels  # noqa: F401
    except ImportError:
        offpolicy.__path__.append(str(ROOT))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", nargs="+", metavar="JSON", help="print the table of these result files and exit")
    ap.add_argument("--out", help="JSON file to write the records to")
    ap.add_argument("--targets", default="sm_80,sm_90,sm_100", help="comma-separated, from " + ",".join(TARGETS))
    ap.add_argument("--only", default="", help="substring a case name must contain (default: every case)")
    ap.add_argument("--dump", help="folder to write each compiled kernel's PTX and cubin to")
    args = ap.parse_args(argv)
    if args.markdown:
        print(markdown(args.markdown))
        return 0
    if not args.out:
        ap.error("--out is required")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("aot_compile: unset TRITON_INTERPRET (the interpreter cannot lower kernels)", file=sys.stderr)
        return 2
    targets = [x for x in args.targets.split(",") if x]
    bad = [x for x in targets if x not in TARGETS]
    if bad:
        ap.error(f"--targets: unknown {bad}; known: {sorted(TARGETS)}")
    _kernels_in_place()
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
    # Triton 3.10's default (no FMA contraction unless a launch asks): a kernel that leaves it implicit shows it.
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "0")
    with tempfile.TemporaryDirectory(prefix="offpolicy-aot-triton-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        from triton import knobs
        from triton.runtime import driver

        knobs.nvidia.dump_ptxas_log = True
        launches: list = []
        records = []
        t0 = time.perf_counter()
        for tgt in targets:
            cap, shared = TARGETS[tgt]
            driver.set_active(make_driver(cap, shared, launches))
            for case in cases():
                if args.only in case.name:
                    records.extend(run_case(case, cap, shared, launches, args.dump))

    summary = {"triton": records[0]["triton"] if records else None, "seconds": round(time.perf_counter() - t0, 1),
               "shapes": {"N": N, "V": V, "K": K, "D": D, "quant": list(QUANT_SHAPE)}, "records": records}
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    failed = [r for r in records if r["error"]]
    print(f"aot_compile: {len(records)} kernels, {len(failed)} failed, {summary['seconds']} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
