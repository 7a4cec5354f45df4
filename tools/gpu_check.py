"""The prepared GPU run: every Triton kernel checked and measured on the GPU it runs on, with nothing to install.

    PYTHONPATH=src python tools/gpu_check.py                 # from the checkout's root, on a GPU machine
    python tools/gpu_check.py --dry-run --out /tmp/check     # anywhere: the interpreter at tiny shapes

Needs torch and triton only (no install of offpolicy, no network): the checkout's ``src`` and ``kernels/`` are
found in place. Records the device, driver, torch, CUDA and Triton versions, then, in a time budget (default 480 s):

(a) correctness: ``sparse_log_softmax`` (head and support modes, forward and gradient), ``policy_loss`` through the
    two-pass kernel (each token-level weight mode, without and with score centering over a head record, loss and
    gradient against the float64 reference; MIS + SC + top-p replay through the support pass, padded and as a
    CSR record, whose support kernels must launch once each), and
    ``linear_sparse_log_softmax`` (forward, ``dh`` and ``dW``) on the Triton backend against float64 torch, in bf16
    and fp32; the 64-bit offset path (``N V > 2**31``, rows at both ends against float64); the FP8 / NVFP4 / MXFP4
    quantisers bit-exact against the torch reference (codes, scales and the decoded weights);
(b) resources: each compiled kernel's registers, spills and shared memory as the driver reports them
    (``n_regs``, ``n_spills``, ``metadata.shared``);
(c) speed at the headline shapes (N = 16384, V = 151936, bf16; fused linear N = 8192, D = 4096): the measured
    copy bandwidth and bf16 matmul rate of the device, offpolicy's forward + backward as a fraction of them (the
    spec's ``3 V b`` bytes per token; ``8 N V D`` FLOPs), and the baselines a user would pick: dense torch,
    ``torch.compile`` of it, Liger-Kernel where it imports; the token-level loss's three passes against the
    two-pass kernel (``2 V b`` bytes per token) at one, two and four programs per SM, and with MIS + score
    centering over a head record of K = 256 ids; the support pass of a CSR support record (its Triton kernels)
    against the dense pass at supports of 1% to 100% of V (2,048 rows).

Writes ``gpu_check_<device>_<date>.json`` (``--out``, default benchmarks/results/) and exits 1 when any check
failed (2 on bad usage). ``--dry-run`` sets ``TRITON_INTERPRET=1`` and runs every path on the CPU at tiny shapes
(fp16 for bf16, which the interpreter cannot do); its numbers mean nothing (tests/ops/kernels/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _in_place() -> None:
    """Import offpolicy from this checkout, and its ``kernels/`` as ``offpolicy.kernels`` when it is not installed."""
    sys.path[:0] = [str(ROOT / "src")]
    import offpolicy

    try:
        import offpolicy.kernels  # noqa: F401
    except ImportError:
        offpolicy.__path__.append(str(ROOT))  # offpolicy.kernels -> ROOT/kernels


class Checks:
    """Collects named results; a failed one (or one that raised) makes the run exit non-zero."""

    def __init__(self, budget_s: float):
        self.rows: list[dict] = []
        self.start = time.perf_counter()
        self.budget_s = budget_s

    def out_of_time(self) -> bool:
        return time.perf_counter() - self.start > self.budget_s

    def run(self, name: str, fn, *args) -> dict | None:
        if self.out_of_time():
            self.rows.append({"check": name, "ok": False, "error": "out of time"})
            return None
        t0 = time.perf_counter()
        try:
            res = fn(*args) or {}
            ok = bool(res.pop("ok", True))
            row = {"check": name, "ok": ok, **res}
        except Exception as exc:  # noqa: BLE001 - every failure is recorded, then the run goes on
            row = {"check": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000],
                   "trace": traceback.format_exc()[-3000:]}
        row["seconds"] = round(time.perf_counter() - t0, 2)
        self.rows.append(row)
        print(("ok  " if row["ok"] else "FAIL"), name, row.get("error", ""), flush=True)
        return row


def _err(got, want) -> tuple[float, float]:
    """Largest absolute error and the reference's largest magnitude, over finite reference entries."""
    got, want = got.detach().double(), want.detach().double()
    fin = want.isfinite()
    same_inf = bool((got[~fin] == want[~fin]).all())
    if not same_inf:
        return float("inf"), 1.0
    return float((got - want)[fin].abs().max()) if fin.any() else 0.0, float(want[fin].abs().max()) if fin.any() else 1.0


