"""``policy_loss``: the public entry point (docs/spec.md#api).

The path is short: validate at the boundary -> one sparse log-softmax (logits, or hidden x weight) -> the
``O(N K)`` loss math of :func:`offpolicy.policy_loss_from_logprobs` (weights, rejections, score centering,
aggregation, metrics; the formula is in :mod:`offpolicy.loss.logprobs`).
"""

from __future__ import annotations

import contextlib
import numbers
from dataclasses import dataclass

import torch
from torch import Tensor

from offpolicy.records.candidates import Candidates
from offpolicy.records.csr_candidates import CSRCandidates
from offpolicy.corrections.correction import Correction
from offpolicy.parallel.dtensor import vocab_shard_of
from offpolicy.loss.csr_logprobs import csr_log_probs
from offpolicy.loss.inputs import Aggregation, Parallelism, TokenData
from offpolicy.loss.logprobs import PolicyLossOutput, loss_from_logprobs
from offpolicy.ops import SparseLogSoftmax, VocabShard, backend_registry, input_checks, library, row_threads
from offpolicy.ops.backend_registry import Backend
from offpolicy.ops.linear_op import linear_torch_backend
from offpolicy.ops.linear_op.linear_log_softmax import linear_sparse_log_softmax_unchecked
from offpolicy.ops.logits_op.sparse_log_softmax import sparse_log_softmax_unchecked
from offpolicy.ops.logits_op.stats_grad_pass import RowRule, attach_gradient, stats_and_grad
from offpolicy.loss.token_rule import row_rule
from offpolicy.loss.validation import (check_batch, check_candidates, check_flag, check_records_in_graph, check_tokens,
                                       check_vector, warn_on_contradicting_record)


