"""The trainer's side of the comparison: its log-probs for the recorded tokens, from a tensor file or a model.

Convention (the loss's, ``docs/spec.md#notation``): the trainer log-prob of a sampled token is taken at the
token's declared sampling temperature and, for support records, renormalised over the recorded support.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from offpolicy.diagnose.recorded import RecordedRollouts
from offpolicy.fleet.sampler import support_mask, support_mask_sorted

#: temperatures scanned for the one that best explains the record (log-spaced, ratio 1.145; the reading check
#: refines the best point by a parabola through its neighbours)
TEMPERATURE_GRID = torch.exp(torch.linspace(torch.log(torch.tensor(0.2)), torch.log(torch.tensor(3.0)), 21))
#: elements of the ``[temperatures * n, V]`` fp32 block the grid evaluates at once (64 MiB)
GRID_BLOCK = 1 << 24


@dataclass(frozen=True)
class TrainerScores:
    """Trainer log-probs for ``N`` recorded tokens.

    Attributes:
        logprobs: ``[N]`` float64 ``log p(y)`` (tempered, support-renormalised for support records).
        candidate_logprobs: ``[N, K]`` float64 tempered full-vocabulary log-probs at the record's candidate ids
            (``-inf`` at padding), or ``None``.
        hypotheses: ``{name: [N] float64}``: ``log p(y)`` under each reading of the record that diagnose tests
            (from a model only; see :func:`score_model`), ``declared_support_size [N]`` int64 and
            ``grid_abs_error [G, N]`` fp32.
    """

    logprobs: Tensor
    candidate_logprobs: Tensor | None = None
    hypotheses: dict[str, Tensor] | None = None


def load_trainer_logprobs(path: str | Path, n: int) -> TrainerScores:
    """A ``.safetensors`` or ``.pt`` file with ``logprobs [N]`` and optionally ``candidate_logprobs [N, K]``."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        t = load_file(str(path))
    else:
        t = torch.load(str(path), map_location="cpu", weights_only=True)
        if isinstance(t, Tensor):
            t = {"logprobs": t}
    if not isinstance(t, dict) or "logprobs" not in t:
        raise ValueError(f"{path}: expected a tensor 'logprobs' [N] (and optionally 'candidate_logprobs' [N, K])")
    lp = t["logprobs"].double().flatten()
    if lp.shape[0] != n:
        raise ValueError(f"{path}: 'logprobs' holds {lp.shape[0]} values for {n} recorded tokens")
    cand = t.get("candidate_logprobs")
    return TrainerScores(lp, None if cand is None else cand.double())


def support_of(ids: Tensor, vocab: int) -> Tensor:
    """``[n, V]`` bool from padded support ids ``[n, K]`` (``-1`` padding goes to a spare column, so it can never
    clear a real id 0)."""
    sup = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.bool)
    sup.scatter_(1, torch.where(ids >= 0, ids, vocab), True)
    return sup[:, :vocab]


def _tempered(z: Tensor, temperature: Tensor) -> Tensor:
    return torch.log_softmax(z / temperature[:, None], dim=-1)


def _filtered(lp: Tensor, top_p: Tensor, top_k: Tensor, semantics: str) -> Tensor:
    """``lp`` renormalised over each row's kept set (``-inf`` elsewhere); rows share no parameters, so by group."""
    out = torch.full_like(lp, float("-inf"))
    keys = torch.stack([top_p.double(), top_k.double()], 1)
    for key in torch.unique(keys, dim=0):
        rows = (keys == key).all(1)
        p, k = float(key[0]), int(key[1])
        keep = support_mask(lp[rows].float(), None if k < 0 else k, p, semantics=semantics)
        sub = torch.where(keep, lp[rows], float("-inf"))
        out[rows] = sub - torch.logsumexp(sub, dim=-1, keepdim=True)
    return out


