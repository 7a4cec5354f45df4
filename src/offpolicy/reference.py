"""The float64 oracle: docs/spec.md (#weights to #metrics) written literally, for reading and for tests.

Nothing here is fast, chunked or fused, and nothing here imports the fast path: it materialises the full
``[N, V]`` log-softmax in float64, loops over sequences and tokens in Python and spells each formula as the spec
does. Each correction's own formula is the ``reference`` function of its entry in
:mod:`offpolicy.corrections.registry` (the fast path uses the same entry's ``fast`` function); this module
enumerates those entries. SAPO, VESPO, GMPO and the KL penalty are the exception: their blocks below are written
here from the spec, read the Correction's raw fields and call no registry function. Gradients come from autograd
through it. Use it on small inputs.
"""

from __future__ import annotations

import math
import sys

import torch
from torch import Tensor

from offpolicy.records.candidates import Candidates
from offpolicy.corrections import registry as reg
from offpolicy.corrections.correction import Correction

TAIL_EPS = 1e-6
EXTREME = (0.2, 5.0)



def _saturating_exp(x: float) -> float:
    """``exp(x)`` saturating at the largest float64 (the fast path's perplexities saturate likewise)."""
    return math.exp(min(x, math.log(sys.float_info.max)))

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
    """The weight function (docs/spec.md#weights) at ratio ``r`` (float64), the token-level rejection rules
    included unless ``token_rejection=False``.

    ``r`` is clamped to ``exp(+-max_log_ratio)`` before use (the spec's "clamp in log space first"); bounds are
    tested on the unclamped ratio.
    """
    r = r.double()
    rc = r.clamp(math.exp(-corr.max_log_ratio), math.exp(corr.max_log_ratio))
    inside = (r >= corr.lower) & (r <= corr.upper)
    out = reg.WEIGHT_MODES[corr.weights].reference(rc, inside, corr.lower, corr.upper)
    if token_rejection:
        out = out * _token_keep(r, corr)
    return out