def check_logits(dev, dtype, n, v, k, support, tol):
    import torch

    import offpolicy.ops as ops

    gen = torch.Generator(device="cpu").manual_seed(7)
    z = (torch.randn(n, v, generator=gen) * 3).to(dev, dtype).requires_grad_()
    y = torch.randint(0, v, (n,), generator=gen).to(dev)
    c = torch.randint(0, v, (n, k), generator=gen).to(dev)
    if support:  # distinct ids per row, the target among them
        c = torch.argsort(torch.rand(n, v, generator=gen), 1)[:, :k].to(dev)
        y = c[:, 0].clone()
    tau = 0.9
    out = ops.sparse_log_softmax(z, y, c, tau, support=support, backend="triton")
    gt, gc = torch.randn(n, generator=gen).to(dev), torch.randn(n, k, generator=gen).to(dev)
    (gz,) = torch.autograd.grad((out.target * gt).sum() + (out.candidates * gc).sum(), z)
    z64 = z.detach().double().requires_grad_()
    x = z64 / tau
    if support:
        mask = torch.full_like(x, float("-inf")).scatter(1, c, 0.0)
        x = x + mask
    logp = torch.log_softmax(x, 1)
    t64, c64 = logp.gather(1, y[:, None])[:, 0], logp.gather(1, c)
    (g64,) = torch.autograd.grad((t64 * gt.double()).sum() + (c64 * gc.double()).sum(), z64)
    res = {}
    for name, got, want, rel in (("target", out.target, t64, False), ("candidates", out.candidates, c64, False),
                                 ("grad", gz, g64, True)):
        e, scale = _err(got, want)
        res[f"{name}_err"] = e
        res[f"{name}_ok"] = e <= (tol * scale if rel else tol) + 1e-6
    res["ok"] = all(v_ for key, v_ in res.items() if key.endswith("_ok"))
    return res


