"""Shared test settings: a hypothesis profile sized for 2-core CI machines, and one intra-op thread.

The tests use small tensors, for which a second OpenMP thread costs more in synchronisation than it saves (and on a
busy machine a tiny op can wait milliseconds for it).
"""

import os

import torch
from hypothesis import HealthCheck, settings

torch.set_num_threads(1)

settings.register_profile(
    "ci",
    max_examples=int(os.environ.get("OFFPOLICY_HYPOTHESIS_EXAMPLES", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=False,
    print_blob=True,
)
settings.load_profile("ci")
