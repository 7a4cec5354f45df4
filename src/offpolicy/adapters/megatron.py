"""Megatron-LM / megatron-core adapter: the ``loss_func`` that a ``forward_step`` returns.

Megatron's schedules call ``output_tensor, loss_func = forward_step(data_iterator, model)`` and then
``loss_func(output_tensor)``. With ``config.calculate_per_token_loss = True`` a 3-tuple ``(loss, count, report)``
selects the per-token path: the schedule leaves ``loss`` unscaled, sums ``count`` over micro-batches,
``finalize_model_grads`` all-reduces it over the data-parallel x context-parallel group and divides every gradient
by it. :func:`make_loss_func` returns such a ``loss_func``:

* ``loss``: the *sum* of this rank's terms, so that the divided gradient is exact: for ``token_mean`` the sum of
  per-token losses and ``count`` the trained tokens; for ``seq_mean_token_mean`` / ``seq_mean_token_sum`` the sum of
  per-sequence terms and ``count`` the sequences (counted once, on context-parallel rank 0); for ``constant``
  (Dr. GRPO) the token sum over ``max_tokens`` and ``count`` the sequences. The global
  normaliser is then exactly Megatron's all-reduced count, whatever the data-parallel size and the number of
  micro-batches (docs/spec.md#aggregation).
* ``report``: ``{"policy loss": [sum, count], <metric>: ...}``, the metrics of :func:`offpolicy.policy_loss`
  (docs/spec.md#metrics) reduced over the data-parallel x context-parallel group: token means as ``[global sum,
  global count]`` pairs (Megatron-LM's ``train_step`` sums such pairs over micro-batches, all-reduces them and
  divides: an exact token mean, unchanged by its extra all-reduce since both entries scale alike), maxima, minima
  and the effective sample size as 1-element tensors (averaged over micro-batches by ``train_step``). With
  ``num_groups`` (and a ``groups`` tensor in the batch) the mismatch and weight metrics are also reported per
  sampler group, ``group/{g}/<metric>`` for every ``g < num_groups``, and with ``max_staleness`` (and ``versions``)
  per staleness ``staleness/{s}/<metric>``, ``s = 0 .. max_staleness`` (the last bucket holds everything older):
  fixed key sets, the same on every rank, so that the reduction lines up. Each bucket also reports ``share_tokens``
  as a ``[tokens in the bucket, all trained tokens]`` pair.

The logits are Megatron's vocabulary-parallel ones: ``GPTModel.forward(..., labels=None)`` returns
``[b, s, V / tp]`` (``logits_layout="bsv"``), a bare output layer ``[s, b, V / tp]`` (``"sbv"``). Each tensor-parallel
rank holds the columns ``[tp_rank * V_local, (tp_rank + 1) * V_local)`` (Megatron's even split), and padded
vocabulary columns (``vocab_size`` < ``tp * V_local``) are left out of the softmax.

The micro-batch is a dict of ``[b, s, ...]`` tensors (so Megatron's ``get_batch_on_this_cp_rank`` splits it for
context parallelism like any other batch), see :data:`BATCH_KEYS` and :func:`packed_batch`.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

from offpolicy.loss.aggregation import SEQUENCE_AGGREGATIONS
from offpolicy.records.candidates import Candidates
from offpolicy.records.csr_candidates import CSRCandidates
from offpolicy.records.routed_experts import RoutedExperts
from offpolicy.corrections.correction import Correction
from offpolicy.loss.logits import policy_loss
from offpolicy.loss.metrics import token_stats
from offpolicy.parallel.packing import seq_ids_from_cu_seqlens, thd_cp_index, zigzag_index
from offpolicy.loss.segments import Segments

#: Keys of a micro-batch dict; each value is ``[b, s]`` (candidates ``[b, s, K]``) on this rank.
BATCH_KEYS = {
    "labels": "int, the sampled token at each position (the target of that position's logits)",
    "sampler_logprobs": "float, lq: the sampler's log-probability of the label (after temperature)",
    "advantages": "float",
    "loss_mask": "bool or 0/1, True on trained tokens",
    "seq_ids": "int >= 0, optional: the packed sequence of each token, the same id on every CP rank",
    "candidate_ids": "int [b, s, K], optional: candidate record ids, -1 padding",
    "candidate_logprobs": "float [b, s, K], optional: sampler log-probabilities of the candidates, -inf padding",
    "temperature": "float [b, s], optional: per-token sampling temperature",
    "proximal_logprobs": "float, optional: log pi_prox of the label (decoupled PPO)",
    "groups": "int in [0, num_groups), optional: the sampler group that produced each token (per-group metrics)",
    "versions": "int <= current_version, optional: the policy version that sampled each token (per-staleness "
                "metrics)",
}
_REQUIRED = ("labels", "sampler_logprobs", "advantages", "loss_mask")
AGGREGATIONS = ("token_mean",) + SEQUENCE_AGGREGATIONS + ("constant",)

#: Metrics of :func:`offpolicy.policy_loss` that are means over trained tokens (reduced as sum / count).
_MEAN_KEYS = (
    "kl_k1", "kl_k2", "kl_k3", "abs_log_ratio_mean", "extreme_ratio_frac", "weight_mean",
    "ratio_below_lower_frac", "ratio_above_upper_frac", "entropy", "rejected_frac", "support_size",
    "sc_p_head", "sc_q_head", "sc_rho", "sc_abs_coef_sum",
)
_MAX_KEYS = ("abs_log_ratio_max", "weight_max")
_MIN_KEYS = ("weight_min",)
#: The per-bucket (sampler group, staleness) metrics: means over the bucket's trained tokens, and extrema.
_BUCKET_MEAN_KEYS = (
    "kl_k1", "kl_k2", "kl_k3", "abs_log_ratio_mean", "extreme_ratio_frac", "weight_mean", "ratio_below_lower_frac",
    "ratio_above_upper_frac",
)


def packed_batch(
    labels: Tensor,
    sampler_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    cu_seqlens: Tensor | None = None,
    candidate_ids: Tensor | None = None,
    candidate_offsets: Tensor | None = None,
    candidate_logprobs: Tensor | None = None,
    candidate_width: int | None = None,
    temperature: Tensor | None = None,
    proximal_logprobs: Tensor | None = None,
) -> dict[str, Tensor]:
    """A micro-batch dict ``[1, T, ...]`` from one packed row of ``T`` tokens.

    Args:
        labels, sampler_logprobs, advantages, loss_mask: ``[T]`` per-token tensors of the packed row.
        cu_seqlens: ``[S + 1]`` cumulative sequence lengths; gives ``seq_ids`` (tokens past ``cu_seqlens[-1]``
            get the id ``S``: mask them out).
        candidate_ids, candidate_offsets, candidate_logprobs: the candidate record in CSR form (``[nnz]``,
            ``[T + 1]``, ``[nnz]``), padded here to ``[1, T, K]`` (``K`` = the longest row, or ``candidate_width``).
        temperature, proximal_logprobs: optional ``[T]``.
    """
    t = labels.shape[0]
    out = {"labels": labels, "sampler_logprobs": sampler_logprobs, "advantages": advantages, "loss_mask": loss_mask}
    for name, x in out.items():
        if not isinstance(x, Tensor) or x.shape != (t,):
            raise ValueError(f"{name} must be a [T] = [{t}] tensor, got {getattr(x, 'shape', type(x))}")
    if cu_seqlens is not None:
        out["seq_ids"] = seq_ids_from_cu_seqlens(cu_seqlens, t).to(labels.device)
    csr = (candidate_ids, candidate_offsets, candidate_logprobs)
    if any(x is not None for x in csr):
        if any(x is None for x in csr):
            raise ValueError("candidate_ids, candidate_offsets and candidate_logprobs go together (CSR)")
        if candidate_offsets.numel() != t + 1:
            raise ValueError(f"candidate_offsets must hold T + 1 = {t + 1} entries, got {candidate_offsets.numel()}")
        cands = Candidates.from_csr(candidate_ids, candidate_offsets, candidate_logprobs, width=candidate_width)
        out["candidate_ids"], out["candidate_logprobs"] = cands.ids, cands.logprobs
    if temperature is not None:
        out["temperature"] = temperature
    if proximal_logprobs is not None:
        out["proximal_logprobs"] = proximal_logprobs
    return {k: v.unsqueeze(0) for k, v in out.items()}


def split_for_context_parallel(
    batch: Mapping[str, Tensor], cp_size: int, cp_rank: int, cu_seqlens_padded: Tensor | None = None
) -> dict[str, Tensor]:
    """This context-parallel rank's share of a micro-batch dict, along the sequence dimension (dim 1).

    Without ``cu_seqlens_padded``: Megatron's ``bshd`` split (``get_batch_on_this_cp_rank``, the whole row in
    ``2 cp`` chunks). With it: the ``thd`` split (each packed sequence in ``2 cp`` chunks; pad the row with
    :func:`offpolicy.parallel.packing.scatter_to_padded` first). ``seq_ids`` travel with their tokens. A CSR
    candidate record goes with :func:`split_csr_for_context_parallel`.
    """
    if cp_size == 1:
        return dict(batch)
    s = batch["labels"].shape[1]
    idx = _cp_index(s, cp_size, cp_rank, cu_seqlens_padded, batch["labels"].device)
    return {k: v.index_select(1, idx) for k, v in batch.items()}


def split_csr_for_context_parallel(
    record: CSRCandidates, b: int, s: int, cp_size: int, cp_rank: int, cu_seqlens_padded: Tensor | None = None
) -> CSRCandidates:
    """This context-parallel rank's share of a CSR candidate record over a ``[b, s]`` micro-batch.

    ``record`` holds one row per token, ``b * s`` rows in ``[b, s]`` order; the result holds the rows of the
    tokens :func:`split_for_context_parallel` keeps (the same zigzag or ``thd`` index), ``b * s / cp`` rows in
    this rank's ``[b, s / cp]`` order, with their entries and rebuilt offsets (``O(nnz)`` of the kept rows, never
    padded): pass it to :func:`make_loss_func` as ``csr_candidates`` with the split batch.
    """
    if not isinstance(record, CSRCandidates):
        raise TypeError(f"record must be an offpolicy.CSRCandidates, got {type(record).__name__}")
    if record.num_rows != b * s:
        raise ValueError(f"record must hold b * s = {b} * {s} = {b * s} rows (one per token), got {record.num_rows}")
    if cp_size == 1:
        return record
    device = record.ids.device
    idx = _cp_index(s, cp_size, cp_rank, cu_seqlens_padded, device)
    rows = torch.arange(b, device=device)[:, None] * s + idx[None, :]
    return record.take_rows(rows.reshape(-1))


def split_routes_for_context_parallel(
    record: RoutedExperts, b: int, s: int, cp_size: int, cp_rank: int, cu_seqlens_padded: Tensor | None = None
) -> RoutedExperts:
    """This context-parallel rank's share of a routing record (:class:`~offpolicy.RoutedExperts`) over a ``[b, s]``
    micro-batch: ``record`` holds one token row per position, ``b * s`` rows in ``[b, s]`` order (padded
    positions marked ``valid`` False); the result holds the rows of the positions :func:`split_for_context_parallel`
    keeps (the same zigzag or ``thd`` index), ``b * s / cp`` rows in this rank's ``[b, s / cp]`` order, dense or CSR
    as given, with their ``valid`` and router weights."""
    if not isinstance(record, RoutedExperts):
        raise TypeError(f"record must be an offpolicy.RoutedExperts, got {type(record).__name__}")
    record.check_aligned(b * s, f"positions of the [b, s] = [{b}, {s}] micro-batch")
    if cp_size == 1:
        return record
    device = record.ids.device
    idx = _cp_index(s, cp_size, cp_rank, cu_seqlens_padded, device)
    rows = torch.arange(b, device=device)[:, None] * s + idx[None, :]
    return record.take_rows(rows.reshape(-1))


def _cp_index(s: int, cp_size: int, cp_rank: int, cu_seqlens_padded: Tensor | None, device) -> Tensor:
    """The positions of a length-``s`` row that context-parallel rank ``cp_rank`` keeps (zigzag, or ``thd``)."""
    if cu_seqlens_padded is None:
        return zigzag_index(s, cp_size, cp_rank, device)
    if int(cu_seqlens_padded[-1]) != s:
        raise ValueError(f"cu_seqlens_padded ends at {int(cu_seqlens_padded[-1])}, the row holds {s} tokens")
    return thd_cp_index(cu_seqlens_padded, cp_size, cp_rank).to(device)


def _default_groups(tp_group, cp_group, dp_group, use_parallel_state: bool):
    """Fill unset groups from ``megatron.core.parallel_state`` when it is initialised.

    Megatron is not imported here: if nothing imported ``parallel_state``, it cannot have been initialised.
    """
    ps = sys.modules.get("megatron.core.parallel_state")
    if not use_parallel_state or ps is None or not ps.model_parallel_is_initialized():
        return tp_group, cp_group, dp_group
    if tp_group is None and ps.get_tensor_model_parallel_world_size() > 1:
        tp_group = ps.get_tensor_model_parallel_group()
    if cp_group is None and ps.get_context_parallel_world_size() > 1:
        cp_group = ps.get_context_parallel_group()
    if dp_group is None and ps.get_data_parallel_world_size(with_context_parallel=True) > 1:
        dp_group = ps.get_data_parallel_group(with_context_parallel=True)
    return tp_group, cp_group, dp_group


def _rank(group) -> int:
    import torch.distributed as dist

    return 0 if group is None else dist.get_rank(group)


def _world(group) -> int:
    import torch.distributed as dist

    return 1 if group is None else dist.get_world_size(group)


def make_loss_func(
    batch: Mapping[str, Tensor],
    *,
    correction: Correction = Correction(),
    candidate_kind: str = "head",
    aggregation: str = "token_mean",
    max_tokens: float | None = None,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    logits_layout: str = "bsv",
    tp_group: Any = None,
    cp_group: Any = None,
    dp_group: Any = None,
    use_parallel_state: bool = True,
    reduce_metrics: bool = True,
    num_groups: int | None = None,
    max_staleness: int | None = None,
    current_version: int | None = None,
    config: Any = None,
    csr_candidates: CSRCandidates | None = None,
    **policy_loss_kwargs: Any,
) -> Callable[[Tensor], tuple[Tensor, Tensor, dict[str, Tensor]]]:
    """The ``loss_func`` for Megatron's per-token-loss path (``calculate_per_token_loss=True``).

    Args:
        batch: this rank's micro-batch, a dict of ``[b, s]`` tensors (:data:`BATCH_KEYS`; this CP rank's share).
        correction: the :class:`~offpolicy.Correction`.
        candidate_kind: ``"head"`` or ``"support"``, the kind of ``candidate_ids`` / ``candidate_logprobs``.
        aggregation: ``"token_mean"`` (count = trained tokens) or ``"seq_mean_token_mean"`` /
            ``"seq_mean_token_sum"`` (count = sequences; needs ``seq_ids``), or ``"constant"`` (Dr. GRPO: the sum
            of all token losses over ``global sequences x max_tokens``; count = sequences, needs ``seq_ids`` and
            ``max_tokens``).
        max_tokens: the per-sequence token budget of ``aggregation="constant"`` (typically the maximum response
            length), fixed across steps.
        temperature: sampling temperature when the batch has no ``temperature`` tensor.
        vocab_size: the real (unpadded) vocabulary; columns at or beyond it are left out of the softmax. None:
            every column is real.
        logits_layout: ``"bsv"`` (``GPTModel`` with ``labels=None``: ``[b, s, V/tp]``), ``"sbv"`` (an output
            layer: ``[s, b, V/tp]``) or ``"flat"`` (``[b * s, V/tp]`` in ``[b, s]`` order).
        tp_group, cp_group, dp_group: tensor-parallel (vocabulary), context-parallel and data-parallel (with
            context parallel: the group Megatron all-reduces ``count`` over) groups; unset ones come from
            ``megatron.core.parallel_state`` when it is initialised (and ``use_parallel_state``).
        reduce_metrics: all-reduce the metrics over ``dp_group`` (two small collectives per micro-batch);
            otherwise they are this rank's.
        num_groups: report per sampler group ``0 .. num_groups - 1`` (needs ``batch["groups"]``).
        max_staleness, current_version: report per staleness ``current_version - version`` in
            ``0 .. max_staleness`` (needs ``batch["versions"]``; the trainer's version is given, not inferred,
            because ranks see different batches).
        config: Megatron's ``TransformerConfig``, optional: checked for ``calculate_per_token_loss``.
        csr_candidates: the candidate record as :class:`~offpolicy.CSRCandidates` over the ``b * s`` tokens in
            ``[b, s]`` order (instead of ``batch["candidate_ids"]`` / ``["candidate_logprobs"]``; its own kind),
            read by the loss without padding.
        policy_loss_kwargs: passed on to :func:`offpolicy.policy_loss` (``backend``, ``inplace_grad``, ...).

    Returns:
        ``loss_func(output_tensor) -> (loss, count, report)``: ``loss`` a differentiable scalar (the sum),
        ``count`` an int tensor, ``report`` a dict of detached tensors (see the module docstring).
    """
    if config is not None and not getattr(config, "calculate_per_token_loss", False):
        raise ValueError(
            "config.calculate_per_token_loss must be True: this loss_func returns a sum and a count, and without "
            "the per-token path Megatron would divide each micro-batch by its own count (a mean of means)"
        )
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS} under Megatron, got {aggregation!r}")
    if logits_layout not in ("bsv", "sbv", "flat"):
        raise ValueError(f"logits_layout must be 'bsv', 'sbv' or 'flat', got {logits_layout!r}")
    for key in ("num_loss_tokens", "num_sequences", "tp_group", "vocab_start", "cp_group", "candidates"):
        if key in policy_loss_kwargs:
            raise ValueError(f"{key} is set by the adapter; it cannot be passed through")
    missing = [k for k in _REQUIRED if k not in batch]
    if missing:
        raise ValueError(f"batch is missing {missing}; expected keys {sorted(BATCH_KEYS)}")
    unknown = sorted(set(batch) - set(BATCH_KEYS))
    if unknown:
        raise ValueError(f"batch has unknown keys {unknown}; expected keys among {sorted(BATCH_KEYS)}")
    labels = batch["labels"]
    if not isinstance(labels, Tensor):
        raise TypeError(f"batch['labels'] must be a tensor, got {type(labels).__name__}")
    if labels.dim() != 2:
        raise ValueError(f"batch['labels'] must be [b, s], got {tuple(labels.shape)}")
    b, s = labels.shape
    for key, x in batch.items():
        if not isinstance(x, Tensor):
            raise TypeError(f"batch[{key!r}] must be a tensor, got {type(x).__name__}")
        per_candidate = key.startswith("candidate_")
        if tuple(x.shape[:2]) != (b, s) or x.dim() != (3 if per_candidate else 2):
            raise ValueError(f"batch[{key!r}] must be {'[b, s, K]' if per_candidate else '[b, s]'} with "
                             f"[b, s] = [{b}, {s}] (the labels' shape), got {tuple(x.shape)}")
    mask_in = batch["loss_mask"]
    if mask_in.dtype != torch.bool and bool(((mask_in != 0) & (mask_in != 1)).any()):
        raise ValueError("batch['loss_mask'] must be bool (or hold only 0 and 1); a 2 is not 'trained'")
    if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int)
                                   or vocab_size <= 0):
        raise ValueError(f"vocab_size must be an int > 0 (the real vocabulary), got {vocab_size!r}")
    if ("candidate_ids" in batch) != ("candidate_logprobs" in batch):
        raise ValueError("batch['candidate_ids'] and batch['candidate_logprobs'] go together")
    if aggregation != "token_mean" and "seq_ids" not in batch:
        raise ValueError(f"aggregation={aggregation!r} needs batch['seq_ids']")
    if (aggregation == "constant") != (max_tokens is not None):
        raise ValueError("max_tokens goes with aggregation='constant' (and only with it): Dr. GRPO's normaliser is "
                         "global sequences x max_tokens")
    if max_tokens is not None and not (isinstance(max_tokens, (int, float)) and 0 < max_tokens < float("inf")):
        raise ValueError(f"max_tokens must be a finite number > 0, got {max_tokens!r}")
    # Megatron divides the gradient by the all-reduced count (sequences): Dr. GRPO's constant is that count
    # times max_tokens, so the loss is the per-sequence token sum scaled by 1 / max_tokens.
    inner = "seq_mean_token_sum" if aggregation == "constant" else aggregation
    buckets = _bucket_spec(batch, num_groups, max_staleness, current_version)
    tp_group, cp_group, dp_group = _default_groups(tp_group, cp_group, dp_group, use_parallel_state)
    if csr_candidates is not None:
        if not isinstance(csr_candidates, CSRCandidates):
            raise TypeError(f"csr_candidates must be an offpolicy.CSRCandidates, got {type(csr_candidates).__name__}")
        if "candidate_ids" in batch:
            raise ValueError("pass the record once: batch['candidate_ids'] or csr_candidates, not both")
        if csr_candidates.num_rows != b * s:
            raise ValueError(f"csr_candidates must hold b * s = {b * s} rows (one per token), got "
                             f"{csr_candidates.num_rows}")

    def loss_func(output_tensor: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        logits, order = _flatten_logits(output_tensor, b, s, logits_layout)
        v_local = logits.shape[1]
        start = _rank(tp_group) * v_local
        if vocab_size is not None and vocab_size > _world(tp_group) * v_local:
            raise ValueError(f"vocab_size={vocab_size} is wider than the logits: {_world(tp_group)} vocabulary "
                             f"shard(s) of {v_local} columns hold {_world(tp_group) * v_local}")
        if vocab_size is not None:
            real = max(0, min(v_local, vocab_size - start))  # a rank may hold padding only (zero real columns)
            if real < v_local:
                logits = logits[:, :real]
        flat = {k: _flat_tokens(v, order) for k, v in batch.items()}
        cands = None
        if "candidate_ids" in flat:
            cands = Candidates(flat["candidate_ids"], flat["candidate_logprobs"], candidate_kind)
        elif csr_candidates is not None:
            cands = csr_candidates if order is None else csr_candidates.take_rows(order)
        mask = flat["loss_mask"].to(torch.bool)
        seq_ids = flat.get("seq_ids")
        out = policy_loss(
            logits, flat["labels"], flat["sampler_logprobs"], flat["advantages"], candidates=cands,
            loss_mask=mask, temperature=flat.get("temperature", temperature), correction=correction,
            seq_ids=seq_ids, aggregation=inner, num_loss_tokens=1.0, num_sequences=float(max_tokens or 1.0),
            tp_group=tp_group, vocab_start=start, cp_group=cp_group,
            proximal_logprobs=flat.get("proximal_logprobs"), **policy_loss_kwargs,
        )
        if aggregation == "token_mean":
            count = mask.sum()
        else:
            seqs = Segments.from_ids(seq_ids, mask, cp_group).has_active().sum()
            count = seqs if _rank(cp_group) == 0 else torch.zeros_like(seqs)
        count = count.to(torch.int)
        selections = _buckets(buckets, flat, mask, policy_loss_kwargs.get("validate", True))
        report = _report(out, mask, count, dp_group if reduce_metrics else None, selections, correction)
        return out.loss, count, report

    return loss_func


def _flatten_logits(x: Tensor, b: int, s: int, layout: str) -> tuple[Tensor, Tensor | None]:
    """``[N, V_local]`` rows and, for ``sbv``, the permutation taking ``[b, s]``-ordered tokens to its rows."""
    if layout == "flat":
        if x.dim() != 2 or x.shape[0] != b * s:
            raise ValueError(f"logits: expected [b * s, V/tp] = [{b * s}, V/tp], got {tuple(x.shape)}")
        return x, None
    want = (b, s) if layout == "bsv" else (s, b)
    if x.dim() != 3 or tuple(x.shape[:2]) != want:
        raise ValueError(f"logits: expected layout {layout!r} [{want[0]}, {want[1]}, V/tp], got {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError("logits must be contiguous (Megatron's output layer and GPTModel return contiguous logits)")
    rows = x.view(b * s, x.shape[2])
    if layout == "bsv":
        return rows, None
    return rows, torch.arange(b * s, device=x.device).view(b, s).t().reshape(-1)


def _flat_tokens(x: Tensor, order: Tensor | None) -> Tensor:
    """``[b, s, ...]`` -> ``[b * s, ...]`` in the logits' row order."""
    flat = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    return flat if order is None else flat[order]


