"""Deliberately wrong policy losses, for showing that ``offpolicy.testing`` catches each mistake.

:func:`dense_loss` is an independent, dense (``[N, V]`` log-softmax) implementation of the spec's per-token loss,
written in the style of a framework's loss function and reached through the kit's adapter signature. With
``bug=None`` it is correct (the kit must pass it); each entry of :data:`BUGS` injects one mistake people make.
Besides the weights, levels and score centering it implements token-level rejection rules (chained ratio bands
and KL bands, one- or two-sided) and the token-ratio surrogates (decoupled PPO with its dual clip and delta,
CISPO); it refuses the rest of the family (sequence rules, batch normalisation, GSPO-token, the normaliser
convention) rather than get them wrong.
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
}

#: The KL estimators at a clamped log-ratio ``lr`` (k1, k2, k3 of KL(q || p)).
_KL = {"k1": lambda lr: -lr, "k2": lambda lr: 0.5 * lr * lr, "k3": lambda lr: torch.exp(lr) - 1 - lr}


def _keep(log_r: Tensor, cfg: LossConfig, bug: str | None) -> Tensor:
    """The token-level rejection rules (``kl_rejection``, then ``rejections`` in order), chained: a token is kept
    iff every rule keeps it."""
    corr = cfg.correction
    rules = [r for _, r in corr.rejection_rules]
    if bug == "rejection_chain_first_only":
        rules = rules[:1]
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


def _sequence_weight(log_r: Tensor, trained: Tensor, seq_ids: Tensor, cfg: LossConfig, bug: str | None) -> Tensor:
    """``f`` of each sequence's summed (``"sequence"``) or mean (``"geometric"``) trained log-ratio, per token."""
    counted = torch.ones_like(trained) if bug == "sequence_counts_untrained" else trained
    _, seq = torch.unique(seq_ids, return_inverse=True)
    num = int(seq.max()) + 1 if seq.numel() else 0
    lr = torch.where(counted, log_r, torch.zeros_like(log_r))
    total = torch.zeros(num, dtype=lr.dtype).index_add(0, seq, lr)
    count = torch.zeros(num, dtype=lr.dtype).index_add(0, seq, counted.to(lr.dtype)).clamp_min(1)
    seq_lr = total / count if cfg.level == "geometric" and bug != "geometric_as_sequence" else total
    return _weight(seq_lr[seq], cfg, bug) * _keep(log_r, cfg, bug)  # token-level rules act on each token's own r


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


def _surrogate(logp_y: Tensor, prox: Tensor, adv: Tensor, cfg: LossConfig, bug: str | None) -> Tensor:
    """``s_t`` of decoupled PPO (clipped ``u A``, dual clip, delta) or CISPO (``sg(clamp(u, lo, hi)) A log p``),
    ``u = p / pi_prox``; the token loss is ``-w s``."""
    corr = cfg.correction
    log_u = (logp_y - prox).clamp(-corr.max_log_ratio, corr.max_log_ratio)
    if cfg.cispo is not None:
        coef = torch.exp(log_u if bug == "cispo_coef_attached" else log_u.detach())
        if bug != "cispo_unclipped":
            coef = coef.clamp(*cfg.cispo)
        return torch.where(coef != 0, coef * adv * logp_y, torch.zeros_like(logp_y))
    u = torch.exp(log_u)
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
    unsupported = [name for name, on in (("sequence rejection rules", cfg.has_sequence_rejections),
                                         ("batch_normalize", cfg.batch_normalize is not False),
                                         ("rejected_in_normalizer=False", not cfg.rejected_in_normalizer),
                                         ("ppo_ratio='gspo_token'", cfg.ppo_ratio != "token")) if on]
    if unsupported or (cfg.needs_proximal and cfg.level != "token"):
        raise NotImplementedError(f"dense_loss does not implement {unsupported or ['sequence-level PPO weights']}")

    def loss_fn(logits, tokens, sampler_logprobs, candidates, advantages, temperature, loss_mask=None, seq_ids=None,
                proximal_logprobs=None):
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
        if cfg.needs_proximal:
            # Decoupled PPO / CISPO: the weight acts on pi_prox / q; an impossible token weighs 0.
            prox = proximal_logprobs.double().detach()
            w = _f(prox - lq_used, cfg, bug)
            w = torch.where(logp_y.detach() == -math.inf, torch.zeros_like(w), w)
            s = _surrogate(logp_y, prox, adv, cfg, bug)
            loss = torch.where(w != 0, -w * s, torch.zeros_like(s))
            loss = torch.where((adv != 0) & trained, loss, torch.zeros_like(loss))
            return loss if cfg.aggregation is None else _aggregate(loss, trained, seq_ids, cfg, bug)
        if cfg.level == "token" or bug == "sequence_as_token":
            w = _f(lp_for_w - lq_used, cfg, bug)
        else:
            w = _sequence_weight(lp_for_w - lq_used, trained, seq_ids, cfg, bug)
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
            c = m - alpha[:, None] * p
            if bug == "sc_no_tail":
                c = m
            if bug == "sc_skipped":
                c = zero
            term = term - torch.where(c != 0, c * lpc, zero).sum(1)
        loss = adv * term if bug == "sign_error" else -adv * term
        keep = (adv != 0) if bug == "mask_ignored" else (adv != 0) & trained
        loss = torch.where(keep, loss, torch.zeros_like(loss))
        return loss if cfg.aggregation is None else _aggregate(loss, trained, seq_ids, cfg, bug)

    loss_fn.__qualname__ = f"dense_loss[{bug or 'correct'}]"
    return loss_fn


# Entry points for ``OFFPOLICY_LOSS=mutants:<name> pytest --pyargs offpolicy.testing`` (tests/support/ on the path).
_MIS_SUPPORT = LossConfig(weights="mis", score_centering=True, record="support")
correct_mis_support = with_config(_MIS_SUPPORT)(dense_loss(_MIS_SUPPORT))
unweighted_mis_support = with_config(_MIS_SUPPORT)(dense_loss(_MIS_SUPPORT, "sc_unweighted"))
