"""slime (and Miles, its fork, same contract): offpolicy's loss as a ``custom_loss``, and a weights-only TIS hook.

    --loss-type custom_loss --custom-loss-function-path offpolicy.adapters.slime.policy_loss
    --custom-tis-function-path offpolicy.adapters.slime.tis_function      # weights only, slime's own PPO loss

slime calls ``policy_loss(args, batch, logits, sum_of_sample_mean) -> (loss, metrics)`` per micro-batch with

* ``logits``: ``[1, T, V / TP]`` fp32, the packed micro-batch (samples concatenated, each ``total_length`` long;
  under context parallelism each sample's ``2 cp`` zigzag chunks of ``ceil(total / 2cp)`` rows, this rank's two),
  vocabulary-parallel over tensor-parallel ranks, *not* divided by ``args.rollout_temperature``;
* per-sample lists in ``batch``: ``unconcat_tokens`` (prompt + response), ``total_lengths``, ``response_lengths``,
  ``loss_masks`` (full response length), ``advantages``, ``log_probs`` (the recomputed proximal policy),
  ``rollout_log_probs`` (the sampler's ``lq``; these three either full response length or this CP rank's share);
  ``rollout_top_p_token_ids`` / ``rollout_top_p_token_offsets`` (per sample, CSR over the response: the realised
  top-p support) when ``args.rollout_top_p < 1``; optionally ``rollout_top_p_token_logprobs`` (the same CSR layout:
  the sampler's renormalised ``log q`` over the support, needed for score centering) or a head record
  ``rollout_head_token_ids`` / ``rollout_head_token_logprobs`` (per sample ``[R, K]``, via
  ``--custom-rollout-data-keys``).

The loss is built on :func:`offpolicy.adapters.megatron.make_loss_func` over all ``T`` rows of the packed logits
(prompt and padding rows masked: no row gather, no ``[N, V]`` copy; the support record as slime ships it, in CSR,
never padded), with the tensor- and context-parallel groups
from ``megatron.core.parallel_state``. It returns what slime's reducer would: ``sum_of_sample_mean`` semantics
(the sum over this rank's samples of each sample's token-loss sum over its whole-sequence token count; slime
then scales by ``num_microbatches / global_batch_size * dp``), or with ``args.calculate_per_token_loss`` the token
sum (slime divides by the all-reduced token count).

slime records the support's ids only. Without ``rollout_top_p_token_logprobs`` the record's ``log q`` entries
are the uniform ``-log |S_t|``: they enter nothing but score centering, which therefore requires the logprobs key.

The :class:`~offpolicy.Correction` comes from ``args.offpolicy_correction`` (a Correction, or a dict of its
fields, e.g. set by a ``--custom-config-path`` YAML), default token MIS ``[0.5, 5]`` with decoupled PPO at
``(args.eps_clip, args.eps_clip_high)`` on ``batch["log_probs"]``.

Guards (:mod:`offpolicy.adapters.guard`): a filter with no support to replay is an error, ``--rollout-top-k > 0``
without the support keys in ``policy_loss``, and ``--rollout-top-p < 1`` or ``--rollout-top-k > 0`` in the TIS hook
(slime's loss is over the full vocabulary: every weight would be off by ``-log P(S_t)``). On every micro-batch
(warned once, ``offpolicy/guard/<code>`` in the metrics): trained ``rollout_log_probs`` above 0 or NaN are an error,
exactly 0 on 32 trained tokens in a row warn (``sampler_logprobs_zero``), and, where no support is replayed, above the
trainer's (``batch["log_probs"]``, or the hook's ``train_log_probs``) on almost every token warn
(``narrower_sampler``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from offpolicy.adapters.guard import Guard, check_sampler_logprobs
from offpolicy.adapters.megatron import make_loss_func
from offpolicy.corrections.correction import Correction
from offpolicy.loss.logprobs import policy_loss_from_logprobs
from offpolicy.records.candidates import Candidates
from offpolicy.records.csr_candidates import CSRCandidates

SUPPORT_KEYS = ("rollout_top_p_token_ids", "rollout_top_p_token_offsets")
SUPPORT_LOGPROBS_KEY = "rollout_top_p_token_logprobs"
HEAD_KEYS = ("rollout_head_token_ids", "rollout_head_token_logprobs")
#: One guard per process (slime calls the loss per micro-batch).
GUARD = Guard([])


def _parallel():
    """``(tp_group, tp_size, cp_group, cp_size, cp_rank)`` from megatron's parallel_state when initialised."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is None or not ps.model_parallel_is_initialized():
        return None, 1, None, 1, 0
    tp = ps.get_tensor_model_parallel_world_size()
    cp = ps.get_context_parallel_world_size()
    return (ps.get_tensor_model_parallel_group() if tp > 1 else None, tp,
            ps.get_context_parallel_group() if cp > 1 else None, cp,
            ps.get_context_parallel_rank() if cp > 1 else 0)


