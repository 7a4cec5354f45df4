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


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow_live`` (minutes of live engines: tests/adapters/test_fleet_live_kill.py) run only when
    asked with ``OFFPOLICY_SLOW_LIVE=1``; otherwise they are deselected, not skipped."""
    if os.environ.get("OFFPOLICY_SLOW_LIVE") == "1":
        return
    slow = [item for item in items if item.get_closest_marker("slow_live")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow_live")]