def policy_loss(
    logits: Tensor | None = None,
    tokens: Tensor | None = None,
    sampler_logprobs: Tensor | None = None,
    advantages: Tensor | None = None,
    candidates: Candidates | CSRCandidates | None = None,
    loss_mask: Tensor | None = None,
    temperature: float | Tensor = 1.0,
    correction: Correction = Correction(),
    seq_ids: Tensor | None = None,
    aggregation: str = "token_mean",
    num_loss_tokens: float | Tensor | None = None,
    groups: Tensor | None = None,
    versions: Tensor | None = None,
    tp_group=None,
    vocab_start: int = 0,
    *,
    hidden: Tensor | None = None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    proximal_logprobs: Tensor | None = None,
    num_sequences: float | Tensor | None = None,
    constant_normalizer: float | None = None,
    cp_group=None,
    current_version: int | None = None,
    reference_logprobs: Tensor | None = None,
    segment_ids: Tensor | None = None,
    route_flips: Tensor | None = None,
    inplace_grad: bool = False,
    backend: str | None = None,
    validate: bool = True,
) -> PolicyLossOutput:
    """Off-policy-corrected policy-gradient loss on tokens drawn by a sampler ``q``.

    Args:
        logits: ``[N, V]`` bf16/fp16/fp32/fp64 trainer logits (``V`` = this rank's shard under ``tp_group``).
            Alternatively pass ``hidden [N, D]``, ``weight [V, D]`` (and optional ``bias [V]``).
        tokens: ``[N]`` int sampled token ids.
        sampler_logprobs: ``[N]`` float ``lq_t``, the sampler's log-probability of ``y_t`` after temperature
            (renormalised over the support when sampling was filtered).
        advantages: ``[N]`` float, detached.
        candidates: :class:`~offpolicy.Candidates` record (``kind="head"`` or ``"support"``), its unpadded
            :class:`~offpolicy.CSRCandidates` form (read at its ``nnz`` entries, never padded), or None.
        loss_mask: ``[N]`` bool, True on trained tokens; None trains all.
        temperature: float or ``[N]`` tensor, ``> 0``: the sampling temperature.
        correction: :class:`~offpolicy.Correction`; the default is plain REINFORCE/GRPO.
        seq_ids: ``[N]`` int sequence of each token (sequence-level weights, rejections, sequence aggregation).
        aggregation: ``"token_mean" | "seq_mean_token_mean" | "seq_mean_token_sum" | "constant"``.
        num_loss_tokens: global token count for ``token_mean`` (data-parallel / micro-batch exactness).
        groups: ``[N]`` int sampler group of each token, for per-group metrics.
        versions: ``[N]`` int policy version that sampled each token, for per-staleness metrics.
        tp_group: ``torch.distributed`` group over which the vocabulary is split; ``vocab_start`` is this
            rank's first id. The shards must tile ``[0, V)`` (checked with one small all-gather when validating);
            ``V`` is the global vocabulary that tokens and candidates are checked against. Exclude padded
            vocabulary columns by passing only the real ones (e.g. ``logits[:, :real_width]``).
            Vocabulary-sharded ``DTensor`` logits (``Shard(1)``, e.g. from a ``loss_parallel`` output layer)
            carry both in their device mesh: pass them as they are, without these two.
        hidden, weight, bias: the fused-linear input (instead of ``logits``).
        proximal_logprobs: ``[N]`` ``log pi_prox(y_t)`` for decoupled PPO (``correction.ppo_clip``).
        num_sequences: global sequence count for the sequence aggregations.
        constant_normalizer: the divisor of ``aggregation="constant"``.
        cp_group: ``torch.distributed`` group over which the tokens of each sequence are split (context
            parallelism). Sequence statistics (sequence and geometric log-ratios, OPSM and veto, per-sequence token
            counts), the default ``token_mean`` count and the ``batch_normalize`` mean are all-reduced over it;
            ``seq_ids`` must then name the same sequence on every rank (ids ``>= 0``), and ``loss`` is this rank's
            share: the shares sum to the whole batch's loss. Metrics stay per rank.
        current_version: the trainer's policy version (staleness = current - version); default the newest.
        reference_logprobs: ``[N]`` float ``log p_ref(y_t)`` of the reference model, for ``correction.kl_penalty``
            (both or neither).
        segment_ids: ``[N]`` int turn of each token within its sequence, for ``Correction(level="segment")`` (both
            or neither; a turn is one ``(seq_ids, segment_ids)`` pair, or one ``segment_ids`` value without
            ``seq_ids``). Not under ``cp_group``.
        route_flips: ``[N]`` int ``>= 0``, per trained token the number of MoE layers where the sampler's top-k
            expert set differs from the trainer's, for ``Correction(max_route_flips=k)`` / ``RouteFlipRejection``.
        inplace_grad: write the logits' gradient into ``logits`` (saves an ``[N, V]`` buffer; the logits are
            overwritten by the backward and autograd's version check is bypassed). A CSR support record's
            gradient, which no vocabulary pass produces, is a fresh buffer whatever this says.
        backend: ``"torch"``, ``"cpu"`` or ``"triton"``; default by device.
        validate: check inputs at the boundary (host syncs). Under ``torch.compile`` the checks of ``tokens`` and
            ``candidates`` run inside the graph (:func:`~offpolicy.loss.validation.check_records_in_graph`, the
            eager errors) and the other value checks are skipped.
            Without it, what the log-softmax reads (``logits`` or ``hidden`` / ``weight`` / ``bias``, the shape
            and dtype of ``tokens``, the temperature's type and shape, ``inplace_grad`` on overlapping rows) is still
            checked: no host sync.

    Returns:
        :class:`PolicyLossOutput`.
    """
    check_flag("validate", validate)
    check_flag("inplace_grad", inplace_grad)
    eager = not library.tracing()  # the one question about torch.compile; the ops get the answer in their plan
    check = validate and eager
    logits, tp_group, vocab_start = vocab_shard_of(logits, tp_group, vocab_start)
    model = ModelInputs(logits, hidden, weight, bias)
    data = TokenData(sampler_logprobs, advantages, loss_mask, seq_ids, groups, versions, proximal_logprobs,
                     current_version, reference_logprobs, segment_ids, route_flips)
    agg = Aggregation(aggregation, num_loss_tokens, num_sequences, constant_normalizer)
    par = Parallelism(tp_group, vocab_start, cp_group)
    # On CPU the checks and the O(N K) math are many small ops; each parallel region waits for all its threads,
    # which on shared cores costs more than the op. With logits they run with one intra-op thread, and the
    # vocabulary passes share their rows out to torch.get_num_threads() workers (offpolicy.ops.row_threads); this
    # is the call's one entry into that context. The fused-linear path keeps the caller's threads: its matmuls
    # are large parallel regions.
    on_cpu = isinstance(logits, Tensor) and logits.device.type == "cpu"
    with row_threads.single_intra_op() if on_cpu and eager else contextlib.nullcontext():
        n, v, device = _check_op_inputs(model, tokens, temperature, inplace_grad, values=check)
        if check:
            _validate(tokens, candidates, n=n, v=v, device=device, data=data, agg=agg, par=par, corr=correction)
        elif validate:  # traced: the index checks run in the graph, ahead of every op that reads the indices
            mask = torch.ones(n, dtype=torch.bool, device=device) if loss_mask is None else loss_mask.to(torch.bool)
            tokens, candidates = check_records_in_graph(tokens, candidates, mask, v if tp_group is None else None)
        src = model.logits if model.logits is not None else model.hidden
        chosen = backend_registry.choose(backend, device, src.dtype)  # once per call, handed down
        active = torch.ones(n, dtype=torch.bool, device=device) if loss_mask is None else loss_mask.to(torch.bool)
        shard = VocabShard(tp_group, vocab_start) if tp_group is not None else None
        rule = _two_pass_rule(model, candidates, correction, data, agg, chosen, shard=shard,
                              inplace_grad=inplace_grad, eager=eager, cp_group=cp_group)
        if rule is not None:  # the statistics and the logits' gradient in one program per row
            lp, dz = stats_and_grad(model.logits, tokens, candidates.ids if candidates is not None else None,
                                    temperature, backend=chosen, skip=~active, rule=rule)
        else:
            lp = _log_probs(model, tokens, candidates, temperature, skip=~active, shard=shard,
                            inplace_grad=inplace_grad, backend=chosen, eager=eager)
        if check:
            _refuse_broken_rows(model, lp, candidates, temperature, active=active, shard=shard)
            warn_on_contradicting_record(candidates, tokens, sampler_logprobs, active,
                                         lp.candidates if shard is None else None)
        out = loss_from_logprobs(lp.target, candidates, lp.candidates, lp.entropy, data=data, agg=agg,
                                 corr=correction, cp_group=cp_group)
        if rule is not None:
            out.loss = attach_gradient(out.loss, model.logits, dz)
        return out


