"""The loss math on per-token log-probabilities: ``policy_loss_from_logprobs``.

Everything of docs/spec.md (#weights to #metrics) that follows the log-softmax, in ``O(N K)`` plain torch:
importance weights (token, sequence, geometric), rejections, batch normalisation, decoupled PPO, score centering,
aggregation and metrics. :func:`offpolicy.policy_loss` computes the log-probabilities from logits (or hidden
states) with the sparse log-softmax primitive and lands here; trainers that already compute per-token
log-probabilities with their own kernels (verl, TRL, OpenRLHF style) call this entry point directly.

Per-token loss (docs/spec.md#score-centering), ``sg`` = stop-gradient:

    loss_t = -A_t * ( w_t log p(y_t) - sum_{v in H_t} sg(c_t(v)) log p(v) )

with ``w_t = sg(f(r_t))`` (or the sequence-level weight), and the centering sum present only with score
centering. Decoupled PPO replaces the first term by the clipped surrogate of ``u = p / pi_prox``. A
``kl_penalty`` adds ``coef * k_t`` on every trained token (:mod:`offpolicy.loss.penalty`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from offpolicy.loss.aggregation import aggregate
from offpolicy.records.csr_candidates import CSRCandidates
from offpolicy.loss.centering import Centering, centering_coefficients
from offpolicy.loss.entry_rows import EntryRows, Record
from offpolicy.corrections.correction import Correction
from offpolicy.corrections.tree import CorrectionTree
from offpolicy.loss.metrics import TokenView, policy_metrics, token_view
from offpolicy.loss.penalty import kl_penalty_terms
from offpolicy.loss.segments import Segments
from offpolicy.loss.inputs import Aggregation, TokenData
from offpolicy.ops.library import tracing
from offpolicy.loss.validation import LOGPROB_SLACK, check_batch, check_candidates, check_flag, check_vector
from offpolicy.corrections.rules import RuleInputs
from offpolicy.corrections.weights import (bounded_log_ratio, inside_bounds, mask_drops, sequence_drops,
                                           sequence_keep, token_rejected, token_weight)


@dataclass
class PolicyLossOutput:
    """What :func:`offpolicy.policy_loss` and :func:`policy_loss_from_logprobs` return.

    Attributes:
        loss: scalar, differentiable with respect to the logits (or hidden and weight, or the log-probabilities).
        token_loss: ``[N]`` detached per-token loss (0 on untrained and rejected tokens, but for a
            ``kl_penalty``, which acts on every trained token and is included), before aggregation.
        metrics: dict of detached scalar tensors (see :mod:`offpolicy.loss.metrics`).
        token_weight: ``[N]`` detached importance weight ``w_t`` of each sampled token.
        log_ratio: ``[N]`` detached ``log p(y_t) - lq_t``.
        logprobs: ``[N]`` detached trainer log-probability ``log p(y_t)`` (support-normalised under replay).
        token_view: the detached per-token inputs of the metrics (:class:`~offpolicy.loss.metrics.TokenView`:
            clamped log-ratios, the ratio the bounds act on, weights, ...), for callers that reduce the metrics
            over their own buckets with :func:`~offpolicy.loss.metrics.token_stats`.
    """

    loss: Tensor
    token_loss: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)
    token_weight: Tensor | None = None
    log_ratio: Tensor | None = None
    logprobs: Tensor | None = None
    token_view: TokenView | None = None


def policy_loss_from_logprobs(
    logprobs: Tensor,
    sampler_logprobs: Tensor,
    advantages: Tensor,
    candidates: Record | None = None,
    candidate_logprobs: Tensor | None = None,
    loss_mask: Tensor | None = None,
    correction: Correction = Correction(),
    seq_ids: Tensor | None = None,
    aggregation: str = "token_mean",
    num_loss_tokens: float | Tensor | None = None,
    groups: Tensor | None = None,
    versions: Tensor | None = None,
    *,
    entropy: Tensor | None = None,
    proximal_logprobs: Tensor | None = None,
    num_sequences: float | Tensor | None = None,
    constant_normalizer: float | None = None,
    cp_group=None,
    current_version: int | None = None,
    reference_logprobs: Tensor | None = None,
    segment_ids: Tensor | None = None,
    route_flips: Tensor | None = None,
    validate: bool = True,
) -> PolicyLossOutput:
    """Off-policy-corrected policy-gradient loss from the trainer's per-token log-probabilities.

    Args:
        logprobs: ``[N]`` float ``log p(y_t)``, differentiable: the trainer's log-probability of each sampled token
            at the sampling temperature, renormalised over the replayed support for ``kind="support"`` records
            (the caller's log-softmax does the masking; it cannot be checked without the logits).
        sampler_logprobs: ``[N]`` float ``lq_t``.
        advantages: ``[N]`` float.
        candidates: the sampler's :class:`~offpolicy.Candidates` record (ids and ``log q``), padded or
            :class:`~offpolicy.CSRCandidates`; needed for score centering.
        candidate_logprobs: ``[N, K]`` float, differentiable: the trainer's log-probabilities at
            ``candidates.ids`` (same normalisation as ``logprobs``; any finite value at ``-1`` padding); ``[nnz]``
            for a CSR record. Required with score centering and a record.
        loss_mask, correction, seq_ids, aggregation, num_loss_tokens, groups, versions, proximal_logprobs,
            num_sequences, constant_normalizer, cp_group, current_version, reference_logprobs, segment_ids, route_flips,
            validate: as in
            :func:`offpolicy.policy_loss`.
        entropy: ``[N]`` detached entropy of the trainer's distribution, for the ``entropy`` metric (omitted from
            the metrics when None).

    Returns:
        :class:`PolicyLossOutput`; ``loss`` is differentiable with respect to ``logprobs`` and
        ``candidate_logprobs``.
    """
    data = TokenData(sampler_logprobs, advantages, loss_mask, seq_ids, groups, versions, proximal_logprobs,
                     current_version, reference_logprobs, segment_ids, route_flips)
    agg = Aggregation(aggregation, num_loss_tokens, num_sequences, constant_normalizer)
    check_flag("validate", validate)
    if validate and not tracing():
        _validate(logprobs, candidates, candidate_logprobs, entropy, data, agg, correction)
    return loss_from_logprobs(logprobs, candidates, candidate_logprobs, entropy, data=data, agg=agg, corr=correction,
                              cp_group=cp_group)


@dataclass
class _Pass:
    """What the stages of :func:`loss_from_logprobs` read and fill in, in order (``[N]`` tensors unless said).

    Inputs: ``logp_y`` (differentiable), ``lq``, ``adv``, ``prox`` (or None), ``active`` (bool), ``seg`` / ``turns``
    (the sequences, the turns), ``tree``. Then: ``log_r`` (``log p - lq``), ``log_w`` (the ratio the weights act
    on), ``w`` (the weights, masked as the stages go), ``impossible``; ``drops`` (``{rule: [N] bool}``), ``kept``
    (or None), ``sel`` (kept trained tokens), ``trained``; ``tr_masked`` (or None); ``scale``; ``token_loss``,
    ``centering``, ``tr_penalty``; ``level_log_r``, ``counted``, ``loss``; ``kl_penalty``, ``kl_est``; ``metrics``.
    """

    logp_y: Tensor
    candidates: Record | None
    cand_lp: Tensor | None
    entropy: Tensor | None
    data: TokenData
    agg: Aggregation
    tree: CorrectionTree
    cp_group: object
    active: Tensor
    lq: Tensor
    adv: Tensor
    prox: Tensor | None
    seg: Segments | None
    turns: Segments | None
    zero: Tensor
    log_r: Tensor | None = None
    log_w: Tensor | None = None
    w: Tensor | None = None
    impossible: Tensor | None = None
    drops: dict = field(default_factory=dict)
    kept: Tensor | None = None
    sel: Tensor | None = None
    trained: Tensor | None = None
    tr_masked: Tensor | None = None
    scale: Tensor | float = 1.0
    rows: EntryRows | None = None
    token_loss: Tensor | None = None
    centering: Centering | None = None
    tr_penalty: Tensor | None = None
    level_log_r: Tensor | None = None
    counted: Tensor | None = None
    loss: Tensor | None = None
    kl_penalty: Tensor | None = None
    kl_est: Tensor | None = None
    metrics: dict = field(default_factory=dict)
    view: TokenView | None = None

    @property
    def ref(self) -> Tensor:
        """The log-probabilities a surrogate's ratio is taken against: the proximal policy's, else the sampler's."""
        return self.prox if self.prox is not None else self.lq


