"""A toy mixture-of-experts causal LM whose top-k routing can be recorded and forced, and records from a
simulated fleet of its samplers (stale versions, quantised groups, flipped routes, mis-read records), for the
attribution tests (tests/diagnose/test_attribution.py) and tools/attribution_example.py.

Routes are ``[B, T, L, K]`` int64 expert ids per position, layer and slot. A forced route keeps the router's
weights recomputed from the model's own router logits over the forced experts (softmax over the K), as a replay
hook on a real MoE does.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch
from torch import nn

from offpolicy.diagnose import RecordedRollouts
from offpolicy.diagnose.attribution import ScoreBatch
from offpolicy.diagnose.contexts import Contexts
from offpolicy.fleet.quant import fake_quantize_module
from offpolicy.fleet.sampler import sample

V, DIM, LAYERS, EXPERTS, TOP_K = 64, 32, 2, 8, 2


class ToyMoE(nn.Module):
    """``ids [B, T] -> logits [B, T, V]``: embedding + position, then per layer a causal running mean mixed in
    (context) and a top-k mixture of ``EXPERTS`` two-layer MLP experts, then a linear head.

    ``forward(ids, routes=None, flip=None, return_routes=False)``: ``routes [B, T, L, K]`` forces the experts;
    ``flip [L, T]`` bool makes a layer at a position take the router's ranks ``0, 2`` instead of ``0, 1`` (a
    sampler's numerics flipping a near tie, deterministic and causal); ``return_routes`` also returns the routes
    used ``[B, T, L, K]``.
    """

    def __init__(self, seed: int = 0, scale: float = 1.0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = nn.Embedding(V, DIM)
        self.pos = nn.Parameter(torch.zeros(64, DIM))
        self.mix = nn.ModuleList(nn.Linear(DIM, DIM, bias=False) for _ in range(LAYERS))
        self.router = nn.ModuleList(nn.Linear(DIM, EXPERTS, bias=False) for _ in range(LAYERS))
        self.up = nn.ModuleList(nn.ModuleList(nn.Linear(DIM, 2 * DIM) for _ in range(EXPERTS)) for _ in range(LAYERS))
        self.down = nn.ModuleList(nn.ModuleList(nn.Linear(2 * DIM, DIM) for _ in range(EXPERTS))
                                  for _ in range(LAYERS))
        self.head = nn.Linear(DIM, V, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * scale / max(p.shape[-1], 1) ** 0.5)
            self.emb.weight.mul_(DIM ** 0.5)
            self.head.weight.mul_(3.0)
            for r in self.router:
                r.weight.mul_(4.0)

    def forward(self, ids, routes=None, flip=None, return_routes=False):
        b, t = ids.shape
        h = self.emb(ids) + self.pos[:t]
        used = torch.empty(b, t, LAYERS, TOP_K, dtype=torch.int64)
        count = torch.arange(1, t + 1, dtype=h.dtype)[None, :, None]
        for layer in range(LAYERS):
            h = h + torch.tanh(self.mix[layer](torch.cumsum(h, 1) / count))
            logits = self.router[layer](h)  # [b, t, E]
            if routes is not None:
                chosen = routes[:, :t, layer]
            else:
                ranks = torch.argsort(logits, dim=-1, descending=True, stable=True)[..., : TOP_K + 1]
                chosen = ranks[..., :TOP_K].clone()
                if flip is not None:
                    f = flip[layer, :t][None, :].expand(b, t)
                    chosen[..., 1] = torch.where(f, ranks[..., 2], ranks[..., 1])
            used[:, :, layer] = chosen
            w = torch.softmax(logits.gather(-1, chosen), -1)  # [b, t, K]
            out = torch.zeros_like(h)
            for e in range(EXPERTS):
                gate = (w * (chosen == e)).sum(-1, keepdim=True)  # [b, t, 1]
                if bool((gate != 0).any()):
                    out = out + gate * self.down[layer][e](torch.tanh(self.up[layer][e](h)))
            h = h + out
        logits = self.head(h)
        return (logits, used) if return_routes else logits


def perturbed(model: ToyMoE, size: float, seed: int) -> ToyMoE:
    """A copy with every weight moved by ``size`` relative Gaussian noise (a training step's worth)."""
    g = torch.Generator().manual_seed(seed)
    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=g) * size * p.abs().mean())
    return out


class _Sampler(nn.Module):
    """A sampler replica: a (stale, quantised) copy run with flipped routing."""

    def __init__(self, net: ToyMoE, flip):
        super().__init__()
        self.net, self.flip = net, flip

    def forward(self, ids):
        return self.net(ids, flip=self.flip)


