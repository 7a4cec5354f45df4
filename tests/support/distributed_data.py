"""Random RL batches for the distributed tests, and the single-process and float64 answers they are held to.

A batch is a packed run of sequences (``cu_seqlens``), drawn from a sampler ``q`` that is the trainer's softmax
perturbed in logit space, with head or support candidate records (or none). Some rows concentrate their mass,
their sampled token and their candidates in one vocabulary region (so one shard owns everything) and the others
spread over the whole vocabulary (so targets and candidates land on any shard).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

import offpolicy as op
from offpolicy.parallel.packing import seq_ids_from_cu_seqlens
from offpolicy.reference import reference_policy_loss


@dataclass
class Batch:
    """One packed batch, float64 logits ``[N, V]``; everything else as ``policy_loss`` takes it."""

    logits: Tensor
    tokens: Tensor
    lq: Tensor
    adv: Tensor
    cands: op.Candidates | None
    mask: Tensor
    seq_ids: Tensor
    cu_seqlens: Tensor
    temperature: float | Tensor
    proximal: Tensor

    @property
    def n(self) -> int:
        return self.tokens.shape[0]

    def rows(self, idx: Tensor) -> "Batch":
        """The tokens ``idx`` (a data-parallel or context-parallel share); ``cu_seqlens`` no longer applies."""
        tau = self.temperature[idx] if isinstance(self.temperature, Tensor) else self.temperature
        cands = None if self.cands is None else op.Candidates(self.cands.ids[idx], self.cands.logprobs[idx],
                                                              self.cands.kind)
        return replace(self, logits=self.logits[idx], tokens=self.tokens[idx], lq=self.lq[idx], adv=self.adv[idx],
                       cands=cands, mask=self.mask[idx], seq_ids=self.seq_ids[idx], temperature=tau,
                       proximal=self.proximal[idx])


def make_batch(
    seed: int,
    v: int = 50,
    k: int = 6,
    kind: str | None = "head",
    seq_lens: tuple[int, ...] = (5, 7, 3, 6, 4),
    mismatch: float = 0.7,
    scale: float = 2.0,
    temperature: float | str = 1.0,
    regions: int = 4,
) -> Batch:
    """A packed batch of ``len(seq_lens)`` sequences over a vocabulary of ``v``.

    ``temperature="per_token"`` draws a temperature in ``[0.5, 1.5]`` per token. ``regions`` splits the vocabulary
    into that many equal ranges: every third row boosts one range so that its mass (and usually its sampled
    token and whole record) sits there.
    """
    gen = torch.Generator().manual_seed(seed)
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    n = int(cu[-1])
    z = torch.randn(n, v, generator=gen, dtype=torch.float64) * scale
    width = -(-v // regions)
    for r in range(0, n, 3):
        lo = (r // 3 % regions) * width
        z[r, lo:lo + width] += 4.0
    if temperature == "per_token":
        tau: float | Tensor = 0.5 + torch.rand(n, generator=gen, dtype=torch.float64)
        tau_col = tau[:, None]
    else:
        tau = float(temperature)
        tau_col = tau
    noise = torch.randn(n, v, generator=gen, dtype=torch.float64) * mismatch
    q = torch.softmax(z / tau_col + noise, dim=-1)
    cands = None
    if kind == "support":
        ids = torch.full((n, k), -1, dtype=torch.int64)
        lqc = torch.full((n, k), float("-inf"), dtype=torch.float64)
        y = torch.empty(n, dtype=torch.int64)
        for i in range(n):
            size = 1 if i == 2 else int(torch.randint(2, k + 1, (1,), generator=gen))
            if i % 3 == 1:  # the whole support inside one region
                lo = (i // 3 % regions) * width
                pool = torch.arange(lo, min(v, lo + width))
                s = pool[torch.randperm(pool.numel(), generator=gen)[:size]]
            else:
                s = torch.randperm(v, generator=gen)[:size]
            ps = q[i, s] / q[i, s].sum()
            y[i] = s[torch.multinomial(ps, 1, generator=gen)]
            ids[i, : s.numel()] = s
            lqc[i, : s.numel()] = torch.log(ps)
        lq = lqc.gather(1, (ids == y[:, None]).long().argmax(1, keepdim=True))[:, 0]
        cands = op.Candidates(ids, lqc.float(), "support")
    else:
        y = torch.multinomial(q, 1, generator=gen)[:, 0]
        lq = torch.log(q.gather(1, y[:, None]))[:, 0]
        if kind == "head":
            top = torch.topk(q, k, dim=1)
            ids, lqc = top.indices.clone(), torch.log(top.values)
            ids[1, 2:], lqc[1, 2:] = -1, float("-inf")  # a short record
            ids[4], lqc[4] = -1, float("-inf")  # an empty record
            cands = op.Candidates(ids, lqc.float(), "head")
    mask = torch.rand(n, generator=gen) < 0.85
    seq_ids = seq_ids_from_cu_seqlens(cu)
    seq_adv = torch.randn(lens.numel(), generator=gen, dtype=torch.float64)
    seq_adv[0] = -abs(float(seq_adv[0])) - 0.5  # a negative sequence (OPSM's target)
    seq_adv[-1] = 0.0
    adv = seq_adv[seq_ids].float()
    proximal = (torch.log_softmax(z / tau_col + 0.3 * noise, dim=-1).gather(1, y[:, None])[:, 0]).float()
    return Batch(z, y, lq.float(), adv, cands, mask, seq_ids, cu, tau, proximal)


def loss_kwargs(b: Batch, corr: op.Correction, agg: str, **extra) -> dict:
    """The keyword arguments of ``policy_loss`` / ``reference_policy_loss`` for this batch, logits aside."""
    kw = dict(tokens=b.tokens, sampler_logprobs=b.lq, advantages=b.adv, candidates=b.cands, loss_mask=b.mask,
              temperature=b.temperature, correction=corr, seq_ids=b.seq_ids, aggregation=agg)
    if corr.ppo_clip is not None:
        kw["proximal_logprobs"] = b.proximal
    if agg == "constant":
        kw["constant_normalizer"] = 17.0
    kw.update(extra)
    return kw


def single_process(b: Batch, corr: op.Correction, agg: str, dtype=torch.float64, **extra):
    """``(loss, grad [N, V], out)`` of ``policy_loss`` on the whole vocabulary in one process."""
    z = b.logits.detach().to(dtype).clone().requires_grad_(True)
    out = op.policy_loss(z, **loss_kwargs(b, corr, agg, **extra))
    out.loss.backward()
    return out.loss.detach(), z.grad, out


def reference(b: Batch, corr: op.Correction, agg: str, **extra):
    """``(loss, grad [N, V])`` of the float64 oracle."""
    z = b.logits.detach().double().clone().requires_grad_(True)
    kw = loss_kwargs(b, corr, agg, **extra)
    kw.pop("groups", None)
    loss, _, _ = reference_policy_loss(z, **kw)
    loss.backward()
    return loss.detach(), z.grad


def close(name: str, got: Tensor, want: Tensor, rtol: float, atol: float) -> None:
    """Assert ``got == want`` within tolerance, naming the quantity and the worst entry."""
    got, want = torch.as_tensor(got).double(), torch.as_tensor(want).double()
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    finite = torch.isfinite(want)
    if not torch.equal(finite, torch.isfinite(got)) or not torch.equal(got[~finite], want[~finite]):
        raise AssertionError(f"{name}: non-finite entries differ")
    err = (got - want).abs()[finite]
    bound = atol + rtol * want.abs()[finite]
    if err.numel() and bool((err > bound).any()):
        i = int((err - bound).argmax())
        raise AssertionError(f"{name}: |got - want| = {float(err[i]):.3e} > {float(bound[i]):.3e} "
                             f"(got {float(got[finite][i]):.10g}, want {float(want[finite][i]):.10g})")


def shard_bounds(v: int, world: int, widths: tuple[int, ...] | None = None) -> list[tuple[int, int]]:
    """``[(start, end)]`` of each rank's vocabulary columns: ``widths`` if given, else a near-even split."""
    if widths is None:
        base, extra = divmod(v, world)
        widths = tuple(base + (r < extra) for r in range(world))
    assert sum(widths) == v and len(widths) == world
    starts = [sum(widths[:r]) for r in range(world)]
    return [(s, s + w) for s, w in zip(starts, widths)]