def _start(logprobs, candidates, candidate_logprobs, entropy, data: TokenData, agg: Aggregation, corr: Correction,
           cp_group) -> _Pass:
    """The pass's inputs: trained tokens, detached sampler-side inputs (data, never differentiated: ``w = sg(f(r))``,
    ``c = sg(c)``, even if a caller's are attached), the sequences and turns."""
    tree = corr.tree
    n, dtype = logprobs.shape[0], logprobs.dtype
    active = (torch.ones(n, dtype=torch.bool, device=logprobs.device) if data.loss_mask is None
              else data.loss_mask.to(torch.bool))
    prox = data.proximal_logprobs.to(dtype).detach() if data.proximal_logprobs is not None else None
    seg = Segments.from_ids(data.seq_ids, active, cp_group) if data.seq_ids is not None else None
    return _Pass(logprobs, candidates, candidate_logprobs, entropy, data, agg, tree, cp_group, active,
                 data.sampler_logprobs.to(dtype).detach(), data.advantages.to(dtype).detach(), prox, seg,
                 _turns(data, active, cp_group) if tree.needs_segments else None, torch.zeros_like(logprobs))


def _ratios(p: _Pass) -> None:
    """``log r = log p - lq``, and the ratio the weights act on (``pi_prox / q`` under decoupled PPO)."""
    p.log_r = torch.where(p.active, p.logp_y.detach() - p.lq, p.zero)
    p.log_w = p.log_r if p.prox is None else torch.where(p.active, p.prox - p.lq, p.zero)