def response_rows(total_length: int, response_length: int, cp_size: int, cp_rank: int) -> tuple[Tensor, Tensor, int]:
    """Where one sample's response lives in this rank's packed logits.

    Logits row ``j`` predicts token ``j + 1``, so response token ``r`` (sequence position ``P + r``, ``P`` the prompt
    length) is scored by row ``P + r - 1``. Under context parallelism (slime's ``thd`` zigzag) the sample's
    ``2 cp`` chunks of ``c = ceil(total / 2cp)`` rows are split so that this rank holds chunks ``cp_rank`` and
    ``2 cp - 1 - cp_rank``, in that order.

    Returns:
        ``(rows [n], resp [n], block)``: int64 local rows (relative to the sample's first local row) and the
        response index each scores, in slime's local order; ``block`` the rows the sample occupies on this rank.
    """
    prompt = total_length - response_length
    if prompt < 1:
        raise ValueError(f"a sample needs a prompt of at least one token (total {total_length}, response "
                         f"{response_length})")
    if cp_size == 1:
        resp = torch.arange(response_length)
        return resp + prompt - 1, resp, total_length
    c = -(-total_length // (2 * cp_size))
    rows, resp = [], []
    for local_base, chunk in ((0, cp_rank), (c, 2 * cp_size - 1 - cp_rank)):
        lo, hi = max(chunk * c, prompt - 1), min((chunk + 1) * c, total_length - 1)
        if lo < hi:
            pos = torch.arange(lo, hi)
            rows.append(local_base + pos - chunk * c)
            resp.append(pos - (prompt - 1))
    if not rows:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), 2 * c
    return torch.cat(rows), torch.cat(resp), 2 * c


def correction_from_args(args) -> Correction:
    """The :class:`~offpolicy.Correction` named by ``args.offpolicy_correction`` (see the module docstring)."""
    spec = getattr(args, "offpolicy_correction", None)
    if spec is None:
        return Correction(weights="mis", bounds=(0.5, 5.0),
                          ppo_clip=(float(args.eps_clip), float(getattr(args, "eps_clip_high", None) or args.eps_clip)))
    if isinstance(spec, Correction):
        return spec
    if isinstance(spec, Mapping):
        fields = dict(spec)
        for key in ("bounds", "ppo_clip"):
            if isinstance(fields.get(key), list):
                fields[key] = tuple(fields[key])
        return Correction(**fields)
    raise TypeError("args.offpolicy_correction must be a Correction or a dict of its fields, got "
                    f"{type(spec).__name__}")


def _per_sample(x, name: str, i: int, resp: Tensor, response_length: int, device) -> Tensor:
    """Sample ``i``'s values of ``name`` at this rank's response indices (full length or already CP-local)."""
    x = torch.as_tensor(x, device=device)
    if x.dim() < 1:
        raise ValueError(f"batch[{name!r}][{i}] must be a per-token tensor, got a scalar")
    if x.shape[0] == response_length:
        return x[resp.to(device)]
    if x.shape[0] == resp.numel():
        return x
    raise ValueError(f"batch[{name!r}][{i}] holds {x.shape[0]} tokens; expected the response length "
                     f"{response_length} or this CP rank's share {resp.numel()}")


def _support_rows(batch, i: int, resp: Tensor, response_length: int, device) -> CSRCandidates:
    """Sample ``i``'s support record at this rank's response tokens ``resp``, in CSR as slime ships it."""
    ids = torch.as_tensor(batch[SUPPORT_KEYS[0]][i], device=device).long()
    offsets = torch.as_tensor(batch[SUPPORT_KEYS[1]][i], device=device).long()
    if offsets.numel() != response_length + 1:
        raise ValueError(f"batch['rollout_top_p_token_offsets'][{i}] must hold response_length + 1 = "
                         f"{response_length + 1} entries, got {offsets.numel()}")
    if SUPPORT_LOGPROBS_KEY in batch:
        lq = torch.as_tensor(batch[SUPPORT_LOGPROBS_KEY][i], device=device).float()
    else:
        sizes = (offsets[1:] - offsets[:-1]).clamp_min(1).float()
        lq = torch.repeat_interleave(-torch.log(sizes), offsets[1:] - offsets[:-1])
    if ids.dim() != 1 or lq.shape != ids.shape or offsets.dim() != 1:
        raise ValueError(f"batch{list(SUPPORT_KEYS)}[{i}] must be 1-D CSR (ids [nnz], offsets [R + 1]) with the "
                         f"log-probs aligned with the ids, got {tuple(ids.shape)}, {tuple(offsets.shape)} and "
                         f"{tuple(lq.shape)}")
    full = CSRCandidates(ids, offsets, lq, kind="support")
    full.check_offsets()
    return full.take_rows(resp)