def _two_pass_rule(model: ModelInputs, candidates: Candidates | CSRCandidates | None, correction: Correction,
                   data: TokenData, agg: Aggregation, backend: Backend, *, shard: VocabShard | None,
                   inplace_grad: bool, eager: bool, cp_group) -> RowRule | None:
    """The closed-form row gradient (:func:`offpolicy.loss.token_rule.row_rule`) when this call can take the
    two-pass kernel: logits that need a gradient, a backend with ``two_pass`` (triton), eagerly, no vocabulary
    split, no in-place gradient, no record or a padded head record, and a correction whose gradient is a closed
    form of each row's own log-probabilities (score centering over a head record included). Else None: the
    three-pass path (or the support pass)."""
    logits = model.logits
    if (logits is None or not backend.two_pass or not eager or shard is not None or inplace_grad
            or not (torch.is_grad_enabled() and logits.requires_grad)
            or isinstance(candidates, CSRCandidates) or (candidates is not None and candidates.kind != "head")):
        return None
    return row_rule(correction, data, agg, n=logits.shape[0], device=logits.device, cp_group=cp_group,
                    candidates=candidates)


def _log_probs(model: ModelInputs, tokens: Tensor, candidates: Candidates | CSRCandidates | None,
               temperature: float | Tensor, *, skip: Tensor, shard: VocabShard | None, inplace_grad: bool,
               backend: Backend, eager: bool) -> SparseLogSoftmax:
    """The trainer's log-probabilities the loss reads: the op's unchecked entry (the arguments were checked by
    :func:`_check_op_inputs` and :func:`_validate`, the backend resolved by :func:`policy_loss`), or a CSR
    record's entries."""
    if isinstance(candidates, CSRCandidates):
        return csr_log_probs(model, tokens, candidates, temperature, skip, backend=backend, inplace_grad=inplace_grad,
                             shard=shard, eager=eager)
    support = candidates is not None and candidates.kind == "support"
    cand_ids = candidates.ids if candidates is not None else None
    if model.logits is not None:
        return sparse_log_softmax_unchecked(model.logits, tokens, cand_ids, temperature, backend=backend,
                                            support=support, skip=skip, shard=shard, inplace_grad=inplace_grad,
                                            stats=(), eager=eager)
    return linear_sparse_log_softmax_unchecked(model.hidden, model.weight, tokens, cand_ids, temperature,
                                               bias=model.bias, backend=backend, support=support, skip=skip,
                                               shard=shard, chunk_bytes=linear_torch_backend.CHUNK_BYTES,
                                               grad_filter=None, stats=(), eager=eager)