def _bucket_spec(batch: Mapping[str, Tensor], num_groups: int | None, max_staleness: int | None,
                 current_version: int | None) -> tuple[int | None, int | None, int | None]:
    """Validate the per-group / per-staleness options against the batch."""
    if num_groups is not None:
        if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1:
            raise ValueError(f"num_groups must be a positive int, got {num_groups!r}")
        if "groups" not in batch:
            raise ValueError("num_groups needs batch['groups'] (the sampler group of each token)")
    elif "groups" in batch:
        raise ValueError("batch['groups'] needs num_groups= (the report's keys must be the same on every rank)")
    if max_staleness is not None:
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(f"max_staleness must be an int >= 0, got {max_staleness!r}")
        if current_version is None or "versions" not in batch:
            raise ValueError("max_staleness needs current_version= and batch['versions']")
    elif "versions" in batch:
        raise ValueError("batch['versions'] needs max_staleness= and current_version= (the report's keys must be "
                         "the same on every rank)")
    return num_groups, max_staleness, current_version


def _buckets(spec: tuple[int | None, int | None, int | None], flat: Mapping[str, Tensor], mask: Tensor,
             validate: bool) -> list[tuple[str, Tensor]]:
    """``(key prefix, [N] bool selection of trained tokens)`` for every sampler group and staleness bucket
    (``validate``: check the ranges, one host sync each)."""
    num_groups, max_staleness, now = spec
    out = []
    if num_groups is not None:
        groups = flat["groups"]
        bad = mask & ((groups < 0) | (groups >= num_groups))
        if validate and bool(bad.any()):
            raise ValueError(f"batch['groups'] must lie in [0, {num_groups}) on trained tokens, got "
                             f"{int(groups[bad][0])}")
        out += [(f"group/{g}", mask & (groups == g)) for g in range(num_groups)]
    if max_staleness is not None:
        age = now - flat["versions"]
        if validate and bool((mask & (age < 0)).any()):
            raise ValueError(f"batch['versions'] must be <= current_version={now} on trained tokens, got "
                             f"{int(flat['versions'][mask & (age < 0)][0])}")
        out += [(f"staleness/{a}", mask & (age == a)) for a in range(max_staleness)]
        out.append((f"staleness/{max_staleness}", mask & (age >= max_staleness)))
    return out


