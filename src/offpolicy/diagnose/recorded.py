"""Recorded rollouts as ``offpolicy diagnose`` reads them: the adapters' records with group and weight-version
columns, saved as JSONL (one turn per line) or safetensors (flat per-token columns).

JSONL line (what :func:`turn_to_json` writes from an adapter :class:`~offpolicy.adapters.common.TurnRecord`)::

    {"group": "fp8-pool", "version": 7, "seq_id": 0, "input_ids": [...], "tokens": [...],
     "sampler_logprobs": [...], "temperature": 0.7, "top_p": 0.9, "top_k": 16,
     "candidates": {"kind": "support", "ids": [[...], ...], "logprobs": [[...], ...]}}

``"versions": [...]`` (one per token) may replace ``version``; ``candidates`` may be ``null``; each candidate row
holds its own ids (a ``-1`` id with a ``null`` log-prob is padding, dropped); ``seq_id`` groups the turns of one
multi-turn episode (default: one sequence per line). Every line is checked once, where it is read
(:mod:`offpolicy.diagnose.schema`): a malformed value raises :class:`RolloutsError` naming the file, the line and
the field. safetensors: tensors ``tokens [N]``, ``sampler_logprobs [N]``, ``versions [N]``, ``group_index [N]``,
``seq_ids [N]``, ``temperature [N]``, ``top_p [N]``, ``top_k [N]`` (-1: off), ``rows [N]``, ``cols [N]``, the
contexts ``context_ids [S]`` / ``context_offsets [B + 1]`` (an older file's ``sequences [B, L]`` is read too) and
optionally the CSR candidates ``candidate_ids [nnz]``, ``candidate_offsets [N + 1]``,
``candidate_logprobs [nnz]`` (an older file's padded ``candidate_ids [N, K]`` / ``candidate_logprobs [N, K]`` is
read too); metadata ``groups`` (a JSON list of names) and ``candidate_kind``.

Candidates are held in CSR (:class:`~offpolicy.records.CSRCandidates`), never padded to ``[N, K]``: memory is
linear in the entries the file holds.
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
from offpolicy.diagnose.contexts import Contexts
from offpolicy.diagnose.schema import RolloutsError, check_columns, check_line
from offpolicy.records.candidates import Candidates
from offpolicy.records.csr_candidates import CSRCandidates
from offpolicy.records.token_batch import TokenBatch



@dataclass(frozen=True)
class RecordedRollouts:
    """``N`` sampled tokens with what the sampler recorded and where each sits in its sequence.

    Attributes:
        tokens: ``[N]`` int64.  sampler_logprobs: ``[N]`` fp32 ``lq``.
        candidates: :class:`CSRCandidates` (``N`` rows) or ``None``; a padded ``[N, K]`` :class:`Candidates`
            passed in is stored as CSR (its ``-1`` entries dropped).
        group_names: the sampler groups; ``group_index [N]`` int64 indexes it.
        versions: ``[N]`` int64 weight version (-1: unknown).  seq_ids: ``[N]`` int64 episode of each token.
        temperature, top_p: ``[N]`` fp32 declared sampling parameters; top_k: ``[N]`` int64 (-1: off).
        contexts: the ``B`` sequences back to back (:class:`~offpolicy.diagnose.contexts.Contexts`, CSR; a padded
            ``[B, L]`` tensor passed in is stored row by row); rows, cols: ``[N]`` the token's position (sequence
            ``rows``, index ``cols``; the logits that predicted it are at ``cols - 1``). :attr:`sequences` pads them
            to ``[B, L]`` on demand (small records, tests; diagnose itself never does).
    """

    tokens: Tensor
    sampler_logprobs: Tensor
    candidates: CSRCandidates | None
    group_names: tuple[str, ...]
    group_index: Tensor
    versions: Tensor
    seq_ids: Tensor
    temperature: Tensor
    top_p: Tensor
    top_k: Tensor
    contexts: Contexts
    rows: Tensor
    cols: Tensor

    def __post_init__(self) -> None:
        if isinstance(self.contexts, Tensor):
            object.__setattr__(self, "contexts", Contexts.from_padded(self.contexts))
        elif not isinstance(self.contexts, Contexts):
            raise RolloutsError(f"rollouts, field 'contexts': expected Contexts or an int [B, L] tensor, got "
                                f"{type(self.contexts).__name__}")
        c = self.candidates
        if isinstance(c, Candidates):
            if c.ids.dim() != 2 or c.ids.shape[0] != self.tokens.numel():
                raise RolloutsError(f"rollouts, field 'candidates': [N, K] with N = {self.tokens.numel()} expected, "
                                    f"got {list(c.ids.shape)}")
            if bool((c.ids < -1).any()):
                raise RolloutsError("rollouts, field 'candidates.ids': an id below -1 (-1 is padding)")
            object.__setattr__(self, "candidates", CSRCandidates.from_padded(c))
        elif c is not None and not isinstance(c, CSRCandidates):
            raise RolloutsError(f"rollouts, field 'candidates': expected CSRCandidates, Candidates or None, got "
                                f"{type(c).__name__}")
        check_columns(self)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def sequences(self) -> Tensor:
        """``[B, L]`` int64 the contexts right-padded with 0 (``O(B L)``: for small records and tests)."""
        return self.contexts.padded()


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
    """A log-prob for JSON: ``-inf`` as ``null``; NaN and ``+inf`` are not log-probs and are refused."""
    if math.isnan(v) or v == float("inf"):
        raise ValueError(f"turn_to_json: {v} is not a log-probability")
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


def load_jsonl(path: str | Path) -> RecordedRollouts:
    """Read a JSONL file written by :func:`save_jsonl` / :func:`turn_to_json`, checking every line once (a
    malformed one raises :class:`RolloutsError` naming the file, the line (1-based) and the field); an engine
    response (one JSON document with ``choices``) is refused with the way to convert it."""
    path = Path(path)
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise RolloutsError(f"{path}, line {line}: not UTF-8 text (byte "
                            f"{exc.start}); rollouts are JSONL, one JSON object per line") from None
    lines, numbers = [], []
    for n, s in enumerate(text.splitlines(), start=1):
        if not s.strip():
            continue
        try:
            lines.append(_loads(s))
            numbers.append(n)
        except json.JSONDecodeError:
            lines, numbers = [_whole_document(text, path, n)], [1]
            break
    if not lines:
        raise RolloutsError(f"{path}: no rollouts (the file holds no JSON line)")
    for n, line in zip(numbers, lines):
        if isinstance(line, dict) and "choices" in line and "tokens" not in line:
            raise RolloutsError(
                f"{path}: this is an engine response (a JSON object with 'choices', e.g. vLLM's /v1/completions or "
                "/inference/v1/generate), not offpolicy rollouts: parse it with offpolicy.adapters.vllm "
                "(parse_completion_response / parse_generate_response, with its request) and write the records "
                "with offpolicy.diagnose.turn_to_json + save_jsonl (docs/diagnose.md#inputs)")
    return from_lines(lines, source=str(path), line_numbers=numbers)


def _loads(text: str) -> object:
    """``json.loads``; nesting too deep for the parser (``RecursionError``) is reported as invalid JSON."""
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", text, 0) from None


def _whole_document(text: str, path: str | Path, n: int) -> object:
    """A file that is not JSONL: one (pretty-printed) JSON document, else a clear error naming the line."""
    try:
        return _loads(text)
    except json.JSONDecodeError:
        pass
    for k, s in enumerate(text.splitlines(), start=1):
        if not s.strip():
            continue
        try:
            _loads(s)
        except json.JSONDecodeError as exc:
            raise RolloutsError(f"{path}, line {k}: not JSON ({exc.msg}); rollouts are JSONL, one JSON object per "
                                "line") from None
    raise RolloutsError(f"{path}, line {n}: not JSON; rollouts are JSONL, one JSON object per line")


def from_lines(lines: Sequence[dict], *, source: str = "rollouts",
               line_numbers: Sequence[int] | None = None) -> RecordedRollouts:
    """Flatten JSONL lines (dicts) into :class:`RecordedRollouts`, each line checked once
    (:func:`~offpolicy.diagnose.schema.check_line`; errors name ``source``, the line number, 1-based unless
    ``line_numbers`` gives them, and the field). Turns sharing a ``seq_id`` share a context row (each later turn's
    ``input_ids`` must extend the earlier context). Candidate rows are stored as CSR, in line order."""
    numbers = list(range(1, len(lines) + 1)) if line_numbers is None else list(line_numbers)
    groups: dict[str, int] = {}
    contexts: dict[object, list[int]] = {}
    order: list[object] = []
    cols_t, rows_key, toks, lqs, gi, vers, temps, tps, tks = ([] for _ in range(9))
    cand_ids: list[int] = []
    cand_lps: list[float] = []
    lengths: list[int] = []
    kind = None
    for n, obj in zip(numbers, lines):
        where = f"{source}, line {n}"
        line = check_line(obj, where)
        if n == numbers[0]:
            kind = line.kind
        elif (line.kind is None) != (kind is None):
            raise RolloutsError(f"{where}, field 'candidates': {'absent' if line.kind is None else 'present'} "
                                f"although line {numbers[0]}'s {'are present' if kind else 'are absent'} (every "
                                "line records candidates, or none does)")
        elif line.kind != kind:
            raise RolloutsError(f"{where}, field 'candidates.kind': {line.kind!r} after {kind!r} (one kind per file)")
        sid = ("line", n) if line.seq_id is None else line.seq_id
        ids, t = line.input_ids, len(line.tokens)
        ctx = contexts.get(sid)
        if ctx is None:
            order.append(sid)
        elif ids[: len(ctx)] != ctx:
            raise RolloutsError(f"{where}, field 'input_ids': they do not extend the context of seq_id {sid} "
                                "(an earlier line's input_ids + tokens)")
        contexts[sid] = ids + line.tokens
        g = groups.setdefault(line.group, len(groups))
        toks += line.tokens
        lqs += line.sampler_logprobs
        cols_t += range(len(ids), len(ids) + t)
        rows_key += [sid] * t
        gi += [g] * t
        vers += line.versions
        temps += [line.temperature] * t
        tps += [line.top_p] * t
        tks += [declared_top_k(line.top_k)] * t
        if line.kind is not None:
            for r_ids, r_lps in zip(line.cand_ids, line.cand_logprobs):
                cand_ids += r_ids
                cand_lps += r_lps
                lengths.append(len(r_ids))
    row_of = {sid: b for b, sid in enumerate(order)}
    seqs = Contexts.from_lists([contexts[sid] for sid in order])
    cands = None
    if kind is not None:
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
        cands = CSRCandidates(torch.tensor(cand_ids, dtype=torch.int64), offsets,
                              torch.tensor(cand_lps, dtype=torch.float32), kind)
    rows = torch.tensor([row_of[s] for s in rows_key], dtype=torch.int64)
    try:
        return RecordedRollouts(
            tokens=torch.tensor(toks, dtype=torch.int64), sampler_logprobs=torch.tensor(lqs, dtype=torch.float32),
            candidates=cands, group_names=tuple(groups), group_index=torch.tensor(gi, dtype=torch.int64),
            versions=torch.tensor(vers, dtype=torch.int64), seq_ids=rows.clone(),
            temperature=torch.tensor(temps, dtype=torch.float32), top_p=torch.tensor(tps, dtype=torch.float32),
            top_k=torch.tensor(tks, dtype=torch.int64), contexts=seqs, rows=rows,
            cols=torch.tensor(cols_t, dtype=torch.int64))
    except RolloutsError as exc:  # fp32 rounding can only push a value past a bound the line itself passed
        raise RolloutsError(f"{source}: {exc}") from None


_TENSORS = ("tokens", "sampler_logprobs", "group_index", "versions", "seq_ids", "temperature", "top_p", "top_k",
            "rows", "cols")


def save_safetensors(rollouts: RecordedRollouts, path: str | Path) -> Path:
    """Write the columns, the contexts (``context_ids [S]``, ``context_offsets [B + 1]``) and the CSR candidates
    (``candidate_ids [nnz]``, ``candidate_offsets [N + 1]``, ``candidate_logprobs [nnz]``)."""
    from safetensors.torch import save_file

    # columns may share storage (a TokenBatch's rows and seq_ids often do); safetensors refuses shared tensors
    tensors = {k: getattr(rollouts, k).clone(memory_format=torch.contiguous_format) for k in _TENSORS}
    tensors["context_ids"] = rollouts.contexts.ids.to(torch.int64).clone()
    tensors["context_offsets"] = rollouts.contexts.offsets.to(torch.int64).clone()
    meta = {"groups": json.dumps(list(rollouts.group_names)), "candidate_kind": ""}
    if rollouts.candidates is not None:
        c = rollouts.candidates
        tensors["candidate_ids"] = c.ids.to(torch.int64).clone()
        tensors["candidate_offsets"] = c.offsets.to(torch.int64).clone()
        tensors["candidate_logprobs"] = c.logprobs.float().clone()
        meta["candidate_kind"] = c.kind
    save_file(tensors, str(path), metadata=meta)
    return Path(path)


def load_safetensors(path: str | Path) -> RecordedRollouts:
    """Read :func:`save_safetensors`' file, checking every tensor once (errors name the file and the tensor)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            keys = set(f.keys())
            missing = [k for k in _TENSORS if k not in keys]
            if "sequences" not in keys and not {"context_ids", "context_offsets"} <= keys:
                missing.append("context_ids / context_offsets (or an older file's sequences)")
            if missing or "groups" not in meta:
                raise RolloutsError(f"{path}: not a rollouts file (missing {missing or ['groups metadata']})")
            t = {k: f.get_tensor(k) for k in keys}
    except RolloutsError:
        raise
    except Exception as exc:  # safetensors raises its own SafetensorError (and OSError, ValueError) on junk
        raise RolloutsError(f"{path}: not a readable safetensors file ({type(exc).__name__}: {exc})") from None
    try:
        names = json.loads(meta["groups"])
    except (json.JSONDecodeError, RecursionError):
        names = None
    if not isinstance(names, list) or not names or not all(isinstance(g, str) for g in names):
        raise RolloutsError(f"{path}, metadata 'groups': expected a JSON list of group names")
    kind = meta.get("candidate_kind") or None
    cands = None
    if kind is not None:
        if kind not in ("head", "support"):
            raise RolloutsError(f"{path}, metadata 'candidate_kind': {kind[:40]!r} is not 'head' or 'support'")
        cands = _stored_candidates(path, t, kind)
    for k in _TENSORS:
        if t[k].dtype in (torch.float16, torch.bfloat16, torch.float64) and k in ("sampler_logprobs", "temperature",
                                                                                  "top_p"):
            t[k] = t[k].float()
    try:
        ctx = _stored_contexts(path, t)
        return RecordedRollouts(candidates=cands, group_names=tuple(names), contexts=ctx,
                                **{k: t[k] for k in _TENSORS})
    except RolloutsError as exc:
        raise RolloutsError(f"{path}: {exc}") from None