def _refuse_broken_rows(model: ModelInputs, lp: SparseLogSoftmax, candidates: Candidates | CSRCandidates | None,
                        temperature: float | Tensor, *, active: Tensor, shard: VocabShard | None) -> None:
    """A NaN logit makes the row's log-probabilities NaN; a +inf one makes its normaliser inf - inf (NaN entropy,
    NaN gradient): neither is a distribution, so a trained row holding one is refused (a host sync: only when
    validating)."""
    csr = isinstance(candidates, CSRCandidates)
    support = candidates is not None and candidates.kind == "support"
    broken = (torch.isnan(lp.target) | torch.isnan(lp.entropy)) & active
    if model.logits is not None and shard is None and not (csr and support):
        cand_ids = candidates.ids if candidates is not None and not csr else None
        broken |= _overflowed(model.logits, torch.isposinf(lp.lse) & active & ~broken, cand_ids=cand_ids,
                              support=support)
    if bool(broken.any()):
        raise ValueError(_broken_row(model, int(broken.nonzero()[0]), temperature))


def _overflowed(logits: Tensor, no_mass: Tensor, *, cand_ids: Tensor | None, support: bool) -> Tensor:
    """``[N]`` bool: rows among ``no_mass`` (normaliser ``+inf``) that hold a finite logit where the normaliser
    reads (the row, or its support), so ``z / tau`` overflowed. A row of ``-inf`` logits has no mass either and is
    allowed (``p(y) = 0``). Only the flagged rows are read."""
    out = torch.zeros_like(no_mass)
    if not bool(no_mass.any()):
        return out
    rows = no_mass.nonzero()[:, 0]
    z = logits[rows]
    if support:
        ids = cand_ids[rows]
        z = z.gather(1, ids.clamp_min(0)).masked_fill(ids < 0, -float("inf"))
    out[rows] = torch.isfinite(z).any(dim=1)
    return out


def _broken_row(model: ModelInputs, row: int, temperature: float | Tensor) -> str:
    """The error for a trained row with no distribution: which of NaN, ``+inf`` or an overflow of ``z / tau`` it
    holds (read from that one row: the error path only)."""
    trained = "a trained token (loss_mask is True there)"
    if model.logits is None:
        return (f"hidden @ weight.T (+ bias): NaN, +inf, or a value that overflows once divided by the temperature, "
                f"in row {row}, {trained}")
    z = model.logits[row]
    if bool(torch.isnan(z).any()) or bool(torch.isposinf(z).any()):
        return f"logits: NaN or +inf in row {row}, {trained}"
    tau = float(temperature[row] if isinstance(temperature, Tensor) and temperature.numel() > 1 else temperature)
    acc = torch.float64 if z.dtype == torch.float64 else torch.float32
    return (f"logits: row {row} is finite, but its largest |z| / temperature = {float(z.abs().max()) / tau:.3g} "
            f"overflows {str(acc).removeprefix('torch.')} (max {torch.finfo(acc).max:.3g}), on {trained}; raise the "
            "temperature or scale the logits down")


