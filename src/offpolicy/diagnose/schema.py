"""The rollouts file's schema, checked once where a line is read: every malformed value raises
:class:`RolloutsError` naming the file, the line and the field.

Rules (docs/diagnose.md#input-rules): integers are JSON integers (not ``true`` / ``false``, not ``5.0``), token
and candidate ids in ``[0, 2^31)``; log-probabilities are finite numbers ``<= 0`` (``1e-4`` of slack, the loss's
``LOGPROB_SLACK``), never ``NaN`` / ``Infinity``, and ``null`` (``-inf``) only in a head row; ``temperature > 0``;
``0 < top_p <= 1``; ``top_k`` ``-1``, ``0``, ``null`` (off) or positive; ``version`` / ``versions`` ``>= -1``;
``seq_id >= 0``; ``input_ids`` and ``tokens`` non-empty; candidate rows one per token, ids and log-probs of equal
length per row, ids unique within a row (``-1`` with a ``null`` log-prob is padding, dropped).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from offpolicy.loss.validation import LOGPROB_SLACK
from offpolicy.records.candidates import KINDS

#: token and candidate ids lie in ``[0, MAX_ID)`` (no vocabulary is larger; the model path checks its own size)
MAX_ID = 1 << 31
#: weight versions and sequence ids lie below this (int64 with room)
MAX_INDEX = 1 << 62
REQUIRED = ("group", "input_ids", "tokens", "sampler_logprobs", "temperature")


class RolloutsError(ValueError):
    """A malformed rollouts file or record; the message names the file, the line (or tensor) and the field."""


@dataclass(frozen=True)
class Line:
    """One checked JSONL line: per-token lists of length ``T >= 1`` and the candidate rows (padding dropped)."""

    group: str
    seq_id: int | None
    input_ids: list[int]
    tokens: list[int]
    sampler_logprobs: list[float]
    versions: list[int]
    temperature: float
    top_p: float
    top_k: int | None
    kind: str | None
    cand_ids: list[list[int]] | None
    cand_logprobs: list[list[float]] | None


class _Where:
    def __init__(self, where: str):
        self.where = where

    def fail(self, field: str, problem: str) -> RolloutsError:
        return RolloutsError(f"{self.where}, field {field!r}: {problem}")


def _show(v: object) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _int(w: _Where, field: str, v: object, lo: int, hi: int) -> int:
    if type(v) is not int:  # bool is a subclass of int; 5.0 is a float
        raise w.fail(field, f"expected an integer, got {type(v).__name__} {_show(v)}")
    if not lo <= v < hi:
        raise w.fail(field, f"{_show(v)} is outside [{lo}, {hi})")
    return v


def _num(w: _Where, field: str, v: object) -> float:
    if type(v) not in (int, float):
        raise w.fail(field, f"expected a number, got {type(v).__name__} {_show(v)}")
    x = float(v)
    if not math.isfinite(x):
        raise w.fail(field, f"{x} is not finite")
    return x


def _logprob(w: _Where, field: str, v: object, allow_null: bool) -> float:
    if v is None:
        if allow_null:
            return float("-inf")
        raise w.fail(field, "null (-inf) is not a log-prob a sampled token or support entry can have")
    x = _num(w, field, v)
    if x > LOGPROB_SLACK:
        raise w.fail(field, f"{x:.6g} > 0 is not a log-probability (logits recorded?)")
    return x


def _list(w: _Where, field: str, v: object, length: int | None = None) -> list:
    if not isinstance(v, list):
        raise w.fail(field, f"expected a list, got {type(v).__name__} {_show(v)}")
    if length is not None and len(v) != length:
        raise w.fail(field, f"holds {len(v)} entries for {length} tokens")
    return v


def check_line(obj: object, where: str) -> Line:
    """Check one parsed JSONL line (``where``: e.g. ``"rollouts.jsonl, line 3"``) and return its values."""
    w = _Where(where)
    if not isinstance(obj, dict):
        raise RolloutsError(f"{where}: a JSON {type(obj).__name__}, not a rollouts object")
    for key in REQUIRED:
        if key not in obj:
            raise w.fail(key, "missing")
    group = obj["group"]
    if not isinstance(group, str) or not group:
        raise w.fail("group", f"expected a non-empty string, got {type(group).__name__} {_show(group)}")
    seq_id = obj.get("seq_id")
    if seq_id is not None:
        seq_id = _int(w, "seq_id", seq_id, 0, MAX_INDEX)
    ids = _list(w, "input_ids", obj["input_ids"])
    if not ids:
        raise w.fail("input_ids", "empty: a token needs a context to be scored (at least the prompt's first token)")
    input_ids = [_int(w, f"input_ids[{i}]", v, 0, MAX_ID) for i, v in enumerate(ids)]
    toks = _list(w, "tokens", obj["tokens"])
    if not toks:
        raise w.fail("tokens", "empty: the line records no sampled token")
    tokens = [_int(w, f"tokens[{i}]", v, 0, MAX_ID) for i, v in enumerate(toks)]
    t = len(tokens)
    lq = [_logprob(w, f"sampler_logprobs[{i}]", v, False)
          for i, v in enumerate(_list(w, "sampler_logprobs", obj["sampler_logprobs"], t))]
    if obj.get("versions") is not None:
        versions = [_int(w, f"versions[{i}]", v, -1, MAX_INDEX)
                    for i, v in enumerate(_list(w, "versions", obj["versions"], t))]
    else:
        versions = [_int(w, "version", obj.get("version", -1), -1, MAX_INDEX)] * t
    temperature = _num(w, "temperature", obj["temperature"])
    if temperature <= 0:
        raise w.fail("temperature", f"{temperature} must be > 0")
    top_p = 1.0 if obj.get("top_p") is None else _num(w, "top_p", obj["top_p"])
    if not 0 < top_p <= 1:
        raise w.fail("top_p", f"{top_p} must lie in (0, 1] (null or 1: no top-p)")
    top_k = obj.get("top_k")
    if top_k is not None:
        top_k = _int(w, "top_k", top_k, -1, MAX_INDEX)
    kind = cid = clp = None
    c = obj.get("candidates")
    if c is not None:
        kind, cid, clp = _candidates(w, c, tokens)
    return Line(group, seq_id, input_ids, tokens, lq, versions, temperature, top_p, top_k, kind, cid, clp)


def _candidates(w: _Where, c: object, tokens: list[int]) -> tuple[str, list[list[int]], list[list[float]]]:
    if not isinstance(c, dict):
        raise w.fail("candidates", f"expected an object or null, got {type(c).__name__}")
    for key in ("kind", "ids", "logprobs"):
        if key not in c:
            raise w.fail(f"candidates.{key}", "missing")
    kind = c["kind"]
    if kind not in KINDS:
        raise w.fail("candidates.kind", f"{_show(kind)} is not one of {KINDS}")
    t = len(tokens)
    rows_ids = _list(w, "candidates.ids", c["ids"], t)
    rows_lps = _list(w, "candidates.logprobs", c["logprobs"], t)
    ids_out, lps_out = [], []
    for r, (ids, lps) in enumerate(zip(rows_ids, rows_lps)):
        ids = _list(w, f"candidates.ids[{r}]", ids)
        lps = _list(w, f"candidates.logprobs[{r}]", lps)
        if len(ids) != len(lps):
            raise w.fail(f"candidates.logprobs[{r}]", f"holds {len(lps)} log-probs for {len(ids)} ids (ragged row)")
        row_ids, row_lps = [], []
        for j, (i, v) in enumerate(zip(ids, lps)):
            if i == -1 and type(i) is int and v is None:
                continue  # padding
            row_ids.append(_int(w, f"candidates.ids[{r}][{j}]", i, 0, MAX_ID))
            row_lps.append(_logprob(w, f"candidates.logprobs[{r}][{j}]", v, kind == "head"))
        if len(set(row_ids)) != len(row_ids):
            dup = next(i for i in row_ids if row_ids.count(i) > 1)
            raise w.fail(f"candidates.ids[{r}]", f"id {dup} appears twice in the row")
        ids_out.append(row_ids)
        lps_out.append(row_lps)
    return kind, ids_out, lps_out


def _fail(where: str, field: str, problem: str) -> RolloutsError:
    return RolloutsError(f"{where}, field {field!r}: {problem}")


def _column(where: str, name: str, x: object, n: int | None, kind: str):
    import torch

    if not isinstance(x, torch.Tensor):
        raise _fail(where, name, f"expected a tensor, got {type(x).__name__}")
    if x.device.type != "cpu":
        raise _fail(where, name, f"on {x.device}; rollouts live on the CPU")
    if kind == "int" and x.dtype not in (torch.int32, torch.int64):
        raise _fail(where, name, f"expected int32 or int64, got {x.dtype}")
    if kind == "float" and not x.is_floating_point():
        raise _fail(where, name, f"expected a float tensor, got {x.dtype}")
    if n is not None and tuple(x.shape) != (n,):
        raise _fail(where, name, f"expected shape [{n}], got {list(x.shape)}")
    return x


def _first(mask) -> int:
    return int(mask.nonzero()[0])


def check_columns(r, where: str = "rollouts") -> None:
    """Check a :class:`~offpolicy.diagnose.recorded.RecordedRollouts`' tensors once (``O(N + nnz log nnz)``):
    dtypes, shapes, ranges, finiteness, positions inside their context holding their token, each position recorded
    once, and a CSR candidate record whose offsets, ids and log-probs are sound (not relying on the record's own
    constructor). Raises :class:`RolloutsError` naming the field and the first bad token."""
    import torch

    tokens = _column(where, "tokens", r.tokens, None, "int")
    if tokens.dim() != 1 or tokens.numel() == 0:
        raise _fail(where, "tokens", f"expected a non-empty [N] tensor, got shape {list(tokens.shape)}")
    n = tokens.numel()
    for name in ("group_index", "versions", "seq_ids", "top_k", "rows", "cols"):
        _column(where, name, getattr(r, name), n, "int")
    for name in ("sampler_logprobs", "temperature", "top_p"):
        x = _column(where, name, getattr(r, name), n, "float")
        if not bool(torch.isfinite(x).all()):
            raise _fail(where, name, f"token {_first(~torch.isfinite(x))} holds {float(x[~torch.isfinite(x)][0])}")
    if bool((tokens < 0).any() | (tokens >= MAX_ID).any()):
        raise _fail(where, "tokens", f"token {_first((tokens < 0) | (tokens >= MAX_ID))} is outside [0, 2^31)")
    checks = (("sampler_logprobs", r.sampler_logprobs > LOGPROB_SLACK, "> 0 (not a log-probability)"),
              ("temperature", r.temperature <= 0, "<= 0 (must be > 0)"),
              ("top_p", (r.top_p <= 0) | (r.top_p > 1), "outside (0, 1]"),
              ("top_k", r.top_k < -1, "< -1 (-1: off)"),
              ("versions", r.versions < -1, "< -1 (-1: unknown)"))
    for name, bad, problem in checks:
        if bool(bad.any()):
            raise _fail(where, name, f"token {_first(bad)}: {float(getattr(r, name)[bad][0]):.6g} {problem}")
    names = r.group_names
    if not isinstance(names, tuple) or not names or not all(isinstance(g, str) for g in names):
        raise _fail(where, "group_names", "expected a non-empty tuple of strings")
    if bool((r.group_index < 0).any() | (r.group_index >= len(names)).any()):
        raise _fail(where, "group_index", f"token {_first((r.group_index < 0) | (r.group_index >= len(names)))} "
                    f"does not index the {len(names)} group names")
    ctx = r.contexts
    ids, off = ctx.ids, ctx.offsets
    for name, x in (("contexts.ids", ids), ("contexts.offsets", off)):
        if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.dtype not in (torch.int32, torch.int64):
            raise _fail(where, name, "expected a 1-D int tensor")
    b = off.numel() - 1
    if b < 1 or int(off[0]) != 0 or int(off[-1]) != ids.numel() or bool((off[1:] < off[:-1]).any()):
        raise _fail(where, "contexts.offsets", f"must run from 0 to the {ids.numel()} context ids without "
                    "decreasing, one more entry than sequences")
    if ids.numel() and bool((ids < 0).any() | (ids >= MAX_ID).any()):
        raise _fail(where, "contexts.ids", "holds an id outside [0, 2^31)")
    rows, cols = r.rows.long(), r.cols.long()
    bad = (rows < 0) | (rows >= b)
    if bool(bad.any()):
        raise _fail(where, "rows", f"token {_first(bad)} sits in row {int(rows[bad][0])}, outside the {b} sequences")
    length = (off[1:] - off[:-1])[rows]
    bad = (cols < 1) | (cols >= length)
    if bool(bad.any()):
        i = _first(bad)
        raise _fail(where, "cols", f"token {i} sits at column {int(cols[i])}; a token needs a non-empty context "
                    f"before it and a place in its sequence (1 <= col < {int(length[i])})")
    at = off.long()[rows] + cols
    bad = ids[at].long() != tokens.long()
    if bool(bad.any()):
        i = _first(bad)
        raise _fail(where, "tokens", f"token {i} is {int(tokens[i])} but its sequence {int(rows[i])} holds "
                    f"{int(ids[at[i]])} at column {int(cols[i])}: the columns are misaligned")
    key = torch.sort(at).values
    if n > 1 and bool((key[1:] == key[:-1]).any()):
        raise _fail(where, "cols", "two tokens are recorded at the same position of one sequence")
    if r.candidates is not None:
        check_csr(r.candidates, n, where)


def check_csr(c, n: int, where: str) -> None:
    """A CSR candidate record of ``n`` rows: offsets from 0 to ``nnz``, non-decreasing; ids in ``[0, 2^31)``,
    unique within a row; log-probs not NaN / ``+inf``, ``<= 0``; support entries finite."""
    import torch

    off = c.offsets.long()
    if off.numel() != n + 1:
        raise _fail(where, "candidates.offsets", f"holds {off.numel()} entries for {n} tokens (N + 1 expected)")
    nnz = c.ids.numel()
    if int(off[0]) != 0 or int(off[-1]) != nnz:
        raise _fail(where, "candidates.offsets", f"must run from 0 to nnz = {nnz}, got {int(off[0])}..{int(off[-1])}")
    if n and bool((off[1:] < off[:-1]).any()):
        raise _fail(where, "candidates.offsets", f"decrease at row {_first(off[1:] < off[:-1])}")
    ids, lp = c.ids.long(), c.logprobs
    if nnz == 0:
        return
    bad = (ids < 0) | (ids >= MAX_ID)
    if bool(bad.any()):
        raise _fail(where, "candidates.ids", f"entry {_first(bad)} is {int(ids[bad][0])}, outside [0, 2^31)")
    bad = torch.isnan(lp) | (lp > LOGPROB_SLACK)
    if c.kind == "support":
        bad |= lp == float("-inf")
    if bool(bad.any()):
        raise _fail(where, "candidates.logprobs", f"entry {_first(bad)} is {float(lp[bad][0])}: not a log-prob "
                    "(finite and <= 0; -inf only in a head row)")
    row = torch.repeat_interleave(torch.arange(n), off[1:] - off[:-1], output_size=nnz)
    key = torch.sort(row * MAX_ID + ids).values
    dup = key[1:] == key[:-1]
    if bool(dup.any()):
        raise _fail(where, "candidates.ids", f"row {int(key[1:][dup][0]) // MAX_ID} holds id "
                    f"{int(key[1:][dup][0]) % MAX_ID} twice")
