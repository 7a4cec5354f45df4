"""The trainer's side of the comparison: its log-probs for the recorded tokens, from a tensor file or a model.

Convention (the loss's, ``docs/spec.md#notation``): the trainer log-prob of a sampled token is taken at the
token's declared sampling temperature and, for support records, renormalised over the recorded support.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from offpolicy.diagnose.entries import entry_rows, padded_to_entries
from offpolicy.diagnose.recorded import RecordedRollouts
from offpolicy.loss.validation import LOGPROB_SLACK
from offpolicy.records.csr_candidates import CSRCandidates
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
        candidate_logprobs: ``[nnz]`` float64 tempered full-vocabulary log-probs at the record's CSR candidate
            entries, or ``None``. :func:`~offpolicy.diagnose.diagnose` also takes ``[N, K]`` in the layout of
            ``candidates.to_padded()`` (``-inf`` after each row's entries) and reads it as ``[nnz]``.
        hypotheses: ``{name: [N] float64}``: ``log p(y)`` under each reading of the record that diagnose tests
            (from a model only; see :func:`score_model`), ``declared_support_size [N]`` int64 and
            ``grid_abs_error [G, N]`` fp32.
    """

    logprobs: Tensor
    candidate_logprobs: Tensor | None = None
    hypotheses: dict[str, Tensor] | None = None


def load_trainer_logprobs(path: str | Path, n: int, candidates: CSRCandidates | None = None) -> TrainerScores:
    """A ``.safetensors`` or ``.pt`` file with ``logprobs [N]`` and optionally ``candidate_logprobs`` (``[nnz]``
    aligned with the record's CSR entries, or ``[N, K]`` in the layout of ``candidates.to_padded()``).

    A ``.pt`` file is read with ``torch.load(weights_only=True)`` (no code runs). Every failure, a file that
    does not parse included, raises ``ValueError`` naming the file and the tensor. With the record's
    ``candidates``, ``candidate_logprobs`` is checked against them here (and returned as ``[nnz]``)."""
    path = Path(path)
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            t = load_file(str(path))
        else:
            t = torch.load(str(path), map_location="cpu", weights_only=True)
    except OSError:
        raise
    except Exception as exc:  # SafetensorError, UnpicklingError, RuntimeError (zip), EOFError, ...
        raise ValueError(f"{path}: not a readable {'safetensors' if path.suffix == '.safetensors' else 'torch'} "
                         f"file ({type(exc).__name__}: {str(exc)[:200]})") from None
    if isinstance(t, Tensor):
        t = {"logprobs": t}
    if not isinstance(t, dict) or not isinstance(t.get("logprobs"), Tensor):
        raise ValueError(f"{path}: expected a tensor 'logprobs' [N] (and optionally 'candidate_logprobs' [N, K])")
    lp = check_trainer_values(t["logprobs"], f"{path}, tensor 'logprobs'")
    if lp.dim() != 1 and not (lp.dim() == 2 and lp.shape[1] == 1):
        raise ValueError(f"{path}, tensor 'logprobs': expected [N], got {list(lp.shape)}")
    lp = lp.flatten()
    if lp.shape[0] != n:
        raise ValueError(f"{path}, tensor 'logprobs': {lp.shape[0]} values for {n} recorded tokens")
    cand = t.get("candidate_logprobs")
    if cand is not None:
        if not isinstance(cand, Tensor):
            raise ValueError(f"{path}, 'candidate_logprobs': expected a tensor, got {type(cand).__name__}")
        what = f"{path}, tensor 'candidate_logprobs'"
        cand = check_trainer_values(cand, what)
        if candidates is None:
            raise ValueError(f"{what}: given, but the rollouts record no candidates")
        cand = padded_to_entries(cand, candidates, what)
    return TrainerScores(lp, cand)


def check_trainer_values(x: Tensor, what: str) -> Tensor:
    """Trainer log-probs: a float tensor, no NaN, no value above 0 (``-inf`` allowed); returned as float64."""
    if not x.is_floating_point():
        raise ValueError(f"{what}: expected a float tensor, got {x.dtype}")
    if x.device.type != "cpu":
        x = x.cpu()
    x = x.double()
    if bool(torch.isnan(x).any()):
        raise ValueError(f"{what}: NaN at index {int(torch.isnan(x).flatten().nonzero()[0])}")
    if bool((x > LOGPROB_SLACK).any()):
        raise ValueError(f"{what}: {float(x.max()):.6g} > 0 is not a log-probability")
    return x