def flips(share: float, seed: int, length: int = 64) -> torch.Tensor:
    """``[L, length]`` bool: a ``share`` of (layer, position) pairs flipped."""
    return torch.rand(LAYERS, length, generator=torch.Generator().manual_seed(seed)) < share


def fleet_records(trainer: ToyMoE, weights: dict[int, ToyMoE], groups: list[dict], *, current: int, seqs: int = 24,
                  new: int = 8, temperature: float = 1.0, seed: int = 1):
    """Records of a simulated fleet: each group ``{"name", "format", "version", "flip": share or 0, "raw": bool,
    "seqs"}`` samples from the version's weights in its format with its flips (``raw``: the record holds
    untempered log-probs of a T = 0.7 sampler, a semantic mistake). Returns ``(rollouts, routes [S, L, K])``:
    the routes each sampler used at every context position, aligned with ``rollouts.contexts.ids``."""
    parts, route_parts = [], []
    for gi, grp in enumerate(groups):
        v = grp["version"]
        net = trainer if v == current else weights[v]
        net = fake_quantize_module(net, grp["format"]) if grp["format"] not in ("fp32", "none") else net
        flip = flips(grp.get("flip", 0.0), seed + 100 + gi) if grp.get("flip") else None
        sampler = _Sampler(net, flip)
        n = grp.get("seqs", seqs)
        prompts = torch.randint(0, V, (n, 4), generator=torch.Generator().manual_seed(seed + gi))
        t = 0.7 if grp.get("raw") else temperature
        ro = sample(sampler, prompts, new, t, 1.0, None, record=None, version=v,
                    generator=torch.Generator().manual_seed(seed + 50 + gi))
        tb = ro.flatten()
        lq = tb.sampler_logprobs.float()
        if grp.get("raw"):  # the record holds log softmax(z) instead of log softmax(z / 0.7)
            with torch.no_grad():
                z = sampler(ro.sequences)[tb.rows, tb.cols - 1].double()
            lq = torch.log_softmax(z, -1).gather(1, tb.tokens[:, None])[:, 0].float()
        with torch.no_grad():
            _, used = net(ro.sequences, flip=flip, return_routes=True)
        parts.append((tb, lq, ro.sequences, ro.lengths, gi, t))
        route_parts.append([used[b, : int(ro.lengths[b])] for b in range(used.shape[0])])
    tokens, lqs, gidx, vers, temps, rows, cols, seq_list = [], [], [], [], [], [], [], []
    off = 0
    for (tb, lq, seqs_, lengths, gi, t) in parts:
        tokens.append(tb.tokens)
        lqs.append(lq)
        gidx.append(torch.full_like(tb.tokens, gi))
        vers.append(tb.versions.long())
        temps.append(torch.full((tb.tokens.numel(),), t, dtype=torch.float32))
        rows.append(tb.rows + off)
        cols.append(tb.cols)
        seq_list += [seqs_[b, : int(lengths[b])].tolist() for b in range(seqs_.shape[0])]
        off += seqs_.shape[0]
    n = sum(x.numel() for x in tokens)
    rec = RecordedRollouts(
        tokens=torch.cat(tokens), sampler_logprobs=torch.cat(lqs), candidates=None,
        group_names=tuple(g["name"] for g in groups), group_index=torch.cat(gidx), versions=torch.cat(vers),
        seq_ids=torch.cat(rows), temperature=torch.cat(temps), top_p=torch.ones(n), top_k=torch.full((n,), -1),
        contexts=Contexts.from_lists(seq_list), rows=torch.cat(rows), cols=torch.cat(cols))
    routes = torch.cat([r for rs in route_parts for r in rs])
    return rec, routes


def declared_as(rec: RecordedRollouts, temperature: float) -> RecordedRollouts:
    return replace(rec, temperature=torch.full_like(rec.temperature, temperature))


def make_replay(rec: RecordedRollouts, routes: torch.Tensor):
    """The routing re-scorer: ``(model, batch) -> logits`` with the recorded routes of ``batch.rows`` forced."""
    offsets = rec.contexts.offsets

    def replay(model: ToyMoE, batch: ScoreBatch) -> torch.Tensor:
        b, t = batch.input_ids.shape
        forced = torch.zeros(b, t, LAYERS, TOP_K, dtype=torch.int64)
        forced[..., :] = torch.arange(TOP_K)  # padding positions: any distinct experts (never read)
        for j, row in enumerate(batch.rows.tolist()):
            o, n = int(offsets[row]), int(batch.lengths[j])
            forced[j, :n] = routes[o: o + n]
        return model(batch.input_ids, routes=forced)

    return replay