def _token_keep(r: Tensor, corr: Correction) -> Tensor:
    """``[N]`` bool: tokens every token-level rejection rule keeps (unclamped float64 ratios)."""
    keep = torch.ones_like(r, dtype=torch.bool)
    for rule in corr.token_rejection_rules():
        keep = keep & reg.REJECTION_KINDS[rule.kind].token_keep_reference(r, rule, corr)
    return keep


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
    reference_logprobs: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Literal float64 policy loss. Returns ``(loss, token_loss [N], weight [N])``; ``loss`` is differentiable
    with respect to ``logits`` (pass float64 logits with ``requires_grad`` for gradients). ``reference_logprobs``
    goes with ``correction.kl_penalty``."""
    corr = correction
    st = _state(logits, tokens, sampler_logprobs, advantages, candidates, loss_mask, temperature, corr, seq_ids,
                proximal_logprobs)
    n, lp, logp_y, adv, mask, keep, w = st["n"], st["lp"], st["logp_y"], st["adv"], st["mask"], st["keep"], st["w"]
    surrogate = corr.surrogate
    if corr.score_centering and candidates is None:
        raise ValueError("score centering needs candidates")
    s = None
    own = _own_surrogate(corr)
    if _trust_region_surrogate(corr):
        s = _trust_region_ratio(logp_y, st["tr_ref"], adv, corr)
    elif own is not None:
        s = own(logp_y, proximal_logprobs.double(), adv, st["seqs"], corr)
    elif surrogate.reference is not None:
        s = surrogate.reference(logp_y, proximal_logprobs.double(), adv, st["seqs"], corr)
    token_loss = torch.zeros(n, dtype=torch.float64)
    for t in range(n):
        if not (mask[t] and keep[t]) or adv[t] == 0:
            continue
        if s is not None:
            if w[t] != 0:
                token_loss[t] = -w[t] * s[t]
            continue
        term = w[t] * logp_y[t] if w[t] != 0 else torch.zeros((), dtype=torch.float64)
        if corr.score_centering:
            c, ids = _centering(lp[t], candidates, t, st["is_support"], corr)
            for cv, v in zip(c, ids):
                # A candidate the trainer gives probability 0 contributes exactly 0 (its score is undefined).
                if cv != 0 and lp[t, v] > -math.inf:
                    term = term - st["scale"] * cv * lp[t, v]
        token_loss[t] = -adv[t] * term
    if corr.trust_region is not None and corr.trust_region.penalty:
        token_loss = token_loss + _trust_region_penalty(logp_y, st["tr_ref"], mask & keep, corr)
    counted, seqs = mask, st["seqs"]
    if not corr.rejected_in_normalizer:
        # Rejected tokens (sequence rules, token-level KL rejection) leave the normaliser.
        counted = mask & keep & ~st["token_rejected"] & ~st["tr_masked"]
        if reg.WEIGHT_MODES[corr.weights].rejects:
            # A ratio outside the band is a rejection for this mode: the token leaves the normaliser too.
            b = st["bounded"]
            counted = counted & (b >= corr.lower) & (b <= corr.upper)
        seqs = [idx[counted[idx]] for idx in seqs if bool(counted[idx].any())]
    loss = _aggregate(token_loss, counted, aggregation, seqs, num_loss_tokens, num_sequences, constant_normalizer)
    if corr.kl_penalty is not None:
        old = proximal_logprobs.double() if proximal_logprobs is not None else st["lq"]
        pen, _ = _kl_penalty(logp_y, reference_logprobs.double(), old, mask, corr)
        loss = loss + _aggregate(pen, mask, aggregation, st["seqs"], num_loss_tokens, num_sequences,
                                 constant_normalizer)
        token_loss = token_loss + pen
    # Keep the loss attached to the logits even when every token is masked (its gradient is then zero).
    x = logits.double()
    loss = loss + torch.where(torch.isfinite(x), x, torch.zeros_like(x)).sum() * 0
    return loss, token_loss.detach(), w.detach()


# ---------------------------------------------------------------------------------------------------------------
# SAPO, VESPO, GMPO and the KL penalty, written here from docs/spec.md alone: they read the Correction's raw fields
# and call nothing of offpolicy.corrections (no registry function), so they check the fast path independently.
# ---------------------------------------------------------------------------------------------------------------


def _own_surrogate(corr: Correction):
    """The reference of the surrogate the raw fields select, among those written here; None for the others."""
    if corr.sapo is not None:
        return _sapo
    if corr.vespo is not None:
        return _vespo
    if corr.gmpo is not None:
        return _gmpo
    return None


def _ratio(log_x: Tensor, corr: Correction) -> Tensor:
    """``exp(log_x)`` with ``log_x`` clamped to ``[-max_log_ratio, max_log_ratio]`` first."""
    return torch.exp(log_x.clamp(-corr.max_log_ratio, corr.max_log_ratio))


def _sapo(logp_y: Tensor, prox: Tensor, adv: Tensor, seqs: list, corr: Correction) -> Tensor:
    """docs/spec.md#sapo, token by token: ``s_t = (4 / tau) sigmoid(tau (u_t - 1)) A_t``, ``tau`` = ``tau_pos``
    where ``A_t > 0`` else ``tau_neg``."""
    tau_pos, tau_neg = corr.sapo
    out = torch.zeros_like(logp_y)
    for t in range(logp_y.shape[0]):
        tau = tau_pos if float(adv[t]) > 0 else tau_neg
        u = _ratio(logp_y[t] - prox[t], corr)
        out[t] = 4.0 / tau / (1.0 + torch.exp(-tau * (u - 1.0))) * adv[t]
    return out


def _vespo(logp_y: Tensor, prox: Tensor, adv: Tensor, seqs: list, corr: Correction) -> Tensor:
    """docs/spec.md#vespo, sequence by sequence: ``log W = clamp(sum_t clamp(log u_t), log 1e-8, max)``,
    ``phi = exp(lam + k log W - lam W)`` (detached; ``(k, lam)`` by the sign of ``A_t``), ``s_t = phi A_t log p``."""
    k_pos, lam_pos, k_neg, lam_neg = corr.vespo
    out = torch.zeros_like(logp_y)
    for idx in seqs:
        log_w = sum(min(max(float(logp_y[t].detach()) - float(prox[t]), -corr.max_log_ratio), corr.max_log_ratio)
                    for t in idx.tolist())
        log_w = min(max(log_w, math.log(1e-8)), corr.max_log_ratio)
        for t in idx.tolist():
            k, lam = (k_pos, lam_pos) if float(adv[t]) >= 0 else (k_neg, lam_neg)
            phi = math.exp(lam + k * log_w - lam * math.exp(log_w))
            out[t] = phi * adv[t] * logp_y[t] if phi != 0 else 0.0
    return out


def _gmpo(logp_y: Tensor, prox: Tensor, adv: Tensor, seqs: list, corr: Correction) -> Tensor:
    """docs/spec.md#gmpo, sequence by sequence: ``l_t = log u_t`` (clamped), kept where it is on the pessimistic
    side of ``[-eps_lo, eps_hi]`` for the sign of ``A_t`` and clipped to it otherwise (0 where ``A_t = 0``);
    ``s_t = A_t exp(mean_i l)``, differentiable through every ``l`` of the sequence."""
    eps_lo, eps_hi = corr.gmpo
    out = torch.zeros_like(logp_y)
    for idx in seqs:
        terms = []
        for t in idx.tolist():
            lu = (logp_y[t] - prox[t]).clamp(-corr.max_log_ratio, corr.max_log_ratio)
            a = float(adv[t])
            if a > 0:  # objective A exp(.) increasing in l: keep the smaller of l and its clip
                terms.append(torch.minimum(lu, lu.clamp(-eps_lo, eps_hi)))
            elif a < 0:  # decreasing: keep the larger
                terms.append(torch.maximum(lu, lu.clamp(-eps_lo, eps_hi)))
            else:
                terms.append(torch.zeros((), dtype=torch.float64))
        geo = torch.exp(torch.stack(terms).sum() / len(terms))
        for t in idx.tolist():
            out[t] = adv[t] * geo
    return out


def _kl_penalty(logp_y: Tensor, ref: Tensor, old: Tensor, mask: Tensor, corr: Correction) -> tuple[Tensor, Tensor]:
    """docs/spec.md#kl-penalty, token by token: ``(pen [N], est [N])``; ``rho = p_ref / p``, ``k1 = -log rho``,
    ``k2 = (log rho)^2 / 2``, ``k3 = rho - 1 - log rho``, times the differentiable ``p / pi_old`` when
    importance-weighted; ``pen = coef * est`` on trained tokens the trainer can produce, else 0."""
    spec = corr.kl_penalty
    pen = torch.zeros_like(logp_y)
    est = torch.zeros(logp_y.shape[0], dtype=torch.float64)
    for t in range(logp_y.shape[0]):
        if not mask[t] or float(logp_y[t].detach()) == -math.inf:
            continue
        log_rho = (ref[t] - logp_y[t]).clamp(-corr.max_log_ratio, corr.max_log_ratio)
        k = {"k1": lambda: -log_rho, "k2": lambda: log_rho ** 2 / 2,
             "k3": lambda: torch.exp(log_rho) - 1 - log_rho}[spec.estimator]()
        if spec.importance_weighted:
            k = _ratio(logp_y[t] - old[t], corr) * k
        pen[t] = spec.coef * k
        est[t] = float(k)
    return pen, est


def _state(logits, tokens, sampler_logprobs, advantages, candidates, loss_mask, temperature, corr, seq_ids,
           proximal_logprobs) -> dict:
    """Everything before the surrogate, token by token and sequence by sequence: log-probabilities, ratios, the
    ratio the bounds act on, weights, kept sequences, the normalisation scale."""
    n, vocab = logits.shape
    mask = torch.ones(n, dtype=torch.bool) if loss_mask is None else loss_mask.bool()
    is_support = candidates is not None and candidates.kind == "support"
    lp = log_probs(logits, temperature, support_mask(candidates, vocab) if is_support else None)
    logp_y = lp[torch.arange(n), tokens.long()]
    lq = sampler_logprobs.double()
    adv = advantages.double()

    # r: the ratio the weights act on (pi_prox / q under decoupled PPO, else p / q); r_p: always p / q.
    base = proximal_logprobs.double() if proximal_logprobs is not None else logp_y.detach()
    r = torch.where(mask, torch.exp(base - lq), torch.ones_like(lq))
    r_p = torch.where(mask, torch.exp(logp_y.detach() - lq), torch.ones_like(lq))
    seqs = _sequences(seq_ids, mask) if seq_ids is not None else []

    # Importance weight w_t at the correction's level (a token-level KL rejection masks the token's own ratio).
    level = reg.LEVELS[corr.level]
    bounded = r.clone()
    if not level.per_sequence:
        w = f(r, corr)
    else:
        w = torch.zeros(n, dtype=torch.float64)
        for idx in seqs:
            bounded[idx] = torch.exp(level.reference(torch.log(r[idx])))
            w[idx] = f(bounded[idx][:1], corr, token_rejection=False)[0]
        w = w * _token_keep(r, corr)
    token_rejected = mask & ~_token_keep(r, corr)
    # A sampled token the trainer gives probability 0 gets weight exactly 0 (its loss w log p would be infinite).
    impossible = mask & (logp_y.detach() == -math.inf)
    w = torch.where(impossible, torch.zeros_like(w), w)

    # Sequence-level rejections: a sequence is dropped when any rule that applies says so.
    rules = {rule.name: (lambda idx, rule=rule: rule.reference(r[idx], r_p[idx], adv[idx], corr))
             for rule in reg.SEQUENCE_RULES.values() if rule.applies(corr)}
    for name, item in corr.rejection_rules:
        kind = reg.REJECTION_KINDS[item.kind]
        if kind.per_sequence(item):
            rules[name] = lambda idx, kind=kind, item=item: kind.sequence_drop_reference(r[idx], item, corr)
    keep = torch.ones(n, dtype=torch.bool)
    dropped_by = {name: torch.zeros(n, dtype=torch.bool) for name in rules}
    for idx in seqs:
        for name, drops in rules.items():
            if drops(idx):
                dropped_by[name][idx] = True
                keep[idx] = False
    w = w * (mask & keep)
    # The trust region's mask (docs/spec.md#trust-region) zeroes the weight before the normalisation.
    tr_masked, tr_ref = _trust_region_state(logp_y.detach(), lq, proximal_logprobs, adv, mask, seqs, corr)
    w = w * ~tr_masked
    scale = 1.0
    norm = reg.normalisation_of(corr)
    if norm is not None:
        mean_w = norm.reference(w, mask & keep, seqs)
        scale = 1.0 / mean_w if mean_w > 0 else 1.0
        w = w * scale
    return dict(n=n, lp=lp, logp_y=logp_y, lq=lq, adv=adv, mask=mask, keep=keep, w=w, scale=scale, seqs=seqs,
                r_p=r_p, r=r, bounded=bounded, impossible=impossible, is_support=is_support,
                token_rejected=token_rejected, dropped_by=dropped_by, tr_masked=tr_masked, tr_ref=tr_ref)


def _centering(lp_row: Tensor, cands: Candidates, t: int, is_support: bool, corr: Correction):
    """docs/spec.md#score-centering for one row: ``c(v) = q f(p/q) - alpha p`` over the recorded ids."""
    c, ids, _ = _centering_row(lp_row, cands, t, is_support, corr)
    return c, ids


