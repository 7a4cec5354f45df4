"""The float64 oracle: docs/spec.md (#weights to #metrics) written literally, for reading and for tests.

Nothing here is fast, chunked or fused, and nothing here imports the fast path: it materialises the full
``[N, V]`` log-softmax in float64, loops over sequences and tokens in Python and spells each formula as the spec
does. Each correction's own formula is the ``reference`` function of its entry in
:mod:`offpolicy.corrections.registry` (the fast path uses the same entry's ``fast`` function); this module
enumerates those entries. Gradients come from autograd through it. Use it on small inputs.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from offpolicy.records.candidates import Candidates
from offpolicy.corrections import registry as reg
from offpolicy.corrections.correction import Correction

TAIL_EPS = 1e-6
EXTREME = (0.2, 5.0)


def log_probs(logits: Tensor, temperature: float | Tensor = 1.0, support: Tensor | None = None) -> Tensor:
    """``[N, V]`` float64 ``log p`` of ``softmax(z / tau)``, or of ``p^S`` (renormalised over ``support``,
    ``[N, V]`` bool; ``-inf`` outside it)."""
    x = logits.double()
    tau = temperature.double()[:, None] if isinstance(temperature, Tensor) and temperature.dim() else temperature
    x = x / tau
    if support is not None:
        x = x.masked_fill(~support, -math.inf)
    return torch.log_softmax(x, dim=-1)


def support_mask(candidates: Candidates, vocab: int) -> Tensor:
    """``[N, V]`` bool: True on each row's recorded ids."""
    mask = torch.zeros(candidates.ids.shape[0], vocab + 1, dtype=torch.bool, device=candidates.ids.device)
    ids = torch.where(candidates.ids >= 0, candidates.ids.long(), vocab)
    return mask.scatter(1, ids, True)[:, :vocab]


def f(r: Tensor, corr: Correction, token_rejection: bool = True) -> Tensor:
    """The weight function (docs/spec.md#weights) at ratio ``r`` (float64), a token-level KL rejection included
    unless ``token_rejection=False``.

    ``r`` is clamped to ``exp(+-max_log_ratio)`` before use (the spec's "clamp in log space first"); bounds are
    tested on the unclamped ratio.
    """
    r = r.double()
    rc = r.clamp(math.exp(-corr.max_log_ratio), math.exp(corr.max_log_ratio))
    inside = (r >= corr.lower) & (r <= corr.upper)
    out = reg.WEIGHT_MODES[corr.weights].reference(rc, inside, corr.lower, corr.upper)
    rej = corr.kl_rejection
    if token_rejection and rej is not None and not reg.KL_LEVELS[rej.level].per_sequence:
        out = out * (kl(rc, rej.estimator) <= rej.threshold)
    return out


def kl(r: Tensor, estimator: str) -> Tensor:
    """Schulman's k1 / k2 / k3 of KL(q||p) at ratio ``r = p / q``."""
    return reg.ESTIMATORS[estimator].reference(r)


