"""Shared test settings: a hypothesis profile sized for 2-core CI machines, one intra-op thread, and Triton's
CPU interpreter when there is no GPU.

The tests use small tensors, for which a second OpenMP thread costs more in synchronisation than it saves (and on a
busy machine a tiny op can wait milliseconds for it).

``TRITON_INTERPRET`` is read when a ``@triton.jit`` function is defined, so it is set here, before any test module
imports :mod:`offpolicy.kernels`: without a GPU every Triton kernel then runs in the interpreter (the torch
backends never import Triton). With a GPU nothing changes: the kernels compile for it.

The checkout's root leaves ``sys.path`` (``python -m pytest`` puts the working directory there): its ``kernels/``
folder, installed as ``offpolicy.kernels``, would otherwise be found as the top-level ``kernels`` and shadow the
Hugging Face package of that name, which transformers imports (``kernels/__init__.py``).
"""

import os
import sys
from pathlib import Path

import torch
from hypothesis import HealthCheck, settings

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != _ROOT]

torch.set_num_threads(1)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

settings.register_profile(
    "ci",
    max_examples=int(os.environ.get("OFFPOLICY_HYPOTHESIS_EXAMPLES", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=False,
    print_blob=True,
)
settings.load_profile("ci")