def support_of(local: Tensor, ids: Tensor, n: int, vocab: int) -> Tensor:
    """``[n, V]`` bool with ``True`` at ``(local[e], ids[e])`` for each CSR entry ``e``."""
    sup = torch.zeros(n, vocab, dtype=torch.bool)
    sup[local, ids] = True
    return sup


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
    r = rollouts
    n = len(r)
    lp = torch.empty(n, dtype=torch.float64)
    names = ("declared", "raw", "temperature_twice", "not_renormalised")
    hyp = {k: torch.empty(n, dtype=torch.float64) for k in names}
    size = torch.zeros(n, dtype=torch.int64)
    grid_err = torch.zeros(len(TEMPERATURE_GRID), n, dtype=torch.float32)
    c = r.candidates
    cand = None if c is None else torch.full((c.nnz,), float("-inf"), dtype=torch.float64)
    # tokens and CSR entries sorted by their sequence row once: each chunk of rows takes a contiguous slice
    tok_order = torch.argsort(r.rows, stable=True)
    tok_rows = r.rows[tok_order]
    if c is not None:
        ent_token = entry_rows(c)
        ent_order = torch.argsort(r.rows[ent_token], stable=True)
        ent_rows = r.rows[ent_token][ent_order]
    local_of = torch.full((n,), -1, dtype=torch.int64)
    scored = torch.zeros(n, dtype=torch.bool)
    was = model.training
    model.eval()
    try:
        for b0 in range(0, len(r.contexts), chunk):
            bounds = torch.tensor([b0, b0 + chunk])
            t0, t1 = torch.searchsorted(tok_rows, bounds).tolist()
            sel = tok_order[t0:t1]
            if sel.numel() == 0:
                continue
            logits = _forward(model, r.contexts.padded(b0, b0 + chunk), b0)  # padded to this chunk's longest
            vocab = logits.shape[-1]
            _check_vocab(r.tokens[sel], vocab, "tokens")
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
            if c is not None:
                e0, e1 = torch.searchsorted(ent_rows, bounds).tolist()
                ents = ent_order[e0:e1]
                local_of[sel] = torch.arange(sel.numel())
                local = local_of[ent_token[ents]]
                ids = c.ids[ents].long()
                _check_vocab(ids, vocab, "candidate ids")
                cand[ents] = lt[local, ids]
            if c is not None and c.kind == "support":
                sup = support_of(local, ids, sel.numel(), vocab)
                sub = torch.where(sup, lt, float("-inf"))
                lp[sel] = (sub - torch.logsumexp(sub, -1, keepdim=True)).gather(1, y)[:, 0]
            else:
                lp[sel] = torch.where(filt, renorm.gather(1, y)[:, 0], lt.gather(1, y)[:, 0])
            grid_err[:, sel] = _grid_errors(z, y[:, 0], r.sampler_logprobs[sel].double(), p, k, semantics)
            scored[sel] = True
    finally:
        model.train(was)
    if not bool(scored.all()):  # check_columns puts every token in a sequence; kept as a guard on torch.empty
        raise ValueError(f"diagnose: {int((~scored).sum())} tokens sit outside the recorded sequences")
    hyp["declared_support_size"] = size
    hyp["grid_abs_error"] = grid_err
    return TrainerScores(lp, cand, hyp)


def _forward(model: torch.nn.Module, ids: Tensor, b0: int) -> Tensor:
    """``logits [b, L, V]`` of ``model`` on ``ids [b, L]``; a model that fails on the recorded contexts (ids past
    its vocabulary, contexts past its positions) raises ``ValueError`` naming the rows."""
    try:
        out = model(ids)
    except (IndexError, RuntimeError, ValueError) as exc:
        raise ValueError(f"--model: the model failed on the recorded contexts of sequences {b0}..{b0 + len(ids) - 1} "
                         f"(token ids up to {int(ids.max())}, length {ids.shape[1]}): {type(exc).__name__}: "
                         f"{str(exc)[:200]}") from None
    logits = out.logits if hasattr(out, "logits") else out
    if not isinstance(logits, Tensor) or logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(ids.shape):
        raise ValueError(f"--model: expected logits [B, L, V] for input [B, L] = {list(ids.shape)}, got "
                         f"{list(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__}")
    return logits


def _check_vocab(ids: Tensor, vocab: int, what: str) -> None:
    if ids.numel() and int(ids.max()) >= vocab:
        raise ValueError(f"diagnose: recorded {what} reach id {int(ids.max())}, outside the model's vocabulary "
                         f"of {vocab}: the rollouts come from another tokenizer or model")


def load_model(path: str | Path) -> torch.nn.Module:
    """A ``transformers`` causal LM from a local directory, in float32 (nothing is downloaded; the folder's own
    code is never run: ``trust_remote_code=False``). Any load failure raises ``ValueError`` naming the folder."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"--model {path}: no such folder; pass a local transformers model directory (with "
                         "config.json and the weights; diagnose downloads nothing)")
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {path}: the folder holds no config.json; pass the directory a transformers "
                         "model was saved to (save_pretrained)")
    try:  # trust_remote_code=False: a folder's own Python never runs, and transformers never prompts on stdin
        return AutoModelForCausalLM.from_pretrained(str(path), **{_dtype_keyword(): torch.float32},
                                                    local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # a corrupt config or weight file, custom code refused, an unknown architecture
        raise ValueError(f"--model {path}: the model does not load ({type(exc).__name__}: {str(exc)[:300]}); "
                         "diagnose loads a local transformers causal LM without running its folder's code "
                         "(trust_remote_code=False)") from None


def _dtype_keyword() -> str:
    """``dtype`` (transformers >= 4.56), else the older ``torch_dtype``."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