def _weights(p: _Pass) -> None:
    """``w = f(r)`` at the correction's level. A sampled token the trainer gives probability 0 gets weight exactly 0
    in every mode: its score is undefined and ``w log p(y)`` would be infinite (counted in ``zero_prob_frac``)."""
    p.impossible = p.active & (p.logp_y.detach() == float("-inf"))
    p.w = torch.where(p.impossible, p.zero, token_weight(p.log_w, p.seg, p.tree, p.turns))


def _rejections(p: _Pass) -> None:
    """Sequences the sequence rules drop (veto, OPSM, sequence KL / ratio rejections) and tokens the mask rules
    drop (staleness, ...): out of ``sel``, their weight 0."""
    p.drops = sequence_drops(p.log_w, p.log_r, p.adv, p.seg, p.tree)
    p.drops.update(mask_drops(RuleInputs(p.log_w, p.active, p.seg, p.tree.max_log_ratio, _named_inputs(p.data),
                                         p.cp_group), p.tree))
    p.kept = sequence_keep(p.drops)
    p.sel = p.active if p.kept is None else p.active & p.kept
    p.trained = p.sel & (p.adv != 0)
    p.w = torch.where(p.sel, p.w, p.zero)


def _trust_region(p: _Pass) -> None:
    """docs/spec.md#trust-region: a mask on probability differences zeroes the weight."""
    tr = p.tree.trust_region
    if tr is not None:
        p.tr_masked = _trust_region_masked(tr, p.logp_y.detach(), p.lq, p.prox, p.adv,
                                           p.turns if tr.needs_segments else p.seg)
        p.w = torch.where(p.tr_masked, p.zero, p.w)


def _normalisation(p: _Pass) -> None:
    """A batch constant on the weights and the centering coefficients alike (drift stays zero)."""
    p.w, p.scale = _normalise(p.w, p.sel, p.seg, p.tree, p.cp_group)


