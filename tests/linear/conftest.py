"""Fused-linear kernel tests: without a GPU the Triton kernels run in Triton's CPU interpreter.

``TRITON_INTERPRET`` is read when a ``@triton.jit`` function is defined, so it is set here, at collection time,
before anything imports :mod:`offpolicy.kernels.linear_logsoftmax` (the torch backends never import Triton, so
the rest of the suite is unaffected). If the kernel module was imported earlier in this process it is reloaded
so that its kernels become interpreted ones. With a GPU nothing changes: the kernels compile for it.
"""

import importlib
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if "offpolicy.kernels.linear_logsoftmax" in sys.modules:
        importlib.reload(sys.modules["offpolicy.kernels.linear_logsoftmax"])
