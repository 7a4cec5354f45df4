"""Tensor parallelism with ``torch.distributed.tensor`` (torchtitan's layout): the loss on vocabulary-sharded
DTensor logits, without gathering the vocabulary. Runnable on CPU with gloo:

    python examples/dtensor_tensor_parallel.py          # spawns 2 processes (TP = 2) on 127.0.0.1
    torchrun --nproc-per-node 2 examples/dtensor_tensor_parallel.py

The output layer is parallelised ``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)``, as
torchtitan does for ``loss_parallel``: each rank computes ``[b, s, V / tp]`` of the logits and they stay a DTensor.
``op.policy_loss`` takes the flattened ``[N, V]`` DTensor as it is: the device mesh gives the tensor-parallel
group and each rank's vocabulary range, the forward all-reduces ``O(N)`` statistics and the gradient flows back
into the sharded output layer. Rank 0 checks the loss against a single-process copy of the model and prints the
metrics.
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist

import offpolicy as op

VOCAB, HIDDEN, B, S = 50, 32, 4, 6


def build(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, HIDDEN), torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.GELU(),
                               torch.nn.Linear(HIDDEN, VOCAB, bias=False))


def rollout(seed: int = 1) -> dict:
    """A stand-in for a sampler's output: tokens from perturbed logits, their log-probabilities, top-8 records."""
    gen = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, VOCAB, (B, S), generator=gen)
    with torch.no_grad():
        sampler_logits = build()(inputs).reshape(B * S, VOCAB)
        sampler_logits += 0.3 * torch.randn(sampler_logits.shape, generator=gen)  # other numerics
    logq = torch.log_softmax(sampler_logits, -1)
    tokens = torch.multinomial(logq.exp(), 1, generator=gen)[:, 0]
    top = torch.topk(logq, 8, dim=-1)
    reward = (tokens < VOCAB // 2).float().reshape(B, S).mean(1)
    adv = op.advantages.grpo(reward, torch.arange(B) // 2).repeat_interleave(S)
    return dict(inputs=inputs, tokens=tokens, sampler_logprobs=logq.gather(1, tokens[:, None])[:, 0],
                advantages=adv, candidates=op.Candidates(top.indices, top.values, "head"))


def loss_of(logits, data: dict) -> op.PolicyLossOutput:
    return op.policy_loss(logits, data["tokens"], data["sampler_logprobs"], data["advantages"],
                          candidates=data["candidates"], correction=op.Correction(weights="mis", score_centering=True))


def main(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    model = build()
    parallelize_module(model, mesh, {"3": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
    data = rollout()
    logits = model(data["inputs"])                     # DTensor [b, s, V], Shard(-1): [b, s, V / tp] per rank
    out = loss_of(logits.reshape(B * S, VOCAB), data)  # no gather: the loss runs on the local shard
    out.loss.backward()
    grad_shard = model[3].weight.grad                  # a DTensor sharded like the weight
    if rank == 0:
        single = build()
        want = loss_of(single(data["inputs"]).reshape(B * S, VOCAB), data)
        want.loss.backward()
        assert torch.allclose(out.loss.detach(), want.loss.detach(), rtol=1e-5, atol=1e-6)
    full_grad = grad_shard.full_tensor()               # a collective: every rank takes part
    if rank == 0:
        assert torch.allclose(full_grad, single[3].weight.grad, rtol=1e-4, atol=1e-6)
        print(f"TP={world}: logits {type(logits).__name__} {tuple(logits.shape)} with local shard "
              f"{tuple(logits.to_local().shape)}; loss {float(out.loss.detach()):+.5f} equals the single-process loss; "
              "the output layer's gradient too")
        print("  " + "  ".join(f"{k} {float(out.metrics[k]):.4f}" for k in ("kl_k3", "weight_mean", "sc_rho")))


def _run(rank: int, world: int) -> None:
    try:
        main(rank, world)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # DTensor's functional collectives on gloo (torch 2.13, CPU) occasionally abort in a static destructor at
    # interpreter exit ("terminate called without an active exception", about 1 run in 20 here), after all the
    # work is done: leave without running them.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawned(rank: int, world: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    _run(rank, world)


if __name__ == "__main__":
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
        _run(dist.get_rank(), dist.get_world_size())
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            free = s.getsockname()[1]
        torch.multiprocessing.spawn(_spawned, args=(2, free), nprocs=2)