def _centering_row(lp_row: Tensor, cands: Candidates, t: int, is_support: bool, corr: Correction):
    """``(c(v) list, ids list, (P_H, Q_H, rho))`` for row ``t``."""
    valid = cands.ids[t] >= 0
    ids = cands.ids[t][valid].long()
    p = torch.exp(lp_row.detach()[ids])
    q = torch.exp(cands.logprobs[t][valid].double())
    with torch.no_grad():
        m = torch.where(q > 0, q * f(p / torch.where(q > 0, q, torch.ones_like(q)), corr), torch.zeros_like(q))
        if is_support:
            rho = 1.0
            alpha = f(torch.ones(1, dtype=torch.float64), corr)[0]
        else:
            rho = max(1 - float(q.sum()), TAIL_EPS) / max(1 - float(p.sum()), TAIL_EPS)
            alpha = rho * f(torch.tensor([1 / rho], dtype=torch.float64), corr)[0]
    return (m - alpha * p).tolist(), ids.tolist(), (float(p.sum()), float(q.sum()), rho)


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
    logits: Tensor,
    tokens: Tensor,
    sampler_logprobs: Tensor,
    advantages: Tensor,
    candidates: Candidates | None = None,
    loss_mask: Tensor | None = None,
    temperature: float | Tensor = 1.0,
    correction: Correction = Correction(),
    seq_ids: Tensor | None = None,
    *,
    proximal_logprobs: Tensor | None = None,
    groups: Tensor | None = None,
    versions: Tensor | None = None,
    current_version: int | None = None,
    reference_logprobs: Tensor | None = None,
    aggregation: str = "token_mean",
    num_loss_tokens: float | None = None,
    num_sequences: float | None = None,
    constant_normalizer: float | None = None,
) -> dict[str, float]:
    """Every key of docs/spec.md#metrics (those of ``policy_loss``'s ``out.metrics``, entropy included), literally,
    token by token in float64; same arguments as :func:`reference_policy_loss` plus the metric-only ones (the
    aggregation arguments matter only for the ``kl_penalty`` key)."""
    corr = correction
    st = _state(logits, tokens, sampler_logprobs, advantages, candidates, loss_mask, temperature, corr, seq_ids,
                proximal_logprobs)
    mask, n = st["mask"], st["n"]
    lp = st["lp"].detach()
    ent = -torch.where(lp > -math.inf, lp.exp() * lp, torch.zeros_like(lp)).sum(1)
    seq_of = seq_ids if seq_ids is not None else None
    out = _token_metrics(st, mask, corr)
    out["entropy"] = _mean([float(ent[t]) for t in range(n) if mask[t]])
    out["rejected_frac"] = _mean([float(not st["keep"][t]) for t in range(n) if mask[t]])
    if corr.kl_penalty is not None:
        old = proximal_logprobs.double() if proximal_logprobs is not None else st["lq"]
        pen, est = _kl_penalty(st["logp_y"].detach(), reference_logprobs.double(), old, mask, corr)
        out["ref_kl"] = _mean([float(est[t]) for t in range(n) if mask[t]])
        out["kl_penalty"] = float(_aggregate(pen, mask, aggregation, st["seqs"], num_loss_tokens, num_sequences,
                                             constant_normalizer))
    if seq_ids is not None:
        out.update(_sequence_metrics(st, corr))
        if reg.LEVELS[corr.level].per_sequence:
            # One weight per sequence: the mean of its trained tokens' final weights.
            ws = [sum(float(st["w"][t]) for t in idx.tolist()) / idx.numel() for idx in st["seqs"]]
            sq = sum(x * x for x in ws)
            out["seq_ess"] = sum(ws) ** 2 / (len(ws) * sq) if sq > 0 else 0.0
        for name, dropped in st["dropped_by"].items():
            out[f"rejected_frac/{name}"] = _mean([float(dropped[t]) for t in range(n) if mask[t]])
    if corr.trust_region is not None:
        out["trust_region_masked_frac"] = _mean([float(st["tr_masked"][t]) for t in range(n) if mask[t]])
        if corr.trust_region.penalty:
            pen = _trust_region_penalty(st["logp_y"].detach(), st["tr_ref"], mask & st["keep"], corr)
            out["trust_region_penalty"] = _mean([float(pen[t]) for t in range(n) if mask[t]])
    if candidates is not None:
        valid = candidates.ids >= 0
        out["support_size"] = _mean([float(valid[t].sum()) for t in range(n) if mask[t]])
    if corr.score_centering:
        rows = [(_centering_row(lp[t], candidates, t, st["is_support"], corr)) for t in range(n) if mask[t]]
        out["sc_p_head"] = _mean([d[0] for _, _, d in rows])
        out["sc_q_head"] = _mean([d[1] for _, _, d in rows])
        out["sc_rho"] = _mean([d[2] for _, _, d in rows])
        out["sc_abs_coef_sum"] = _mean([sum(abs(x) for x in c) for c, _, _ in rows])
    splits = []
    if groups is not None:
        splits.append(("group", groups))
    if versions is not None and bool(mask.any()):
        now = int(versions[mask].max()) if current_version is None else current_version
        splits.append(("staleness", now - versions))
    for name, key in splits:
        n_active = max(int(mask.sum()), 1)
        extreme = [t for t in range(n) if mask[t] and _is_extreme(st, t, corr)]
        seqs_all = {int(seq_of[t]) for t in range(n) if mask[t]} if seq_of is not None else set()
        for value in sorted({int(key[t]) for t in range(n) if mask[t]}):
            sel = mask & (key == value)
            stats = _token_metrics(st, sel, corr)
            stats["share_tokens"] = int(sel.sum()) / n_active
            stats["share_extreme"] = (sum(1 for t in extreme if sel[t]) / len(extreme)) if extreme else 0.0
            if seq_of is not None:
                stats["share_samples"] = len({int(seq_of[t]) for t in range(n) if sel[t]}) / max(len(seqs_all), 1)
            else:
                stats["share_samples"] = stats["share_tokens"]
            out.update({f"{name}/{value}/{k}": v for k, v in stats.items()})
    if versions is not None and seq_ids is not None and bool(mask.any()):
        now = int(versions[mask].max()) if current_version is None else current_version
        flight, queue = [], []
        for idx in st["seqs"]:
            v_end = max(int(versions[t]) for t in idx.tolist())
            flight += [v_end - int(versions[t]) for t in idx.tolist()]
            queue += [now - v_end] * idx.numel()
        out["staleness_in_flight"] = _mean([float(x) for x in flight])
        out["staleness_in_queue"] = _mean([float(x) for x in queue])
    return out


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _clamped_log_ratio(st: dict, t: int, corr: Correction) -> float:
    lr = float(st["logp_y"][t].detach() - st["lq"][t])
    return min(max(lr, -corr.max_log_ratio), corr.max_log_ratio)


