"""``policy_loss``: the public entry point (SPEC section 9).

The path is short: validate at the boundary -> one sparse log-softmax (logits, or hidden x weight) -> ``O(N K)``
loss math in plain torch (weights, rejections, score centering, aggregation, metrics).

Per-token loss (SPEC section 3), ``sg`` = stop-gradient:

    loss_t = -A_t * ( w_t log p(y_t) - sum_{v in H_t} sg(c_t(v)) log p(v) )

with ``w_t = sg(f(r_t))`` (or the sequence-level weight), and the centering sum present only with score
centering. Decoupled PPO replaces the first term by the clipped surrogate of ``u = p / pi_prox``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from offpolicy.aggregation import AGGREGATIONS, SEQUENCE_AGGREGATIONS, aggregate
from offpolicy.candidates import Candidates
from offpolicy.centering import Centering, centering_coefficients
from offpolicy.correction import Correction
from offpolicy.dtensor import vocab_shard_of
from offpolicy.metrics import policy_metrics
from offpolicy.ops import SparseLogSoftmax, VocabShard, sparse_log_softmax
from offpolicy.segments import Segments
from offpolicy.weights import sequence_keep, sequence_weight, weight_function

#: Sampler log-probabilities may exceed 0 by rounding; beyond this they are not log-probabilities.
LOGPROB_SLACK = 1e-4


@dataclass
class PolicyLossOutput:
    """What :func:`policy_loss` returns.

    Attributes:
        loss: scalar, differentiable with respect to the logits (or hidden and weight).
        token_loss: ``[N]`` detached per-token loss (0 on untrained and rejected tokens), before aggregation.
        metrics: dict of detached scalar tensors (see :mod:`offpolicy.metrics`).
        token_weight: ``[N]`` detached importance weight ``w_t`` of each sampled token.
        log_ratio: ``[N]`` detached ``log p(y_t) - lq_t``.
        logprobs: ``[N]`` detached trainer log-probability ``log p(y_t)`` (support-normalised under replay).
    """

    loss: Tensor
    token_loss: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)
    token_weight: Tensor | None = None
    log_ratio: Tensor | None = None
    logprobs: Tensor | None = None


def policy_loss(
    logits: Tensor | None = None,
    tokens: Tensor | None = None,
    sampler_logprobs: Tensor | None = None,
    advantages: Tensor | None = None,
    candidates: Candidates | None = None,
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
        candidates: :class:`~offpolicy.Candidates` record (``kind="head"`` or ``"support"``), or None.
        loss_mask: ``[N]`` bool, True on trained tokens; None trains all.
        temperature: float or ``[N]`` tensor, ``> 0``: the sampling temperature.
        correction: :class:`~offpolicy.Correction`; the default is plain REINFORCE/GRPO.
        seq_ids: ``[N]`` int sequence of each token (sequence-level weights, rejections, sequence aggregation).
        aggregation: ``"token_mean" | "seq_mean_token_mean" | "seq_mean_token_sum" | "constant"``.
        num_loss_tokens: global token count for ``token_mean`` (data-parallel / micro-batch exactness).
        groups: ``[N]`` int sampler group of each token, for per-group metrics.
        versions: ``[N]`` int policy version that sampled each token, for per-staleness metrics.
        tp_group: ``torch.distributed`` group over which the vocabulary is split; ``vocab_start`` is this
            rank's first id. Vocabulary-sharded ``DTensor`` logits (``Shard(1)``, e.g. from a ``loss_parallel``
            output layer) carry both in their device mesh: pass them as they are, without these two. The shards must tile ``[0, V)`` (checked with one small all-gather when validating);
            ``V`` is the global vocabulary that tokens and candidates are checked against. Exclude padded
            vocabulary columns by passing only the real ones (e.g. ``logits[:, :real_width]``).
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
        inplace_grad: write the logits' gradient into ``logits`` (saves an ``[N, V]`` buffer; the logits are
            overwritten by the backward and autograd's version check is bypassed).
        backend: ``"torch"`` or ``"triton"``; default by device.
        validate: check inputs at the boundary (host syncs); skipped automatically under ``torch.compile``.

    Returns:
        :class:`PolicyLossOutput`.
    """
    corr = correction
    check = validate and not torch.compiler.is_compiling()
    logits, tp_group, vocab_start = vocab_shard_of(logits, tp_group, vocab_start)
    if check:
        _validate(
            logits, hidden, weight, bias, tokens, sampler_logprobs, advantages, candidates, loss_mask, temperature,
            corr, seq_ids, aggregation, num_loss_tokens, num_sequences, constant_normalizer, groups, versions,
            proximal_logprobs, tp_group, vocab_start,
        )
    n = tokens.shape[0]
    device = tokens.device
    active = torch.ones(n, dtype=torch.bool, device=device) if loss_mask is None else loss_mask.to(torch.bool)
    support = candidates is not None and candidates.kind == "support"
    cand_ids = candidates.ids if candidates is not None else None
    shard = VocabShard(tp_group, vocab_start) if tp_group is not None else None

    lp = _log_probs(logits, hidden, weight, bias, tokens, cand_ids, temperature, support, ~active, shard,
                    inplace_grad, backend)
    if check and bool(torch.isnan(lp.target[active]).any()):
        row = int((torch.isnan(lp.target) & active).nonzero()[0])
        raise ValueError(f"logits: NaN in row {row}, a trained token (loss_mask is True there)")

    logp_y = lp.target
    dtype = logp_y.dtype
    # Sampler-side inputs are data, never differentiated (w = sg(f(r)), c = sg(c)), even if a caller's are attached.
    lq = sampler_logprobs.to(dtype).detach()
    adv = advantages.to(dtype).detach()
    zero = torch.zeros_like(logp_y)
    log_r = torch.where(active, logp_y.detach() - lq, zero)
    seg = Segments.from_ids(seq_ids, active, cp_group) if seq_ids is not None else None

    # The ratio that importance-weights the sampled token: p/q, or pi_prox/q under decoupled PPO.
    log_w = log_r if proximal_logprobs is None else torch.where(active, proximal_logprobs.to(dtype) - lq, zero)
    w = sequence_weight(log_w, seg, corr) if corr.sequence_level else weight_function(log_w, corr)
    kept = sequence_keep(log_w, adv, seg, corr)
    trained = active & (adv != 0) if kept is None else active & (adv != 0) & kept
    w = torch.where(active if kept is None else active & kept, w, zero)
    scale = 1.0
    if corr.batch_normalize:
        # A batch constant, applied to the weights and the centering coefficients alike: drift stays zero.
        sel = active if kept is None else active & kept
        w_sum, n_sel = _group_sum(torch.stack([w.sum(), sel.sum().to(dtype)]), cp_group)
        mean_w = w_sum / n_sel.clamp_min(1)
        scale = torch.where(mean_w > 0, 1.0 / mean_w.clamp_min(torch.finfo(dtype).tiny), torch.ones_like(mean_w))
        w = w * scale

    centering: Centering | None = None
    if corr.ppo_clip is not None:
        eps_lo, eps_hi = corr.ppo_clip
        log_u = (logp_y - proximal_logprobs.to(dtype)).clamp(-corr.max_log_ratio, corr.max_log_ratio)
        u = torch.exp(log_u)
        surrogate = torch.minimum(u * adv, u.clamp(1.0 - eps_lo, 1.0 + eps_hi) * adv)
        token_loss = -w * surrogate
    else:
        # w * log p(y) with w = 0 where the token's own weight is masked (0 * -inf must not make a NaN).
        policy_term = torch.where(w != 0, w * logp_y, zero)
        if corr.score_centering and candidates is not None:
            valid = candidates.ids >= 0
            centering = centering_coefficients(lp.candidates.detach(), candidates.logprobs.detach(), valid, support,
                                               corr)
            coef = centering.coef * scale
            policy_term = policy_term - torch.where(coef != 0, coef * lp.candidates, torch.zeros_like(coef)).sum(1)
        token_loss = -adv * policy_term
    token_loss = torch.where(trained, token_loss, zero)
    loss = aggregate(
        token_loss, active, aggregation, seg, num_loss_tokens, num_sequences, constant_normalizer, cp_group
    )

    metrics = policy_metrics(
        log_ratio=log_r, weight=w, active=active, entropy=lp.entropy, corr=corr, kept=kept, centering=centering,
        cand_valid=(candidates.ids >= 0) if candidates is not None else None,
        seg=seg.local() if seg is not None else None, groups=groups,
        versions=versions, current_version=current_version,
    )
    return PolicyLossOutput(loss, token_loss.detach(), metrics, w.detach(), log_r, logp_y.detach())


