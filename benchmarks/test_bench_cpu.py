"""pytest-benchmark version of the CPU comparison at a moderate shape (not part of the test run).

    pytest benchmarks/test_bench_cpu.py --benchmark-group-by=param:dtype --benchmark-json=benchmarks/results/x.json

Each group shows op.policy_loss (chunked torch path) and the dense PyTorch way side by side, forward + backward of
the same MIS + score-centering loss. The full-size run with memory is benchmarks/bench_cpu.py.
"""

from __future__ import annotations

import pytest

import offpolicy as op
from bench_cpu import _dense_loss, _inputs

N, V, K = 512, 151936, 128
CORR = op.Correction(weights="mis", score_centering=True)


@pytest.mark.parametrize("kind", ["head", "support"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("method", ["offpolicy", "dense"])
def test_policy_loss_fwd_bwd(benchmark, method, dtype, kind):
    logits, tokens, lq, adv, cands = _inputs(N, V, K, dtype, kind)
    logits.requires_grad_()

    def step():
        logits.grad = None
        if method == "dense":
            loss = _dense_loss(logits, tokens, lq, adv, cands, 1.0)
        else:
            loss = op.policy_loss(logits, tokens, lq, adv, cands, correction=CORR).loss
        loss.backward()

    benchmark.extra_info.update(n=N, v=V, k=K, floor_bytes=3 * V * logits.element_size() * N)
    benchmark.pedantic(step, rounds=3, warmup_rounds=1)