def _is_extreme(st: dict, t: int, corr: Correction) -> bool:
    r = math.exp(_clamped_log_ratio(st, t, corr))
    return r < EXTREME[0] or r > EXTREME[1]


def _sequence_metrics(st: dict, corr: Correction) -> dict[str, float]:
    """The ``seq_*`` keys: one value per sequence with a trained token, from its clamped token log-ratios."""
    rho, d = [], []
    for idx in st["seqs"]:
        lr = [_clamped_log_ratio(st, t, corr) for t in idx.tolist()]
        rho.append(math.exp(min(max(sum(lr), -corr.max_log_ratio), corr.max_log_ratio)))
        d.append(-sum(lr) / len(lr))
    return {
        "seq_chi2": _mean([x * x for x in rho]) - 1 if rho else 0.0,
        "seq_ratio_mean": _mean(rho),
        "seq_ratio_max": max(rho, default=0.0),
        "seq_ratio_min": min(rho, default=0.0),
        "seq_log_ppl_diff_mean": _mean(d),
        "seq_log_ppl_diff_abs_mean": _mean([abs(x) for x in d]),
        "seq_log_ppl_diff_max": max(d, default=0.0),
        "seq_log_ppl_diff_min": min(d, default=0.0),
        "seq_ppl_ratio_mean": _mean([math.exp(x) for x in d]),
    }


