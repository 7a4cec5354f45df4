"""pytest-benchmark version of the CPU comparison at a moderate shape (not part of the test run).

    pytest benchmarks/test_bench_cpu.py --benchmark-group-by=param:dtype --benchmark-json=/tmp/bench.json

Each group shows the floor (allocate + copy the logits), op.policy_loss (the default ``cpu`` backend, and
``backend="torch"``, the chunked PyTorch fallback) and the dense PyTorch way side by side, forward + backward of the same MIS + score-centering loss. The full-size run with memory and
ratios to the floor is benchmarks/bench_cpu.py.
"""

from __future__ import annotations

import pytest
import torch
from bench_cpu import OURS, _dense_loss, _inputs, _ours_loss

N, V, K = 512, 151936, 128


@pytest.mark.parametrize("kind", ["head", "support"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("method", ["floor", "offpolicy", "offpolicy-torch", "dense"])
def test_policy_loss_fwd_bwd(benchmark, method, dtype, kind):
    logits, tokens, lq, adv, cands = _inputs(N, V, K, dtype, kind)
    logits.requires_grad_()

    def step():
        logits.grad = None
        if method == "floor":
            torch.empty_like(logits).copy_(logits)
            return
        if method == "dense":
            _dense_loss(logits, tokens, lq, adv, cands).backward()
        else:
            _ours_loss(logits, tokens, lq, adv, cands, backend=OURS[method]).backward()

    benchmark.extra_info.update(n=N, v=V, k=K, floor_bytes=2 * V * logits.element_size() * N)
    benchmark.pedantic(step, rounds=3, warmup_rounds=1)