def _head_rows(batch, i: int, resp: Tensor, response_length: int, device) -> Candidates:
    ids = _per_sample(batch[HEAD_KEYS[0]][i], HEAD_KEYS[0], i, resp, response_length, device).long()
    lq = _per_sample(batch[HEAD_KEYS[1]][i], HEAD_KEYS[1], i, resp, response_length, device).float()
    return Candidates(ids, lq, kind="head")


def megatron_batch(args, batch: Mapping[str, Any], t: int, device, cp_size: int = 1,
                   cp_rank: int = 0, csr: bool = False) -> tuple[dict[str, Tensor], str | None]:
    """slime's per-sample micro-batch as the Megatron adapter's ``[1, T]`` dict over all ``T`` local rows.

    Returns ``(batch_dict, candidate_kind or None)``; prompt and padding rows carry ``loss_mask`` False. With
    ``csr`` (what :func:`policy_loss` asks for) a support record is returned as ``batch_dict["candidates"]``, a
    :class:`~offpolicy.CSRCandidates` over the ``T`` rows (prompt and padding rows empty), never padded;
    otherwise (and for head records) it is padded to ``[1, T, K]`` under ``candidate_ids`` /
    ``candidate_logprobs``.
    """
    required = ("unconcat_tokens", "total_lengths", "response_lengths", "loss_masks", "advantages",
                "rollout_log_probs")
    missing = [k for k in required if k not in batch]
    if missing:
        raise ValueError(f"batch is missing {missing} (slime's per-sample lists)")
    n = len(batch["total_lengths"])
    top_p = float(getattr(args, "rollout_top_p", 1.0))
    kind = None
    if top_p < 1.0 or all(k in batch for k in SUPPORT_KEYS):
        if not all(k in batch for k in SUPPORT_KEYS):
            raise ValueError(f"args.rollout_top_p={top_p} < 1 needs batch{list(SUPPORT_KEYS)} (the realised "
                             "support) for mask replay")
        kind = "support"
    elif int(getattr(args, "rollout_top_k", -1) or -1) > 0:
        raise ValueError(f"args.rollout_top_k={args.rollout_top_k} filters the sampler but the batch holds no "
                         f"support record {list(SUPPORT_KEYS)} to replay: every ratio would be off by -log P(S_t); "
                         "sample with --rollout-top-k -1 (or record the realised support under those keys)")
    elif all(k in batch for k in HEAD_KEYS):
        kind = "head"
    labels = torch.zeros(t, dtype=torch.long, device=device)
    lq = torch.zeros(t, dtype=torch.float32, device=device)
    adv = torch.zeros(t, dtype=torch.float32, device=device)
    mask = torch.zeros(t, dtype=torch.bool, device=device)
    seq = torch.full((t,), n, dtype=torch.long, device=device)
    prox = torch.zeros(t, dtype=torch.float32, device=device) if "log_probs" in batch else None
    cand_rows: list[tuple[Tensor, Candidates | CSRCandidates]] = []
    start = 0
    for i in range(n):
        total, length = int(batch["total_lengths"][i]), int(batch["response_lengths"][i])
        rows, resp, block = response_rows(total, length, cp_size, cp_rank)
        if start + block > t:
            raise ValueError(f"the samples need {start + block} local logits rows, the logits hold {t}")
        tokens = torch.as_tensor(batch["unconcat_tokens"][i], device=device)
        if tokens.numel() != total:
            raise ValueError(f"batch['unconcat_tokens'][{i}] holds {tokens.numel()} tokens, total_lengths says {total}")
        full_mask = torch.as_tensor(batch["loss_masks"][i], device=device)
        if full_mask.numel() != length:
            raise ValueError(f"batch['loss_masks'][{i}] must be the full response length {length}, got "
                             f"{full_mask.numel()}")
        at = rows.to(device) + start
        labels[at] = tokens[total - length:][resp.to(device)].long()
        mask[at] = full_mask[resp.to(device)].bool()
        lq[at] = _per_sample(batch["rollout_log_probs"][i], "rollout_log_probs", i, resp, length, device).float()
        adv[at] = _per_sample(batch["advantages"][i], "advantages", i, resp, length, device).float()
        if prox is not None:
            prox[at] = _per_sample(batch["log_probs"][i], "log_probs", i, resp, length, device).float()
        seq[at] = i
        if kind == "support":
            cand_rows.append((at, _support_rows(batch, i, resp, length, device)))
        elif kind == "head":
            cand_rows.append((at, _head_rows(batch, i, resp, length, device)))
        start += block
    out = {"labels": labels, "sampler_logprobs": lq, "advantages": adv, "loss_mask": mask, "seq_ids": seq}
    if prox is not None:
        out["proximal_logprobs"] = prox
    record = None
    if kind == "support":
        record = _rows_at(cand_rows, t, device)
    if kind == "support" and not csr:
        record = record.to_padded(width=max(1, int(record.lengths.max()) if t else 1))
        out["candidate_ids"], out["candidate_logprobs"] = record.ids, record.logprobs
    elif kind is not None and not csr:
        width = max([c.width for _, c in cand_rows] + [1])
        ids = torch.full((t, width), -1, dtype=torch.long, device=device)
        vals = torch.full((t, width), float("-inf"), dtype=torch.float32, device=device)
        for at, c in cand_rows:
            ids[at, :c.width] = c.ids
            vals[at, :c.width] = c.logprobs
        out["candidate_ids"], out["candidate_logprobs"] = ids, vals
    mb = {k: v.unsqueeze(0) for k, v in out.items()}
    if kind == "support" and csr:
        mb["candidates"] = record
    return mb, kind


