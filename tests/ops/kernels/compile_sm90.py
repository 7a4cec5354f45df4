"""Lower both vocabulary kernels to a Hopper (sm_90) cubin with Triton's bundled ptxas, no GPU needed.

Run as a script in a process without ``TRITON_INTERPRET`` (the interpreter patches ``triton.language`` in place,
so compiled lowering cannot share its process). Exits non-zero with the compiler's message on failure. The
interpreter does not enforce the typing rules of compiled Triton; this does.
"""

from __future__ import annotations

import sys

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from offpolicy.kernels.logsoftmax import _row_grad_kernel, _row_stats_kernel


def signatures(ptr: str) -> tuple[dict, dict]:
    stats = {"logits_ptr": ptr, "stride_row": "i32", "inv_temp_ptr": "*fp32", "skip_ptr": "*u8", "m_ptr": "*fp32",
             "s_ptr": "*fp32", "t_ptr": "*fp32", "q_ptr": "*fp32", "V": "i32", "HAS_SKIP": "constexpr",
             "SUM_P2": "constexpr", "BLOCK": "constexpr", "INT64": "constexpr"}  # fmt: skip
    grad = {"logits_ptr": ptr, "stride_lrow": "i32", "out_ptr": ptr, "stride_orow": "i32", "ids_ptr": "*i64",
            "grad_ptr": "*fp32", "vals_ptr": "*fp32", "inv_temp_ptr": "*fp32", "lse_ptr": "*fp32",
            "grad_sum_ptr": "*fp32", "V": "i32", "M": "i32", "BLOCK": "constexpr", "ID_CHUNK": "constexpr",
            "ID_CMP": "constexpr", "INT64": "constexpr"}  # fmt: skip
    return stats, grad


def main() -> int:
    target = GPUTarget("cuda", 90, 32)
    for dtype in ("bf16", "fp16", "fp32"):
        stats_sig, grad_sig = signatures(f"*{dtype}")
        for int64 in (False, True):
            # SUM_P2 rides on int64, so both variants of the stats kernel are lowered
            for fn, sig, consts in [
                (_row_stats_kernel, stats_sig, {"HAS_SKIP": True, "SUM_P2": int64, "BLOCK": 4096, "INT64": int64}),
                (_row_grad_kernel, grad_sig, {"BLOCK": 4096, "ID_CHUNK": 64, "ID_CMP": 32, "INT64": int64}),
            ]:
                # Launches specialise 16-byte aligned pointers and integers divisible by 16 (V = 151936 is);
                # say so, to see the vectorised loads.
                attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(sig)
                         if sig[a].startswith("*") or a.startswith("stride") or a == "V"}  # fmt: skip
                ptx = compile(ASTSource(fn, sig, consts, attrs), target=target, options={"num_warps": 8}).asm["ptx"]
                name = f"{fn.__name__}[{dtype}, int64={int64}]"
                assert ".target sm_90" in ptx, name
                assert "ld.global.v4" in ptx, f"{name}: no 16-byte vector loads"
                if fn is _row_grad_kernel:
                    assert ptx.count("bar.sync") >= 2, f"{name}: the barriers ordering the id stores are missing"
                print("ok", name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