def _policy_term(p: _Pass) -> None:
    """The surrogate (and score centering), on trained tokens; the trust region's squared-log-ratio penalty on every
    kept trained token the trainer can produce, masked or not."""
    p.rows = EntryRows.of(p.candidates) if p.candidates is not None else None
    loss, p.centering = _surrogate(p.logp_y, p.w, p.scale, p.adv, p.ref, p.seg, p.candidates, p.cand_lp, p.rows,
                                   p.tree, p.sel)
    p.token_loss = torch.where(p.trained, loss, p.zero)
    tr = p.tree.trust_region
    if tr is not None and tr.penalty:
        p.tr_penalty = tr.penalty * torch.where(p.sel & ~p.impossible, p.logp_y - p.ref, p.zero).square()
        p.token_loss = p.token_loss + p.tr_penalty


def _aggregation(p: _Pass) -> None:
    """The aggregation, without the rejected tokens in the normaliser when the correction says so."""
    tree = p.tree
    p.level_log_r = bounded_log_ratio(p.log_w, p.seg, tree, p.turns)  # the ratio f acted on (also a metric)
    p.counted, seg_counted = p.active, p.seg
    if not tree.rejected_in_normalizer:
        tok_rej = token_rejected(p.log_w, tree)
        p.counted = p.sel if tok_rej is None else p.sel & ~tok_rej
        p.counted = p.counted if p.tr_masked is None else p.counted & ~p.tr_masked
        if tree.weighting.mode.rejects:
            p.counted = p.counted & inside_bounds(p.level_log_r, tree)
        seg_counted = replace(p.seg, active=p.counted) if p.seg is not None else None
    agg = p.agg
    p.loss = aggregate(p.token_loss, p.counted, agg.name, seg_counted, agg.num_loss_tokens, agg.num_sequences,
                       agg.constant_normalizer, p.cp_group)


def _kl_penalty(p: _Pass) -> None:
    """The KL-to-reference penalty on every trained token, rejected or not, with the same aggregation over them."""
    if p.tree.kl_penalty is None:
        return
    agg = p.agg
    pen, p.kl_est = kl_penalty_terms(p.logp_y, p.data.reference_logprobs.to(p.logp_y.dtype).detach(), p.ref,
                                     p.active, p.tree)
    p.kl_penalty = aggregate(pen, p.active, agg.name, p.seg, agg.num_loss_tokens, agg.num_sequences,
                             agg.constant_normalizer, p.cp_group)
    p.loss = p.loss + p.kl_penalty
    p.token_loss = p.token_loss + pen


def _metrics(p: _Pass) -> None:
    """docs/spec.md#metrics, and the trust region's and the KL penalty's own."""
    p.view = token_view(log_ratio=p.log_r, bounded_log_ratio=p.level_log_r, impossible=p.impossible,
                        weight_ratio=p.log_w, logprobs=p.logp_y, sampler_logprobs=p.lq, weight=p.w, tree=p.tree,
                        advantages=p.adv)
    data, active, dtype = p.data, p.active, p.logp_y.dtype
    p.metrics = policy_metrics(
        view=p.view, drops=p.drops, active=active, entropy=p.zero if p.entropy is None else p.entropy, tree=p.tree,
        kept=p.kept, centering=p.centering,
        support_size=p.rows.sizes(p.candidates) if p.candidates is not None else None,
        seg=p.seg.local() if p.seg is not None else None, groups=data.groups,
        versions=data.versions, current_version=data.current_version, route_flips=data.route_flips,
    )
    if p.entropy is None:
        del p.metrics["entropy"]
    n_active = active.sum().clamp_min(1)
    if p.tr_masked is not None:
        p.metrics["trust_region_masked_frac"] = (p.tr_masked & active).sum().to(dtype) / n_active
        if p.tr_penalty is not None:
            p.metrics["trust_region_penalty"] = p.tr_penalty.detach().sum() / n_active
    if p.kl_penalty is not None:
        p.metrics["ref_kl"] = torch.where(active, p.kl_est, p.zero).sum() / n_active
        p.metrics["kl_penalty"] = p.kl_penalty.detach()


#: The pipeline, in order: each stage reads what the ones before it filled in (:class:`_Pass`).
STAGES = (_ratios, _weights, _rejections, _trust_region, _normalisation, _policy_term, _aggregation, _kl_penalty,
          _metrics)


