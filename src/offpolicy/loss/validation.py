"""Boundary checks shared by the public entry points (:func:`offpolicy.policy_loss`,
:func:`offpolicy.policy_loss_from_logprobs`): each names the argument and what was expected."""

from __future__ import annotations

import math
import numbers
import warnings

import torch
from torch import Tensor

from offpolicy.loss.aggregation import AGGREGATIONS, SEQUENCE_AGGREGATIONS
from offpolicy.records.candidates import SUPPORT_SUM_TOL, Candidates
from offpolicy.records.csr_candidates import CSRCandidates
from offpolicy.corrections.correction import Correction
from offpolicy.loss.inputs import Aggregation, TokenData
from offpolicy.ops.input_checks import INT_NAMES, INTS

#: Log-probabilities may exceed 0 by rounding; beyond this they are not log-probabilities.
LOGPROB_SLACK = 1e-4


def check_vector(name: str, x, n: int, device, kind: str) -> None:
    """Check that ``x`` is an ``[n]`` tensor of the given kind ("int", "float" or "any") on ``device``."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape [{n}], got {type(x).__name__}")
    if x.dim() != 1 or x.shape[0] != n:
        raise ValueError(f"{name} must have shape [N] = [{n}], got {tuple(x.shape)}")
    if kind == "int" and x.dtype not in INTS:
        raise TypeError(f"{name} must be an integer ({INT_NAMES}) tensor, got {x.dtype}")
    if kind == "float" and not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}, expected {device} like the other inputs")


def check_positive_count(name: str, val) -> None:
    """``val`` is None, or a finite number ``> 0`` (a Python or NumPy real, or a one-element tensor; not a bool)."""
    if val is None:
        return
    if isinstance(val, Tensor):
        if val.numel() != 1 or val.dtype == torch.bool or val.is_complex():
            raise TypeError(f"{name} must be a number or a one-element tensor, got a {val.dtype} tensor of shape "
                            f"{tuple(val.shape)}")
    elif isinstance(val, bool) or not isinstance(val, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(val).__name__} {val!r}")
    num = float(val)
    if not (math.isfinite(num) and num > 0):
        raise ValueError(f"{name} must be finite and > 0, got {num}")


def check_flag(name: str, val) -> None:
    """``val`` is a bool (a string such as ``"no"`` would read as True)."""
    if not isinstance(val, bool):
        raise TypeError(f"{name} must be a bool, got {type(val).__name__} {val!r}")


def check_batch(n: int, device, data: TokenData, agg: Aggregation, corr: Correction) -> Tensor:
    """The per-token data and options common to every entry point; returns ``active [N]`` (bool)."""
    if not isinstance(corr, Correction):
        raise TypeError(f"correction must be an offpolicy.Correction, got {type(corr).__name__}")
    lq, adv, loss_mask, proximal = data.sampler_logprobs, data.advantages, data.loss_mask, data.proximal_logprobs
    if lq is None or adv is None:
        raise ValueError("sampler_logprobs and advantages are required")
    check_vector("sampler_logprobs", lq, n, device, "float")
    check_vector("advantages", adv, n, device, "float")
    if loss_mask is not None:
        check_vector("loss_mask", loss_mask, n, device, "any")
        if loss_mask.dtype != torch.bool and bool(((loss_mask != 0) & (loss_mask != 1)).any()):
            raise ValueError("loss_mask must be bool (or hold only 0 and 1)")
        active = loss_mask.to(torch.bool)
    else:
        active = torch.ones(n, dtype=torch.bool, device=device)
    lq_a = lq[active]
    if bool(torch.isnan(lq_a).any()):
        raise ValueError("sampler_logprobs: NaN on a trained token")
    if bool((lq_a == float("-inf")).any()):
        raise ValueError("sampler_logprobs: -inf on a trained token (the sampler cannot have drawn it)")
    if bool((lq_a > LOGPROB_SLACK).any()):
        raise ValueError(f"sampler_logprobs: value {float(lq_a.max()):.4g} > 0 on a trained token")
    if not bool(torch.isfinite(adv[active]).all()):
        raise ValueError("advantages: NaN or inf on a trained token")
    seq_ids = data.seq_ids
    if not isinstance(agg.name, str) or agg.name not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {agg.name!r}")
    if agg.name in SEQUENCE_AGGREGATIONS and seq_ids is None:
        raise ValueError(f"aggregation={agg.name!r} needs seq_ids")
    if agg.name == "constant" and agg.constant_normalizer is None:
        raise ValueError("aggregation='constant' needs constant_normalizer > 0")
    tree = corr.tree
    if tree.needs_segments != (data.segment_ids is not None):
        raise ValueError("Correction(level='segment') and segment_ids go together (so do a "
                         "RatioRejection(level='segment') or TrustRegion(level='segment') and segment_ids): per-turn "
                         "weights, rejections and trust regions need each "
                         "token's [N] turn id, and segment_ids is read by nothing else (got level="
                         f"{corr.level!r}, segment_ids={'None' if data.segment_ids is None else 'a tensor'})")
    if tree.needs_sequences and seq_ids is None:
        raise ValueError("this correction (sequence-level weights or a sequence rejection) needs seq_ids")
    for name, val in (("num_loss_tokens", agg.num_loss_tokens), ("num_sequences", agg.num_sequences),
                      ("constant_normalizer", agg.constant_normalizer)):
        check_positive_count(name, val)
    if not tree.surrogate.proximal_optional and tree.surrogate.needs_proximal != (proximal is not None):
        raise ValueError("correction.ppo_clip and proximal_logprobs go together (decoupled PPO; likewise cispo, sapo, "
                         "vespo and gmpo)")
    if proximal is not None:
        check_vector("proximal_logprobs", proximal, n, device, "float")
        if not bool(torch.isfinite(proximal[active]).all()):
            raise ValueError("proximal_logprobs: NaN or inf on a trained token")
        if bool((proximal[active] > LOGPROB_SLACK).any()):
            raise ValueError(f"proximal_logprobs: value {float(proximal[active].max()):.4g} > 0 on a trained token "
                             "(log-probabilities are <= 0)")
    ref = data.reference_logprobs
    if (tree.kl_penalty is None) != (ref is None):
        raise ValueError("correction.kl_penalty and reference_logprobs go together: the penalty needs the reference "
                         f"model's [N] log-probabilities (got kl_penalty={tree.kl_penalty!r}, reference_logprobs="
                         f"{'None' if ref is None else 'a tensor'})")
    if ref is not None:
        check_vector("reference_logprobs", ref, n, device, "float")
        if not bool(torch.isfinite(ref[active]).all()):
            raise ValueError("reference_logprobs: NaN or inf on a trained token")
        if bool((ref[active] > LOGPROB_SLACK).any()):
            raise ValueError(f"reference_logprobs: value {float(ref[active].max()):.4g} > 0 on a trained token "
                             "(log-probabilities are <= 0)")
    for name, val in (("seq_ids", seq_ids), ("groups", data.groups), ("versions", data.versions),
                      ("segment_ids", data.segment_ids), ("route_flips", data.route_flips)):
        if val is not None:
            check_vector(name, val, n, device, "int")
    if data.route_flips is not None and bool((data.route_flips[active] < 0).any()):
        raise ValueError("route_flips: a negative count on a trained token (it counts MoE layers)")
    for node in tree.nodes():
        # The inputs a node declares (seq_ids, segment_ids, proximal and reference log-probabilities have their own
        # messages above): a missing one is named with the node that reads it.
        for name in getattr(node, "inputs", ()):
            if hasattr(data, name) and getattr(data, name) is None:
                raise ValueError(f"{type(node).__name__} (Correction{_keywords(node)}) needs the {name} input")
    current = data.current_version
    if current is not None:
        if isinstance(current, bool) or not isinstance(current, numbers.Integral):
            raise TypeError(f"current_version must be an int, got {type(current).__name__} {current!r}")
        # Over trained tokens only: untrained rows may hold any version (padding), like every other value.
        trained_versions = data.versions[active] if data.versions is not None else None
        if trained_versions is not None and trained_versions.numel() and int(trained_versions.max()) > int(current):
            raise ValueError(f"current_version={int(current)} is older than the batch's newest trained version "
                             f"{int(trained_versions.max())} (versions are the policies that sampled the tokens)")
    return active


def _keywords(node) -> str:
    kws = [k.name for k in type(node).__dict__.get("keywords", ())]
    return f".{kws[0]}" if kws else ""


def check_candidates(candidates, vocab: int | None, n: int, device, active: Tensor, tokens: Tensor | None) -> None:
    """The record against the batch (ids in range when ``vocab`` is known, the sampled token in its support when
    ``tokens`` are known)."""
    if candidates is None:
        return
    if not isinstance(candidates, (Candidates, CSRCandidates)):
        raise TypeError(f"candidates must be an offpolicy.Candidates or offpolicy.CSRCandidates, got "
                        f"{type(candidates).__name__}")
    if candidates.ids.device != device:
        raise ValueError(f"candidates are on {candidates.ids.device}, expected {device}")
    candidates.validate(vocab, n, tokens, active)
    if candidates.kind == "support":
        nonempty = candidates.lengths > 0 if isinstance(candidates, CSRCandidates) else (candidates.ids >= 0).any(1)
        empty = active & ~nonempty
        if bool(empty.any()):
            row = int(empty.nonzero()[0])
            raise ValueError(f"candidates: kind='support' row {row} is empty but its token is trained")


def check_tokens(tokens: Tensor, vocab: int | None) -> None:
    """``tokens [N]`` in ``[0, vocab)`` (the lower bound only when ``vocab`` is None: a vocabulary split whose
    global size is not known here)."""
    if not tokens.numel():
        return
    if bool((tokens < 0).any()):
        raise ValueError(f"tokens: id {int(tokens.min())} is negative")
    if vocab is not None and bool((tokens >= vocab).any()):
        raise ValueError(f"tokens: id {int(tokens.max())} is out of range for vocabulary size {vocab}")


@torch.library.custom_op("offpolicy::check_records", mutates_args=())
def _check_records_op(tokens: Tensor, active: Tensor, ids: Tensor | None, offsets: Tensor | None,
                      logprobs: Tensor | None, vocab: int, kind: str) -> tuple[Tensor, Tensor, Tensor]:
    """The eager checks of the tokens and the record (:func:`check_tokens`, :func:`check_candidates`), run when a
    compiled graph runs; returns copies of ``tokens``, ``ids`` and ``offsets`` (empty when absent) for the graph to
    read instead of its inputs, so every op that indexes by them waits for the check."""
    vocab_or_none = None if vocab < 0 else vocab
    check_tokens(tokens, vocab_or_none)
    record = None
    if ids is not None:
        record = (Candidates(ids, logprobs, kind) if offsets is None else
                  CSRCandidates(ids, offsets, logprobs, kind))
        check_candidates(record, vocab_or_none, tokens.shape[0], tokens.device, active, tokens)
    empty = tokens.new_empty(0)
    return (tokens.clone(), empty.clone() if ids is None else ids.clone(),
            empty.clone() if offsets is None else offsets.clone())


@_check_records_op.register_fake
def _check_records_fake(tokens, active, ids, offsets, logprobs, vocab, kind):
    empty = tokens.new_empty(0)
    return (torch.empty_like(tokens), empty.clone() if ids is None else torch.empty_like(ids),
            empty.clone() if offsets is None else torch.empty_like(offsets))


def check_records_in_graph(tokens: Tensor, candidates, active: Tensor, vocab: int | None):
    """The record checks of a traced :func:`offpolicy.policy_loss` (docs/errors.md#validatefalse): the custom op
    ``offpolicy::check_records``, opaque to ``torch.compile``, runs :func:`check_tokens` and
    :func:`check_candidates` eagerly each time the compiled graph runs (host syncs, the same errors as an eager
    call) and hands back the tokens and the record rebuilt on its outputs, which the rest of the graph reads: no
    gather, scatter or kernel indexes by an id or offset before the check has passed. Returns ``(tokens,
    candidates)``."""
    if candidates is not None and not isinstance(candidates, (Candidates, CSRCandidates)):
        raise TypeError(f"candidates must be an offpolicy.Candidates or offpolicy.CSRCandidates, got "
                        f"{type(candidates).__name__}")
    csr = isinstance(candidates, CSRCandidates)
    tok, ids, offsets = _check_records_op(tokens, active, None if candidates is None else candidates.ids,
                                          candidates.offsets if csr else None,
                                          None if candidates is None else candidates.logprobs,
                                          -1 if vocab is None else vocab,
                                          "head" if candidates is None else candidates.kind)
    if candidates is None:
        return tok, None
    if csr:
        return tok, CSRCandidates(ids, offsets, candidates.logprobs, candidates.kind)
    return tok, Candidates(ids, candidates.logprobs, candidates.kind)


class RecordWarning(UserWarning):
    """A candidate record that passes every check but contradicts the rest of the batch, so the loss would be
    computed for a different sampler than the one that drew the tokens (docs/errors.md#records-that-contradict-the-batch).
    Each cause is warned once per process."""


#: Causes already warned about in this process (each is warned once).
_WARNED: set[str] = set()
#: The sampled token's ``lq`` and its own candidate entry are the same number in a correct record; they may
#: differ by this much (absolute + relative to ``|lq|``: bf16 rounding of either side), as ``offpolicy diagnose``
#: allows.
ENTRY_ATOL = 1e-3
ENTRY_RTOL = 1e-3
#: A head row whose sampler mass is one (within the support tolerance) while the trainer puts less than this on
#: the same ids is a renormalised row: an honest head's tail is the sampler's too.
HEAD_TRAINER_MASS = 0.95


def _warn_once(code: str, message: str) -> None:
    if code in _WARNED:
        return
    _WARNED.add(code)
    warnings.warn(message, RecordWarning, stacklevel=4)


def _per_row(candidates, values: Tensor, on: Tensor, n: int) -> Tensor:
    """``[N]`` float64 sum of ``values`` (entry-shaped, float) over each row's entries where ``on``; for a CSR
    record (validated: its offsets checked) one segment sum over the offsets, ``O(nnz)``, no search of rows."""
    v = torch.where(on, values.double(), torch.zeros((), dtype=torch.float64, device=values.device))
    if isinstance(candidates, CSRCandidates):
        return torch.segment_reduce(v, "sum", offsets=candidates.offsets.to(torch.int64))
    return v.sum(dim=1)


def warn_on_contradicting_record(candidates, tokens: Tensor, sampler_logprobs: Tensor, active: Tensor,
                                 trainer_candidate_logprobs: Tensor | None) -> None:
    """Warn (:class:`RecordWarning`, once per cause) about a validated record that contradicts the batch:

    * ``lq_off_own_entry``: on a trained row that holds its sampled token, ``sampler_logprobs`` differs from that
      token's own entry in the record (beyond ``ENTRY_ATOL + ENTRY_RTOL |lq|``). A correct record holds the same
      number; below the entry of a support record it is the full-vocabulary ``lq`` (off by ``log P(S)``).
    * ``head_sums_to_one``: a ``kind="head"`` record whose every trained row holds ``K < V`` ids summing to one
      while the trainer gives those ids less than :data:`HEAD_TRAINER_MASS`: a renormalised support record
      labelled head.

    ``trainer_candidate_logprobs``: the trainer's log-probabilities at the record's entries (``[N, K]`` or
    ``[nnz]``), or None to skip the second check. A few host syncs: only when validating, eagerly."""
    if candidates is None or tokens.numel() == 0:
        return
    n = tokens.shape[0]
    csr = isinstance(candidates, CSRCandidates)
    ids, lp = candidates.ids, candidates.logprobs
    tok = tokens.to(device=ids.device, dtype=torch.int64)
    if csr:  # the offsets were checked by the validation before this: per-row values spread by one repeat
        lengths, nnz = candidates.lengths, candidates.nnz
        valid = torch.ones_like(ids, dtype=torch.bool)
        hit = ids.to(torch.int64) == torch.repeat_interleave(tok, lengths, output_size=nnz)
        trained_entry = torch.repeat_interleave(active.to(ids.device), lengths, output_size=nnz)
    else:
        valid = ids >= 0
        hit = (ids.to(torch.int64) == tok[:, None]) & valid
        trained_entry = active[:, None] & valid
    if csr:  # the hits are at most a few per row: their rows by a search among the rows' ends, O(hits log N)
        pos = hit.nonzero().view(-1)
        at = torch.searchsorted(candidates.offsets.to(torch.int64)[1:], pos, right=True)
        holds = torch.zeros(n, dtype=torch.bool, device=ids.device).index_fill_(0, at, True)
        entry = torch.zeros(n, dtype=torch.float64, device=ids.device).index_add_(0, at, lp[pos].double())
    else:
        holds = _per_row(candidates, hit.to(torch.float64), hit, n) > 0
        entry = _per_row(candidates, lp, hit, n)
    lq = sampler_logprobs.double()
    rtol = ENTRY_RTOL + torch.finfo(lp.dtype).eps  # a bf16 record's entry is lq rounded to bf16
    off = active & holds & ((entry - lq).abs() > ENTRY_ATOL + rtol * lq.abs())
    if bool(off.any()):
        gap = (entry - lq)[off]
        count, total = int(off.sum()), int((active & holds).sum())
        below = bool((gap > 0).all())
        if candidates.kind == "support" and below:
            cause = (f"sampler_logprobs: on {count} of {total} trained rows the sampled token's lq lies below its "
                     f"own entry in the support record (by {float(gap.min()):.3g} to {float(gap.max()):.3g}): lq "
                     "looks like the full-vocabulary log-probability while the record is renormalised over the "
                     "support (they differ by log P(S)), so every ratio is off by that much. Pass the renormalised "
                     "log-probability of the sampled token (its entry in the record) as sampler_logprobs")
        else:
            cause = (f"sampler_logprobs: on {count} of {total} trained rows the sampled token's lq differs from its "
                     f"own entry in the candidate record (kind={candidates.kind!r}; entry - lq from "
                     f"{float(gap.min()):.3g} to {float(gap.max()):.3g}): an lq off its own candidate entry. "
                     "lq and the record are the same sampler's numbers in a correct batch; record both from one "
                     "sampling step, at one position and temperature")
        _warn_once("lq_off_own_entry", cause)
    if candidates.kind != "head" or trainer_candidate_logprobs is None:
        return
    width = _per_row(candidates, valid.to(torch.float64), valid, n)
    rows = active & (width > 0)
    if not bool(rows.any()):
        return
    on = trained_entry & valid
    q_mass = _per_row(candidates, torch.exp(lp.double()), on, n)
    p_mass = _per_row(candidates, torch.exp(trainer_candidate_logprobs.detach().double()), on, n)
    eps = torch.finfo(lp.dtype).eps
    ent = torch.where(torch.isfinite(lp.double()), -torch.exp(lp.double()) * lp.double(), 0.0)
    tol = SUPPORT_SUM_TOL + eps * _per_row(candidates, ent, on, n)
    sums_to_one = (q_mass - 1.0).abs() <= tol
    if bool((sums_to_one | ~rows).all()) and bool((p_mass[rows] < HEAD_TRAINER_MASS).any()):
        _warn_once("head_sums_to_one", (
            f"candidates: kind='head', but every trained row's sampler log-probabilities sum to 1 over its "
            f"{int(width[rows].min())} to {int(width[rows].max())} ids while the trainer puts as little as "
            f"{float(p_mass[rows].min()):.3g} of its mass there: a top-p / top-k support record, renormalised over "
            "each row's support, labelled head. A head record holds full-vocabulary log-probabilities and the loss "
            "models the unrecorded tail; pass kind='support' so the loss replays the sampler's mask"))
