"""Count the SASS instructions in each loop of a compiled kernel (a cubin written by ``tools/aot_compile.py --dump``).

    python tools/sass_loops.py DUMP/_row_stats_kernel.row_stats_int32_.bf16.sm_90.cubin [--elements 16]

The cubin is disassembled with the ``nvdisasm`` bundled with Triton. A loop is a backward branch ``BRA `(.L_x_k)``
to a label above it; its body is every instruction from the label to the branch, both included. A forward branch
inside the body that jumps to a label still inside it skips a conditional block (the rescale of the online softmax
when the running max moves): those instructions are counted apart (``conditional``), so ``always`` is what every
iteration issues. With ``--elements`` (elements per thread per iteration: ``BLOCK / (32 num_warps)``) it prints
``always / elements``, the instructions issued per element.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

_INSN = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRA = re.compile(r"\bBRA(?:\.\w+)*\s+(?:!?U?P\w*,\s*)?`\((\.L_x_\d+)\)")


def disassemble(cubin: str) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    return subprocess.run([tool, "-c", cubin], capture_output=True, text=True, check=True).stdout


def loops(sass: str) -> list[dict]:
    """One record per loop: label, ``instructions`` (the body), ``conditional`` (inside forward-skipped blocks),
    ``always``, and counts of ``MUFU`` (special-function), ``LDG`` (global loads) and ``BAR`` in the body."""
    items: list[tuple[str, str]] = []  # ("label", name) or ("insn", text)
    for line in sass.splitlines():
        lab = _LABEL.match(line.strip())
        if lab:
            items.append(("label", lab.group(1)))
            continue
        ins = _INSN.match(line)
        if ins:
            items.append(("insn", ins.group(2)))
    where = {name: i for i, (kind, name) in enumerate(items) if kind == "label"}
    out = []
    for j, (kind, text) in enumerate(items):
        m = _BRA.search(text) if kind == "insn" else None
        if not m or where.get(m.group(1), j) >= j - 1:  # forward, or a branch to itself (the trap after EXIT)
            continue
        start = where[m.group(1)]
        body = [(i, t) for i, (k, t) in enumerate(items[start:j + 1], start) if k == "insn"]
        skipped = set()
        for i, t in body:
            f = _BRA.search(t)
            if f and i < where.get(f.group(1), -1) <= j:
                skipped.update(k for k, _ in body if i < k < where[f.group(1)])
        texts = [t for _, t in body]
        out.append({"label": m.group(1), "instructions": len(body), "conditional": len(skipped),
                    "always": len(body) - len(skipped), "MUFU": sum("MUFU" in t for t in texts),
                    "LDG": sum("LDG" in t for t in texts), "BAR": sum("BAR" in t for t in texts)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cubin")
    ap.add_argument("--elements", type=int, help="elements per thread per iteration (BLOCK / (32 num_warps))")
    args = ap.parse_args(argv)
    for rec in loops(disassemble(args.cubin)):
        per = f", {rec['always'] / args.elements:.2f} per element" if args.elements else ""
        print(f"{rec['label']}: {rec['instructions']} instructions ({rec['conditional']} conditional, "
              f"{rec['always']} every iteration{per}); MUFU {rec['MUFU']}, LDG {rec['LDG']}, BAR {rec['BAR']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