def _group_sum(x: Tensor, group) -> Tensor:
    """``x`` summed over ``group`` (a detached all-reduce), or ``x`` itself without a group."""
    if group is None:
        return x
    import torch.distributed as dist

    x = x.detach().clone()
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def _global_vocab(group, vocab_start: int, v_local: int, n: int, device) -> int:
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


def _log_probs(logits, hidden, weight, bias, tokens, cand_ids, temperature, support, skip, shard, inplace_grad,
               backend) -> SparseLogSoftmax:
    if logits is not None:
        return sparse_log_softmax(logits, tokens, cand_ids, temperature, support=support, skip=skip, shard=shard,
                                  inplace_grad=inplace_grad, backend=backend)
    from offpolicy.ops.linear_log_softmax import linear_sparse_log_softmax

    return linear_sparse_log_softmax(hidden, weight, tokens, cand_ids, temperature, bias=bias, support=support,
                                     skip=skip, shard=shard, backend=backend)


def _vector(name: str, x, n: int, device, kind: str) -> None:
    """Check that ``x`` is an ``[n]`` tensor of the given kind ("int" or "float") on ``device``."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape [{n}], got {type(x).__name__}")
    if x.dim() != 1 or x.shape[0] != n:
        raise ValueError(f"{name} must have shape [N] = [{n}], got {tuple(x.shape)}")
    if kind == "int" and (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool):
        raise TypeError(f"{name} must be an integer tensor, got {x.dtype}")
    if kind == "float" and not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}, expected {device} like the other inputs")


def _validate(logits, hidden, weight, bias, tokens, lq, adv, candidates, loss_mask, temperature, corr, seq_ids,
              aggregation, num_loss_tokens, num_sequences, constant_normalizer, groups, versions, proximal,
              tp_group, vocab_start) -> None:
    if not isinstance(corr, Correction):
        raise TypeError(f"correction must be an offpolicy.Correction, got {type(corr).__name__}")
    if logits is not None and (hidden is not None or weight is not None):
        raise ValueError("pass either logits, or hidden and weight, not both")
    if logits is None:
        if hidden is None or weight is None:
            raise ValueError("policy_loss needs logits [N, V], or hidden [N, D] and weight [V, D]")
        if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
            raise ValueError(
                f"hidden must be [N, D] and weight [V, D] with the same D, got {tuple(hidden.shape)} and "
                f"{tuple(weight.shape)}"
            )
        if not (hidden.is_floating_point() and weight.is_floating_point()):
            raise TypeError("hidden and weight must be floating-point tensors")
        if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
            raise ValueError(f"bias must be [V] = [{weight.shape[0]}], got {tuple(bias.shape)}")
        n, v, device = hidden.shape[0], weight.shape[0], hidden.device
    else:
        if not isinstance(logits, Tensor) or logits.dim() != 2:
            raise ValueError(f"logits must be a [N, V] tensor, got {getattr(logits, 'shape', type(logits))}")
        if not logits.is_floating_point():
            raise TypeError(f"logits must be a floating-point tensor, got {logits.dtype}")
        if logits.shape[1] > 0 and logits.stride(1) != 1:
            raise ValueError("logits must have unit stride along the vocabulary (call .contiguous())")
        n, v, device = logits.shape[0], logits.shape[1], logits.device
    if tokens is None or lq is None or adv is None:
        raise ValueError("tokens, sampler_logprobs and advantages are required")
    _vector("tokens", tokens, n, device, "int")
    _vector("sampler_logprobs", lq, n, device, "float")
    _vector("advantages", adv, n, device, "float")
    if loss_mask is not None:
        _vector("loss_mask", loss_mask, n, device, "any")
        if loss_mask.dtype != torch.bool:
            if loss_mask.is_floating_point() and bool(((loss_mask != 0) & (loss_mask != 1)).any()):
                raise ValueError("loss_mask must be bool (or hold only 0 and 1)")
            if not loss_mask.is_floating_point() and bool(((loss_mask != 0) & (loss_mask != 1)).any()):
                raise ValueError("loss_mask must be bool (or hold only 0 and 1)")
        active = loss_mask.to(torch.bool)
    else:
        active = torch.ones(n, dtype=torch.bool, device=device)
    vocab = v if tp_group is None else _global_vocab(tp_group, vocab_start, v, n, device)
    if n and bool((tokens < 0).any()):
        raise ValueError(f"tokens: id {int(tokens.min())} is negative")
    if n and vocab is not None and bool((tokens >= vocab).any()):
        raise ValueError(f"tokens: id {int(tokens.max())} is out of range for vocabulary size {vocab}")
    lq_a = lq[active]
    if bool(torch.isnan(lq_a).any()):
        raise ValueError("sampler_logprobs: NaN on a trained token")
    if bool((lq_a == float("-inf")).any()):
        raise ValueError("sampler_logprobs: -inf on a trained token (the sampler cannot have drawn it)")
    if bool((lq_a > LOGPROB_SLACK).any()):
        raise ValueError(f"sampler_logprobs: value {float(lq_a.max()):.4g} > 0 on a trained token")
    if not bool(torch.isfinite(adv[active]).all()):
        raise ValueError("advantages: NaN or inf on a trained token")
    if isinstance(temperature, Tensor):
        if temperature.dim() > 1 or (temperature.dim() == 1 and temperature.shape[0] != n):
            raise ValueError(f"temperature must be a float or a [N] = [{n}] tensor, got {tuple(temperature.shape)}")
        if not bool((torch.isfinite(temperature) & (temperature > 0)).all()):
            raise ValueError("temperature must be finite and > 0")
    elif not (isinstance(temperature, (int, float)) and 0 < temperature < float("inf")):
        raise ValueError(f"temperature must be finite and > 0, got {temperature!r}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if aggregation in SEQUENCE_AGGREGATIONS and seq_ids is None:
        raise ValueError(f"aggregation={aggregation!r} needs seq_ids")
    if aggregation == "constant" and not (constant_normalizer is not None and constant_normalizer > 0):
        raise ValueError("aggregation='constant' needs constant_normalizer > 0")
    if corr.needs_sequences and seq_ids is None:
        raise ValueError("this correction (sequence-level weights or a sequence rejection) needs seq_ids")
    for name, val in (("num_loss_tokens", num_loss_tokens), ("num_sequences", num_sequences)):
        if val is not None and not float(val) > 0:
            raise ValueError(f"{name} must be > 0, got {val}")
    if (corr.ppo_clip is None) != (proximal is None):
        raise ValueError("correction.ppo_clip and proximal_logprobs go together (decoupled PPO)")
    if proximal is not None:
        _vector("proximal_logprobs", proximal, n, device, "float")
        if not bool(torch.isfinite(proximal[active]).all()):
            raise ValueError("proximal_logprobs: NaN or inf on a trained token")
    for name, val in (("seq_ids", seq_ids), ("groups", groups), ("versions", versions)):
        if val is not None:
            _vector(name, val, n, device, "int")
    if candidates is not None:
        if not isinstance(candidates, Candidates):
            raise TypeError(f"candidates must be an offpolicy.Candidates, got {type(candidates).__name__}")
        if candidates.ids.device != device:
            raise ValueError(f"candidates are on {candidates.ids.device}, expected {device}")
        candidates.validate(vocab, n, tokens)
        if candidates.kind == "support":
            empty = active & ~(candidates.ids >= 0).any(dim=1)
            if bool(empty.any()):
                row = int(empty.nonzero()[0])
                raise ValueError(f"candidates: kind='support' row {row} is empty but its token is trained")
