"""Deliberately wrong policy losses, for showing that ``offpolicy.testing`` catches each mistake.

:func:`dense_loss` is an independent, dense (``[N, V]`` log-softmax) implementation of the spec's per-token loss,
written in the style of a framework's loss function and reached through the kit's adapter signature. With
``bug=None`` it is correct (the kit must pass it); each entry of :data:`BUGS` injects one mistake people make.
Besides the weights, levels and score centering it implements the rest of the family from docs/spec.md#family:
token-level rejection rules (chained ratio and KL bands, one- or two-sided), sequence rules (ratio bands on the
summed or mean log-ratio, KL bands at ``seq_sum`` / ``seq_mean`` / ``seq_max``, veto, OPSM), batch normalisation over
tokens and over sequences, the surrogates (decoupled PPO with its dual clip and delta, GSPO-token, CISPO, TOPR,
Kimi15, KL-Cov, Clip-Cov, at any weight level), M2PO's batch mask, seq_logprob_error and
``rejected_in_normalizer=False``. It refuses nothing the kit's :class:`LossConfig` can declare.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from offpolicy.testing import LossConfig, with_config

EPS = 1e-6

#: bug -> what it gets wrong.
BUGS = {
    "sc_no_tail": "score centering without the tail term: c(v) = q f(p/q), no - alpha p",
    "sc_unweighted": "the unweighted centering variant: c(v) = q(v) - alpha p(v) (q instead of q f(p/q))",
    "sc_skipped": "claims score centering but never subtracts anything",
    "sc_coef_not_detached": "centering coefficients c(v) left attached to the graph",
    "rho_no_floor": "tail ratio rho = (1 - Q_H) / (1 - P_H) without the eps floor",
    "mis_clip": "MIS that clips the ratio to [L, U] instead of masking it",
    "weights_not_detached": "importance weights w = f(r) not detached",
    "temperature_twice": "temperature applied twice (logits / tau / tau)",
    "temperature_numerator_only": "temperature divides the logit but not the normaliser: z/tau - logsumexp(z)",
    "support_not_replayed": "support records: p over the full vocabulary instead of renormalised over S",
    "sampler_grad_leak": "the sampler log-probabilities are used without detaching (gradient leaks into them)",
    "sign_error": "the loss has the wrong sign (+A w log p)",
    "unclamped_ratio": "r = exp(log p - lq) without clamping the log-ratio: inf * 0 = NaN under MIS",
    "no_inf_guard": "w * log p(y) without guarding w = 0 against log p = -inf (0 * -inf = NaN)",
    "mask_ignored": "takes loss_mask but never applies it: untrained tokens keep their loss",
    "sequence_counts_untrained": "sequence ratio summed over every token, untrained ones (loss_mask False) too",
    "geometric_as_sequence": "level='geometric' computed as the sequence product (sum of log-ratios, no mean)",
    "sequence_as_token": "level='sequence' that ignores seq_ids and weights each token by its own ratio",
    "seq_mean_as_token_mean": "aggregation='seq_mean_token_mean' computed as the token mean",
    "mean_over_all_tokens": "token_mean dividing by every token, untrained ones (loss_mask False) included",
    "dual_clip_missing": "claims a dual clip but never bounds the surrogate below by c A",
    "dual_clip_positive_advantages": "dual clip max(s, c A) applied for A > 0 too (it bounds only A < 0)",
    "dual_clip_as_upper_bound": "dual clip as min(s, c A) for A < 0: an upper bound instead of a lower one",
    "ppo_delta_ignored": "TRL's delta never caps u in the unclipped branch",
    "cispo_coef_attached": "CISPO's coefficient clamp(u, lo, hi) left attached to the graph",
    "cispo_unclipped": "CISPO's coefficient u never clamped to [lo, hi]",
    "rejection_chain_first_only": "chained rejections: only the first rule of the chain is applied",
    "kl_two_sided_as_upper": "a two-sided KL band (lo, hi) tested as an upper threshold k <= hi only",
    "sequence_rule_per_token": "a sequence-level rejection rule tested on each token's own ratio / k, not on the "
                               "sequence's statistic",
    "batch_norm_counts_untrained": "batch normalisation's mean weight taken over every row, untrained ones "
                                   "(loss_mask False) and dropped sequences included",
    "batch_norm_sequences_as_tokens": "batch_normalize='sequences' computed as the token mean of the weights",
    "gspo_token_sequence_gradient": "GSPO-token's ratio left attached through the sequence mean "
                                    "(exp(mean_t log p_t / pi_prox_t)): the gradient is GSPO's, not per token",
    "opsm_any_advantage": "OPSM drops off-policy sequences whatever their advantage (it drops only A_i < 0)",
    "rejected_kept_in_normalizer": "rejected_in_normalizer=False ignored: rejected tokens stay in the normaliser",
    "topr_negative_unclipped": "TOPR's A < 0 coefficient u never clamped to [0, 1]",
    "kimi15_penalty_detached": "Kimi15's squared penalty computed on a detached log p (no gradient from it)",
    "kl_cov_penalty_signed": "KL-Cov's penalty coef * log u instead of coef * |log u|",
    "clip_cov_unseeded_draw": "Clip-Cov drops the first candidates in token order, not the seeded draw",
    "m2po_smallest_first": "M2PO drops the tokens with the smallest (log r)^2 first",
    "seq_logprob_error_signed": "seq_logprob_error's statistic mean exp(log r), not mean exp(|log r|)",
    "staleness_sequence_as_token": "a sequence-level staleness rejection drops the stale tokens, not their sequences",
    "route_flips_at_threshold": "the route-flip rejection drops tokens with route_flips >= max_flips, not >",
}

#: The KL estimators at a clamped log-ratio ``lr`` (k1, k2, k3 of KL(q || p)).
_KL = {"k1": lambda lr: -lr, "k2": lambda lr: 0.5 * lr * lr, "k3": lambda lr: torch.exp(lr) - 1 - lr}


def _is_sequence_rule(rule) -> bool:
    """Whether a ``KLRejection`` / ``RatioRejection`` acts on whole sequences (its level is not ``"token"``)."""
    return rule.level != "token"


def _ratio_rules(corr) -> list:
    """The ``KLRejection`` / ``RatioRejection`` items of ``kl_rejection`` and ``rejections`` (the mask rules, staleness
    and route flips, are :func:`_mask_rule_drop`'s)."""
    return [r for _, r in corr.rejection_rules if r.kind in ("kl", "ratio")]


def _mask_rule_drop(trained: Tensor, seq_ids: Tensor | None, versions: Tensor | None, current_version: int | None,
                    route_flips: Tensor | None, cfg: LossConfig, bug: str | None) -> Tensor:
    """``[N]`` bool: the trained tokens a staleness rejection (docs/spec.md#staleness-rejection: ``current_version -
    versions > max_lag``) or a route-flip rejection (docs/spec.md#route-flip-rejection: ``route_flips > max_flips``)
    drops, the token itself at ``level="token"``, every trained token of its sequence at ``"sequence"``."""
    corr = cfg.correction
    rules = [("staleness", corr.max_staleness, "token")] if corr.max_staleness is not None else []
    rules += [("route_flips", corr.max_route_flips, "token")] if corr.max_route_flips is not None else []
    rules += [(r.kind, r.max_lag if r.kind == "staleness" else r.max_flips, r.level) for r in corr.rejections
              if r.kind in ("staleness", "route_flips")]
    drop = torch.zeros_like(trained)
    for kind, limit, level in rules:
        if kind == "staleness":
            bad = trained & (current_version - versions > limit)
        else:
            bad = trained & ((route_flips >= limit) if bug == "route_flips_at_threshold" else (route_flips > limit))
        if level == "sequence" and bug != "staleness_sequence_as_token":
            seq, num = _segments(seq_ids)
            bad = trained & (_seq_sum(bad.to(torch.float64), seq, num) > 0)[seq]
        drop |= bad
    return drop


def _keep(log_r: Tensor, cfg: LossConfig, bug: str | None) -> Tensor:
    """The token-level rejection rules (``kl_rejection``, then ``rejections`` in order), chained: a token is kept
    iff every rule keeps it. Sequence-level rules are :func:`_dropped`'s (``sequence_rule_per_token`` tests them
    here, on each token's own ratio)."""
    corr = cfg.correction
    rules = _ratio_rules(corr)
    if bug == "rejection_chain_first_only":
        rules = rules[:1]
    if bug != "sequence_rule_per_token":
        rules = [r for r in rules if not _is_sequence_rule(r)]
    lr = log_r.clamp(-corr.max_log_ratio, corr.max_log_ratio)
    keep = torch.ones_like(log_r, dtype=torch.bool)
    for rule in rules:
        if rule.kind == "ratio":
            lo = math.log(rule.lower) if rule.lower > 0 else -math.inf
            keep &= (log_r >= lo) & (log_r <= math.log(rule.upper))
        else:
            k = _KL[rule.estimator](lr)
            lo, hi = rule.threshold if isinstance(rule.threshold, tuple) else (-math.inf, rule.threshold)
            keep &= (k <= hi) if bug == "kl_two_sided_as_upper" else (k >= lo) & (k <= hi)
    return keep


def _segments(seq_ids: Tensor) -> tuple[Tensor, int]:
    """``(index [N] of each token's sequence in 0..num-1, num)``."""
    _, seq = torch.unique(seq_ids, return_inverse=True)
    return seq, int(seq.max()) + 1 if seq.numel() else 0


def _seq_sum(x: Tensor, seq: Tensor, num: int) -> Tensor:
    return torch.zeros(num, dtype=x.dtype).index_add(0, seq, x)


def _dropped(log_r: Tensor, log_r_p: Tensor, adv: Tensor, trained: Tensor, seq_ids: Tensor | None, cfg: LossConfig,
             bug: str | None) -> Tensor:
    """``[N]`` bool: tokens of sequences a sequence rule drops, every statistic over the sequence's trained tokens:
    the veto (docs/spec.md#veto: some unclamped ``log r < log veto``), OPSM (docs/spec.md#opsm: mean advantage
    ``< 0`` and mean ``lq - log p > delta``, ``log_r_p = log p - lq`` of the current policy), a KL statistic
    ``seq_sum`` / ``seq_mean`` / ``seq_max`` of ``k`` on the clamped log-ratio outside its band
    (docs/spec.md#kl-rejection), a ratio band on the summed (``"sequence"``) or mean (``"geometric"``) unclamped
    log-ratio."""
    rules = [r for r in _ratio_rules(cfg.correction) if bug != "sequence_rule_per_token" and _is_sequence_rule(r)]
    drop = torch.zeros_like(trained)
    if not rules and cfg.veto is None and cfg.opsm_delta is None and cfg.seq_logprob_error is None:
        return drop
    seq, num = _segments(seq_ids)
    count = _seq_sum(trained.to(log_r.dtype), seq, num)
    lr = log_r.clamp(-cfg.max_log_ratio, cfg.max_log_ratio)
    seq_drop = torch.zeros(num, dtype=torch.bool)
    if cfg.seq_logprob_error is not None:
        # docs/spec.md#seq-logprob-error: mean over the sequence's trained tokens of exp(|clamped log r|).
        e = torch.exp(lr if bug == "seq_logprob_error_signed" else lr.abs())
        mean = _seq_sum(torch.where(trained, e, torch.zeros_like(e)), seq, num) / count.clamp_min(1)
        seq_drop |= (count > 0) & (mean > cfg.seq_logprob_error)
    if cfg.veto is not None:
        seq_drop |= _seq_sum((trained & (log_r < math.log(cfg.veto))).to(lr.dtype), seq, num) > 0
    if cfg.opsm_delta is not None:
        mean_adv = _seq_sum(torch.where(trained, adv, torch.zeros_like(adv)), seq, num) / count.clamp_min(1)
        k1 = _seq_sum(torch.where(trained, -log_r_p, torch.zeros_like(log_r_p)), seq, num)
        negative = torch.ones_like(seq_drop) if bug == "opsm_any_advantage" else mean_adv < 0
        seq_drop |= (count > 0) & negative & (k1 / count.clamp_min(1) > cfg.opsm_delta)
    for rule in rules:
        if rule.kind == "ratio":
            total = _seq_sum(torch.where(trained, log_r, torch.zeros_like(log_r)), seq, num)
            stat = total / count.clamp_min(1) if rule.level == "geometric" else total
            lo = math.log(rule.lower) if rule.lower > 0 else -math.inf
            band = (lo, math.log(rule.upper))
        else:
            k = _KL[rule.estimator](lr)
            if rule.level == "seq_max":
                fill = torch.where(trained, k, torch.full_like(k, -math.inf))
                stat = torch.full((num,), -math.inf, dtype=k.dtype).scatter_reduce(0, seq, fill, "amax")
            else:
                stat = _seq_sum(torch.where(trained, k, torch.zeros_like(k)), seq, num)
                if rule.level == "seq_mean":
                    stat = stat / count.clamp_min(1)
            band = rule.threshold if isinstance(rule.threshold, tuple) else (-math.inf, rule.threshold)
        seq_drop |= (count > 0) & ~((stat >= band[0]) & (stat <= band[1]))
    return seq_drop[seq] & trained


def _m2po_drop(log_r: Tensor, trained: Tensor, cfg: LossConfig, bug: str | None) -> Tensor:
    """docs/spec.md#m2po: over the trained tokens in order of decreasing ``(clamped log r)^2`` (ties in token order),
    drop the fewest whose removal brings the remaining mean below ``tau`` (all but one when none does)."""
    drop = torch.zeros_like(trained)
    if cfg.m2po is None:
        return drop
    idx = [int(i) for i in trained.nonzero().flatten()]
    m2 = log_r.clamp(-cfg.max_log_ratio, cfg.max_log_ratio).square()
    order = sorted(idx, key=lambda i: (float(m2[i]) if bug == "m2po_smallest_first" else -float(m2[i]), i))
    for k in range(len(order)):
        rest = order[k:]
        if sum(float(m2[i]) for i in rest) / len(rest) < cfg.m2po:
            break
    else:
        k = max(0, len(order) - 1)
    for i in order[:k]:
        drop[i] = True
    return drop


def _covariance(logp_y: Tensor, adv: Tensor, valid: Tensor) -> Tensor:
    """``[N]`` ``(A_t - mean A)(log p_t - mean log p)`` with the means over ``valid`` (detached)."""
    lp = torch.where(valid, logp_y.detach(), torch.zeros_like(logp_y))
    n = valid.sum().clamp_min(1)
    a_mean = torch.where(valid, adv, torch.zeros_like(adv)).sum() / n
    return (adv - a_mean) * (lp - lp.sum() / n)


def _batch_scale(w: Tensor, sel: Tensor, seq_ids: Tensor | None, cfg: LossConfig, bug: str | None) -> Tensor:
    """docs/spec.md#batch-normalization: ``1 / mean(w)`` over the selected (trained, not dropped) tokens, or over
    the sequences' mean selected weights (``"sequences"``); 1 when there is no normalisation or the mean is 0."""
    if cfg.batch_normalize is False:
        return w.new_ones(())
    if bug == "batch_norm_counts_untrained":
        sel = torch.ones_like(sel)
    if cfg.batch_normalize == "sequences" and bug != "batch_norm_sequences_as_tokens":
        seq, num = _segments(seq_ids)
        sums = _seq_sum(torch.where(sel, w, torch.zeros_like(w)), seq, num)
        counts = _seq_sum(sel.to(w.dtype), seq, num)
        has = counts > 0
        mean = (sums[has] / counts[has]).sum() / has.sum().clamp_min(1)
    else:
        mean = torch.where(sel, w, torch.zeros_like(w)).sum() / sel.sum().clamp_min(1)
    return torch.where(mean > 0, 1 / torch.where(mean > 0, mean, torch.ones_like(mean)), torch.ones_like(mean))


def _f(log_r: Tensor, cfg: LossConfig, bug: str | None) -> Tensor:
    """The weight function with the token-level rejection rules folded in."""
    return _weight(log_r, cfg, bug) * _keep(log_r, cfg, bug)


def _weight(log_r: Tensor, cfg: LossConfig, bug: str | None) -> Tensor:
    corr = cfg.correction
    lo, hi = corr.lower, corr.upper
    lr = log_r.clamp(-corr.max_log_ratio, corr.max_log_ratio)
    if bug == "unclamped_ratio":
        r = torch.exp(log_r)
        inside = (r >= lo) & (r <= hi)
        if cfg.weights == "mis":
            return r * inside
        if cfg.weights == "tis":
            return r.clamp(lo, hi)
        return torch.ones_like(r) if cfg.weights == "none" else inside.to(r.dtype)
    log_lo = math.log(lo) if lo > 0 else -math.inf
    inside = (log_r >= log_lo) & (log_r <= math.log(hi))
    if cfg.weights == "none":
        return torch.ones_like(lr)
    if cfg.weights == "tis":
        return torch.exp(lr.clamp(min=max(log_lo, -corr.max_log_ratio), max=math.log(hi)))
    if cfg.weights == "mis":
        if bug == "mis_clip":
            return torch.exp(lr.clamp(min=max(log_lo, -corr.max_log_ratio), max=math.log(hi)))
        return torch.where(inside, torch.exp(lr), torch.zeros_like(lr))
    return inside.to(lr.dtype)


def _sequence_log_ratio(log_r: Tensor, trained: Tensor, seq_ids: Tensor, cfg: LossConfig, bug: str | None) -> Tensor:
    """``[N]``: each token's sequence's summed (``"sequence"``) or mean (``"geometric"``) trained log-ratio."""
    counted = torch.ones_like(trained) if bug == "sequence_counts_untrained" else trained
    seq, num = _segments(seq_ids)
    total = _seq_sum(torch.where(counted, log_r, torch.zeros_like(log_r)), seq, num)
    count = _seq_sum(counted.to(log_r.dtype), seq, num).clamp_min(1)
    return (total / count if cfg.level == "geometric" and bug != "geometric_as_sequence" else total)[seq]


def _sequence_weight(log_r: Tensor, trained: Tensor, seq_ids: Tensor, cfg: LossConfig, bug: str | None) -> Tensor:
    """``f`` of each sequence's summed (``"sequence"``) or mean (``"geometric"``) trained log-ratio, per token."""
    seq_lr = _sequence_log_ratio(log_r, trained, seq_ids, cfg, bug)
    return _weight(seq_lr, cfg, bug) * _keep(log_r, cfg, bug)  # token-level rules act on each token's own r


def _aggregate(loss: Tensor, trained: Tensor, seq_ids: Tensor | None, cfg: LossConfig, bug: str | None) -> Tensor:
    """The scalar of ``cfg.aggregation`` from per-token losses (0 where untrained)."""
    count = trained.sum().clamp_min(1).to(loss.dtype)
    if cfg.aggregation == "token_mean" or bug == "seq_mean_as_token_mean":
        return loss.sum() / (loss.new_tensor(float(max(1, loss.shape[0]))) if bug == "mean_over_all_tokens" else count)
    if cfg.aggregation == "constant":
        return loss.sum() / cfg.constant_normalizer
    _, seq = torch.unique(seq_ids, return_inverse=True)
    num = int(seq.max()) + 1 if seq.numel() else 0
    sums = torch.zeros(num, dtype=loss.dtype).index_add(0, seq, loss)
    tokens = torch.zeros(num, dtype=loss.dtype).index_add(0, seq, trained.to(loss.dtype))
    per_seq = sums / tokens.clamp_min(1) if cfg.aggregation == "seq_mean_token_mean" else sums
    return per_seq.sum() / (tokens > 0).sum().clamp_min(1)


def _surrogate(logp_y: Tensor, prox: Tensor, adv: Tensor, trained: Tensor, seq_ids: Tensor | None, cfg: LossConfig,
               bug: str | None, valid: Tensor | None = None) -> Tensor:
    """``s_t`` of decoupled PPO (clipped ``u A``, dual clip, delta) or CISPO (``sg(clamp(u, lo, hi)) A log p``),
    ``u = p / pi_prox`` (GSPO-token: ``u = sg(s_i) p_t / sg(p_t)`` with GSPO's sequence ratio
    ``s_i = exp(mean_{t in i} log(p_t / pi_prox_t))`` over trained tokens); the token loss is ``-w s``."""
    corr = cfg.correction
    if cfg.ppo_ratio == "gspo_token":
        seq, num = _segments(seq_ids)
        lp = torch.where(trained, logp_y, torch.zeros_like(logp_y))
        lp_in_mean = lp if bug == "gspo_token_sequence_gradient" else lp.detach()
        zero = torch.zeros_like(lp)
        count = _seq_sum(trained.to(lp.dtype), seq, num).clamp_min(1)
        log_s = (_seq_sum(torch.where(trained, lp_in_mean - prox, zero), seq, num) / count)[seq]
        log_u = log_s if bug == "gspo_token_sequence_gradient" else log_s + lp - lp.detach()
    else:
        log_u = logp_y - prox
    log_u = log_u.clamp(-corr.max_log_ratio, corr.max_log_ratio)
    if cfg.cispo is not None:
        coef = torch.exp(log_u if bug == "cispo_coef_attached" else log_u.detach())
        if bug != "cispo_unclipped":
            coef = coef.clamp(*cfg.cispo)
        return torch.where(coef != 0, coef * adv * logp_y, torch.zeros_like(logp_y))
    u = torch.exp(log_u)
    if cfg.kl_cov is not None:
        # docs/spec.md#kl-cov: u A minus coef |log u| on the top max(1, int(n ratio)) valid tokens by covariance.
        ratio, coef = cfg.kl_cov
        valid = valid & torch.isfinite(logp_y.detach())
        cov = torch.where(valid, _covariance(logp_y, adv, valid), torch.full_like(adv, -math.inf))
        k = max(1, int(int(valid.sum()) * ratio))
        top = torch.zeros_like(valid)
        if valid.any():
            top[torch.sort(cov, descending=True, stable=True).indices[:k]] = True
        pen = coef * (log_u if bug == "kl_cov_penalty_signed" else log_u.abs())
        return u * adv - torch.where(top & valid, pen, torch.zeros_like(pen))
    if cfg.clip_cov is not None:
        # docs/spec.md#clip-cov: PPO's clipped u A, 0 on tokens drawn (seeded randperm) among the unclipped valid
        # tokens with lb < covariance < ub.
        lb, ub = cfg.clip_cov
        lo, hi = cfg.clip_cov_eps
        valid = valid & torch.isfinite(logp_y.detach())
        s1, s2 = u * adv, u.clamp(1 - lo, 1 + hi) * adv
        cov = _covariance(logp_y, adv, valid)
        cand = (valid & ~(s2.detach() < s1.detach()) & (cov > lb) & (cov < ub)).nonzero().flatten()
        k = max(1, int(int(valid.sum()) * cfg.clip_cov_ratio))
        perm = (torch.arange(len(cand)) if bug == "clip_cov_unseeded_draw"
                else torch.randperm(len(cand), generator=torch.Generator().manual_seed(cfg.clip_cov_seed)))
        out = torch.ones_like(valid)
        out[cand[perm[:k]]] = False
        return torch.where(out, torch.minimum(s1, s2), torch.zeros_like(s1))
    lo, hi = cfg.ppo_clip
    capped = u if cfg.ppo_delta is None or bug == "ppo_delta_ignored" else u.clamp(max=cfg.ppo_delta)
    s = torch.minimum(capped * adv, u.clamp(1 - lo, 1 + hi) * adv)
    if cfg.dual_clip is not None and bug != "dual_clip_missing":
        floor = cfg.dual_clip * adv
        if bug == "dual_clip_positive_advantages":
            s = torch.maximum(s, floor)
        elif bug == "dual_clip_as_upper_bound":
            s = torch.where(adv < 0, torch.minimum(s, floor), s)
        else:
            s = torch.where(adv < 0, torch.maximum(s, floor), s)
    return s


def dense_loss(cfg: LossConfig, bug: str | None = None):
    """A loss for configuration ``cfg`` with one injected ``bug`` (a key of :data:`BUGS`) or none."""
    if bug is not None and bug not in BUGS:
        raise KeyError(f"unknown bug {bug!r}; expected one of {list(BUGS)}")

    def loss_fn(logits, tokens, sampler_logprobs, candidates, advantages, temperature, loss_mask=None, seq_ids=None,
                proximal_logprobs=None, versions=None, current_version=None, route_flips=None):
        if cfg.needs_sequences and seq_ids is None:
            raise ValueError(f"seq_ids is required by {cfg.describe()}")
        trained = torch.ones_like(tokens, dtype=torch.bool) if loss_mask is None else loss_mask
        tau = temperature * temperature if bug == "temperature_twice" else temperature
        z = logits.double()
        support = candidates is not None and candidates.kind == "support"
        valid = None
        if candidates is not None:
            valid = candidates.ids >= 0
            ids = candidates.ids.clamp_min(0)
        x = z / tau
        if support and bug != "support_not_replayed":
            # Padding (-1) goes to an extra column that is dropped: it must not overwrite a real id's entry.
            slot = torch.where(valid, ids, torch.full_like(ids, z.shape[1]))
            in_s = torch.zeros(z.shape[0], z.shape[1] + 1, dtype=torch.bool).scatter(1, slot, True)[:, :-1]
            x = x.masked_fill(~in_s, -math.inf)
        if bug == "temperature_numerator_only":
            logp = x - torch.logsumexp(z, dim=1, keepdim=True)
        else:
            logp = torch.log_softmax(x, dim=1)
        logp_y = logp.gather(1, tokens[:, None].long())[:, 0]
        lq = sampler_logprobs.double()
        lq_used = lq if bug == "sampler_grad_leak" else lq.detach()
        lp_for_w = logp_y if bug == "weights_not_detached" else logp_y.detach()
        adv = advantages.double().detach()
        # The ratio the weights and rejections act on: pi_prox / q under decoupled PPO / CISPO, else p / q.
        prox = proximal_logprobs.double().detach() if cfg.needs_proximal else None
        log_r = prox - lq_used if cfg.needs_proximal else lp_for_w - lq_used
        if cfg.level == "token" or bug == "sequence_as_token":
            w = _f(log_r, cfg, bug)
            bounded = log_r
        else:
            w = _sequence_weight(log_r, trained, seq_ids, cfg, bug)
            bounded = _sequence_log_ratio(log_r, trained, seq_ids, cfg, bug)
        dropped = _dropped(log_r, logp_y.detach() - lq_used.detach(), adv, trained, seq_ids, cfg, bug)
        dropped = dropped | _m2po_drop(log_r.detach(), trained, cfg, bug)
        dropped = dropped | _mask_rule_drop(trained, seq_ids, versions, current_version, route_flips, cfg, bug)
        w = torch.where(dropped, torch.zeros_like(w), w)
        impossible = logp_y.detach() == -math.inf
        kept = trained & ~dropped
        for_mean = w if bug == "batch_norm_counts_untrained" else torch.where(impossible, torch.zeros_like(w), w)
        scale = _batch_scale(for_mean, kept, seq_ids, cfg, bug)
        w = w * scale
        counted = trained
        if not cfg.rejected_in_normalizer and bug != "rejected_kept_in_normalizer":
            # Rejected tokens (sequence rules, token-level rules, a "reject" weight outside its band) leave it.
            counted = kept & _keep(log_r, cfg, bug)
            if cfg.weights == "reject":
                lo = math.log(cfg.correction.lower) if cfg.correction.lower > 0 else -math.inf
                counted = counted & (bounded >= lo) & (bounded <= math.log(cfg.correction.upper))
        if cfg.needs_proximal:
            # Decoupled PPO / CISPO: the weight acts on pi_prox / q; an impossible token weighs 0.
            w = torch.where(impossible, torch.zeros_like(w), w)
            s = _surrogate(logp_y, prox, adv, trained, seq_ids, cfg, bug, valid=kept)
            loss = torch.where(w != 0, -w * s, torch.zeros_like(s))
            loss = torch.where((adv != 0) & trained, loss, torch.zeros_like(loss))
            return loss if cfg.aggregation is None else _aggregate(loss, counted, seq_ids, cfg, bug)
        if cfg.topr is not None or cfg.kimi15 is not None:
            # docs/spec.md#topr, #kimi15: u = p / pi_old, pi_old the sampler here (no proximal policy fed).
            log_u = (logp_y - lq_used).clamp(-cfg.max_log_ratio, cfg.max_log_ratio)
            if cfg.topr is not None:
                pos, neg = cfg.topr
                u = torch.exp(log_u.detach())
                coef = torch.where(adv >= 0, torch.full_like(u, pos),
                                   neg * (u if bug == "topr_negative_unclipped" else u.clamp(0.0, 1.0)))
                s = torch.where(coef != 0, coef * adv * logp_y, torch.zeros_like(logp_y))
            else:
                pen = log_u.detach() if bug == "kimi15_penalty_detached" else log_u
                s = adv * logp_y - 0.5 * cfg.kimi15 * pen.square()
            loss = torch.where(w != 0, -w * s, torch.zeros_like(s))
            loss = torch.where((adv != 0) & kept, loss, torch.zeros_like(loss))
            return loss if cfg.aggregation is None else _aggregate(loss, counted, seq_ids, cfg, bug)
        term = w * logp_y if bug == "no_inf_guard" else torch.where(w != 0, w * logp_y, torch.zeros_like(logp_y))
        if cfg.score_centering and candidates is not None:
            lpc = logp.gather(1, ids)
            clq = candidates.logprobs.double().detach()
            zero = torch.zeros_like(lpc)
            lpc_d = lpc if bug == "sc_coef_not_detached" else lpc.detach()
            p = torch.where(valid, lpc_d.exp(), zero)
            q = torch.where(valid, clq.exp(), zero)
            if bug == "sc_unweighted":
                m = q
            else:
                m = torch.where(q > 0, q * _f(lpc_d - clq, cfg, bug), zero)
            if support:
                rho = torch.ones(p.shape[0], dtype=p.dtype)
            elif bug == "rho_no_floor":
                rho = (1 - q.sum(1)) / (1 - p.sum(1))
            else:
                rho = (1 - q.sum(1)).clamp_min(EPS) / (1 - p.sum(1)).clamp_min(EPS)
            alpha = rho * _f(-torch.log(rho), cfg, bug)
            c = scale * (m - alpha[:, None] * p)
            if bug == "sc_no_tail":
                c = scale * m
            if bug == "sc_skipped":
                c = zero
            term = term - torch.where(c != 0, c * lpc, zero).sum(1)
        loss = adv * term if bug == "sign_error" else -adv * term
        keep = (adv != 0) if bug == "mask_ignored" else (adv != 0) & kept
        loss = torch.where(keep, loss, torch.zeros_like(loss))
        return loss if cfg.aggregation is None else _aggregate(loss, counted, seq_ids, cfg, bug)

    loss_fn.__qualname__ = f"dense_loss[{bug or 'correct'}]"
    return loss_fn


# Entry points for ``OFFPOLICY_LOSS=mutants:<name> pytest --pyargs offpolicy.testing`` (tests/support/ on the path).
_MIS_SUPPORT = LossConfig(weights="mis", score_centering=True, record="support")
correct_mis_support = with_config(_MIS_SUPPORT)(dense_loss(_MIS_SUPPORT))
unweighted_mis_support = with_config(_MIS_SUPPORT)(dense_loss(_MIS_SUPPORT, "sc_unweighted"))
