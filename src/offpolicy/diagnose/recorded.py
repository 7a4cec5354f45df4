"""Recorded rollouts as ``offpolicy diagnose`` reads them: the adapters' records with group and weight-version
columns, saved as JSONL (one turn per line) or safetensors (flat per-token columns).

JSONL line (what :func:`turn_to_json` writes from an adapter :class:`~offpolicy.adapters.common.TurnRecord`)::

    {"group": "fp8-pool", "version": 7, "seq_id": 0, "input_ids": [...], "tokens": [...],
     "sampler_logprobs": [...], "temperature": 0.7, "top_p": 0.9, "top_k": 16,
     "candidates": {"kind": "support", "ids": [[...], ...], "logprobs": [[...], ...]}}

``"versions": [...]`` (one per token) may replace ``version``; ``candidates`` may be ``null``; ``-inf`` padding is written as ``null`` (``ids`` padded with -1); ``seq_id`` groups the
turns of one multi-turn episode (default: one sequence per line). safetensors: tensors ``tokens [N]``,
``sampler_logprobs [N]``, ``versions [N]``, ``group_index [N]``, ``seq_ids [N]``, ``temperature [N]``, ``top_p [N]``,
``top_k [N]`` (-1: off), ``rows [N]``, ``cols [N]``, ``sequences [B, L]`` and optionally ``candidate_ids [N, K]``,
``candidate_logprobs [N, K]``; metadata ``groups`` (a JSON list of names) and ``candidate_kind``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from offpolicy.adapters.common import TurnRecord
from offpolicy.adapters.sglang import TOP_K_ALL
from offpolicy.records.candidates import Candidates
from offpolicy.records.csr_candidates import CSRCandidates
from offpolicy.records.token_batch import TokenBatch


@dataclass(frozen=True)
class RecordedRollouts:
    """``N`` sampled tokens with what the sampler recorded and where each sits in its sequence.

    Attributes:
        tokens: ``[N]`` int64.  sampler_logprobs: ``[N]`` fp32 ``lq``.
        candidates: ``[N, K]`` :class:`Candidates` or ``None``.
        group_names: the sampler groups; ``group_index [N]`` int64 indexes it.
        versions: ``[N]`` int64 weight version (-1: unknown).  seq_ids: ``[N]`` int64 episode of each token.
        temperature, top_p: ``[N]`` fp32 declared sampling parameters; top_k: ``[N]`` int64 (-1: off).
        sequences: ``[B, L]`` int64 contexts (right-padded with 0); rows, cols: ``[N]`` the token's position
            (the logits that predicted it are at ``cols - 1``).
    """

    tokens: Tensor
    sampler_logprobs: Tensor
    candidates: Candidates | None
    group_names: tuple[str, ...]
    group_index: Tensor
    versions: Tensor
    seq_ids: Tensor
    temperature: Tensor
    top_p: Tensor
    top_k: Tensor
    sequences: Tensor
    rows: Tensor
    cols: Tensor

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def turn_to_json(record: TurnRecord, *, group: str, version: int | None = None, seq_id: int | None = None) -> dict:
    """One JSONL line from an adapter record (``record.input_ids`` must be known: the trainer needs the context).

    ``version`` stamps every token; without it the record's own per-token ``versions`` (e.g. vLLM's
    ``weight_versions`` spans, SGLang's ``weight_version``) are written as ``"versions": [...]`` (integers).
    """
    if record.input_ids is None:
        raise ValueError("turn_to_json: the record carries no input_ids (the context the trainer must score)")
    if version is None and record.versions is None:
        raise ValueError("turn_to_json: pass version= (the record carries no weight versions)")
    line: dict[str, object] = {
        "group": str(group), "input_ids": list(record.input_ids),
        "tokens": record.tokens.tolist(), "sampler_logprobs": [_num(v) for v in record.sampler_logprobs.tolist()],
        "temperature": record.temperature, "top_p": record.top_p, "top_k": record.top_k,
        "candidates": None,
    }
    if version is not None:
        line["version"] = int(version)
    else:
        try:
            line["versions"] = [int(v) for v in record.versions]
        except ValueError as exc:
            raise ValueError(f"turn_to_json: weight versions {record.versions[:3]} are not integers: pass "
                             "version=") from exc
    if seq_id is not None:
        line["seq_id"] = int(seq_id)
    if isinstance(record.candidates, CSRCandidates):  # ragged rows: each token's own support
        c = record.candidates
        sizes = c.lengths.tolist()
        line["candidates"] = {"kind": c.kind, "ids": [r.tolist() for r in c.ids.split(sizes)],
                              "logprobs": [[_num(v) for v in r.tolist()] for r in c.logprobs.split(sizes)]}
    elif record.candidates is not None:
        c = record.candidates
        line["candidates"] = {"kind": c.kind, "ids": c.ids.tolist(),
                              "logprobs": [[_num(v) for v in row] for row in c.logprobs.tolist()]}
    return line


def _num(v: float) -> float | None:
    return v if math.isfinite(v) else None


def declared_top_k(top_k: int | None) -> int:
    """The stored top-k: ``-1`` for every engine's "off" (``None``; vLLM's ``0`` and ``-1``; SGLang's all-tokens
    ``TOP_K_ALL = 1 << 30`` and above), else the integer."""
    if top_k is None or int(top_k) in (0, -1) or int(top_k) >= TOP_K_ALL:
        return -1
    return int(top_k)


def save_jsonl(lines: Iterable[dict], path: str | Path) -> Path:
    path = Path(path)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _req(line: dict, key: str, n: int) -> object:
    if key not in line:
        raise ValueError(f"rollouts line {n}: field {key!r} is missing")
    return line[key]


def load_jsonl(path: str | Path) -> RecordedRollouts:
    """Read a JSONL file written by :func:`save_jsonl` / :func:`turn_to_json`; an engine response (one JSON
    document with ``choices``) is refused with the way to convert it."""
    text = Path(path).read_text()
    lines = []
    for n, s in enumerate(text.splitlines()):
        if not s.strip():
            continue
        try:
            lines.append(json.loads(s))
        except json.JSONDecodeError:
            lines = [_whole_document(text, path, n)]
            break
    if not lines:
        raise ValueError(f"{path}: no rollouts")
    for n, line in enumerate(lines):
        if not isinstance(line, dict):
            raise ValueError(f"{path}: line {n} is a JSON {type(line).__name__}, not a rollouts object")
        if "choices" in line and "tokens" not in line:
            raise ValueError(
                f"{path}: this is an engine response (a JSON object with 'choices', e.g. vLLM's /v1/completions or "
                "/inference/v1/generate), not offpolicy rollouts: parse it with offpolicy.adapters.vllm "
                "(parse_completion_response / parse_generate_response, with its request) and write the records "
                "with offpolicy.diagnose.turn_to_json + save_jsonl (docs/diagnose.md#inputs)")
    return from_lines(lines)


def _whole_document(text: str, path: str | Path, n: int) -> object:
    """A file that is not JSONL: one (pretty-printed) JSON document, else a clear error."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: line {n} is not JSON ({exc.msg}); rollouts are JSONL, one JSON object per line"
                         ) from exc