def _token_metrics(st: dict, sel: Tensor, corr: Correction) -> dict[str, float]:
    """The mismatch and weight keys over the tokens of ``sel``."""
    rows = [t for t in range(st["n"]) if sel[t]]
    lr = [_clamped_log_ratio(st, t, corr) for t in rows]
    w = [float(st["w"][t]) for t in rows]
    b = [float(st["bounded"][t]) for t in rows]
    sq = sum(x * x for x in w)
    r = [math.exp(x) for x in lr]
    possible = [t for t in rows if not st["impossible"][t]]
    neg_logp = _mean([-float(st["logp_y"][t]) for t in possible])
    neg_lq = _mean([-float(st["lq"][t]) for t in possible])
    mean_w = _mean(w)
    extra = {
        "chi2_token": _mean([x * x for x in r]) - 1 if r else 0.0,
        "ratio_mean": _mean(r),
        "ratio_max": max(r, default=0.0),
        "ratio_min": min(r, default=0.0),
        "weight_std": math.sqrt(_mean([(x - mean_w) ** 2 for x in w])),
        "weight_before_bound_mean": _mean([min(max(x, math.exp(-corr.max_log_ratio)), math.exp(corr.max_log_ratio))
                                           for x in b]),
        "ppl_trainer": _saturating_exp(neg_logp),
        "ppl_sampler": _saturating_exp(neg_lq),
        "ppl_ratio": _saturating_exp(neg_logp - neg_lq),
    }
    extra["weight_before_bound_max"] = max([min(max(x, math.exp(-corr.max_log_ratio)), math.exp(corr.max_log_ratio))
                                            for x in b], default=0.0)
    # KL(q||p) = E_q[r - 1 - log r]; KL(p||q) = E_q[r log r], less E_q[r - 1] = 0 for the k3 form.
    extra["kl_sampler_trainer"] = _mean([math.exp(x) - 1 - x for x in lr])
    extra["kl_trainer_sampler"] = _mean([math.exp(x) * x - math.exp(x) + 1 for x in lr])
    extra["kl_trainer_sampler_k1"] = _mean([math.exp(x) * x for x in lr])
    for key, sign in (("masked_share_pos_adv", 1), ("masked_share_neg_adv", -1)):
        side = [t for t in rows if float(st["adv"][t]) * sign > 0]
        extra[key] = _mean([float(float(st["w"][t]) == 0.0) for t in side])
    if corr.veto is not None:
        extra["veto_catastrophic_frac"] = _mean([float(float(st["r"][t]) < corr.veto) for t in rows])
    return extra | {
        "kl_k1": _mean([-x for x in lr]),
        "kl_k2": _mean([0.5 * x * x for x in lr]),
        "kl_k3": _mean([math.exp(x) - 1 - x for x in lr]),
        "abs_log_ratio_mean": _mean([abs(x) for x in lr]),
        "abs_log_ratio_max": max([abs(x) for x in lr], default=0.0),
        "extreme_ratio_frac": _mean([float(_is_extreme(st, t, corr)) for t in rows]),
        "weight_mean": _mean(w),
        "weight_min": min(w, default=0.0),
        "weight_max": max(w, default=0.0),
        # The ratio the bounds act on: the token's, its sequence's (sequence / geometric levels), pi_prox / q.
        "ratio_below_lower_frac": _mean([float(x < corr.lower) for x in b]),
        "ratio_above_upper_frac": _mean([float(x > corr.upper) for x in b]),
        "ess": sum(w) ** 2 / (len(w) * sq) if sq > 0 else 0.0,
        "num_tokens": float(len(rows)),
        "zero_prob_frac": _mean([float(st["impossible"][t]) for t in rows]),
    }