def check_two_pass(dev, dtype, n, v, tol):
    """``policy_loss`` through the two-pass kernel (triton backend, token-level weights: the statistics and the
    gradient in one program per row) against the float64 reference loss and gradient, for each weight mode, without
    and with score centering over a head record of 32 ids (the study's MIS + SC among them: the head term in the
    same program); and MIS + SC + top-p replay (a support record), which takes the support pass (no vocabulary
    read, no two-pass launch), against the same reference."""
    import torch

    import offpolicy as op
    from offpolicy.kernels import logsoftmax as K
    from offpolicy.kernels import support_logsoftmax as SK
    from offpolicy.reference import reference_policy_loss

    gen = torch.Generator(device="cpu").manual_seed(11)
    z = (torch.randn(n, v, generator=gen) * 3).to(dtype)
    y = torch.randint(0, v, (n,), generator=gen)
    x = z.double() / 0.9
    logp = torch.log_softmax(x, 1)
    lp = logp.gather(1, y[:, None])[:, 0]
    lq = (lp - torch.empty(n, dtype=torch.float64).uniform_(-1.5, 2.0, generator=gen)).clamp_max(0).float()
    adv = torch.randn(n, generator=gen)
    mask = torch.rand(n, generator=gen) > 0.2
    k = min(32, v)
    # a head record: the sampler's top-k (the trainer's, perturbed), its mass at most 1, the target's entry its lq
    ids = torch.topk(x + torch.randn(n, v, generator=gen, dtype=torch.float64), k, 1).indices
    lq_h = logp.gather(1, ids) + 0.3 * torch.randn(n, k, generator=gen, dtype=torch.float64)
    lq_h = torch.where(ids == y[:, None], lq.double()[:, None], lq_h)
    lq_h = lq_h - (torch.logsumexp(lq_h, 1) + 0.01).clamp_min(0)[:, None]
    lq_y = torch.where((ids == y[:, None]).any(1), lq_h.gather(1, (ids == y[:, None]).int().argmax(1)[:, None])[:, 0],
                       lq.double()).float()
    head = op.Candidates(ids, lq_h.float(), "head")
    # a top-p support: the target and the k - 1 largest others, q renormalised over it
    sup = torch.cat([y[:, None], torch.topk(x.scatter(1, y[:, None], -float("inf")), k - 1, 1).indices], 1)
    lq_s = torch.log_softmax(x.gather(1, sup) + 0.3 * torch.randn(n, k, generator=gen, dtype=torch.float64), 1)
    support = op.Candidates(sup, lq_s.float(), "support")
    cases = [(w, None, lq, op.Correction(weights=w)) for w in ("none", "tis", "mis", "reject")]
    cases += [(f"{w}_sc", head, lq_y, op.Correction(weights=w, score_centering=True))
              for w in ("none", "tis", "mis", "reject")]
    cases.append(("mis_sc_top_p", support, lq_s[:, 0].float(), op.Correction(weights="mis", score_centering=True)))
    # the same top-p support as a CSR record: the support pass's Triton kernels (kernels/support_logsoftmax.py)
    cases.append(("mis_sc_top_p_csr", support, lq_s[:, 0].float(),
                  op.Correction(weights="mis", score_centering=True)))
    res = {"ok": True}
    real, calls = K.row_loss_grad, []
    K.row_loss_grad = lambda *a, **k: calls.append(1) or real(*a, **k)
    sp_real = {f: getattr(SK, f) for f in ("support_stats", "support_grad")}
    sp_calls: list[str] = []
    for f, fn in sp_real.items():
        setattr(SK, f, lambda *a, _f=fn, _n=f, **k: sp_calls.append(_n) or _f(*a, **k))
    try:
        for name, cands, lq_t, corr in cases:
            zz = z.detach().clone().to(dev).requires_grad_()
            rec = None if cands is None else op.Candidates(cands.ids.to(dev), cands.logprobs.to(dev), cands.kind)
            if name.endswith("_csr"):
                rec = op.CSRCandidates.from_padded(rec)
            out = op.policy_loss(zz, y.to(dev), lq_t.to(dev), adv.to(dev), candidates=rec, loss_mask=mask.to(dev),
                                 temperature=0.9, correction=corr, backend="triton")
            out.loss.backward()
            z64 = z.detach().double().requires_grad_()
            loss64, _, _ = reference_policy_loss(z64, y, lq_t.double(), adv.double(), candidates=cands,
                                                 loss_mask=mask, temperature=0.9, correction=corr)
            loss64.backward()
            e_loss = abs(float(out.loss.detach()) - float(loss64))
            e_g, scale = _err(zz.grad.cpu(), z64.grad)
            res[f"{name}_loss_err"], res[f"{name}_grad_err"] = e_loss, e_g
            res["ok"] &= e_loss <= tol * max(1.0, abs(float(loss64))) and e_g <= tol * scale + 1e-6
    finally:
        K.row_loss_grad = real
        for f, fn in sp_real.items():
            setattr(SK, f, fn)
    res["two_pass_launches"] = len(calls)
    res["ok"] &= len(calls) == 8  # the four modes, with and without centering; not the support records
    res["support_kernel_launches"] = sp_calls
    res["ok"] &= sp_calls == ["support_stats", "support_grad"]  # the CSR record, once each
    return res


