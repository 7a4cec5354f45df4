"""Vocabulary-sharded ``DTensor`` logits (``Shard(1)``, the ``loss_parallel`` layout) go straight into
``op.policy_loss``: loss and gathered gradient equal the single-process computation, on 2 and 3 gloo ranks with
a vocabulary that does not divide evenly."""

from __future__ import annotations

import pytest
import torch

import offpolicy as op
from support.distributed_harness import run_distributed

N, K = 10, 3


def _problem(vocab: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(N, vocab, generator=gen, dtype=torch.float64) * 2
    lq = torch.log_softmax(z + 0.4 * torch.randn(N, vocab, generator=gen, dtype=torch.float64), -1)
    tokens = torch.multinomial(lq.exp(), 1, generator=gen)[:, 0]
    top = torch.topk(lq, K, dim=-1)
    kw = dict(tokens=tokens, sampler_logprobs=lq.gather(1, tokens[:, None])[:, 0],
              advantages=torch.randn(N, generator=gen, dtype=torch.float64),
              candidates=op.Candidates(top.indices, top.values, "head"),
              correction=op.Correction(weights="mis", score_centering=True), temperature=0.9)
    return z, kw


def _worker(rank: int, world: int, vocab: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    z, kw = _problem(vocab)
    mesh = init_device_mesh("cpu", (world,))
    logits = distribute_tensor(z.clone(), mesh, [Shard(1)]).requires_grad_(True)
    out = op.policy_loss(logits, **kw)
    out.loss.backward()
    errors = {}
    for name, bad in [("Shard(0)", distribute_tensor(z.clone(), mesh, [Shard(0)])),
                      ("Replicate", distribute_tensor(z.clone(), mesh, [Replicate()]))]:
        try:
            op.policy_loss(bad, **kw)
        except ValueError as exc:
            errors[name] = str(exc)
    try:
        op.policy_loss(logits, tp_group=mesh.get_group(0), **kw)
    except ValueError as exc:
        errors["tp_group"] = str(exc)
    return {"loss": float(out.loss.detach()), "grad": logits.grad.full_tensor().tolist(),
            "kl": float(out.metrics["kl_k3"]),
            "grad_is_dtensor": type(logits.grad).__name__, "errors": errors}


@pytest.mark.parametrize("world, vocab", [(2, 13), (3, 11), (3, 4)])  # (3, 4): the last rank holds no column
def test_dtensor_logits_equal_single_process(world, vocab):
    z, kw = _problem(vocab)
    zs = z.clone().requires_grad_(True)
    want = op.policy_loss(zs, **kw)
    want.loss.backward()
    expected = {"Shard(0)": "sharded over the vocabulary", "Replicate": "sharded over the vocabulary",
                "tp_group": "pass neither tp_group nor vocab_start"}
    for res in run_distributed(_worker, world, vocab):
        assert res["loss"] == pytest.approx(float(want.loss.detach()), rel=1e-12, abs=1e-14)
        assert res["kl"] == pytest.approx(float(want.metrics["kl_k3"]), rel=1e-12, abs=1e-14)
        assert res["grad_is_dtensor"] == "DTensor"
        torch.testing.assert_close(torch.tensor(res["grad"], dtype=torch.float64), zs.grad, rtol=1e-12, atol=1e-14)
        assert res["errors"].keys() == expected.keys(), res["errors"]
        for name, match in expected.items():
            assert match in res["errors"][name]