# ---------------------------------------------------------------------------------------------------------------
# Trust regions on probability differences, docs/spec.md#trust-region. Self-contained: reads the TrustRegion's
# keyword values and nothing else of the library.
# ---------------------------------------------------------------------------------------------------------------


def _trust_region_surrogate(corr: Correction) -> bool:
    """Whether the surrogate is the trust region's masked ratio ``u A`` (on the update, no PPO clip, no CISPO)."""
    tr = corr.trust_region
    return tr is not None and tr.on == "update" and corr.ppo_clip is None and corr.cispo is None


def _bernoulli_kl(log_a: float, log_b: float) -> float:
    """``KL(Bern(a) || Bern(b))`` with ``0 log 0 = 0``; ``inf`` where ``b`` is 0 or 1 and ``a`` is not."""
    a, na = math.exp(log_a), -math.expm1(log_a)
    nb = -math.expm1(log_b)
    head = 0.0 if a == 0 else (math.inf if log_b == -math.inf else a * (log_a - log_b))
    tail = 0.0 if na == 0 else (math.inf if nb == 0 else na * (math.log(na) - math.log(nb)))
    return head + tail


def _trust_region_state(logp_y: Tensor, lq: Tensor, proximal: Tensor | None, adv: Tensor, mask: Tensor,
                        seqs: list, corr: Correction) -> tuple[Tensor, Tensor | None]:
    """``([N] bool masked, [N] float64 log p_ref of the update)``: the tokens the trust region masks, token by
    token (or sequence by sequence), and the log-probabilities the update's ratio and penalty divide by."""
    n = logp_y.shape[0]
    tr = corr.trust_region
    masked = torch.zeros(n, dtype=torch.bool)
    if tr is None:
        return masked, None
    prox = proximal.double() if proximal is not None else None
    upd_ref = prox if prox is not None else lq
    if tr.on == "update":
        num, den = logp_y, upd_ref
    else:
        num, den = (prox if prox is not None else logp_y), lq
    d = [math.exp(float(num[t])) - math.exp(float(den[t])) for t in range(n)]
    lower, upper = float(tr.lower), float(tr.upper)
    if tr.level in ("sequence", "geometric"):
        for idx in seqs:
            total = sum(d[t] for t in idx.tolist())
            stat = total if tr.level == "sequence" else total / idx.numel()
            if stat > upper or stat < -lower:
                masked[idx] = True
        return masked, upd_ref
    for t in range(n):
        if not mask[t]:
            continue
        lp, lr = float(num[t]), float(den[t])
        if tr.divergence == "difference":
            div = abs(d[t])
        elif tr.divergence == "binary_kl":
            div = _bernoulli_kl(lr, lp)
        else:
            div = max(_bernoulli_kl(lr, lp), _bernoulli_kl(lp, lr))
        rise = d[t] > 0 and div > upper
        fall = d[t] < 0 and div > lower
        if tr.sign == "advantage":
            masked[t] = rise if adv[t] > 0 else fall
        else:
            masked[t] = rise or fall
    return masked, upd_ref


def _trust_region_ratio(logp_y: Tensor, ref: Tensor, adv: Tensor, corr: Correction) -> Tensor:
    """``[N]`` the surrogate ``u_t A_t``, ``u = exp(clamp(log p - log p_ref, +-max_log_ratio))``, token by token."""
    out = torch.zeros_like(logp_y)
    for t in range(logp_y.shape[0]):
        out[t] = torch.exp((logp_y[t] - ref[t]).clamp(-corr.max_log_ratio, corr.max_log_ratio)) * adv[t]
    return out


def _trust_region_penalty(logp_y: Tensor, ref: Tensor, kept: Tensor, corr: Correction) -> Tensor:
    """``[N]`` ``c (log p - log p_ref)^2`` on kept trained tokens the trainer can produce, 0 elsewhere."""
    out = torch.zeros_like(logp_y)
    for t in range(logp_y.shape[0]):
        if kept[t] and logp_y[t] > -math.inf:
            out[t] = float(corr.trust_region.penalty) * (logp_y[t] - ref[t]) ** 2
    return out