def _grid_errors(z: Tensor, y: Tensor, lq: Tensor, top_p: Tensor, top_k: Tensor, semantics: str) -> Tensor:
    """``|log q_T(y) - lq|`` ``[G, n]`` fp32 at every grid temperature (filtered and renormalised as declared),
    from logits ``z [n, V]`` float64, computed in fp32 (evidence only: errors of interest exceed 1e-3). A row's
    order does not change with T, so each row group is sorted once and every temperature filters the sorted rows
    (:func:`~offpolicy.fleet.sampler.support_mask_sorted`), in blocks of temperatures."""
    out = torch.empty(len(TEMPERATURE_GRID), z.shape[0], dtype=torch.float32)
    keys = torch.stack([top_p.double(), top_k.double()], 1)
    for key in torch.unique(keys, dim=0):
        rows = (keys == key).all(1).nonzero().flatten()
        p, k = float(key[0]), int(key[1])
        zs, order = torch.sort(z[rows].float(), dim=1, descending=True, stable=True)
        pos = (order == y[rows, None]).int().argmax(1, keepdim=True)
        n, v = zs.shape
        step = max(1, GRID_BLOCK // max(n * v, 1))  # temperatures per block: [step * n, V] fp32 at a time
        for g0 in range(0, len(TEMPERATURE_GRID), step):
            temps = TEMPERATURE_GRID[g0: g0 + step]
            lp = torch.log_softmax(zs[None] / temps[:, None, None], -1).reshape(-1, v)  # [t * n, V]
            keep = support_mask_sorted(lp, None if k < 0 else k, p, semantics)
            sub = torch.where(keep, lp, float("-inf"))
            at = sub.gather(1, pos.repeat(len(temps), 1))[:, 0] - torch.logsumexp(sub, -1)
            out[g0: g0 + len(temps), rows] = (at.view(len(temps), n).double() - lq[rows]).abs().float()
    return out


@torch.no_grad()
def score_model(model: torch.nn.Module, rollouts: RecordedRollouts, *, semantics: str = "vllm",
                chunk: int = 16) -> TrainerScores:
    """Evaluate ``model`` (``input_ids [B, L] -> logits [B, L, V]``) on the recorded contexts.

    Besides the trainer log-probs it computes, per token, ``log p(y)`` under each reading of the record:
    ``declared`` (the declared temperature and filter, renormalised: what the record should be), ``raw`` (T = 1, no
    filter), ``temperature_twice`` (T^2, filtered, renormalised), ``not_renormalised`` (T, no division by the
    support mass), the size of the declared filter's kept set (``declared_support_size``) and, for the grid
    :data:`TEMPERATURE_GRID`, the record's absolute error at each temperature (``grid_abs_error [G, N]``).
    ``semantics`` is the engine's filter order (``"vllm"`` or ``"sglang"``).
    """
    was = model.training
    model.eval()
    r = rollouts
    n = len(r)
    lp = torch.empty(n, dtype=torch.float64)
    names = ("declared", "raw", "temperature_twice", "not_renormalised")
    hyp = {k: torch.empty(n, dtype=torch.float64) for k in names}
    size = torch.zeros(n, dtype=torch.int64)
    grid_err = torch.zeros(len(TEMPERATURE_GRID), n, dtype=torch.float32)
    cand = None
    if r.candidates is not None:
        cand = torch.full(r.candidates.ids.shape, float("-inf"), dtype=torch.float64)
    try:
        for b0 in range(0, r.sequences.shape[0], chunk):
            out = model(r.sequences[b0: b0 + chunk])
            logits = out.logits if hasattr(out, "logits") else out
            sel = ((r.rows >= b0) & (r.rows < b0 + chunk)).nonzero().flatten()
            if sel.numel() == 0:
                continue
            z = logits[r.rows[sel] - b0, r.cols[sel] - 1].double()  # [n, V]
            y = r.tokens[sel][:, None]
            t, p, k = r.temperature[sel].double(), r.top_p[sel], r.top_k[sel]
            filt = (p < 1.0) | (k >= 0)
            lt = _tempered(z, t)
            renorm = _filtered(lt, p, k, semantics)
            hyp["declared"][sel] = renorm.gather(1, y)[:, 0]
            size[sel] = (renorm > float("-inf")).sum(1)
            hyp["raw"][sel] = torch.log_softmax(z, -1).gather(1, y)[:, 0]
            hyp["temperature_twice"][sel] = _filtered(_tempered(z, t * t), p, k, semantics).gather(1, y)[:, 0]
            hyp["not_renormalised"][sel] = lt.gather(1, y)[:, 0]
            if r.candidates is not None and r.candidates.kind == "support":
                sup = support_of(r.candidates.ids[sel], z.shape[1])
                sub = torch.where(sup, lt, float("-inf"))
                lp[sel] = (sub - torch.logsumexp(sub, -1, keepdim=True)).gather(1, y)[:, 0]
            else:
                lp[sel] = torch.where(filt, renorm.gather(1, y)[:, 0], lt.gather(1, y)[:, 0])
            if cand is not None:
                ids = r.candidates.ids[sel]
                cand[sel] = torch.where(ids >= 0, lt.gather(1, ids.clamp(min=0)), float("-inf"))
            grid_err[:, sel] = _grid_errors(z, y[:, 0], r.sampler_logprobs[sel].double(), p, k, semantics)
    finally:
        model.train(was)
    hyp["declared_support_size"] = size
    hyp["grid_abs_error"] = grid_err
    return TrainerScores(lp, cand, hyp)


def load_model(path: str | Path) -> torch.nn.Module:
    """A ``transformers`` causal LM from a local directory, in float32 (nothing is downloaded)."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"--model {path}: no such folder; pass a local transformers model directory (with "
                         "config.json and the weights; diagnose downloads nothing)")
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {path}: the folder holds no config.json; pass the directory a transformers "
                         "model was saved to (save_pretrained)")
    return AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32, local_files_only=True)