def loss_from_logprobs(
    logprobs: Tensor,
    candidates: Record | None,
    candidate_logprobs: Tensor | None,
    entropy: Tensor | None,
    *,
    data: TokenData,
    agg: Aggregation,
    corr: Correction,
    cp_group=None,
) -> PolicyLossOutput:
    """The pipeline behind both entry points, on validated records: the :data:`STAGES` (ratios -> weights ->
    rejections -> trust region -> normalisation -> surrogate (+ score centering) -> aggregation -> KL penalty ->
    metrics), each reading the nodes of the correction's :class:`~offpolicy.corrections.tree.CorrectionTree`."""
    p = _start(logprobs, candidates, candidate_logprobs, entropy, data, agg, corr, cp_group)
    for stage in STAGES:
        stage(p)
    return PolicyLossOutput(p.loss, p.token_loss.detach(), p.metrics, p.w.detach(), p.log_r, p.logp_y.detach(),
                            p.view)


def _named_inputs(data: TokenData) -> dict:
    """The loss inputs a mask rule may declare, by name."""
    return {"versions": data.versions, "current_version": data.current_version, "seq_ids": data.seq_ids,
            "groups": data.groups, "route_flips": data.route_flips, "segment_ids": data.segment_ids}


def _turns(data: TokenData, active: Tensor, cp_group) -> Segments:
    """The segments of the turns: one per ``(seq_ids, segment_ids)`` pair (``segment_ids`` alone without
    ``seq_ids``), so that turn ``k`` of two sequences never merges."""
    if cp_group is not None:
        raise ValueError("Correction(level='segment') under cp_group is not supported: a turn's mean is taken over "
                         "this rank's tokens only")
    ids = data.segment_ids.to(torch.int64)
    if data.seq_ids is not None and ids.numel():
        ids = torch.unique(torch.stack([data.seq_ids.to(torch.int64), ids], 1), dim=0, return_inverse=True)[1]
    return Segments.from_ids(ids, active)


def _trust_region_masked(tr, logp_y: Tensor, lq: Tensor, prox: Tensor | None, adv: Tensor,
                         seg: Segments | None) -> Tensor:
    """``[N]`` bool, the tokens the trust region masks: the current policy against the proximal one (the
    sampler without it) for ``on="update"``, the weights' numerator against the sampler for ``on="weights"``."""
    if tr.on == "update":
        return tr.masked(logp_y, prox if prox is not None else lq, adv, seg)
    return tr.masked(prox if prox is not None else logp_y, lq, adv, seg)


def _normalise(w: Tensor, sel: Tensor, seg: Segments | None, tree: CorrectionTree,
               cp_group) -> tuple[Tensor, Tensor | float]:
    """``(w / mean, 1 / mean)`` under the tree's normalisation (mean over ``cp_group`` too), else ``(w, 1.0)``. A
    batch whose kept weights are all 0 keeps them (scale 1)."""
    norm = tree.normalisation
    if norm is None:
        return w, 1.0
    num, den = _group_sum(torch.stack(norm.fast(w, sel, seg)), cp_group)
    mean_w = num / den.clamp_min(1)
    scale = torch.where(mean_w > 0, 1.0 / mean_w.clamp_min(torch.finfo(w.dtype).tiny), torch.ones_like(mean_w))
    return w * scale, scale