def check_int64_rows(dev, dtype, v):
    """N V > 2**31: the kernels switch to 64-bit row offsets; rows at both ends against float64."""
    import torch

    from offpolicy.kernels import logsoftmax as K

    n = (2**31) // v + 64
    z = torch.empty(n, v, dtype=dtype, device=dev)
    gen = torch.Generator(device=dev).manual_seed(3)
    z.normal_(0, 3, generator=gen)
    inv = torch.full((n,), 1 / 0.9, device=dev)
    m, s, _ = K.row_stats(z, inv)
    lse = m + s.log()
    ids = torch.randint(0, v, (n, 8), device=dev, generator=gen)
    g = torch.randn(n, 8, device=dev, generator=gen)
    ends = {"first": slice(0, 32), "last": slice(n - 32, n)}
    kept = {part: z[sl].double() / 0.9 for part, sl in ends.items()}  # the in-place gradient overwrites z
    two = torch.empty_like(z)  # the two-pass kernel (row_loss_grad), its gradient against the same float64
    coef = torch.randn(n, device=dev, generator=gen)
    _, _, _, lse2, g2 = K.row_loss_grad(z, ids[:, 0].contiguous(), inv, None, coef, torch.zeros_like(coef), two)
    out = K.row_grad(z, ids, inv, lse, g, g.sum(1), z)  # in place: one [N, V] buffer
    res = {"rows": n, "ok": True}
    for part, sl in ends.items():
        zz = kept[part]
        lse64 = torch.logsumexp(zz, 1)
        want = (torch.zeros_like(zz).scatter_add_(1, ids[sl], g[sl].double()) - g[sl].sum(1, keepdim=True).double()
                * torch.exp(zz - lse64[:, None])) / 0.9
        e_lse, _ = _err(lse[sl], lse64)
        e_g, scale = _err(out[sl], want)
        res[f"{part}_lse_err"], res[f"{part}_grad_err"] = e_lse, e_g
        res["ok"] &= e_lse <= 1e-3 and e_g <= 2**-7 * scale + 1e-6
        y = ids[sl, 0]
        want2 = -g2[sl, None].double() * torch.exp(zz - lse64[:, None]) / 0.9
        want2[torch.arange(32, device=dev), y] += g2[sl].double() / 0.9
        e_lse2, _ = _err(lse2[sl], lse64)
        e_g2, scale2 = _err(two[sl], want2)
        res[f"{part}_two_pass_lse_err"], res[f"{part}_two_pass_grad_err"] = e_lse2, e_g2
        res["ok"] &= e_lse2 <= 1e-3 and e_g2 <= 2**-7 * scale2 + 1e-6
    del z, out, two
    torch.cuda.empty_cache()
    return res


def check_linear(dev, dtype, n, d, v, k, tol):
    import torch

    from offpolicy.ops import linear_sparse_log_softmax

    gen = torch.Generator().manual_seed(11)
    h = (torch.randn(n, d, generator=gen) / d**0.25).to(dev, dtype).requires_grad_()
    w = (torch.randn(v, d, generator=gen) / d**0.25).to(dev, dtype).requires_grad_()
    y = torch.randint(0, v, (n,), generator=gen).to(dev)
    c = torch.randint(0, v, (n, k), generator=gen).to(dev)
    out = linear_sparse_log_softmax(h, w, y, c, 0.9, backend="triton")
    gt = torch.randn(n, generator=gen).to(dev)
    gh, gw = torch.autograd.grad((out.target * gt).sum() + out.candidates.sum(), [h, w])
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    logp = torch.log_softmax(h64 @ w64.T / 0.9, 1)
    t64, c64 = logp.gather(1, y[:, None])[:, 0], logp.gather(1, c)
    gh64, gw64 = torch.autograd.grad((t64 * gt.double()).sum() + c64.sum(), [h64, w64])
    res = {}
    for name, got, want, rel in (("target", out.target, t64, False), ("dh", gh, gh64, True), ("dw", gw, gw64, True)):
        e, scale = _err(got, want)
        res[f"{name}_err"] = e
        res[f"{name}_ok"] = e <= (tol * scale if rel else tol) + 1e-6
    res["ok"] = all(v_ for key, v_ in res.items() if key.endswith("_ok"))
    return res


