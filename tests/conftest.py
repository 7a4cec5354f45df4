"""Shared test settings: a hypothesis profile sized for 2-core CI machines, one intra-op thread, and Triton's
CPU interpreter when there is no GPU.

The tests use small tensors, for which a second OpenMP thread costs more in synchronisation than it saves (and on a
busy machine a tiny op can wait milliseconds for it).

``TRITON_INTERPRET`` is read when a ``@triton.jit`` function is defined, so it is set here, before any test module
imports :mod:`offpolicy.kernels`: without a GPU every Triton kernel then runs in the interpreter (the torch
backends never import Triton). With a GPU nothing changes: the kernels compile for it.

``python -m pytest`` puts the checkout's root on ``sys.path``; that is harmless: none of its folders is a regular
package (``kernels/`` has no ``__init__.py``, so it never shadows the Hugging Face ``kernels`` that transformers
imports; tests/project/test_kernels_name.py).
"""

import os

import torch
from hypothesis import HealthCheck, settings

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