def _rows_at(cand_rows: list[tuple[Tensor, CSRCandidates]], t: int, device) -> CSRCandidates:
    """One CSR record over the ``t`` local rows from each sample's ``(rows, record)``: row ``rows[j]`` gets the
    sample's row ``j``; rows of no response are empty."""
    # The samples' rows one after another, then one empty row (index m) for the rows of no response.
    empty = CSRCandidates(torch.zeros(0, dtype=torch.int64, device=device),
                          torch.zeros(2, dtype=torch.int64, device=device),
                          torch.zeros(0, dtype=torch.float32, device=device), "support")
    m = sum(c.num_rows for _, c in cand_rows)
    src = torch.full((t,), m, dtype=torch.int64, device=device)
    if cand_rows:
        src[torch.cat([at for at, _ in cand_rows])] = torch.arange(m, device=device)
    return CSRCandidates.cat([c for _, c in cand_rows] + [empty]).take_rows(src)


def policy_loss(args, batch: Mapping[str, Any], logits: Tensor,
                sum_of_sample_mean: Callable[[Tensor], Tensor] | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """slime's ``custom_loss`` contract (see the module docstring).

    Args:
        args: slime's argparse namespace (``rollout_temperature``, ``rollout_top_p``, ``calculate_per_token_loss``,
            ``eps_clip`` / ``eps_clip_high``, optional ``offpolicy_correction`` and ``vocab_size``).
        batch: slime's micro-batch (per-sample lists).
        logits: ``[1, T, V / TP]`` fp32 packed logits (this TP and CP rank's share), before temperature.
        sum_of_sample_mean: slime's reducer; unused (the loss reproduces its semantics, including context
            parallelism, through the Megatron adapter's sequence aggregation).

    Returns:
        ``(loss, metrics)``: ``loss`` a differentiable scalar, ``metrics`` detached scalar tensors
        (``offpolicy/<name>``, this rank's).
    """
    del sum_of_sample_mean
    if logits.dim() != 3 or logits.shape[0] != 1:
        raise ValueError(f"logits must be slime's packed [1, T, V/TP], got {tuple(logits.shape)}")
    correction = correction_from_args(args)
    tp_group, _, cp_group, cp_size, cp_rank = _parallel()
    # The support goes to the loss as slime ships it, in CSR (never padded).
    mb, kind = megatron_batch(args, batch, logits.shape[1], logits.device, cp_size, cp_rank, csr=True)
    csr_record = mb.pop("candidates", None)
    flags = check_sampler_logprobs(GUARD, mb["sampler_logprobs"], mb["loss_mask"], name="batch['rollout_log_probs']",
                                   trainer_logprobs=mb.get("proximal_logprobs") if kind != "support" else None)
    if correction.ppo_clip is None:
        mb.pop("proximal_logprobs", None)
    elif "proximal_logprobs" not in mb:
        raise ValueError("Correction.ppo_clip needs batch['log_probs'] (the recomputed proximal policy)")
    per_token = bool(getattr(args, "calculate_per_token_loss", False))
    loss_func = make_loss_func(
        mb, correction=correction, candidate_kind=kind or "head",
        aggregation="token_mean" if per_token else "seq_mean_token_mean",
        temperature=float(getattr(args, "rollout_temperature", 1.0)), vocab_size=getattr(args, "vocab_size", None),
        logits_layout="bsv", tp_group=tp_group, cp_group=cp_group, use_parallel_state=False, reduce_metrics=False,
        csr_candidates=csr_record,
    )
    loss, _count, report = loss_func(logits)
    metrics = {}
    for name, value in report.items():
        v = value.detach().float().reshape(-1)
        metrics[f"offpolicy/{name}"] = v[0] / v[1].clamp_min(1) if v.numel() == 2 else v[0]
    metrics.update({f"offpolicy/{k}": torch.tensor(v, device=logits.device) for k, v in flags.items()})
    return loss, metrics


def tis_function(args, pg_loss: Tensor, train_log_probs: Sequence[Tensor], rollout_log_probs: Sequence[Tensor],
                 loss_masks: Sequence[Tensor], total_lengths: Sequence[int], response_lengths: Sequence[int],
                 **_: Any) -> tuple[Tensor, list[Tensor], dict[str, Tensor]]:
    """slime's ``--custom-tis-function-path`` hook: offpolicy's importance weights on slime's own PPO loss.

    The weight of each token is :class:`~offpolicy.Correction`'s ``w`` (token, sequence or geometric level,
    truncation or masking, veto, KL rejection) of ``r = pi_old / q`` from ``train_log_probs`` (slime's recomputed
    log-probs, this CP rank's share) and ``rollout_log_probs``; rejected tokens get weight 0. The masks are returned
    unchanged: rejected tokens stay in the denominators, as in :func:`offpolicy.policy_loss`.

    Returns:
        ``(pg_loss * w, loss_masks, metrics)`` with ``pg_loss`` ``[sum of local response tokens]``.
    """
    correction = correction_from_args(args)
    if correction.ppo_clip is not None or correction.score_centering or correction.opsm_delta is not None:
        raise ValueError("the TIS hook applies weights only: ppo_clip, score_centering and opsm_delta (which needs "
                         "advantages) belong to the full loss (offpolicy.adapters.slime.policy_loss)")
    top_p, top_k = float(getattr(args, "rollout_top_p", 1.0)), int(getattr(args, "rollout_top_k", -1) or -1)
    if top_p < 1.0 or top_k > 0:
        raise ValueError(f"the TIS hook weights slime's full-vocabulary log-probs, which cannot replay the sampler's "
                         f"filter (rollout_top_p={top_p}, rollout_top_k={top_k}): every weight would be off by "
                         "-log P(S_t); use the full loss (--loss-type custom_loss --custom-loss-function-path "
                         "offpolicy.adapters.slime.policy_loss) with the support record, or sample unfiltered")
    _, _, cp_group, cp_size, cp_rank = _parallel()
    device = pg_loss.device
    logp, lq, mask, seq = [], [], [], []
    for i, (total, length) in enumerate(zip(total_lengths, response_lengths)):
        _, resp, _ = response_rows(int(total), int(length), cp_size, cp_rank)
        logp.append(_per_sample(train_log_probs[i], "train_log_probs", i, resp, int(length), device).float())
        lq.append(_per_sample(rollout_log_probs[i], "rollout_log_probs", i, resp, int(length), device).float())
        mask.append(torch.as_tensor(loss_masks[i], device=device)[resp.to(device)].bool())
        seq.append(torch.full((resp.numel(),), i, dtype=torch.long, device=device))
    flat_mask = torch.cat(mask)
    if flat_mask.numel() != pg_loss.numel():
        raise ValueError(f"pg_loss holds {pg_loss.numel()} tokens; the samples' local responses {flat_mask.numel()}")
    out = policy_loss_from_logprobs(
        torch.cat(logp).detach(), torch.cat(lq), torch.ones_like(flat_mask, dtype=torch.float32), loss_mask=flat_mask,
        correction=correction, seq_ids=torch.cat(seq), cp_group=cp_group,
    )
    metrics = {f"offpolicy/{k}": v.detach() for k, v in out.metrics.items()}
    flags = check_sampler_logprobs(GUARD, torch.cat(lq), flat_mask, name="rollout_log_probs",
                                   trainer_logprobs=torch.cat(logp))
    metrics.update({f"offpolicy/{k}": torch.tensor(v, device=device) for k, v in flags.items()})
    return pg_loss * out.token_weight.to(pg_loss.dtype), list(loss_masks), metrics


__all__ = ["GUARD", "correction_from_args", "megatron_batch", "policy_loss", "response_rows", "tis_function"]