def from_lines(lines: Sequence[dict]) -> RecordedRollouts:
    """Flatten JSONL lines (dicts) into :class:`RecordedRollouts`; turns sharing a ``seq_id`` share a context row
    (each later turn's ``input_ids`` must extend the earlier context)."""
    groups: dict[str, int] = {}
    contexts: dict[int, list[int]] = {}
    order: list[int] = []
    cols_t, rows_key, toks, lqs, gi, vers, sids, temps, tps, tks, cid, clp = ([] for _ in range(12))
    kinds = set()
    for n, line in enumerate(lines):
        sid = int(line.get("seq_id", -1 - n))
        ids = [int(t) for t in _req(line, "input_ids", n)]
        tokens = [int(t) for t in _req(line, "tokens", n)]
        lq = [float("-inf") if v is None else float(v) for v in _req(line, "sampler_logprobs", n)]
        if len(lq) != len(tokens):
            raise ValueError(f"rollouts line {n}: {len(tokens)} tokens but {len(lq)} sampler_logprobs")
        ctx = contexts.get(sid)
        if ctx is None:
            order.append(sid)
        elif ids[: len(ctx)] != ctx:
            raise ValueError(f"rollouts line {n}: input_ids do not extend the context of seq_id {sid}")
        contexts[sid] = ids + tokens
        g = groups.setdefault(str(_req(line, "group", n)), len(groups))
        t = len(tokens)
        toks += tokens
        lqs += lq
        cols_t += range(len(ids), len(ids) + t)
        rows_key += [sid] * t
        gi += [g] * t
        if "versions" in line:
            per = [int(v) for v in line["versions"]]
            if len(per) != t:
                raise ValueError(f"rollouts line {n}: {len(per)} versions for {t} tokens")
            vers += per
        else:
            vers += [int(line.get("version", -1))] * t
        sids += [sid] * t
        temps += [float(_req(line, "temperature", n))] * t
        tps += [float(line.get("top_p", 1.0) or 1.0)] * t
        tks += [declared_top_k(line.get("top_k"))] * t
        c = line.get("candidates")
        if c is not None:
            kinds.add(c["kind"])
            cid.append([[int(v) for v in row] for row in c["ids"]])
            clp.append([[float("-inf") if v is None else float(v) for v in row] for row in c["logprobs"]])
            if len(c["ids"]) != t:
                raise ValueError(f"rollouts line {n}: candidates hold {len(c['ids'])} rows for {t} tokens")
        elif kinds:
            raise ValueError(f"rollouts line {n}: no candidates although earlier lines carry them")
    if len(kinds) > 1:
        raise ValueError(f"rollouts mix candidate kinds {sorted(kinds)}")
    row_of = {sid: b for b, sid in enumerate(order)}
    length = max(len(c) for c in contexts.values())
    seqs = torch.zeros(len(order), length, dtype=torch.int64)
    for sid, ctx in contexts.items():
        seqs[row_of[sid], : len(ctx)] = torch.tensor(ctx, dtype=torch.int64)
    cands = None
    if kinds:
        width = max(len(r) for block in cid for r in block)
        ids = torch.full((len(toks), width), -1, dtype=torch.int64)
        lps = torch.full((len(toks), width), float("-inf"))
        i = 0
        for block_ids, block_lps in zip(cid, clp):
            for r_ids, r_lps in zip(block_ids, block_lps):
                ids[i, : len(r_ids)] = torch.tensor(r_ids, dtype=torch.int64)
                lps[i, : len(r_lps)] = torch.tensor(r_lps)
                i += 1
        cands = Candidates(ids, lps, kinds.pop())
    return RecordedRollouts(
        tokens=torch.tensor(toks, dtype=torch.int64), sampler_logprobs=torch.tensor(lqs, dtype=torch.float32),
        candidates=cands, group_names=tuple(groups), group_index=torch.tensor(gi, dtype=torch.int64),
        versions=torch.tensor(vers, dtype=torch.int64), seq_ids=torch.tensor([row_of[s] for s in sids]),
        temperature=torch.tensor(temps, dtype=torch.float32), top_p=torch.tensor(tps, dtype=torch.float32),
        top_k=torch.tensor(tks, dtype=torch.int64), sequences=seqs,
        rows=torch.tensor([row_of[s] for s in rows_key], dtype=torch.int64),
        cols=torch.tensor(cols_t, dtype=torch.int64),
    )