def _surrogate(logp_y: Tensor, w: Tensor, scale, adv: Tensor, prox: Tensor | None, seg: Segments | None,
               candidates: Record | None, cand_lp: Tensor | None, rows: EntryRows | None,
               tree: CorrectionTree, kept: Tensor) -> tuple[Tensor, Centering | None]:
    """``[N]`` token loss ``-w_t s_t`` of the correction's surrogate; for the score-function surrogate
    ``-A_t (w_t log p(y_t) - sum_v sg(c_t(v)) log p(v))`` with the centering sum under score centering."""
    if tree.centering is not None and candidates is None:
        raise ValueError("score_centering=True needs candidates (the sampler's Candidates record, head or support): "
                         "centering sums over the recorded candidates; got candidates=None")
    sur = tree.surrogate
    zero = torch.zeros_like(logp_y)
    if sur.fast is not None:
        # w = 0 (masked, rejected, impossible) contributes exactly 0 whatever the surrogate holds there.
        # A surrogate with a batch statistic (KL-Cov's covariance) reads the kept trained tokens.
        batch = {"active": kept} if getattr(sur, "batch_statistic", False) else {}
        return torch.where(w != 0, -w * sur.fast(logp_y, prox, adv, seg, tree.max_log_ratio, **batch), zero), None
    # w * log p(y) with w = 0 where the token's own weight is masked (0 * -inf must not make a NaN).
    policy_term = torch.where(w != 0, w * logp_y, zero)
    centering = None
    if tree.centering is not None:
        centering = centering_coefficients(cand_lp.detach(), candidates.logprobs.detach(), candidates.valid,
                                           candidates.kind == "support", tree, rows)
        coef = centering.coef * scale
        # A candidate the trainer gives probability 0 (log p = -inf) contributes exactly 0.
        live = (coef != 0) & (cand_lp.detach() > float("-inf"))
        policy_term = policy_term - rows.sum(torch.where(live, coef * cand_lp, torch.zeros_like(coef)))
    return -adv * policy_term, centering


def _group_sum(x: Tensor, group) -> Tensor:
    """``x`` summed over ``group`` (a detached all-reduce), or ``x`` itself without a group."""
    if group is None:
        return x
    import torch.distributed as dist

    x = x.detach().clone()
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def _validate(logprobs, candidates, cand_lp, entropy, data: TokenData, agg: Aggregation, corr: Correction) -> None:
    if not isinstance(logprobs, Tensor) or logprobs.dim() != 1:
        raise ValueError(f"logprobs must be a [N] tensor, got {getattr(logprobs, 'shape', type(logprobs))}")
    if not logprobs.is_floating_point():
        raise TypeError(f"logprobs must be a floating-point tensor, got {logprobs.dtype}")
    n, device = logprobs.shape[0], logprobs.device
    active = check_batch(n, device, data, agg, corr)
    lp_a = logprobs.detach()[active]
    if bool(torch.isnan(lp_a).any()):
        raise ValueError(f"logprobs: NaN on trained token {int((torch.isnan(logprobs) & active).nonzero()[0])}")
    if bool((lp_a > LOGPROB_SLACK).any()):
        raise ValueError(f"logprobs: value {float(lp_a.max()):.4g} > 0 on a trained token (log-probabilities are "
                         "<= 0: were logits passed?)")
    if entropy is not None:
        check_vector("entropy", entropy, n, device, "float")
        if not bool(torch.isfinite(entropy[active]).all()):
            row = int((~torch.isfinite(entropy) & active).nonzero()[0])
            raise ValueError(f"entropy: NaN or inf on trained token {row}")
    check_candidates(candidates, None, n, device, active, None)
    if cand_lp is not None and candidates is None:
        raise ValueError("candidate_logprobs needs candidates (the sampler's record at the same ids)")
    if candidates is not None and corr.tree.centering is not None and cand_lp is None:
        raise ValueError("score centering needs candidate_logprobs [N, K] ([nnz] for a CSR record): the trainer's "
                         "log-probabilities at candidates.ids")
    if cand_lp is not None:
        csr = isinstance(candidates, CSRCandidates)
        shape = "[nnz]" if csr else "[N, K]"
        if not isinstance(cand_lp, Tensor) or tuple(cand_lp.shape) != tuple(candidates.ids.shape):
            raise ValueError(f"candidate_logprobs must be {shape} = {list(candidates.ids.shape)} like candidates.ids, "
                             f"got {list(getattr(cand_lp, 'shape', []))}")
        if not cand_lp.is_floating_point():
            raise TypeError(f"candidate_logprobs must be a floating-point tensor, got {cand_lp.dtype}")
        on = active[candidates.row_index()] if csr else active[:, None] & (candidates.ids >= 0)
        vals = cand_lp.detach()[on]
        if bool(torch.isnan(vals).any()) or bool((vals > LOGPROB_SLACK).any()):
            raise ValueError("candidate_logprobs: NaN or a value > 0 at a recorded candidate of a trained token")
