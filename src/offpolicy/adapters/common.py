"""What the serving adapters share: the per-turn record, multi-turn trajectories, collation into a
:class:`~offpolicy.records.TokenBatch`, and the semantic checks on recorded log-probabilities.

A *turn* is one generation request: the context sent (token ids), the tokens the server sampled, the sampler's
log-probability of each (after temperature, renormalised over the support when sampling was filtered) and
optionally a candidate record (the record contract: docs/spec.md#records, docs/spec.md#mask-replay): a support
record as :class:`~offpolicy.records.csr_candidates.CSRCandidates`, each token's realised support and nothing more
(:func:`csr_record`; never padded to the widest row), a head record of the top ``K`` as a padded
:class:`~offpolicy.records.candidates.Candidates` ``[T, K]``. A *trajectory* strings turns together
with non-trained tokens between them (tool outputs, chat-template markers), token in, token out: the next
request's context must be exactly the trajectory so far, or the trainer would score tokens in a context the
sampler never saw (the "multi-turn context" mismatch source of the mixed-fleet study, docs/spec.md#sources), so
:meth:`Trajectory.add_turn` checks it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from numbers import Integral, Real

import torch
from torch import Tensor

from offpolicy.records.candidates import SUPPORT_SUM_TOL, Candidates, Kind
from offpolicy.records.csr_candidates import CSRCandidates
from offpolicy.records.routed_experts import RoutedExperts
from offpolicy.records.token_batch import TokenBatch

#: Two log-probabilities of the same token from the same response agree to this (JSON floats are fp32 values
#: printed with enough digits; servers compute them once, so only formatting can differ).
SAME_VALUE_TOL = 1e-4
#: Per-row spread allowed in ``log p_full(v) - log q_S(v)`` across a support (the constant ``log P(S)`` when
#: both come from the post-temperature distribution). fp32 log-probs carry ~1e-6 relative error; the spread
#: from raw (pre-temperature) log-probs is ``|1 - 1/T| * (z_max - z_min)``, orders of magnitude larger.
OFFSET_SPREAD_TOL = 1e-3


class RecordError(ValueError):
    """A server response contradicts the semantics the correction relies on."""


@dataclass(frozen=True)
class TurnRecord:
    """One generation request's sampled tokens and sampler records (``T`` tokens).

    Attributes:
        input_ids: the context the request sent (``None`` if unknown).
        tokens: ``[T]`` int64 sampled ids.
        sampler_logprobs: ``[T]`` fp32 ``lq`` of each sampled token.
        candidates: the support record as :class:`~offpolicy.CSRCandidates` (``T`` rows, ``nnz`` the sum of
            the realised supports), the head record as :class:`~offpolicy.Candidates` ``[T, K]``, or ``None``.
        temperature, top_p, top_k: the sampling parameters used (``top_k=None``: off).
        versions: per-token policy (weight) version strings, or ``None`` when the server reports none.
        finish_reason: as the server reported it.
        routes: the sampler's :class:`~offpolicy.RoutedExperts` of the ``T`` sampled tokens (row ``t`` the
            position that predicted token ``t``), or ``None``; attach a parsed record with :meth:`with_routes`
            (docs/routing.md).
    """

    input_ids: tuple[int, ...] | None
    tokens: Tensor
    sampler_logprobs: Tensor
    candidates: Candidates | CSRCandidates | None
    temperature: float
    top_p: float
    top_k: int | None
    versions: tuple[str, ...] | None = None
    finish_reason: object = None
    routes: RoutedExperts | None = None

    def __post_init__(self) -> None:
        if self.routes is not None:
            if not isinstance(self.routes, RoutedExperts):
                raise TypeError(f"TurnRecord.routes must be an offpolicy.RoutedExperts, got {type(self.routes).__name__}")
            self.routes.check_aligned(len(self), "sampled tokens of the turn")

    def with_routes(self, routes: RoutedExperts) -> "TurnRecord":
        """This turn with the routing record ``routes`` (one row per sampled token, checked)."""
        return replace(self, routes=routes)

    @property
    def kind(self) -> str | None:
        return self.candidates.kind if self.candidates is not None else None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


class Trajectory:
    """A multi-turn episode, token in, token out.

    Example::

        traj = Trajectory(prompt_ids)
        body = sglang.build_request(traj.input_ids, max_new_tokens=256, top_p=0.95, top_k=512, record="support")
        traj.add_turn(sglang.parse_response(post(body), body))
        traj.add_tokens(tool_output_ids)              # not trained
        body = sglang.build_request(traj.input_ids, ...)   # the next turn sees exactly the trajectory
    """

    def __init__(self, prompt_ids: Sequence[int]):
        self._ids = [int(t) for t in prompt_ids]
        if not self._ids:
            raise ValueError("prompt_ids must hold at least one token")
        self._turns: list[tuple[int, TurnRecord, bool, int | None]] = []

    @property
    def input_ids(self) -> list[int]:
        """The whole context so far (what the next request must send)."""
        return list(self._ids)

    @property
    def turns(self) -> list[TurnRecord]:
        return [t for _, t, _, _ in self._turns]

    def add_turn(self, record: TurnRecord, trained: bool = True, version: int | None = None) -> None:
        """Append a sampled turn. ``version`` overrides the record's per-token versions (e.g. for vLLM)."""
        if record.input_ids is not None and list(record.input_ids) != self._ids:
            n = next((i for i, (a, b) in enumerate(zip(record.input_ids, self._ids)) if a != b),
                     min(len(record.input_ids), len(self._ids)))
            raise RecordError(
                f"the turn's request context differs from the trajectory at token {n} (request has "
                f"{len(record.input_ids)} tokens, trajectory {len(self._ids)}): send traj.input_ids, token in "
                "token out, or the trainer scores tokens in a context the sampler never saw"
            )
        self._turns.append((len(self._ids), record, trained, version))
        self._ids.extend(int(t) for t in record.tokens.tolist())

    def add_tokens(self, ids: Sequence[int]) -> None:
        """Append tokens that were not sampled by the policy (tool output); they are never trained."""
        self._ids.extend(int(t) for t in ids)