_TENSORS = ("tokens", "sampler_logprobs", "group_index", "versions", "seq_ids", "temperature", "top_p", "top_k",
            "sequences", "rows", "cols")


def save_safetensors(rollouts: RecordedRollouts, path: str | Path) -> Path:
    from safetensors.torch import save_file

    # columns may share storage (a TokenBatch's rows and seq_ids often do); safetensors refuses shared tensors
    tensors = {k: getattr(rollouts, k).clone(memory_format=torch.contiguous_format) for k in _TENSORS}
    meta = {"groups": json.dumps(list(rollouts.group_names)), "candidate_kind": ""}
    if rollouts.candidates is not None:
        tensors["candidate_ids"] = rollouts.candidates.ids.contiguous()
        tensors["candidate_logprobs"] = rollouts.candidates.logprobs.float().contiguous()
        meta["candidate_kind"] = rollouts.candidates.kind
    save_file(tensors, str(path), metadata=meta)
    return Path(path)


def load_safetensors(path: str | Path) -> RecordedRollouts:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        keys = set(f.keys())
        missing = [k for k in _TENSORS if k not in keys]
        if missing or "groups" not in meta:
            raise ValueError(f"{path}: not a rollouts file (missing {missing or ['groups metadata']})")
        t = {k: f.get_tensor(k) for k in keys}
    cands = None
    if meta.get("candidate_kind"):
        cands = Candidates(t["candidate_ids"], t["candidate_logprobs"], meta["candidate_kind"])
    return RecordedRollouts(candidates=cands, group_names=tuple(json.loads(meta["groups"])),
                            **{k: t[k] for k in _TENSORS})


def load_rollouts(path: str | Path) -> RecordedRollouts:
    """JSONL (``.jsonl`` / ``.json``) or safetensors (``.safetensors``), by suffix."""
    path = Path(path)
    if path.suffix == ".safetensors":
        return load_safetensors(path)
    if path.suffix in (".jsonl", ".json"):
        return load_jsonl(path)
    raise ValueError(f"{path}: rollouts must be .jsonl or .safetensors")


def from_token_batch(
    batch: TokenBatch,
    sequences: Tensor,
    *,
    group_names: Sequence[str] = ("default",),
    group_index: Tensor | None = None,
    top_p: float = 1.0,
    top_k: int | None = None,
) -> RecordedRollouts:
    """Rollouts from a :class:`~offpolicy.records.TokenBatch` (e.g. the reference sampler's ``Rollout.flatten()``
    or the adapters' ``collate``) and its ``sequences [B, L]``; ``top_p`` / ``top_k`` are the declared filter. A
    CSR record is padded here (the diagnosis reads ``[N, K]`` records)."""
    n = batch.tokens.shape[0]
    gi = torch.zeros(n, dtype=torch.int64) if group_index is None else group_index.to(torch.int64)
    if gi.shape != (n,) or (n and (int(gi.min()) < 0 or int(gi.max()) >= len(group_names))):
        raise ValueError(f"group_index must be [N] = [{n}] int64 indexing group_names ({len(group_names)})")
    cands = batch.candidates
    if isinstance(cands, CSRCandidates):  # the diagnosis reads records padded (collate's support records are CSR)
        cands = cands.to_padded()
    return RecordedRollouts(
        tokens=batch.tokens, sampler_logprobs=batch.sampler_logprobs.float(), candidates=cands,
        group_names=tuple(group_names), group_index=gi, versions=batch.versions.to(torch.int64),
        seq_ids=batch.seq_ids.to(torch.int64), temperature=batch.temperature.float(),
        top_p=torch.full((n,), float(top_p)), top_k=torch.full((n,), declared_top_k(top_k)),
        sequences=sequences, rows=batch.rows, cols=batch.cols,
    )
