"""The float64 oracle: SPEC sections 2-6 written literally, for reading and for tests.

Nothing here is fast, chunked or fused, and nothing here imports the fast path: it materialises the full
``[N, V]`` log-softmax in float64, loops over sequences in Python and spells each formula as the SPEC does.
Gradients come from autograd through it. Use it on small inputs.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from offpolicy.records.candidates import Candidates
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


def f(r: Tensor, corr: Correction) -> Tensor:
    """The weight function of SPEC section 2 at ratio ``r`` (float64), token-level KL rejection included.

    ``r`` is clamped to ``exp(+-max_log_ratio)`` before use (the SPEC's "clamp in log space first"); bounds are
    tested on the unclamped ratio.
    """
    r = r.double()
    lo_r, hi_r = math.exp(-corr.max_log_ratio), math.exp(corr.max_log_ratio)
    rc = r.clamp(lo_r, hi_r)
    inside = (r >= corr.lower) & (r <= corr.upper)
    if corr.weights == "none":
        out = torch.ones_like(r)
    elif corr.weights == "tis":
        out = torch.minimum(torch.maximum(rc, torch.full_like(rc, corr.lower)), torch.full_like(rc, corr.upper))
    elif corr.weights == "mis":
        out = rc * inside
    else:
        out = inside.double()
    rej = corr.kl_rejection
    if rej is not None and rej.level == "token":
        out = out * (kl(rc, rej.estimator) <= rej.threshold)
    return out


def kl(r: Tensor, estimator: str) -> Tensor:
    """Schulman's k1 / k2 / k3 of KL(q||p) at ratio ``r = p / q``."""
    if estimator == "k1":
        return -torch.log(r)
    if estimator == "k2":
        return 0.5 * torch.log(r) ** 2
    return r - 1 - torch.log(r)


def token_ratio(logp_y: Tensor, lq: Tensor) -> Tensor:
    return torch.exp(logp_y.detach() - lq.double())


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

    # Importance weight w_t.
    if corr.level == "token":
        w = f(r, corr)
    else:
        w = torch.zeros(n, dtype=torch.float64)
        token_only = _drop_token_rejection(corr)
        for idx in seqs:
            log_rho = torch.log(r[idx]).sum() if corr.level == "sequence" else torch.log(r[idx]).mean()
            w[idx] = f(torch.exp(log_rho)[None], token_only)[0]

    # Sequence-level rejections.
    keep = torch.ones(n, dtype=torch.bool)
    for idx in seqs:
        drop = False
        rr = r[idx].clamp(math.exp(-corr.max_log_ratio), math.exp(corr.max_log_ratio))
        if corr.veto is not None and bool((r[idx] < corr.veto).any()):
            drop = True
        rej = corr.kl_rejection
        if rej is not None and rej.level != "token":
            k = kl(rr, rej.estimator)
            stat = {"seq_sum": k.sum(), "seq_mean": k.mean(), "seq_max": k.max()}[rej.level]
            drop = drop or bool(stat > rej.threshold)
        if corr.opsm_delta is not None:
            drop = drop or bool(adv[idx].mean() < 0 and (-torch.log(r[idx])).mean() > corr.opsm_delta)
        if drop:
            keep[idx] = False
    w = w * (mask & keep)
    scale = 1.0
    if corr.batch_normalize:
        sel = mask & keep
        mean_w = w[sel].mean() if bool(sel.any()) else torch.tensor(0.0, dtype=torch.float64)
        scale = 1.0 / mean_w if mean_w > 0 else 1.0
        w = w * scale

    token_loss = torch.zeros(n, dtype=torch.float64)
    for t in range(n):
        if not (mask[t] and keep[t]) or adv[t] == 0:
            continue
        if corr.ppo_clip is not None:
            u = torch.exp((logp_y[t] - proximal_logprobs[t].double()).clamp(-corr.max_log_ratio, corr.max_log_ratio))
            lo, hi = corr.ppo_clip
            surrogate = torch.minimum(u * adv[t], u.clamp(1 - lo, 1 + hi) * adv[t])
            token_loss[t] = -w[t] * surrogate
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
    """SPEC section 3 for one row: ``c(v) = q f(p/q) - alpha p`` over the recorded ids."""
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


def _drop_token_rejection(corr: Correction) -> Correction:
    from dataclasses import replace

    if corr.kl_rejection is not None and corr.kl_rejection.level == "token":
        return replace(corr, kl_rejection=None)
    return corr


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
    """SPEC section 6 mismatch and weight metrics over the trained tokens, literally."""
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