def reference_policy_loss(
    logits: Tensor,
    tokens: Tensor,
    sampler_logprobs: Tensor,
    advantages: Tensor,
    candidates: Candidates | None = None,
    loss_mask: Tensor | None = None,
    temperature: float | Tensor = 1.0,
    correction: Correction = Correction(),
    seq_ids: Tensor | None = None,
    aggregation: str = "token_mean",
    num_loss_tokens: float | None = None,
    *,
    proximal_logprobs: Tensor | None = None,
    num_sequences: float | None = None,
    constant_normalizer: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Literal float64 policy loss. Returns ``(loss, token_loss [N], weight [N])``; ``loss`` is differentiable
    with respect to ``logits`` (pass float64 logits with ``requires_grad`` for gradients)."""
    corr = correction
    n, vocab = logits.shape
    mask = torch.ones(n, dtype=torch.bool) if loss_mask is None else loss_mask.bool()
    is_support = candidates is not None and candidates.kind == "support"
    lp = log_probs(logits, temperature, support_mask(candidates, vocab) if is_support else None)
    logp_y = lp[torch.arange(n), tokens.long()]
    lq = sampler_logprobs.double()
    adv = advantages.double()

    base = proximal_logprobs.double() if proximal_logprobs is not None else logp_y.detach()
    r = torch.exp(base - lq)
    r = torch.where(mask, r, torch.ones_like(r))
    seqs = _sequences(seq_ids, mask) if seq_ids is not None else []

    # Importance weight w_t at the correction's level (a token-level KL rejection masks the token's own ratio).
    level = reg.LEVELS[corr.level]
    if not level.per_sequence:
        w = f(r, corr)
    else:
        w = torch.zeros(n, dtype=torch.float64)
        for idx in seqs:
            w[idx] = f(torch.exp(level.reference(torch.log(r[idx])))[None], corr, token_rejection=False)[0]
        rej = corr.kl_rejection
        if rej is not None and not reg.KL_LEVELS[rej.level].per_sequence:
            rc = r.clamp(math.exp(-corr.max_log_ratio), math.exp(corr.max_log_ratio))
            w = w * (kl(rc, rej.estimator) <= rej.threshold)

    # Sequence-level rejections: a sequence is dropped when any rule that applies says so.
    rules = [rule for rule in reg.SEQUENCE_RULES.values() if rule.applies(corr)]
    r_p = torch.where(mask, torch.exp(logp_y.detach() - lq), torch.ones_like(lq))
    keep = torch.ones(n, dtype=torch.bool)
    for idx in seqs:
        if any(rule.reference(r[idx], r_p[idx], adv[idx], corr) for rule in rules):
            keep[idx] = False
    w = w * (mask & keep)
    scale = 1.0
    norm = reg.normalisation_of(corr)
    if norm is not None:
        mean_w = norm.reference(w, mask & keep, seqs)
        scale = 1.0 / mean_w if mean_w > 0 else 1.0
        w = w * scale
    surrogate = corr.surrogate

    token_loss = torch.zeros(n, dtype=torch.float64)
    for t in range(n):
        if not (mask[t] and keep[t]) or adv[t] == 0:
            continue
        if surrogate.reference is not None:
            token_loss[t] = -w[t] * surrogate.reference(logp_y[t], proximal_logprobs[t].double(), adv[t], corr)
            continue
        term = w[t] * logp_y[t] if w[t] != 0 else torch.zeros((), dtype=torch.float64)
        if corr.score_centering and candidates is not None:
            c, ids = _centering(lp[t], candidates, t, is_support, corr)
            for cv, v in zip(c, ids):
                if cv != 0:
                    term = term - scale * cv * lp[t, v]
        token_loss[t] = -adv[t] * term
    loss = _aggregate(token_loss, mask, aggregation, seqs, num_loss_tokens, num_sequences, constant_normalizer)
    # Keep the loss attached to the logits even when every token is masked (its gradient is then zero).
    x = logits.double()
    loss = loss + torch.where(torch.isfinite(x), x, torch.zeros_like(x)).sum() * 0
    return loss, token_loss.detach(), w.detach()


def _centering(lp_row: Tensor, cands: Candidates, t: int, is_support: bool, corr: Correction):
    """docs/spec.md#score-centering for one row: ``c(v) = q f(p/q) - alpha p`` over the recorded ids."""
    valid = cands.ids[t] >= 0
    ids = cands.ids[t][valid].long()
    p = torch.exp(lp_row.detach()[ids])
    q = torch.exp(cands.logprobs[t][valid].double())
    with torch.no_grad():
        m = torch.where(q > 0, q * f(p / torch.where(q > 0, q, torch.ones_like(q)), corr), torch.zeros_like(q))
        if is_support:
            alpha = f(torch.ones(1, dtype=torch.float64), corr)[0]
        else:
            rho = max(1 - float(q.sum()), TAIL_EPS) / max(1 - float(p.sum()), TAIL_EPS)
            alpha = rho * f(torch.tensor([1 / rho], dtype=torch.float64), corr)[0]
    return (m - alpha * p).tolist(), ids.tolist()


def _sequences(seq_ids: Tensor, mask: Tensor) -> list[Tensor]:
    """Index tensors of each sequence's trained tokens (sequences without any are left out)."""
    out = []
    for s in torch.unique(seq_ids).tolist():
        idx = ((seq_ids == s) & mask).nonzero().flatten()
        if idx.numel():
            out.append(idx)
    return out


def _aggregate(token_loss, mask, aggregation, seqs, num_loss_tokens, num_sequences, constant_normalizer):
    if aggregation == "token_mean":
        denom = num_loss_tokens if num_loss_tokens is not None else max(int(mask.sum()), 1)
        return token_loss.sum() / denom
    if aggregation == "constant":
        return token_loss.sum() / constant_normalizer
    per_seq = [token_loss[idx].sum() / (idx.numel() if aggregation == "seq_mean_token_mean" else 1) for idx in seqs]
    denom = num_sequences if num_sequences is not None else max(len(seqs), 1)
    return torch.stack(per_seq).sum() / denom if per_seq else token_loss.sum() * 0


def reference_metrics(
    logp_y: Tensor, sampler_logprobs: Tensor, weight: Tensor, loss_mask: Tensor, corr: Correction
) -> dict[str, float]:
    """docs/spec.md#metrics mismatch and weight metrics over the trained tokens, literally."""
    sel = loss_mask.bool()
    log_r = (logp_y.double() - sampler_logprobs.double())[sel].clamp(-corr.max_log_ratio, corr.max_log_ratio)
    r = torch.exp(log_r)
    w = weight.double()[sel]
    n = max(int(sel.sum()), 1)
    return {
        "kl_k1": float((-log_r).sum() / n),
        "kl_k2": float((0.5 * log_r**2).sum() / n),
        "kl_k3": float((r - 1 - log_r).sum() / n),
        "abs_log_ratio_mean": float(log_r.abs().sum() / n),
        "abs_log_ratio_max": float(log_r.abs().max()) if log_r.numel() else 0.0,
        "extreme_ratio_frac": float(((r < EXTREME[0]) | (r > EXTREME[1])).double().sum() / n),
        "weight_mean": float(w.sum() / n),
        "ess": float(w.sum() ** 2 / (n * (w**2).sum())) if float((w**2).sum()) > 0 else 0.0,
    }
