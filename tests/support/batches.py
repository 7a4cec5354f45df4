"""Random batches for the core tests: trainer logits, a mismatched sampler and its candidate records."""

from __future__ import annotations

import torch

import offpolicy as op


def sampler_distribution(z: torch.Tensor, mismatch: float, gen: torch.Generator) -> torch.Tensor:
    """``[N, V]`` float64 sampler probabilities: the trainer's softmax perturbed in logit space."""
    noise = torch.randn(z.shape, generator=gen, dtype=torch.float64) * mismatch
    return torch.softmax(z.double() + noise, dim=-1)


def make_batch(
    n: int = 12,
    v: int = 40,
    k: int = 6,
    kind: str | None = "head",
    mismatch: float = 1.0,
    seed: int = 0,
    scale: float = 2.0,
    temperature: float | torch.Tensor = 1.0,
    empty_row: int | None = 3,
):
    """A batch drawn from the sampler: logits, tokens, sampler logprobs (after temperature), candidates.

    Head records hold the sampler's top-k; support records hold a random support containing the sampled
    token with the sampler's probabilities renormalised over it. ``empty_row`` gets a short record (head) or a
    2-entry support.
    """
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(n, v, generator=gen, dtype=torch.float64) * scale
    tau = temperature.double()[:, None] if isinstance(temperature, torch.Tensor) else temperature
    q = sampler_distribution(z / tau, mismatch, gen)
    if kind == "support":
        ids = torch.full((n, k), -1, dtype=torch.int64)
        lqc = torch.full((n, k), float("-inf"), dtype=torch.float64)
        y = torch.empty(n, dtype=torch.int64)
        for i in range(n):
            width = 2 if i == empty_row else int(torch.randint(1, k + 1, (1,), generator=gen))
            s = torch.randperm(v, generator=gen)[:width]
            ps = q[i, s] / q[i, s].sum()
            y[i] = s[torch.multinomial(ps, 1, generator=gen)]
            ids[i, :width] = s
            lqc[i, :width] = torch.log(ps)
        lq = lqc.gather(1, (ids == y[:, None]).long().argmax(1, keepdim=True))[:, 0]
        cands = op.Candidates(ids, lqc.float(), "support")
    else:
        y = torch.multinomial(q, 1, generator=gen)[:, 0]
        lq = torch.log(q.gather(1, y[:, None]))[:, 0]
        top = torch.topk(q, k, dim=1)
        ids, lqc = top.indices.clone(), torch.log(top.values)
        if empty_row is not None:
            ids[empty_row, 2:] = -1
            lqc[empty_row, 2:] = float("-inf")
        cands = op.Candidates(ids, lqc.float(), "head") if kind == "head" else None
    return z, y, lq.float(), cands