def _version_ints(record: TurnRecord, override: int | None, version_of: Callable[[str], int]) -> list[int]:
    if override is not None:
        return [int(override)] * len(record)
    if record.versions is None:
        return [-1] * len(record)
    try:
        return [version_of(v) for v in record.versions]
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"weight versions {sorted(set(record.versions))[:3]} are not integers: pass version_of= to map them"
        ) from exc


def collate(
    trajectories: Sequence[Trajectory], pad_token_id: int = 0, version_of: Callable[[str], int] = int,
    csr: bool | None = None,
) -> tuple[Tensor, TokenBatch]:
    """Right-pad trajectories into ``sequences [B, L]`` and flatten their sampled tokens into a TokenBatch.

    ``TokenBatch.gather(trainer_model(sequences))`` then gives the trainer logits ``[N, V]`` of each sampled
    token. Every turn must carry the same kind of candidate record (or none). The record's layout: with ``csr``
    True a :class:`~offpolicy.CSRCandidates` (each turn's entries back to back, no padding to the batch's widest
    row: ``12`` bytes per recorded id, docs/spec.md#record-memory), with False a padded ``[N, K]`` one; ``None``
    (default) keeps the turns' own layout: CSR when any turn carries a CSR record (the support records of the
    serving adapters), padded otherwise (head records).

    Routing records (:class:`~offpolicy.RoutedExperts`, ``TurnRecord.routes``) go with their tokens: when any
    turn carries one, every sampled turn must (a turn without routes raises ``ValueError`` naming it: replaying
    some tokens' routes and recomputing others' is the "routes missing" bug), and ``TokenBatch.routes`` holds
    their rows in the batch's token order (:meth:`~offpolicy.RoutedExperts.cat`: dense when every turn is dense
    with one top-k, CSR otherwise).
    """
    if not trajectories:
        raise ValueError("trajectories must be non-empty")
    kinds = {t.kind for traj in trajectories for t in traj.turns}
    if len(kinds) > 1:
        raise ValueError(f"turns carry different kinds of candidate records: {sorted(map(str, kinds))}")
    kind = kinds.pop() if kinds else None
    records = [t.candidates for traj in trajectories for t in traj.turns if t.candidates is not None]
    if csr is None:
        csr = any(isinstance(c, CSRCandidates) for c in records)
    length = max(len(t.input_ids) for t in trajectories)
    seqs = torch.full((len(trajectories), length), pad_token_id, dtype=torch.int64)
    toks, lqs, masks, rows, cols, vers, temps = [], [], [], [], [], [], []
    with_routes = any(t.routes is not None for traj in trajectories for t in traj.turns)
    routes = []
    for b, traj in enumerate(trajectories):
        ids = traj.input_ids
        seqs[b, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        for j, (start, rec, trained, override) in enumerate(traj._turns):
            n = len(rec)
            if with_routes:
                if rec.routes is None:
                    raise ValueError(f"trajectories[{b}] turn {j} carries no routes while other turns do: every "
                                     "sampled turn needs its routing record (or none does)")
                routes.append(rec.routes)
            toks.append(rec.tokens.to(torch.int64))
            lqs.append(rec.sampler_logprobs.float())
            masks.append(torch.full((n,), trained, dtype=torch.bool))
            rows.append(torch.full((n,), b, dtype=torch.int64))
            cols.append(torch.arange(start, start + n, dtype=torch.int64))
            vers.append(torch.tensor(_version_ints(rec, override, version_of), dtype=torch.int64))
            temps.append(torch.full((n,), rec.temperature, dtype=torch.float32))

    def cat(xs: list[Tensor], dt: torch.dtype) -> Tensor:
        return torch.cat(xs) if xs else torch.zeros(0, dtype=dt)

    cands = None
    if kind is not None and csr:
        cands = CSRCandidates.cat([c if isinstance(c, CSRCandidates) else CSRCandidates.from_padded(c)
                                   for c in records])
        cands = replace(cands, logprobs=cands.logprobs.float())
    elif kind is not None:
        padded = [c.to_padded() if isinstance(c, CSRCandidates) else c for c in records]
        width = max(c.width for c in padded)
        pad = torch.nn.functional.pad
        ids = torch.cat([pad(c.ids.to(torch.int64), (0, width - c.width), value=-1) for c in padded])
        lps = torch.cat([pad(c.logprobs.float(), (0, width - c.width), value=float("-inf")) for c in padded])
        cands = Candidates(ids, lps, kind)
    rows_t = cat(rows, torch.int64)
    batch = TokenBatch(
        tokens=cat(toks, torch.int64), sampler_logprobs=cat(lqs, torch.float32), candidates=cands,
        loss_mask=cat(masks, torch.bool), seq_ids=rows_t, versions=cat(vers, torch.int64), rows=rows_t,
        cols=cat(cols, torch.int64), temperature=cat(temps, torch.float32),
        routes=RoutedExperts.cat(routes) if routes else None,
    )
    return seqs, batch


# ------------------------------------------------------------------------------------------ JSON fields
# Readers for fields of a server's JSON response (or of a request body): each returns the field as the type the
# parser needs or raises ``error`` naming the field, never a KeyError / AttributeError / IndexError from deep
# inside, and never converts silently (a float token id is refused, not truncated; a bool is not a number).
def json_mapping(value: object, what: str, error: type[Exception] = RecordError) -> Mapping:
    """``value`` as a JSON object."""
    if not isinstance(value, Mapping):
        raise error(f"{what} must be a JSON object (dict), got {type(value).__name__}")
    return value


def json_list(value: object, what: str, error: type[Exception] = RecordError) -> Sequence:
    """``value`` as a JSON array (a list or tuple; strings and objects are refused)."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise error(f"{what} must be a list, got {type(value).__name__}")
    return value


def json_int(value: object, what: str, error: type[Exception] = RecordError) -> int:
    """``value`` as an integer (bools and floats are refused, even integral ones: ids are never rounded)."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise error(f"{what} must be an integer, got {value!r}")
    return int(value)


def json_float(value: object, what: str, error: type[Exception] = RecordError) -> float:
    """``value`` as a float (any real number but a bool)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise error(f"{what} must be a number, got {value!r}")
    return float(value)


def json_field(obj: Mapping, key: str, what: str, error: type[Exception] = RecordError) -> object:
    """``obj[key]``, or ``error`` naming ``what`` when it is missing."""
    if key not in obj:
        raise error(f"{what} lacks the field {key!r}")
    return obj[key]


# ---------------------------------------------------------------------------------------------------- checks
def check_temperature(temperature: float) -> None:
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature <= 0:
        raise RecordError(
            f"temperature {temperature!r}: sampling at temperature 0 is greedy decoding, which has no sampling "
            "distribution (SGLang then also returns raw, un-tempered log-probs); importance ratios are undefined"
        )


def check_logprob_values(values: Tensor, what: str) -> None:
    """Log-probabilities are finite (or -inf) and <= 0; positive values mean logits were returned."""
    finite = values[torch.isfinite(values)]
    if bool(torch.isnan(values).any()):
        raise RecordError(f"{what}: NaN log-probability")
    if finite.numel() and float(finite.max()) > SAME_VALUE_TOL:
        raise RecordError(
            f"{what}: value {float(finite.max()):.4g} > 0 is not a log-probability (were logits returned, e.g. "
            "vLLM --logprobs-mode raw_logits / processed_logits?)"
        )


def check_head_rows(cands: Candidates, tokens: Tensor, lq: Tensor, where: str) -> None:
    """Head rows: full-vocabulary probabilities (sum <= 1), and the sampled token agrees with its entry."""
    mass = torch.exp(cands.logprobs.double()).sum(dim=1)
    over = mass > 1.0 + SUPPORT_SUM_TOL
    if bool(over.any()):
        t = int(over.nonzero()[0])
        raise RecordError(
            f"{where}: top log-probs of token {t} sum to probability {float(mass[t]):.6f} > 1: these are not "
            "full-vocabulary probabilities (renormalised values recorded as a head?)"
        )
    hit = (cands.ids == tokens[:, None]) & cands.valid
    if bool(hit.any()):
        entry = torch.where(hit, cands.logprobs, torch.zeros_like(cands.logprobs)).sum(dim=1)
        rows = hit.any(dim=1)
        diff = (entry[rows].double() - lq[rows].double()).abs()
        if bool((diff > SAME_VALUE_TOL).any()):
            t = int(rows.nonzero()[int(diff.argmax())])
            raise RecordError(
                f"{where}: the sampled token's log-prob ({float(lq[t]):.6f}) and its top-logprob entry "
                f"({float(entry[t]):.6f}) differ at token {t}: the two come from different distributions"
            )


def head_record(
    ids: Tensor, lps: Tensor, tokens: Tensor, lq: Tensor, where: str, what: str, vocab_size: int | None
) -> Candidates:
    """A checked head record from padded top-K ``ids`` / ``lps`` ``[n, K]`` (``what`` names the response field)."""
    check_logprob_values(lps, f"{where} {what}")
    cands = Candidates(ids, lps, "head")
    check_head_rows(cands, tokens, lq, where)
    if vocab_size is not None:
        cands.validate(vocab_size, tokens.shape[0], tokens)
    return cands


def check_sampled_possible(lq: Tensor, where: str) -> None:
    """No sampled token may have probability 0 under the sampler that drew it."""
    if bool((lq == float("-inf")).any()):
        raise RecordError(f"{where}: a sampled token has log-prob -inf (probability 0 under the sampler)")


def csr_record(rows: Sequence[Sequence[int]], values: Sequence[Sequence[float]], kind: Kind = "support",
               device: torch.device | str | None = None) -> CSRCandidates:
    """The CSR record (``kind``, default ``"support"``) of per-token id lists and their log-probabilities (row
    ``t``: ``rows[t]`` with ``values[t]``, in that order): ``ids [nnz]`` int64, ``offsets [T + 1]`` int64,
    ``logprobs [nnz]`` fp32 with ``nnz = sum_t len(rows[t])``, on ``device``; nothing is padded to the widest row."""
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    ids = torch.tensor([int(i) for r in rows for i in r], dtype=torch.int64)
    lps = torch.tensor([float(v) for r in values for v in r], dtype=torch.float32)
    if lps.shape != ids.shape:
        raise RecordError(f"candidate record: {lps.numel()} log-probs for {ids.numel()} ids")
    return CSRCandidates(ids.to(device), offsets.to(device), lps.to(device), kind)


def entry_at(cands: CSRCandidates, ids: Tensor) -> tuple[Tensor, Tensor]:
    """``(found [T] bool, value [T])``: whether row ``t`` of a CSR record holds the id ``ids[t]`` (``[T]`` int; a
    negative id is never held) and its recorded log-probability there (0 where not found). ``O(nnz)``."""
    row = cands.row_index()
    hit = cands.ids.to(torch.int64) == ids.to(device=cands.ids.device, dtype=torch.int64)[row]
    n = cands.num_rows
    found = torch.zeros(n, dtype=torch.int64, device=row.device).index_add_(0, row, hit.to(torch.int64)) > 0
    vals = torch.where(hit, cands.logprobs, torch.zeros_like(cands.logprobs))
    return found, torch.zeros(n, dtype=vals.dtype, device=row.device).index_add_(0, row, vals)


def check_support_rows(cands: CSRCandidates, tokens: Tensor, lq: Tensor, where: str) -> None:
    """Support rows (CSR, ``T`` rows): non-empty, sum to 1, contain the sampled token whose log-prob ``lq [T]``
    matches its entry."""
    empty = cands.lengths == 0
    if bool(empty.any()):
        raise RecordError(f"{where}: token {int(empty.nonzero()[0])} has an empty sampling support")
    sums = torch.zeros(cands.num_rows, dtype=torch.float64).index_add_(0, cands.row_index(),
                                                                        torch.exp(cands.logprobs.double()))
    off = (sums - 1.0).abs() > SUPPORT_SUM_TOL
    if bool(off.any()):
        t = int(off.nonzero()[0])
        raise RecordError(
            f"{where}: the support of token {t} sums to probability {float(sums[t]):.6f}, not 1: support "
            "log-probs must be renormalised over the support (full-vocabulary values were returned; SGLang: "
            "sampling_logprobs_mode='support', vLLM: --logprobs-mode processed_logprobs)"
        )
    inside, entry = entry_at(cands, tokens)
    if bool((~inside).any()):
        t = int((~inside).nonzero()[0])
        raise RecordError(f"{where}: sampled token {int(tokens[t])} at position {t} is outside its support")
    diff = (entry.double() - lq.double()).abs()
    if bool((diff > SAME_VALUE_TOL).any()):
        t = int(diff.argmax())
        raise RecordError(
            f"{where}: sampled token {t}'s log-prob {float(lq[t]):.6f} differs from its support entry "
            f"{float(entry[t]):.6f}: the sampled log-prob must be renormalised over the support too"
        )


def check_support_offsets(
    cands: CSRCandidates, full_ids: Tensor, full_logprobs: Tensor, where: str
) -> None:
    """Post-temperature check: full-vocabulary log-probs minus support log-probs are one constant per row.

    ``log p_T(v) - log q_S(v) = log P_T(S)`` for every ``v`` in ``S`` when both sides come from the same
    post-temperature distribution ``p_T``. Raw (pre-temperature) full-vocabulary values give
    ``(1 - 1/T) z_v + const`` instead, which varies across the support. ``cands`` is the CSR support record
    (``T`` rows); ``full_ids`` / ``full_logprobs`` are ``[T, J]`` full-vocabulary entries (``-1`` / ``-inf``
    padding), e.g. the top log-probs.
    """
    n = cands.num_rows
    hi = torch.full((n,), -math.inf, dtype=torch.float64)
    lo = torch.full((n,), math.inf, dtype=torch.float64)
    count = torch.zeros(n, dtype=torch.int64)
    for j in range(full_ids.shape[1]):  # J is small (the requested top log-probs); O(nnz) work per entry
        held, entry = entry_at(cands, full_ids[:, j])
        found = held & torch.isfinite(full_logprobs[:, j])
        d = full_logprobs[:, j].double() - entry.double()
        hi = torch.where(found, torch.maximum(hi, d), hi)
        lo = torch.where(found, torch.minimum(lo, d), lo)
        count += found.to(torch.int64)
    spread = torch.where(count >= 2, hi - lo, torch.zeros_like(hi))
    if bool((spread > OFFSET_SPREAD_TOL).any()):
        t = int(spread.argmax())
        raise RecordError(
            f"{where}: at token {t} full-vocabulary minus support log-probs vary by {float(spread[t]):.4g} across "
            "the support; they must differ by the constant log P(S). The full-vocabulary values are not the "
            "post-temperature distribution (raw log-probs: SGLANG_RETURN_ORIGINAL_LOGPROB, or vLLM raw_logprobs?)"
        )
    above = (count > 0) & (hi > SAME_VALUE_TOL)
    if bool(above.any()):
        t = int(above.nonzero()[0])
        raise RecordError(
            f"{where}: at token {t} a full-vocabulary log-prob exceeds the support-renormalised one "
            f"(log P(S) = {float(hi[t]):.4g} > 0): renormalised and full-vocabulary values are confused"
        )


def check_calibration(tokens: Tensor, cands: Candidates, z_max: float = 6.0) -> float:
    """Statistical post-temperature check of head records over many sampled tokens; returns ``z``.

    If the record is the distribution the tokens were drawn from, ``P(y_t in H_t) = Q_H,t`` (the recorded head
    mass) exactly, so ``S = sum_t 1[y_t in H_t]`` has mean ``sum_t Q_H,t`` and variance
    ``s^2 = sum_t Q_H,t (1 - Q_H,t)``. Raw log-probs recorded for tokens drawn at ``T < 1`` understate the head
    mass (``S`` runs high); at ``T > 1`` they overstate it. We raise when
    ``|S - E S| > z_max * sqrt(s^2 + 9)``. By Bernstein's inequality (increments bounded by 1) the chance of
    that under a correct record is at most ``2 exp(-t^2 / (2 (s^2 + t / 3)))`` with ``t = z_max sqrt(s^2 + 9)``,
    which for ``z_max = 6`` is below ``2e-7`` whatever ``s``; the ``+ 9`` keeps rows with ``Q_H`` near 1 from
    turning one rare miss into a false alarm.
    """
    if cands.kind != "head":
        raise ValueError("check_calibration applies to head records")
    q_head = torch.exp(cands.logprobs.double()).sum(dim=1).clamp(0.0, 1.0)
    inside = ((cands.ids == tokens[:, None]) & cands.valid).any(dim=1).double()
    var = float((q_head * (1 - q_head)).sum())
    z = float((inside - q_head).sum()) / math.sqrt(var + 9.0)
    if abs(z) > z_max:
        raise RecordError(
            f"head records are miscalibrated: sampled tokens fall in the recorded top-K {int(inside.sum())} times "
            f"against {float(q_head.sum()):.1f} expected (z = {z:.1f}). The log-probs are not the distribution "
            "the tokens were drawn from: raw (pre-temperature) log-probs, or a filtered sampler recorded as a head?"
        )
    return z


# ------------------------------------------------------------------------------------------- routing records
#: little-endian .npy dtypes a routed-experts payload may use (numpy ``descr`` -> (torch dtype read, mask to undo
#: the sign of an unsigned type read as signed))
_NPY_DTYPES = {"|u1": (torch.uint8, None), "|i1": (torch.int8, None), "<i2": (torch.int16, None),
               "<u2": (torch.int16, 0xFFFF), "<i4": (torch.int32, None), "<u4": (torch.int32, 0xFFFFFFFF),
               "<i8": (torch.int64, None)}
#: raw (headerless) payload dtypes by name (SGLang's ``routed_experts_dtype``)
RAW_ROUTE_DTYPES = {"int32": "<i4", "uint16": "<u2", "uint8": "|u1", "int16": "<i2"}


def decode_base64(payload: object, what: str) -> bytes:
    """The bytes of a base64 JSON string; ``RecordError`` naming ``what`` on anything else."""
    import base64
    import binascii

    if not isinstance(payload, str):
        raise RecordError(f"{what} must be a base64 string, got {type(payload).__name__}")
    try:
        return base64.b64decode(payload.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError) as exc:
        raise RecordError(f"{what} is not valid base64: {exc}") from exc


def raw_int_array(data: bytes, descr: str, what: str) -> Tensor:
    """``[n]`` int64 from little-endian raw bytes of numpy type ``descr`` (one of ``_NPY_DTYPES``)."""
    if descr not in _NPY_DTYPES:
        raise RecordError(f"{what}: dtype {descr!r} is not an integer type a routed-experts payload uses "
                          f"({sorted(_NPY_DTYPES)})")
    dtype, mask = _NPY_DTYPES[descr]
    size = torch.tensor([], dtype=dtype).element_size()
    if len(data) % size:
        raise RecordError(f"{what}: {len(data)} bytes is not a whole number of {descr} values ({size} bytes each)")
    if not data:
        return torch.zeros(0, dtype=torch.int64)
    x = torch.frombuffer(bytearray(data), dtype=dtype).to(torch.int64)
    return x & mask if mask is not None else x


def decode_npy(data: bytes, what: str) -> Tensor:
    """An integer ``.npy`` file's array (``np.save`` format 1.0 - 3.0, C order, little-endian) as int64, without
    numpy: the header is a Python dict literal (read with ``ast.literal_eval``, never executed)."""
    import ast
    import struct

    if not data.startswith(b"\x93NUMPY") or len(data) < 10:
        raise RecordError(f"{what} is not a .npy payload (no \\x93NUMPY magic)")
    major = data[6]
    if major == 1:
        (hlen,), start = struct.unpack("<H", data[8:10]), 10
    elif major in (2, 3) and len(data) >= 12:
        (hlen,), start = struct.unpack("<I", data[8:12]), 12
    else:
        raise RecordError(f"{what}: unsupported .npy format version {major}")
    try:
        header = ast.literal_eval(data[start:start + hlen].decode("latin1"))
    except (ValueError, SyntaxError) as exc:
        raise RecordError(f"{what}: unreadable .npy header") from exc
    if not isinstance(header, dict) or not {"descr", "fortran_order", "shape"} <= set(header):
        raise RecordError(f"{what}: .npy header lacks descr / fortran_order / shape")
    if header["fortran_order"]:
        raise RecordError(f"{what}: a Fortran-order .npy array (expected C order)")
    shape = header["shape"]
    if not isinstance(shape, tuple) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise RecordError(f"{what}: .npy shape {shape!r} is not a tuple of sizes")
    flat = raw_int_array(data[start + hlen:], str(header["descr"]), what)
    n = 1
    for s in shape:
        n *= s
    if flat.numel() != n:
        raise RecordError(f"{what}: .npy body holds {flat.numel()} values, its shape {shape} needs {n}")
    return flat.reshape(shape)


def output_routes(
    positions: Tensor, prompt_len: int, num_tokens: int, *, num_experts: int, moe_layers: Sequence[int] | None,
    where: str, field: str, num_layers: int | None = None,
) -> RoutedExperts:
    """The :class:`~offpolicy.RoutedExperts` of a turn's ``num_tokens`` sampled tokens from an engine's per-position
    routes ``positions [R, L_all, K]`` (int), ``R = prompt_len + num_tokens - 1`` forwarded positions (the last
    sampled token is never forwarded). Sampled token ``t`` is predicted at position ``prompt_len - 1 + t``, so its
    row is that position's: rows ``prompt_len - 1 .. prompt_len + num_tokens - 2``. ``moe_layers``: the indices of
    the MoE layers among the ``L_all`` recorded ones (None: all; a dense layer the engine records as zeros or
    ``-1`` must be left out); ``num_layers``: the model's MoE layer count, checked after that selection (a missing
    layer). Raises :class:`RecordError` naming ``field`` on a wrong row or layer count or a malformed route."""
    if positions.dim() != 3:
        raise RecordError(f"{where}: {field} must be [positions, layers, top_k], got shape {tuple(positions.shape)}")
    rows, layers_all, _ = positions.shape
    if prompt_len < 1:
        raise RecordError(f"{where}: {field}: the prompt length must be >= 1 (the first sampled token is predicted at "
                          f"the prompt's last position), got {prompt_len}")
    want = prompt_len + num_tokens - 1
    if rows != want:
        extra = ""
        if rows == want + 1:
            extra = (" One row more: a row for the last sampled token, which is never forwarded (stale or zero); "
                     "engines return prompt + output - 1 rows.")
        elif rows == num_tokens or rows == num_tokens - 1:
            extra = " It looks like output positions only; this parser expects the prompt's rows too."
        raise RecordError(f"{where}: {field} holds {rows} positions; prompt ({prompt_len}) + output ({num_tokens}) - 1 "
                          f"= {want} expected.{extra}")
    if moe_layers is not None:
        sel = [json_int(i, f"{where}: moe_layers entry", ValueError) for i in moe_layers]
        bad = [i for i in sel if not 0 <= i < layers_all]
        if bad or len(set(sel)) != len(sel) or not sel:
            raise ValueError(f"moe_layers must be distinct layer indices in [0, {layers_all}), got {list(moe_layers)}")
        positions = positions[:, sel]
    if num_layers is not None and positions.shape[1] != num_layers:
        raise RecordError(f"{where}: {field} holds {positions.shape[1]} MoE layers, the model has {num_layers}: "
                          f"{'layers missing' if positions.shape[1] < num_layers else 'extra (dense?) layers'}")
    if num_tokens == 0:
        return RoutedExperts.from_ids(positions[:0], num_experts)
    try:
        return RoutedExperts.from_ids(positions[prompt_len - 1:], num_experts)
    except ValueError as exc:
        raise RecordError(f"{where}: {field}: {exc}") from exc


def route_positions(value: object, what: str) -> Tensor:
    """An engine's decoded per-position routes as an int64 tensor: a torch tensor, an array (``__array__``, e.g. a
    numpy array of an offline output) or nested lists; ``RecordError`` naming ``what`` otherwise."""
    if isinstance(value, Tensor):
        x = value
    elif hasattr(value, "__array__"):
        try:
            x = torch.as_tensor(value)
        except (TypeError, RuntimeError, ValueError) as exc:
            raise RecordError(f"{what}: cannot read the array ({exc})") from exc
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        try:
            x = torch.tensor(value)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise RecordError(f"{what}: nested lists are not a rectangular integer array ({exc})") from exc
    else:
        raise RecordError(f"{what} must be an array of expert ids, got {type(value).__name__}")
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise RecordError(f"{what} must hold integer expert ids, got {x.dtype}")
    return x.to(torch.int64)