def _global_vocab(group, *, vocab_start: int, v_local: int, n: int, device: torch.device) -> int:
    """Size of the vocabulary split over ``group``, checking that the shards tile ``[0, V)`` and agree on ``N``.

    One all-gather of three integers per rank.
    """
    import torch.distributed as dist

    mine = torch.tensor([vocab_start, v_local, n], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    # Shards without columns (a rank holding only vocabulary padding) may sit anywhere.
    shards = sorted((int(x[0]), int(x[1])) for x in every if int(x[1]) > 0)
    rows = {int(x[2]) for x in every}
    if len(rows) != 1:
        raise ValueError(f"tp_group: the ranks hold different numbers of rows {sorted(rows)}; each needs all N rows")
    end = 0
    for start, width in shards:
        if start != end:
            raise ValueError(
                f"vocab_start: the shards (start, width) {shards} do not tile [0, V) (expected a shard at {end}); "
                "each rank passes its first vocabulary id"
            )
        end = start + width
    return end


@dataclass(frozen=True)
class ModelInputs:
    """What the log-softmax reads: ``logits [N, V]``, or ``hidden [N, D]`` x ``weight [V, D]`` (+ ``bias [V]``)."""

    logits: Tensor | None
    hidden: Tensor | None
    weight: Tensor | None
    bias: Tensor | None


def _check_op_inputs(model: ModelInputs, tokens: Tensor, temperature: float | Tensor, inplace_grad: bool, *,
                     values: bool) -> tuple[int, int, torch.device]:
    """The checks of what the log-softmax reads (logits, or hidden and weight; the tokens; the temperature; the
    in-place gradient), which :func:`policy_loss` makes since it calls the ops unchecked: the ops' own
    (:mod:`offpolicy.ops.input_checks`) for the model and the temperature, so both boundaries raise alike. Shapes,
    dtypes and strides cost no host sync and always run; the temperature tensor's values are read with ``values``.
    Returns ``(N, V, device)`` (``V`` local under ``tp_group``)."""
    logits, hidden, weight, bias = model.logits, model.hidden, model.weight, model.bias
    if logits is not None and (hidden is not None or weight is not None):
        raise ValueError("pass either logits, or hidden and weight, not both")
    if logits is None:
        if hidden is None or weight is None:
            raise ValueError("policy_loss needs logits [N, V], or hidden [N, D] and weight [V, D]")
        input_checks.check_layer(hidden, weight, bias, linear_torch_backend.CHUNK_BYTES, None)
        input_checks.check_has_data("hidden", hidden)
        src, v = hidden, weight.shape[0]
    else:
        input_checks.check_logits(logits)
        input_checks.check_inplace_grad(logits, inplace_grad)
        src, v = logits, logits.shape[1]
    if tokens is None:
        raise ValueError("tokens, sampler_logprobs and advantages are required")
    check_vector("tokens", tokens, src.shape[0], src.device, "int")
    n = src.shape[0]
    acc = torch.float64 if src.dtype == torch.float64 else torch.float32
    input_checks.check_temperature(temperature, n, acc, values=values)
    return n, v, src.device


def _validate(tokens: Tensor, candidates: Candidates | CSRCandidates | None, *, n: int, v: int,
              device: torch.device, data: TokenData, agg: Aggregation, par: Parallelism, corr: Correction) -> None:
    """The checks of :func:`policy_loss`'s other arguments and of the values (host syncs), after
    :func:`_check_op_inputs`, made once here: the ops below run unchecked. Each error names the argument."""
    if isinstance(par.vocab_start, bool) or not isinstance(par.vocab_start, numbers.Integral):
        raise TypeError(f"vocab_start must be an int, got {type(par.vocab_start).__name__} {par.vocab_start!r}")
    if par.tp_group is None and par.vocab_start != 0:
        raise ValueError(f"vocab_start={par.vocab_start} needs tp_group (the group the vocabulary is split over); "
                         "without it the logits hold the whole vocabulary, starting at 0")
    vocab = v if par.tp_group is None else _global_vocab(par.tp_group, vocab_start=par.vocab_start, v_local=v, n=n,
                                                                 device=device)
    check_tokens(tokens, vocab)
    active = check_batch(n, device, data, agg, corr)
    check_candidates(candidates, vocab, n, device, active, tokens)