def check_quant(dev, dtype, shape):
    import torch

    from offpolicy.fleet.quant import blockwise as B

    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(*shape, generator=gen) * torch.logspace(-3, 3, shape[1])[None, :]).to(dev, dtype)
    res = {"ok": True}
    for fmt in ("fp8", "nvfp4", "mxfp4"):
        a, b = B.quantize(x, fmt, backend="triton"), B.quantize(x, fmt, backend="torch")
        same = torch.equal(a.data, b.data) and torch.equal(a.scales, b.scales)
        if a.tensor_scale is not None:
            same = same and torch.equal(a.tensor_scale, b.tensor_scale)
        back = torch.equal(B.dequantize(a, torch.float32, backend="triton"), B.dequantize(b, torch.float32))
        res[f"{fmt}_bit_exact"], res[f"{fmt}_decode_exact"] = same, back
        res["ok"] &= same and back
    return res


def kernel_resources() -> list[dict]:
    """Every kernel compiled in this process, as the driver loaded it."""
    from triton.runtime.jit import JITFunction

    from offpolicy.kernels import blockwise_quant, linear_logsoftmax, logsoftmax, support_logsoftmax

    out = []
    for mod in (logsoftmax, linear_logsoftmax, blockwise_quant, support_logsoftmax):
        for fn in vars(mod).values():
            if isinstance(fn, JITFunction):
                for cache in fn.device_caches.values():
                    for k in cache[0].values():
                        k._init_handles()
                        out.append({"kernel": k.name, "registers": k.n_regs, "spills": k.n_spills,
                                    "shared": k.metadata.shared, "num_warps": k.metadata.num_warps,
                                    "num_stages": k.metadata.num_stages})
    return out


def timer(dev, warmup: int, reps: int):
    import torch

    def time_it(fn) -> dict:
        for _ in range(warmup):
            fn()
        ts = []
        for _ in range(reps):
            if dev.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
        return {"median_s": statistics.median(ts), "best_s": min(ts), "spread_s": max(ts) - min(ts)}

    return time_it


