"""The trainer's check of an engine group's answer before any of it reaches a trajectory: the vLLM adapter's own
record checks (:mod:`offpolicy.adapters.common`) applied again on the driver's side of the process boundary, plus
what only the fleet knows (the sessions and contexts it sent, the newest version it published, the tokens it asked
for). A failed check raises :class:`~offpolicy.adapters.common.RecordError` naming the group, the session and what
is wrong; :class:`~.fleet_runner.LiveFleet` then treats the group as broken (an ``"invalid"`` event; it is
restarted like a dead one) and sends the sessions again.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from offpolicy.adapters.common import (
    RecordError,
    check_head_rows,
    check_logprob_values,
    check_sampled_possible,
    check_support_rows,
)
from offpolicy.records.candidates import Candidates
from offpolicy.records.csr_candidates import CSRCandidates


def check_answer(
    served: object,
    requests: Sequence[tuple[Hashable, Sequence[int]]],
    group: str,
    *,
    newest_version: int,
    max_tokens: int,
    vocab_size: int | None = None,
) -> None:
    """Check one ``generate`` answer of ``group`` (a list of :class:`~.engine_group.ServedTurn`).

    Args:
        served: what the group returned.
        requests: the ``(session_id, context token ids)`` it was sent, in order.
        group: the group's name.
        newest_version: the newest version published when the answer arrived (a turn stamped later is from the
            future).
        max_tokens: the most tokens a turn may hold (the request's ``max_tokens``).
        vocab_size: the model's vocabulary size (``None``: ids are checked only for being ``>= 0``).

    Raises:
        RecordError: naming the group, the session and the first thing wrong: the sessions answered, the context
            echoed, the group or version stamped (negative, or newer than ``newest_version``), the per-token
            versions, the lengths of tokens / log-probs / candidate rows, ids outside ``[0, vocab_size)``, NaN or
            positive log-probs, a sampled token of probability 0, support rows not summing to one or missing the
            sampled token, head rows of mass above one.
    """
    from offpolicy.adapters.fleet_live.engine_group import ServedTurn

    where = f"group {group!r}"
    if not isinstance(served, list) or not all(isinstance(t, ServedTurn) for t in served):
        raise RecordError(f"{where}: answered {type(served).__name__}, not a list of ServedTurn")
    got, want = [t.session_id for t in served], [sid for sid, _ in requests]
    if got != want:
        raise RecordError(f"{where}: answered for sessions {got[:4]}..., asked for {want[:4]}... ({len(got)} vs "
                          f"{len(want)} turns)")
    for turn, (sid, ctx) in zip(served, requests):
        at = f"{where}, session {sid!r}"
        if turn.group != group:
            raise RecordError(f"{at}: turn stamped with group {turn.group!r}")
        v = turn.version
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise RecordError(f"{at}: served version {v!r} is not an integer >= 0")
        if v > newest_version:
            raise RecordError(f"{at}: served version {v} is newer than the newest published ({newest_version})")
        check_record(turn.record, at, version=v, context=ctx, max_tokens=max_tokens, vocab_size=vocab_size)


def check_record(record: object, at: str, *, version: int, context: Sequence[int], max_tokens: int,
                 vocab_size: int | None) -> None:
    """The checks of :func:`check_answer` on one turn's :class:`~offpolicy.adapters.common.TurnRecord`."""
    from offpolicy.adapters.common import TurnRecord

    if not isinstance(record, TurnRecord):
        raise RecordError(f"{at}: record is {type(record).__name__}, not a TurnRecord")
    if record.input_ids is not None and tuple(record.input_ids) != tuple(int(t) for t in context):
        raise RecordError(f"{at}: the record's context ({len(record.input_ids)} tokens) is not the one sent "
                          f"({len(context)} tokens)")
    tokens, lq = record.tokens, record.sampler_logprobs
    if not (isinstance(tokens, torch.Tensor) and tokens.dim() == 1 and not tokens.is_floating_point()):
        raise RecordError(f"{at}: tokens must be a 1-D integer tensor")
    n = int(tokens.shape[0])
    if not 1 <= n <= max_tokens:
        raise RecordError(f"{at}: {n} tokens, expected 1 to max_tokens={max_tokens}")
    if not (isinstance(lq, torch.Tensor) and lq.is_floating_point() and tuple(lq.shape) == (n,)):
        raise RecordError(f"{at}: sampler_logprobs of shape {tuple(getattr(lq, 'shape', ()))} for {n} tokens")
    if record.versions is None or len(record.versions) != n or set(record.versions) != {str(version)}:
        shown = None if record.versions is None else sorted(set(record.versions))
        raise RecordError(f"{at}: per-token versions {shown} (length "
                          f"{None if record.versions is None else len(record.versions)}) do not all equal the "
                          f"served version {version} for {n} tokens")
    if int(tokens.min()) < 0 or (vocab_size is not None and int(tokens.max()) >= vocab_size):
        raise RecordError(f"{at}: token ids outside [0, {vocab_size}): min {int(tokens.min())}, max "
                          f"{int(tokens.max())}")
    check_logprob_values(lq, f"{at} sampled log-probs")
    check_sampled_possible(lq, at)
    cands = record.candidates
    if cands is None:
        return
    try:
        if isinstance(cands, CSRCandidates):
            if cands.num_rows != n:
                raise RecordError(f"{at}: candidate record of {cands.num_rows} rows for {n} tokens")
            check_logprob_values(cands.logprobs, f"{at} candidate log-probs")
            if cands.kind == "support":
                check_support_rows(cands, tokens, lq, at)
        elif isinstance(cands, Candidates):
            if cands.ids.shape[0] != n:
                raise RecordError(f"{at}: candidate record of {cands.ids.shape[0]} rows for {n} tokens")
            check_logprob_values(cands.logprobs[cands.valid], f"{at} candidate log-probs")
            if cands.kind == "head":
                check_head_rows(cands, tokens, lq, at)
        else:
            raise RecordError(f"{at}: candidates of type {type(cands).__name__}")
        cands.validate(vocab_size, n, tokens)
    except RecordError:
        raise
    except ValueError as exc:
        raise RecordError(f"{at}: {exc}") from exc
