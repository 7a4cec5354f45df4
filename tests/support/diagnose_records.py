"""Reference-sampler records for the diagnose tests: a tiny peaked causal model and rollouts as diagnose reads
them."""

from __future__ import annotations

from dataclasses import replace

import torch

from offpolicy import Candidates
from offpolicy.diagnose import from_token_batch
from offpolicy.fleet.sampler import sample

V = 48


class TinyLM(torch.nn.Module):
    """A causal bigram-plus-position model: ``logits[b, l] = E[ids[b, l]] + P[l]`` ``[B, L, V]`` (peaked)."""

    def __init__(self, seed: int = 0, scale: float = 2.5):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Parameter(torch.randn(V, V, generator=g) * scale)
        self.pos = torch.nn.Parameter(torch.randn(64, V, generator=g) * 0.5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb[ids] + self.pos[: ids.shape[1]]


def prompts(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (n, 3), generator=torch.Generator().manual_seed(seed))


def record(model, *, temperature=0.7, top_p=1.0, top_k=None, kind="head", n=48, new=6, seed=2, versions=(0,),
           declared_temperature=None):
    """Reference-sampler rollouts (``versions``: one version per block of rows), as diagnose reads them."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for v in versions:
        ro = sample(model, prompts(n // len(versions), seed + v), new, temperature, top_p, top_k, record=kind,
                    k=6, version=v, filter_semantics="vllm", generator=g)
        rows.append(ro)
    parts = [from_token_batch(ro.flatten(), ro.sequences, top_p=top_p, top_k=top_k) for ro in rows]
    rec = parts[0] if len(parts) == 1 else concat(parts)
    if declared_temperature is not None:
        rec = replace(rec, temperature=torch.full_like(rec.temperature, declared_temperature))
    return rec


def padded(rec):
    """The rollouts' CSR candidates as a padded ``[N, K]`` :class:`Candidates` (tests build planted records in
    that layout; diagnose itself never pads)."""
    return rec.candidates.to_padded()


def support_of_ids(ids):
    """``[n, V]`` bool of the padded support ids ``[n, K]`` (one-hot sum, padding masked)."""
    return (torch.nn.functional.one_hot(ids.clamp(min=0), V) * (ids >= 0)[..., None]).sum(1) > 0


def concat(parts):
    """Stack rollouts with disjoint sequence rows."""
    off, seqs, out = 0, [], {k: [] for k in ("tokens", "sampler_logprobs", "group_index", "versions", "seq_ids",
                                               "temperature", "top_p", "top_k", "rows", "cols")}
    ids, lps = [], []
    length = max(p.sequences.shape[1] for p in parts)
    for p in parts:
        seqs.append(torch.nn.functional.pad(p.sequences, (0, length - p.sequences.shape[1])))
        for k in out:
            v = getattr(p, k)
            out[k].append(v + off if k in ("rows", "seq_ids") else v)
        ids.append(padded(p).ids)
        lps.append(padded(p).logprobs)
        off += p.sequences.shape[0]
    w = max(i.shape[1] for i in ids)
    cands = Candidates(torch.cat([torch.nn.functional.pad(i, (0, w - i.shape[1]), value=-1) for i in ids]),
                       torch.cat([torch.nn.functional.pad(x, (0, w - x.shape[1]), value=float("-inf")) for x in lps]),
                       parts[0].candidates.kind)
    return replace(parts[0], candidates=cands, contexts=torch.cat(seqs), **{k: torch.cat(v) for k, v in out.items()})


def rollout_lines(kind: str = "support", n: int = 8, top_p: float = 0.9, seed: int = 2) -> tuple[list[dict], object]:
    """JSONL lines (one per sequence, a ``seq_id`` each) of reference-sampler rollouts on :class:`TinyLM`, and
    the rollouts they read back as."""
    rec = record(TinyLM(), kind=kind, top_p=top_p, n=n, seed=seed)
    c = padded(rec)
    lines = []
    for b in range(rec.sequences.shape[0]):
        sel = (rec.rows == b).nonzero().flatten()
        start = int(rec.cols[sel].min())
        ids = [[int(i) for i in row if i >= 0] for row in c.ids[sel].tolist()]
        lps = [[float(v) for v, i in zip(lrow, irow) if i >= 0] for lrow, irow in zip(c.logprobs[sel].tolist(),
                                                                                      c.ids[sel].tolist())]
        lines.append({"group": "ref", "version": 0, "seq_id": b, "input_ids": rec.sequences[b, :start].tolist(),
                      "tokens": rec.tokens[sel].tolist(), "sampler_logprobs": rec.sampler_logprobs[sel].tolist(),
                      "temperature": 0.7, "top_p": top_p, "top_k": None,
                      "candidates": {"kind": kind, "ids": ids, "logprobs": lps}})
    return lines, rec


def trainer_logprobs(rec) -> torch.Tensor:
    """``[N]`` fp32 the trainer's (same model's) log-probs of the record's tokens, renormalised over the support."""
    from offpolicy.diagnose.scoring import score_model

    return score_model(TinyLM(), rec).logprobs.float()
