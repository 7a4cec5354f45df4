"""Detached diagnostics of the sampler-trainer mismatch and of the correction (docs/spec.md#metrics).

Keys (all scalar tensors, means over trained tokens unless named otherwise):

* mismatch: ``kl_k1``, ``kl_k2``, ``kl_k3`` (estimators of KL(q||p) on sampled tokens), ``abs_log_ratio_mean``,
  ``abs_log_ratio_max``, ``extreme_ratio_frac`` (share of tokens with ``r`` outside ``[0.2, 5]``);
* weights: ``weight_mean``, ``weight_min``, ``weight_max``, ``ratio_below_lower_frac``,
  ``ratio_above_upper_frac`` (tokens whose *bounded* ratio, the one the bounds act on, lies below / above the
  bounds: the token's ``p / q``, its sequence's product or geometric mean at those levels, ``pi_prox / q`` under
  decoupled PPO), ``ess`` (effective sample size ``(sum w)^2 / (n sum w^2)``), ``rejected_frac`` (dropped by
  veto / KL rejection / OPSM), ``zero_prob_frac`` (sampled tokens the trainer gives probability 0: weight 0);
* spread: ``chi2_token`` (``mean r^2 - 1``), ``ratio_mean``, ``ratio_max``, ``ratio_min`` (the untruncated token
  ratio ``p / q``, clamped only at ``exp(+-max_log_ratio)``), ``weight_std`` (population std of the final weights),
  ``weight_before_bound_mean`` / ``weight_before_bound_max`` (of the ratio the bounds act on, before ``f``: the
  pre-clamp weight beside ``weight_mean`` / ``weight_max``);
* both KL directions from the sampled tokens (k3 forms): ``kl_sampler_trainer`` (``mean r - 1 - log r``, the same
  number as ``kl_k3``), ``kl_trainer_sampler`` (``mean r log r - (r - 1)``) and its k1 form
  ``kl_trainer_sampler_k1`` (``mean r log r``);
* ``masked_share_pos_adv`` / ``masked_share_neg_adv``: share of trained tokens with ``A > 0`` / ``A < 0`` whose
  final weight is 0 (masked by the bounds, rejected, or impossible);
* perplexities over the trained tokens the trainer can produce (``zero_prob_frac`` counts the others):
  ``ppl_trainer = exp(mean -log p)``, ``ppl_sampler = exp(mean -lq)``, ``ppl_ratio`` (their ratio);
* with ``veto``: ``veto_catastrophic_frac`` (tokens whose ratio is below the veto threshold);
* with ``seq_ids`` (overall only, over this rank's sequences with a trained token): ``seq_chi2``
  (``mean rho^2 - 1``, ``rho = exp(sum_t log r_t)``), ``seq_ratio_mean/max/min`` (``rho``),
  ``seq_log_ppl_diff_mean/abs_mean/max/min`` (``d = mean_t (lq - log p)``, the log of the trainer-to-sampler
  perplexity ratio; clamped log-ratios), ``seq_ppl_ratio_mean`` (``mean exp(d)``), and per sequence rule ``R``
  switched on ``rejected_frac/R`` (share of trained tokens in sequences ``R`` drops); at the sequence levels
  ``seq_ess`` (the ESS of the per-sequence weights, each the mean of its trained tokens' final weights);
* agreement of the trained tokens' probabilities ``p = exp(log p(y))`` (the trainer's, as the loss uses it: ``p^S``
  under mask replay) and ``q = exp(lq)``: ``prob_pearson`` (Pearson's correlation of ``p`` and ``q`` over the
  selected tokens; 1 when either side is constant and ``p == q`` on every token, 0 when constant otherwise or with
  no token), ``prob_abs_diff_max`` / ``prob_abs_diff_mean`` / ``prob_abs_diff_std`` (of ``|p - q|``; the std with
  Bessel's correction, ``n - 1``, as verl's ``torch.std``; 0 under two tokens);
* policy: ``entropy`` (of ``p``, or of ``p^S`` under mask replay), ``num_tokens``;
* with a ``kl_penalty`` (added by :mod:`offpolicy.loss.logprobs`): ``ref_kl`` (mean weighted estimate),
  ``kl_penalty`` (its aggregated contribution to the loss);
* records: ``support_size``; with score centering ``sc_p_head``, ``sc_q_head``, ``sc_rho``, ``sc_abs_coef_sum``;
* per sampler group ``g``: ``group/{g}/<name>`` with ``share_samples`` (of sequences when ``seq_ids`` are given,
  else of tokens), ``share_tokens``, ``share_extreme`` (the group's share of all extreme-ratio tokens) and the
  mismatch and weight keys above;
* per staleness ``s = current_version - version``: ``staleness/{s}/<name>``, the same; with ``seq_ids`` too,
  ``staleness_in_flight`` (``mean_t v_end - v_t``, ``v_end`` the newest version among the sequence's trained
  tokens, the one it finished under) and ``staleness_in_queue`` (``mean_t current_version - v_end``);
* with the ``route_flips`` input (a mixture-of-experts sampler's flipped layers per token): the route-agreement
  keys of :func:`offpolicy.loss.route_metrics.route_flip_metrics` over the trained tokens, ``route_tokens``,
  ``route_flip_layers_mean``, ``route_any_flip_frac``, and per group ``group/{g}/route_*`` (docs/routing.md).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from offpolicy.loss.centering import Centering
from offpolicy.corrections.rules import Veto
from offpolicy.corrections.tree import CorrectionTree
from offpolicy.loss.route_metrics import route_flip_metrics
from offpolicy.loss.segments import Segments
from offpolicy.corrections.node import log_bound
from offpolicy.corrections.weights import kl_estimate

EXTREME_RATIO = (0.2, 5.0)



def saturating_exp(x: Tensor) -> Tensor:
    """``exp(x)`` saturating at the dtype's largest finite value instead of overflowing to ``inf`` (a perplexity
    of a token the trainer gives probability ``e^-1000`` is reported as ``finfo.max``, not ``inf``)."""
    return torch.exp(x).clamp(max=torch.finfo(x.dtype).max)

def _mean(x: Tensor, sel: Tensor) -> Tensor:
    n = sel.sum()
    return torch.where(sel, x, torch.zeros_like(x)).sum() / n.clamp_min(1)


def _max(x: Tensor, sel: Tensor) -> Tensor:
    """Max of a non-negative quantity over the selection; 0 for an empty one. Branch-free (no host sync)."""
    if x.numel() == 0:
        return x.new_zeros(())
    return torch.where(sel, x, torch.full_like(x, -math.inf)).amax().clamp_min(0)


def _min(x: Tensor, sel: Tensor) -> Tensor:
    """Min over the selection; 0 for an empty one."""
    if x.numel() == 0:
        return x.new_zeros(())
    low = torch.where(sel, x, torch.full_like(x, math.inf)).amin()
    return torch.where(torch.isfinite(low), low, torch.zeros_like(low))


class TokenView(NamedTuple):
    """Per-token detached inputs of the statistics, all ``[N]``.

    Attributes:
        lr: clamped ``log p - lq``.
        lw: unclamped log of the token ratio the weights act on (``pi_prox / q`` under decoupled PPO).
        lb: unclamped log of the ratio the bounds act on (token, sequence or geometric).
        impossible: bool, sampled tokens with trainer probability 0.
        w: final weights.
        logp: ``log p(y)``.
        lq: ``log q(y)``.
        adv: advantages (None: no ``masked_share_*_adv`` keys).
    """

    lr: Tensor
    lw: Tensor
    lb: Tensor
    impossible: Tensor
    w: Tensor
    logp: Tensor
    lq: Tensor
    adv: Tensor | None = None


def token_stats(v: TokenView, sel: Tensor, tree: CorrectionTree) -> dict[str, Tensor]:
    """Mismatch and weight statistics over the tokens selected by ``sel [N]`` (bool). Keys: the token-level keys
    of the module docstring, ``ess`` and ``num_tokens``."""
    lr, lb, impossible, w = v.lr, v.lb, v.impossible, v.w
    n = sel.sum()
    r = torch.exp(lr)
    possible = sel & ~impossible
    zero = torch.zeros_like(lr)
    neg_logp = _mean(torch.where(possible, -v.logp, zero), possible)
    neg_lq = _mean(torch.where(possible, -v.lq, zero), possible)
    mean_w = _mean(w, sel)
    out = {
        "kl_k1": _mean(kl_estimate(lr, "k1"), sel),
        "kl_k2": _mean(kl_estimate(lr, "k2"), sel),
        "kl_k3": _mean(kl_estimate(lr, "k3"), sel),
        "abs_log_ratio_mean": _mean(lr.abs(), sel),
        "abs_log_ratio_max": _max(lr.abs(), sel),
        "extreme_ratio_frac": _mean(_extreme(lr).to(lr.dtype), sel),
        "weight_mean": _mean(w, sel),
        "weight_min": _min(w, sel),
        "weight_max": _max(w, sel),
        "ratio_below_lower_frac": _mean((lb < log_bound(tree.weighting.mode.lower)).to(lr.dtype), sel),
        "ratio_above_upper_frac": _mean((lb > log_bound(tree.weighting.mode.upper)).to(lr.dtype), sel),
        "zero_prob_frac": _mean(impossible.to(lr.dtype), sel),
        "chi2_token": torch.where(n > 0, _mean(r * r, sel) - 1, zero.sum() * 0),
        "ratio_mean": _mean(r, sel),
        "ratio_max": _max(r, sel),
        "ratio_min": _min(r, sel),
        # Two passes (mean, then the mean squared deviation): E[w^2] - E[w]^2 cancels to noise for equal weights.
        "weight_std": _mean((w - mean_w).square(), sel).sqrt(),
        "weight_before_bound_mean": _mean(torch.exp(lb.clamp(-tree.max_log_ratio, tree.max_log_ratio)), sel),
        "weight_before_bound_max": _max(torch.exp(lb.clamp(-tree.max_log_ratio, tree.max_log_ratio)), sel),
        # Both KL directions from tokens drawn from q (Schulman's k3 forms, each term >= 0): KL(q||p) = E_q[r - 1 -
        # log r] and KL(p||q) = E_q[r log r] = E_q[r log r - (r - 1)] since E_q[r] = 1.
        "kl_sampler_trainer": _mean(r - 1 - lr, sel),
        "kl_trainer_sampler": _mean(r * lr - (r - 1), sel),
        "kl_trainer_sampler_k1": _mean(r * lr, sel),
        "ppl_trainer": saturating_exp(neg_logp),
        "ppl_sampler": saturating_exp(neg_lq),
        "ppl_ratio": saturating_exp(neg_logp - neg_lq),
    }
    out.update(_probability_agreement(torch.exp(v.logp.to(lr.dtype)), torch.exp(v.lq), sel))
    for rule in tree.rejections:
        if isinstance(rule, Veto):
            out["veto_catastrophic_frac"] = _mean((v.lw < math.log(rule.threshold)).to(lr.dtype), sel)
    if v.adv is not None:
        masked = w == 0
        for key, side in (("masked_share_pos_adv", v.adv > 0), ("masked_share_neg_adv", v.adv < 0)):
            out[key] = _mean(masked.to(lr.dtype), sel & side)
    out["ess"] = _ess(w, sel)
    out["num_tokens"] = n.to(lr.dtype)
    return out


def _probability_agreement(p: Tensor, q: Tensor, sel: Tensor) -> dict[str, Tensor]:
    """``prob_pearson`` and ``prob_abs_diff_max/mean/std`` of ``p, q [N]`` over ``sel [N]`` (module docstring).
    Centred sums, the mean corrected once (:func:`_centred`), so that a near-constant column does not cancel to
    noise; branch-free."""
    n = sel.sum().to(p.dtype)
    zero = torch.zeros_like(p)
    # Each side centred, then divided by its largest deviation: probabilities near e^-50 deviate by ~1e-22, whose
    # squares underflow in fp32; scaled, every sum of squares is >= 1 unless the side is constant (then 0).
    dp, dq = _unit(_centred(p, sel)), _unit(_centred(q, sel))
    den = (dp * dp).sum().sqrt() * (dq * dq).sum().sqrt()
    corr = ((dp * dq).sum() / torch.where(den > 0, den, torch.ones_like(den))).clamp(-1.0, 1.0)
    equal = ~(sel & (p != q)).any() & (n > 0)
    d = (p - q).abs()
    mean_d = _mean(d, sel)
    dev = _centred(d, sel)
    dev_scale = dev.abs().amax() if dev.numel() else dev.new_zeros(())
    return {
        "prob_pearson": torch.where(den > 0, corr, equal.to(p.dtype)),
        "prob_abs_diff_max": _max(d, sel),
        "prob_abs_diff_mean": mean_d,
        "prob_abs_diff_std": torch.where(n > 1, dev_scale * ((_unit(dev) ** 2).sum() / (n - 1).clamp_min(1)).sqrt(),
                                         zero.sum() * 0),
    }


def _unit(x: Tensor) -> Tensor:
    """``x / max |x|`` (all 0 stays 0); branch-free."""
    scale = x.abs().amax() if x.numel() else x.new_zeros(())
    return torch.where(scale > 0, x / torch.where(scale > 0, scale, torch.ones_like(scale)), torch.zeros_like(x))


def _centred(x: Tensor, sel: Tensor) -> Tensor:
    """``x - mean(x)`` over ``sel`` (0 elsewhere), the mean corrected by the mean of the first deviations (the
    corrected two-pass algorithm): in fp32, 64 probabilities near 0.9 sum with an error of ~1e-7 in their mean, as
    large as a 1e-6 spread's own scale; their deviations' mean recovers it."""
    zero = torch.zeros_like(x)
    dx = torch.where(sel, x - _mean(x, sel), zero)
    return torch.where(sel, dx - _mean(dx, sel), zero)


def _extreme(lr: Tensor) -> Tensor:
    return (lr < math.log(EXTREME_RATIO[0])) | (lr > math.log(EXTREME_RATIO[1]))


def token_view(*, log_ratio: Tensor, bounded_log_ratio: Tensor, impossible: Tensor, weight_ratio: Tensor,
               logprobs: Tensor, sampler_logprobs: Tensor, weight: Tensor, tree: CorrectionTree,
               advantages: Tensor | None = None) -> TokenView:
    """The :class:`TokenView` of a batch, detached.

    Args:
        log_ratio: ``[N]`` ``log p(y) - lq`` (may hold ``+-inf``, clamped here to ``+-max_log_ratio``).
        bounded_log_ratio: ``[N]`` log of the ratio the bounds act on (token, sequence or geometric; ``pi_prox /
            q`` under decoupled PPO).
        impossible: ``[N]`` bool, sampled tokens the trainer gives probability 0.
        weight_ratio: ``[N]`` unclamped log of the token ratio the weights act on.
        logprobs, sampler_logprobs: ``[N]`` ``log p(y)`` and ``lq``.
        weight: ``[N]`` final token weights (after rejection and batch normalisation).
        advantages: ``[N]`` advantages, for the ``masked_share_*_adv`` keys (None: left out).
    """
    lr = log_ratio.detach().clamp(-tree.max_log_ratio, tree.max_log_ratio)
    adv = advantages.detach().to(lr.dtype) if advantages is not None else None
    return TokenView(lr, weight_ratio.detach(), bounded_log_ratio.detach(), impossible, weight.detach(),
                     logprobs.detach(), sampler_logprobs.detach().to(lr.dtype), adv)


def policy_metrics(
    *,
    view: TokenView,
    drops: dict[str, Tensor],
    active: Tensor,
    entropy: Tensor,
    tree: CorrectionTree,
    kept: Tensor | None = None,
    centering: Centering | None = None,
    support_size: Tensor | None = None,
    seg: Segments | None = None,
    groups: Tensor | None = None,
    versions: Tensor | None = None,
    current_version: int | None = None,
    route_flips: Tensor | None = None,
) -> dict[str, Tensor]:
    """All metrics of the module docstring.

    Args:
        view: the batch's :class:`TokenView` (see :func:`token_view`).
        drops: ``{rule: [N] bool}`` tokens each sequence rule drops.
        active: ``[N]`` bool trained tokens.
        entropy: ``[N]`` entropy of the trainer's (full or support) distribution.
        kept: ``[N]`` bool, tokens not dropped by a sequence-level rejection (None: all kept).
        centering: score-centering coefficients and diagnostics, or None.
        support_size: ``[N]`` number of recorded candidates per row, or None (no record).
        seg: sequence segments (for ``share_samples``), or None.
        groups, versions: ``[N]`` int sampler group and policy version of each token, or None.
        current_version: the trainer's version for staleness; default ``versions.max()``.
        route_flips: ``[N]`` int flipped MoE layers per token, or None.
    """
    lr = view.lr
    out = token_stats(view, active, tree)
    if seg is not None:
        out.update(_sequence_stats(lr, seg, tree))
        if tree.weighting.level.per_sequence:
            out["seq_ess"] = _ess(seg.mean(view.w), seg.has_active())
    for name, dropped in drops.items():
        out[f"rejected_frac/{name}"] = _mean(dropped.to(lr.dtype), active)
    out["entropy"] = _mean(entropy.detach().to(lr.dtype), active)
    out["rejected_frac"] = (
        _mean((~kept).to(lr.dtype), active) if kept is not None else lr.new_zeros(())
    )
    if support_size is not None:
        out["support_size"] = _mean(support_size.to(lr.dtype), active)
    if centering is not None:
        out["sc_p_head"] = _mean(centering.p_head, active)
        out["sc_q_head"] = _mean(centering.q_head, active)
        out["sc_rho"] = _mean(centering.rho, active)
        out["sc_abs_coef_sum"] = _mean(centering.abs_coef_sum, active)
    if groups is not None:
        out.update(_split(view, active, tree, groups, "group", seg))
    if versions is not None:
        now = int(versions[active].max()) if current_version is None and bool(active.any()) else current_version
        if now is not None:
            out.update(_split(view, active, tree, now - versions, "staleness", seg))
            if seg is not None:
                # The sequence's newest token version is the version it finished under: in flight before, queued
                # after (docs/spec.md#metrics).
                v = versions.to(lr.dtype)
                done = seg.broadcast(seg.max(v))
                out["staleness_in_flight"] = _mean(done - v, active)
                out["staleness_in_queue"] = _mean(now - done, active)
    if route_flips is not None:
        out.update({k: v.to(lr.dtype) for k, v in route_flip_metrics(route_flips, None, active, groups).items()})
    return out


def _ess(w: Tensor, sel: Tensor) -> Tensor:
    """``(sum w)^2 / (n sum w^2)`` over ``sel``; 0 when every selected weight is 0."""
    ws = torch.where(sel, w, torch.zeros_like(w))
    sq = (ws * ws).sum()
    return torch.where(sq > 0, ws.sum() ** 2 / (sel.sum().clamp_min(1) * sq), torch.zeros_like(sq))


def _sequence_stats(lr: Tensor, seg: Segments, tree: CorrectionTree) -> dict[str, Tensor]:
    """The ``seq_*`` keys over the sequences of ``seg`` with a trained token (``lr``: clamped log-ratios)."""
    has = seg.has_active()
    log_rho = seg.sum(lr).clamp(-tree.max_log_ratio, tree.max_log_ratio)
    rho = torch.exp(log_rho)
    d = -seg.mean(lr)
    n = has.sum()
    zero = torch.zeros((), dtype=lr.dtype, device=lr.device)
    return {
        "seq_chi2": torch.where(n > 0, _mean(rho * rho, has) - 1, zero),
        "seq_ratio_mean": _mean(rho, has),
        "seq_ratio_max": _max(rho, has),
        "seq_ratio_min": _min(rho, has),
        "seq_log_ppl_diff_mean": _mean(d, has),
        "seq_log_ppl_diff_abs_mean": _mean(d.abs(), has),
        "seq_log_ppl_diff_max": torch.where(n > 0, torch.where(has, d, torch.full_like(d, -math.inf)).amax()
                                            if d.numel() else zero, zero),
        "seq_log_ppl_diff_min": _min(d, has),
        "seq_ppl_ratio_mean": _mean(torch.exp(d), has),
    }


def _split(
    view: TokenView, active: Tensor, tree: CorrectionTree, key: Tensor, name: str, seg: Segments | None,
) -> dict[str, Tensor]:
    """Per-value statistics of ``key [N]`` over the active tokens, with each value's shares."""
    lr = view.lr
    out: dict[str, Tensor] = {}
    n_total = active.sum().clamp_min(1).to(lr.dtype)
    extreme = _extreme(lr) & active
    n_extreme = extreme.sum().to(lr.dtype)
    seq_total = seg.has_active().sum().clamp_min(1).to(lr.dtype) if seg is not None else None
    for value in torch.unique(key[active]).tolist():
        sel = active & (key == value)
        stats = token_stats(view, sel, tree)
        stats["share_tokens"] = sel.sum().to(lr.dtype) / n_total
        stats["share_extreme"] = torch.where(
            n_extreme > 0, (extreme & sel).sum().to(lr.dtype) / n_extreme.clamp_min(1), n_extreme * 0
        )
        if seg is not None:
            in_seq = torch.zeros(seg.num, dtype=torch.bool, device=lr.device)
            in_seq[seg.index[sel]] = True
            stats["share_samples"] = in_seq.sum().to(lr.dtype) / seq_total
        else:
            stats["share_samples"] = stats["share_tokens"]
        out.update({f"{name}/{value}/{k}": v for k, v in stats.items()})
    return out