def _stored_contexts(path: str | Path, t: dict[str, Tensor]) -> Contexts:
    if "context_ids" in t:
        ids, off = t["context_ids"], t.get("context_offsets")
        ok = off is not None and ids.dim() == 1 and off.dim() == 1 and off.numel() >= 1
        if not ok or ids.dtype not in (torch.int32, torch.int64) or off.dtype not in (torch.int32, torch.int64):
            raise RolloutsError(f"{path}, tensor 'context_ids' / 'context_offsets': int [S] and [B + 1] expected")
        return Contexts(ids.to(torch.int64), off.to(torch.int64))
    seqs = t["sequences"]
    if seqs.dim() != 2 or seqs.dtype not in (torch.int32, torch.int64):
        raise RolloutsError(f"{path}, tensor 'sequences': int [B, L] expected, got {seqs.dtype} {list(seqs.shape)}")
    return Contexts.from_padded(seqs)


def _stored_candidates(path: str | Path, t: dict[str, Tensor], kind: str) -> CSRCandidates | Candidates:
    ids, lps = t.get("candidate_ids"), t.get("candidate_logprobs")
    if ids is None or lps is None:
        raise RolloutsError(f"{path}, tensor 'candidate_ids' / 'candidate_logprobs': missing although metadata "
                            f"'candidate_kind' is {kind!r}")
    if ids.dtype not in (torch.int32, torch.int64) or not lps.is_floating_point() or ids.shape != lps.shape:
        raise RolloutsError(f"{path}, tensor 'candidate_ids' / 'candidate_logprobs': int ids and float log-probs "
                            f"of one shape expected, got {ids.dtype} {list(ids.shape)} and {lps.dtype} "
                            f"{list(lps.shape)}")
    off = t.get("candidate_offsets")
    if off is None:
        if ids.dim() != 2:
            raise RolloutsError(f"{path}, tensor 'candidate_ids': [nnz] needs 'candidate_offsets' [N + 1]; [N, K] "
                                f"is the padded layout; got {list(ids.shape)}")
        return Candidates(ids, lps.float(), kind)
    if ids.dim() != 1 or off.dim() != 1 or off.dtype not in (torch.int32, torch.int64) or off.numel() == 0:
        raise RolloutsError(f"{path}, tensor 'candidate_offsets': int [N + 1] beside 1-D candidate_ids expected")
    try:  # the record checks its offsets where it is built: name the file and tensor
        return CSRCandidates(ids, off, lps.float(), kind)
    except (ValueError, TypeError) as e:
        raise RolloutsError(f"{path}, tensor 'candidate_offsets': {e}") from None


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
    return RecordedRollouts(
        tokens=batch.tokens, sampler_logprobs=batch.sampler_logprobs.float(), candidates=batch.candidates,
        group_names=tuple(group_names), group_index=gi, versions=batch.versions.to(torch.int64),
        seq_ids=batch.seq_ids.to(torch.int64), temperature=batch.temperature.float(),
        top_p=torch.full((n,), float(top_p)), top_k=torch.full((n,), declared_top_k(top_k)),
        contexts=sequences, rows=batch.rows, cols=batch.cols,
    )