def measure(dev, dry: bool) -> dict:
    import torch

    import offpolicy.ops as ops
    from offpolicy.ops import linear_sparse_log_softmax

    time_it = timer(dev, 1 if dry else 3, 2 if dry else 10)
    out: dict = {}
    nbytes = (16 << 20) if dry else (2 << 30)
    src = torch.empty(nbytes // 4, device=dev)
    t = time_it(lambda: src.clone())
    out["copy_gbps"] = 2 * nbytes / t["median_s"] / 1e9
    src = None  # free it before the next allocation
    size = 128 if dry else 8192
    mdt = torch.float32 if dry else torch.bfloat16
    a, b = torch.randn(size, size, device=dev, dtype=mdt), torch.randn(size, size, device=dev, dtype=mdt)
    t = time_it(lambda: a @ b)
    out["matmul_tflops"] = 2 * size**3 / t["median_s"] / 1e12
    a = b = None

    n, v, k = (16, 512, 8) if dry else (16384, 151936, 256)
    dtype = torch.float16 if dry else torch.bfloat16
    z = torch.randn(n, v, device=dev, dtype=dtype).requires_grad_()
    y = torch.randint(0, v, (n,), device=dev)
    c = torch.randint(0, v, (n, k), device=dev)
    per_token = 3 * v * z.element_size()  # docs/spec.md: one read forward, one read and one write backward

    def ours():
        o = ops.sparse_log_softmax(z, y, c, 0.9, backend="triton", validate=False)
        torch.autograd.grad(o.target.sum() + o.candidates.sum(), z)

    def dense(zz):
        logp = torch.log_softmax(zz.float() / 0.9, 1)
        return logp.gather(1, y[:, None]).sum() + logp.gather(1, c).sum()

    compiled = torch.compile(dense, backend="eager" if dry else "inductor")
    rows = {"offpolicy": ours, "torch_dense": lambda: torch.autograd.grad(dense(z), z),
            "torch_compile": lambda: torch.autograd.grad(compiled(z), z)}
    try:
        from liger_kernel.transformers.functional import liger_cross_entropy

        rows["liger_cross_entropy_target_only"] = lambda: torch.autograd.grad(
            liger_cross_entropy(z / 0.9, y, reduction="sum"), z)
    except Exception as exc:  # noqa: BLE001 - not installed, or an API this script does not know
        out["liger"] = f"not used: {type(exc).__name__}: {exc}"[:300]
    logits = {}
    for name, fn in rows.items():
        try:
            t = time_it(fn)
            logits[name] = {**t, "gbps_3vb": n * per_token / t["median_s"] / 1e9,
                            "copy_fraction": n * per_token / t["median_s"] / 1e9 / out["copy_gbps"]}
        except Exception as exc:  # noqa: BLE001 - a baseline that fails is recorded, not fatal
            logits[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    out["logits"] = {"N": n, "V": v, "K": k, "dtype": str(dtype), "bytes_per_token": per_token, "rows": logits}
    out["two_pass"] = two_pass_speed(dev, z, y, time_it, out["copy_gbps"])
    out["support_width"] = support_width_speed(dev, z, y, time_it, dry)
    z = None
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    n, d, v = (16, 32, 256) if dry else (8192, 4096, 151936)
    h = (torch.randn(n, d, device=dev, dtype=dtype) / d**0.25).requires_grad_()
    w = (torch.randn(v, d, device=dev, dtype=dtype) / d**0.25).requires_grad_()
    y = torch.randint(0, v, (n,), device=dev)
    flops = 8 * n * v * d

    def fused():
        o = linear_sparse_log_softmax(h, w, y, None, 0.9, backend="triton", validate=False)
        torch.autograd.grad(o.target.sum(), [h, w])

    def dense_linear():
        logp = torch.log_softmax((h @ w.T).float() / 0.9, 1)
        torch.autograd.grad(logp.gather(1, y[:, None]).sum(), [h, w])

    lin = {}
    for name, fn in (("offpolicy", fused), ("torch_dense", dense_linear)):
        try:
            t = time_it(fn)
            lin[name] = {**t, "tflops_8nvd": flops / t["median_s"] / 1e12,
                         "matmul_fraction": flops / t["median_s"] / 1e12 / out["matmul_tflops"]}
        except Exception as exc:  # noqa: BLE001
            lin[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    out["linear"] = {"N": n, "D": d, "V": v, "dtype": str(dtype), "flops": flops, "rows": lin}
    return out


def two_pass_speed(dev, z, y, time_it, copy_gbps: float) -> dict:
    """The token-level loss's vocabulary work at the headline shape: three passes (``row_stats``, then ``row_grad``:
    ``3 V b`` bytes per token) against the two-pass kernel (``row_loss_grad``: ``2 V b`` when its second read of each
    row hits L2), the latter at 32 warps per program (the default: one program per SM, 40 MB of rows in flight on an
    H100), 16 and 8 (two and four programs per SM: 80 and 160 MB, past the L2); fractions of copy speed at each
    path's own byte count."""
    import torch

    from offpolicy.kernels import logsoftmax as K

    zd = z.detach()
    n, v = zd.shape
    inv = torch.full((n,), 1 / 0.9, device=dev)
    coef, shift = torch.full((n,), -1.0 / n, device=dev), torch.full((n,), -12.0, device=dev)
    out = torch.empty_like(zd)
    ids, g = y[:, None].contiguous(), torch.full((n, 1), -1.0 / n, device=dev)
    b = zd.element_size()

    def three():
        m, s, _ = K.row_stats(zd, inv)
        K.row_grad(zd, ids, inv, m + s.log(), g, g[:, 0].contiguous(), out)

    # MIS + score centering over a head record of K = 256 ids (the study's configuration): the head term's O(K)
    # sweeps in the same program, against the same three passes (whose row_grad then scatters 1 + K ids)
    # (in the interpreter, on 4 rows: its head sweeps cost seconds per program there)
    k, nh = (256, n) if dev.type == "cuda" else (8, min(n, 4))
    hids = torch.randint(0, v, (nh, k), device=dev)
    hlq = torch.full((nh, k), -8.0, device=dev)
    mis = {"band": (math.log(0.5), math.log(5.0)), "exp_clip": (20.0, -math.inf, math.inf)}
    ids_k, g_k = torch.cat([ids[:nh], hids], 1), torch.full((nh, 1 + k), -1.0 / n, device=dev)

    def three_head():
        m, s, _ = K.row_stats(zd[:nh], inv[:nh])
        K.row_grad(zd[:nh], ids_k, inv[:nh], m + s.log(), g_k, g_k.sum(1), out[:nh])

    def two_head():
        K.row_loss_grad(zd[:nh], y[:nh], inv[:nh], None, coef[:nh], shift[:nh], out[:nh], head=(hids, hlq), **mis)

    rows = {}
    for name, fn, nbytes, rows_n in [("three_pass", three, 3 * v * b, n),
                                     ("three_pass[head K]", three_head, 3 * v * b, nh)] + [
            (f"two_pass[warps={w}]", lambda w=w: K.row_loss_grad(zd, y, inv, None, coef, shift, out, num_warps=w,
                                                                 block=None if dev.type == "cpu" else 256 * w),
             2 * v * b, n) for w in (32, 16, 8)] + [("two_pass[mis+sc, head K]", two_head, 2 * v * b, nh)]:
        try:
            t = time_it(fn)
            rows[name] = {**t, "rows": rows_n, "bytes_per_token": nbytes, "gbps": rows_n * nbytes / t["median_s"] / 1e9,
                          "copy_fraction": rows_n * nbytes / t["median_s"] / 1e9 / copy_gbps}
        except Exception as exc:  # noqa: BLE001 - recorded, not fatal
            rows[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    return {"N": n, "V": v, "K": k, "dtype": str(zd.dtype), "rows": rows}


def support_width_speed(dev, z, y, time_it, dry: bool) -> dict:
    """The support pass (a CSR support record: kernels/support_logsoftmax.py through
    ``offpolicy.ops.support_pass``) forward + backward against the dense ``log_softmax`` forward + backward on the
    same logits (the triton backend's own, ``vs_dense``, and torch's, ``vs_dense_torch``), at supports of about 1%,
    10%, 50%, 85% and 100% of V (issue 42's bound: at most 1.2x the dense pass on the same backend at every width), on the first 2,048 rows of the headline logits (the ``[nnz]`` ids of ``K = V`` rows take
    2.5 GB there); in the interpreter one width on 4 of its tiny rows. Each row's support is the token and random other
    ids, sorted (as an engine's mask lists them)."""
    import torch

    import offpolicy.ops as ops
    from offpolicy.ops import backend_registry, support_pass

    rows_n = min(z.shape[0], 4 if dry else 2048)  # the interpreter: a few rows (about a second per call)
    zd = z.detach()[:rows_n].clone().requires_grad_()
    yy = y[:rows_n]
    n, v = zd.shape
    inv = torch.full((n,), 1 / 0.9, device=dev)
    backend = backend_registry.get("triton")

    def dense_torch():
        logp = torch.log_softmax(zd.float() * inv[:, None], 1)
        torch.autograd.grad(logp.gather(1, yy[:, None]).sum(), zd)

    def dense():  # the same backend's dense pass (no record): row_stats, then row_grad
        o = ops.sparse_log_softmax(zd, yy, None, 0.9, backend="triton", validate=False)
        torch.autograd.grad(o.target.sum(), zd)

    res = {"N": n, "V": v, "dtype": str(zd.dtype), "rows": {}}
    for name, fn in (("dense_torch", dense_torch), ("dense", dense)):
        try:
            res["rows"][name] = time_it(fn)
        except Exception as exc:  # noqa: BLE001 - recorded, not fatal
            res["rows"][name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    if "error" in res["rows"]["dense"]:
        return res
    for frac in (1.0,) if dry else (0.01, 0.1, 0.5, 0.85, 1.0):
        k = max(1, min(v, round(frac * v)))
        try:
            # k ids per row: the token, then the k - 1 smallest of a random key elsewhere; sorted
            key = torch.rand(n, v, device=dev).scatter_(1, yy[:, None], -1.0)
            ids = torch.sort(torch.topk(key, k, 1, largest=False).indices, 1).values.reshape(-1)
            key = None
            offsets = torch.arange(0, n * k + 1, k, device=dev)

            def sup(ids=ids, offsets=offsets):
                target, *_ = support_pass.support_log_softmax(zd, yy, offsets, ids, inv, None, backend=backend,
                                                              eager=True)
                torch.autograd.grad(target.sum(), zd)

            t = time_it(sup)
            res["rows"][f"support[{frac:g} V]"] = {**t, "K": k,
                                                   "vs_dense": t["median_s"] / res["rows"]["dense"]["median_s"]}
            if "median_s" in res["rows"]["dense_torch"]:
                res["rows"][f"support[{frac:g} V]"]["vs_dense_torch"] = (
                    t["median_s"] / res["rows"]["dense_torch"]["median_s"])
            ids = offsets = None
        except Exception as exc:  # noqa: BLE001 - recorded, not fatal
            res["rows"][f"support[{frac:g} V]"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return res


def versions(dev) -> dict:
    import torch
    import triton

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": triton.__version__, "device": "cpu (interpreter)" if dev.type == "cpu" else
            torch.cuda.get_device_name(dev)}  # fmt: skip
    if dev.type == "cuda":
        info["capability"] = list(torch.cuda.get_device_capability(dev))
        info["driver"] = getattr(torch._C, "_cuda_getDriverVersion", lambda: None)()
        props = torch.cuda.get_device_properties(dev)
        info["sms"], info["memory_gib"] = props.multi_processor_count, round(props.total_memory / 2**30, 1)
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, tiny shapes")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="folder for the JSON")
    ap.add_argument("--budget-s", type=float, default=480.0, help="stop starting checks after this many seconds")
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    _in_place()
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --dry-run for the interpreter)", file=sys.stderr)
        return 2
    dev = torch.device("cpu" if args.dry_run else "cuda")
    dry = args.dry_run
    checks = Checks(args.budget_s)
    info = versions(dev)
    print(json.dumps(info), flush=True)
    dtypes = [("fp16" if dry else "bf16", torch.float16 if dry else torch.bfloat16, 2e-2, 2**-6),
              ("fp32", torch.float32, 1e-4, 1e-4)]
    for name, dtype, tol_fwd, tol_grad in dtypes:
        n, v, k = (6, 300, 5) if dry else (512, 151936, 64)
        for support in (False, True):
            mode = "support" if support else "head"
            checks.run(f"logits[{name},{mode}]", lambda: check_logits(dev, dtype, n, v, k, support, tol_fwd))
        n, d, v = (12, 32, 200) if dry else (1024, 1024, 32768)
        n2, v2 = (7, 300) if dry else (256, 151936)
        checks.run(f"two_pass_loss[{name}]", lambda: check_two_pass(dev, dtype, n2, v2, max(tol_fwd, tol_grad)))
        checks.run(f"linear[{name}]", lambda: check_linear(dev, dtype, n, d, v, 4, max(tol_fwd, tol_grad)))
        checks.run(f"quantisers[{name}]", lambda: check_quant(dev, dtype, (128, 128) if dry else (4096, 4096)))
    if not dry:
        checks.run("logits[bf16] 64-bit offsets", lambda: check_int64_rows(dev, torch.bfloat16, 151936))
    checks.run("kernel resources", lambda: {"kernels": kernel_resources()} if not dry else {"interpreted": True})
    perf = checks.run("speed", lambda: measure(dev, dry))
    stamp = dt.datetime.now(dt.timezone.utc)
    label = "".join(ch if ch.isalnum() else "_" for ch in info["device"]).strip("_")
    path = Path(args.out) / f"gpu_check_{label}_{stamp:%Y%m%d_%H%M}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    failed = [r["check"] for r in checks.rows if not r["ok"]]
    path.write_text(json.dumps({"date": stamp.isoformat(), "dry_run": dry, "versions": info, "failed": failed,
                                "seconds": round(time.perf_counter() - checks.start, 1), "checks": checks.rows,
                                "perf": perf}, indent=1, default=str))  # fmt: skip
    print(f"gpu_check: {len(checks.rows) - len(failed)} ok, {len(failed)} failed -> {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
