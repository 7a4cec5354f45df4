"""One call's path (docs/architecture.md): ``op.policy_loss`` is the call's boundary and makes each boundary step
once (the stride and temperature checks, the question whether ``torch.compile`` traces, the single-thread context,
the backend's resolution); the ops below it run unchecked. And the public signature users call positionally stays."""

from __future__ import annotations

import inspect
from collections import Counter

import pytest
import torch

import offpolicy as op
from offpolicy.ops import backend_registry, input_checks, library, row_threads

from support.batches import make_batch

#: ``policy_loss``'s positional parameters, in the order users' code passes them.
POSITIONAL = ("logits", "tokens", "sampler_logprobs", "advantages", "candidates", "loss_mask", "temperature",
              "correction", "seq_ids", "aggregation", "num_loss_tokens", "groups", "versions", "tp_group",
              "vocab_start")


def test_policy_loss_positional_order_is_unchanged():
    params = list(inspect.signature(op.policy_loss).parameters.values())
    positional = tuple(p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)
    assert positional == POSITIONAL
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[len(POSITIONAL):])


def _counting(monkeypatch, counts: Counter, module, name: str) -> None:
    real = getattr(module, name)

    def spy(*args, **kwargs):
        counts[name] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)


@pytest.mark.parametrize("kind", [None, "head", "support", "csr_head"])
@pytest.mark.parametrize("backend", sorted(backend_registry.BACKENDS))
def test_each_boundary_step_runs_once_per_call(monkeypatch, kind, backend):
    """Counted by spies on the functions themselves, for every registered backend (``triton`` runs in Triton's
    interpreter without a GPU, tests/conftest.py)."""
    counts: Counter = Counter()
    for module, name in ((input_checks, "check_temperature"), (input_checks, "check_unit_stride"),
                         (library, "tracing"), (backend_registry, "choose"), (row_threads, "single_intra_op")):
        _counting(monkeypatch, counts, module, name)
    z, y, lq, cands = make_batch(12, 40, 4, "head" if kind is None else kind.removeprefix("csr_"), seed=0)
    z, adv = z.float().requires_grad_(), torch.randn(12, generator=torch.Generator().manual_seed(1))
    if kind is None:
        cands = None
    elif kind == "csr_head":
        cands = op.CSRCandidates.from_padded(cands)
    out = op.policy_loss(z, y, lq, adv, cands, temperature=0.8, backend=backend)
    assert counts == Counter(check_temperature=1, check_unit_stride=1, tracing=1, choose=1, single_intra_op=1)
    counts.clear()
    out.loss.backward()
    # the backward is a call of its own: one question about tracing, one entry into the context
    assert counts == Counter(tracing=1, single_intra_op=1)
    assert bool(torch.isfinite(z.grad).all())