def _report(out, mask: Tensor, count: Tensor, group, buckets: list[tuple[str, Tensor]],
            corr: Correction) -> dict[str, Tensor]:
    """Metrics reduced over ``group`` (or local): token means as ``[sum, count]``, extrema and ESS as ``[1]``;
    the same per bucket (sampler group, staleness) under its key prefix."""
    m = out.metrics
    n = mask.sum().to(torch.float64)
    w = torch.where(mask, out.token_weight, torch.zeros_like(out.token_weight)).double()
    means = [k for k in _MEAN_KEYS if k in m]
    parts = [out.loss.detach().double().reshape(()), count.double(), n, w.sum(), (w * w).sum()]
    parts += [m[k].double() * n for k in means]
    ext_parts = [m[k].double() for k in _MAX_KEYS] + [-m[k].double() for k in _MIN_KEYS]
    has = [n]
    lr = out.log_ratio.detach().double().clamp(-corr.max_log_ratio, corr.max_log_ratio)
    for _, sel in buckets:
        st = token_stats(out.token_view._replace(lr=lr, w=w), sel, corr.tree)
        nb = st["num_tokens"]
        wb = torch.where(sel, w, torch.zeros_like(w))
        parts += [nb, wb.sum(), (wb * wb).sum()] + [st[k] * nb for k in _BUCKET_MEAN_KEYS]
        ext_parts += [st[k] for k in _MAX_KEYS] + [-st[k] for k in _MIN_KEYS]
        has.append(nb)
    sums = torch.stack(parts)
    per = len(_MAX_KEYS) + len(_MIN_KEYS)
    extrema = torch.stack(ext_parts)
    # A rank without trained tokens (in a bucket) reports 0 for its extrema; it must not win a MAX / MIN.
    present = torch.stack(has).repeat_interleave(per) > 0
    extrema = torch.where(present, extrema, torch.full_like(extrema, float("-inf")))
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(extrema, op=dist.ReduceOp.MAX, group=group)
    loss_sum, cnt, n_all, w_sum, w_sq = sums[:5]
    extrema = torch.where(torch.isfinite(extrema), extrema, torch.zeros_like(extrema))
    report = {"policy loss": torch.stack([loss_sum, cnt]).float(), "num_tokens": n_all.float().reshape(1)}
    for i, k in enumerate(means):
        report[k] = torch.stack([sums[5 + i], n_all]).float()
    for i, k in enumerate(_MAX_KEYS):
        report[k] = extrema[i].float().reshape(1)
    for i, k in enumerate(_MIN_KEYS):
        report[k] = (-extrema[len(_MAX_KEYS) + i]).float().reshape(1)
    report["ess"] = _ess(w_sum, w_sq, n_all)
    at, ext_at = 5 + len(means), per
    for prefix, _ in buckets:
        nb, wb_sum, wb_sq = sums[at:at + 3]
        report[f"{prefix}/num_tokens"] = nb.float().reshape(1)
        report[f"{prefix}/share_tokens"] = torch.stack([nb, n_all]).float()
        for i, k in enumerate(_BUCKET_MEAN_KEYS):
            report[f"{prefix}/{k}"] = torch.stack([sums[at + 3 + i], nb]).float()
        for i, k in enumerate(_MAX_KEYS):
            report[f"{prefix}/{k}"] = extrema[ext_at + i].float().reshape(1)
        for i, k in enumerate(_MIN_KEYS):
            report[f"{prefix}/{k}"] = (-extrema[ext_at + len(_MAX_KEYS) + i]).float().reshape(1)
        report[f"{prefix}/ess"] = _ess(wb_sum, wb_sq, nb)
        at, ext_at = at + 3 + len(_BUCKET_MEAN_KEYS), ext_at + per
    return report


def _ess(w_sum: Tensor, w_sq: Tensor, n: Tensor) -> Tensor:
    """``[1]`` effective sample size ``(sum w)^2 / (n sum w^2)`` (0 without weight)."""
    return torch.where(w_sq > 0, w_sum * w_sum / (n.clamp_min(1) * w_sq), torch.zeros_like(w_sq)).float().reshape(1)
