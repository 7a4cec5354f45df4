"""Count the Python frames one CPU ``op.policy_loss`` call passes through on its way to the native kernels.

Forward: the frames from ``policy_loss`` down to the ctypes call of ``stats_f32``; backward: the frames from the
autograd engine's entry (``torch/autograd/function.py``) down to the ctypes call of ``grad_f32``. The native
library is wrapped by a spy whose functions record the stack and then call the real ones. The same run counts, by
a profile hook, per forward and per backward: the Python calls into ``offpolicy``, the calls of
``torch.compiler.is_compiling``, the entries into ``row_threads.single_intra_op`` (and how many of them changed the
thread count: the others were nested) and the calls into the backend registry (and ``importlib``).

Run: ``PYTHONPATH=$PWD/src .venv/bin/python tools/ops_call_path.py`` (a second; needs the native CPU kernels).
"""

from __future__ import annotations

import json
import sys
import traceback
from collections import Counter
from pathlib import Path

import torch

import offpolicy as op
from offpolicy.ops import cpu_native

ROOT = Path(__file__).resolve().parents[1]


def _short(filename: str) -> str:
    path = Path(filename)
    for anchor in ("offpolicy", "torch"):
        if anchor in path.parts:
            return "/".join(path.parts[path.parts.index(anchor):])
    return path.name


class _Spy:
    """The native library, with each call of a ``stats_*`` / ``grad_*`` function recording the Python stack."""

    def __init__(self, lib) -> None:
        self._lib = lib
        self.stacks: dict[str, list[traceback.FrameSummary]] = {}

    def __getattr__(self, name: str):
        real = getattr(self._lib, name)
        if not (name.startswith("stats_") or name.startswith("grad_")):
            return real

        def call(*args):
            self.stacks.setdefault(name.split("_")[0], traceback.extract_stack()[:-1])
            return real(*args)

        return call


def _path(stack: list[traceback.FrameSummary], start: str) -> list[str]:
    """The frames from the last one whose function is ``start`` down to the ctypes call."""
    first = max(i for i, f in enumerate(stack) if f.name == start)
    return [f"{_short(f.filename)}:{f.name}" for f in stack[first:]]


def _profile(fn) -> Counter:
    """Python calls made by ``fn()``, by ``file:function``."""
    seen: Counter = Counter()

    def hook(frame, event, arg):
        if event == "call":
            seen[f"{_short(frame.f_code.co_filename)}:{frame.f_code.co_name}"] += 1
            if frame.f_code.co_name == "single_intra_op" and frame.f_back.f_code.co_name == "__enter__":
                seen["entered:single_intra_op"] += 1
        elif event == "c_call" and getattr(arg, "__name__", "") == "set_num_threads":
            seen["c:set_num_threads"] += 1

    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def measure() -> dict:
    torch.set_num_threads(1)  # every chunk on the calling thread, so its stack reaches the ctypes call
    lib = cpu_native.load()
    if lib is None:
        raise SystemExit(f"the native CPU kernels are unavailable: {cpu_native.unavailable_reason()}")
    spy = _Spy(lib)
    cpu_native.load = lambda: spy
    gen = torch.Generator().manual_seed(0)
    n, v = 16, 512
    logits = torch.randn(n, v, generator=gen).requires_grad_()
    tokens = torch.randint(0, v, (n,), generator=gen)
    lq = torch.log_softmax(logits.detach(), 1)[torch.arange(n), tokens]
    adv = torch.randn(n, generator=gen)

    def forward():
        return op.policy_loss(logits, tokens, lq, adv)

    forward().loss.backward()  # warm: the library is built and modules imported
    spy.stacks.clear()
    out = []
    fwd_calls = _profile(lambda: out.append(forward()))
    bwd_calls = _profile(lambda: out[0].loss.backward())
    result = {}
    for what, start, calls in (("forward", "policy_loss", fwd_calls), ("backward", "apply", bwd_calls)):
        frames = _path(spy.stacks["stats" if what == "forward" else "grad"], start)
        result[what] = {
            "frames": len(frames),
            "offpolicy_frames": sum(f.startswith("offpolicy/") for f in frames),
            "files": len({f.split(":")[0] for f in frames}),
            "path": frames,
            "offpolicy_python_calls": sum(c for k, c in calls.items() if k.startswith("offpolicy/")),
            "is_compiling_calls": sum(c for k, c in calls.items() if k.endswith(":is_compiling")),
            "single_intra_op_entries": calls["entered:single_intra_op"],
            # entries that changed the thread count (one set_num_threads on the way in, one on the way out)
            "single_intra_op_effective": calls["c:set_num_threads"] // 2,
            "backend_lookups": sum(c for k, c in calls.items()
                                   if k.startswith("offpolicy/ops/backend_registry.py:") or k.endswith(":import_module")),
        }
    return result


if __name__ == "__main__":
    print(json.dumps(measure(), indent=1))
