"""The float64 oracle: docs/spec.md (#weights to #metrics) written literally, for reading and for tests.

Nothing here is fast, chunked or fused, and nothing here comes from the library: this module imports nothing from
``offpolicy`` (``tests/project/test_layers.py`` checks it). It reads the correction's raw fields by name (a
``Correction`` or a plain mapping with the same keys), resolves the defaults from its own copy of the spec's
numbers, and spells every weight function, level, estimator, rejection rule, normalisation, surrogate and
aggregation as an explicit branch on its name. A wrong predicate, default or trait in the registry that the fast
path runs therefore shows up as a disagreement with this module instead of being shared by both.

It materialises the full ``[N, V]`` log-softmax in float64, loops over sequences and tokens in Python and spells each
formula as the spec does. Gradients come from autograd through it. Use it on small inputs.

Adding a correction here: a field in :data:`CORRECTION_DEFAULTS` (its default, written again), and one branch in
the block of its kind below (``_weight``, ``sequence_log_ratio``, ``kl``, ``kl_statistic``, ``_sequence_rules``,
``_normalisation_mean``, ``_surrogate``, ``_aggregate``). The trust region (``_trust_region_*``), SAPO, VESPO,
GMPO (``_sapo``, ``_vespo``, ``_gmpo``) and the KL penalty (``_kl_penalty``) are written here from docs/spec.md too;
a ``TrustRegion`` and a ``KLPenalty`` are read by attribute name (:data:`TRUST_REGION_DEFAULTS`,
:data:`KL_PENALTY_DEFAULTS`).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

TAIL_EPS = 1e-6
EXTREME = (0.2, 5.0)

# ---------------------------------------------------------------------------------------------------------------
# The spec's defaults, written again (docs/spec.md#weights, #family; not read from the library)
# ---------------------------------------------------------------------------------------------------------------

#: Every field of ``Correction`` and its default. A correction holding a field not named here is refused: the
#: reference must not silently ignore a switch the fast path applies.
CORRECTION_DEFAULTS: dict[str, Any] = {
    "weights": "none",
    "bounds": None,
    "level": "token",
    "score_centering": False,
    "veto": None,
    "kl_rejection": None,
    "opsm_delta": None,
    "batch_normalize": False,
    "ppo_clip": None,
    "max_log_ratio": 20.0,
    "dual_clip": None,
    "ppo_delta": None,
    "ppo_ratio": "token",
    "cispo": None,
    "rejected_in_normalizer": True,
    "rejections": (),
    "trust_region": None,
    "sapo": None,
    "sapo_level": "token",
    "vespo": None,
    "gmpo": None,
    "kl_penalty": None,
    "max_staleness": None,
    "m2po": None,
    "topr": None,
    "kl_cov": None,
    "clip_cov": None,
    "clip_cov_ratio": 0.0002,
    "clip_cov_eps": (0.2, 0.2),
    "clip_cov_seed": 0,
    "max_route_flips": None,
    "seq_logprob_error": None,
    "kimi15": None,
    "veto_high": None,
}

#: The fields of a ``TrustRegion`` and their defaults (None: required), docs/spec.md#trust-region.
TRUST_REGION_DEFAULTS: dict[str, Any] = {
    "lower": None,
    "upper": None,
    "divergence": "difference",
    "sign": "advantage",
    "level": "token",
    "on": "update",
    "penalty": 0.0,
}

#: The fields of a ``KLPenalty`` and their defaults (None: required), docs/spec.md#kl-penalty.
KL_PENALTY_DEFAULTS: dict[str, Any] = {"coef": None, "estimator": "k3", "importance_weighted": False}

#: ``(lower, upper)`` of each bounded weight mode when ``bounds`` is None (docs/spec.md#weights).
DEFAULT_BOUNDS: dict[str, tuple[float, float]] = {"tis": (0.0, 2.0), "mis": (0.5, 5.0), "reject": (0.5, 5.0)}

#: The fields of a ``KLRejection`` (``kind="kl"``) and a ``RatioRejection`` (``kind="ratio"``) and their defaults
#: (None: required).
RULE_DEFAULTS: dict[str, dict[str, Any]] = {
    "kl": {"threshold": None, "estimator": "k3", "level": "token"},
    "ratio": {"lower": None, "upper": None, "level": "token"},
    "staleness": {"max_lag": None, "level": "token"},
    "route_flips": {"max_flips": None, "level": "token"},
}


class _Rule:
    """One ``KLRejection`` / ``RatioRejection``, read by field name."""

    def __init__(self, item: Any) -> None:
        kind = _read(item, "kind", None)
        if kind not in RULE_DEFAULTS:
            raise ValueError(f"reference: a rejection rule's kind must be one of {tuple(RULE_DEFAULTS)}, got {kind!r}")
        self.kind = kind
        for name, default in RULE_DEFAULTS[kind].items():
            value = _read(item, name, default)
            if value is None:
                raise ValueError(f"reference: a {kind!r} rejection rule needs {name}")
            setattr(self, name, tuple(value) if isinstance(value, list) else value)

    @property
    def per_sequence(self) -> bool:
        """Whether the rule drops whole sequences (else it bounds each token's own ratio)."""
        if self.kind == "kl":
            return _kl_level_per_sequence(self.level)
        if self.kind in ("staleness", "route_flips"):
            return self.level == "sequence"
        if self.kind == "ratio" and self.level == "segment":
            return False  # it drops turns, handled on its own (_Config.segment_rules)
        return _level_per_sequence(self.level)


def _unknown_fields(item: Any, defaults: dict[str, Any]) -> list[str]:
    """The keys of a mapping, or the public dataclass fields of an object, that ``defaults`` does not name."""
    if isinstance(item, Mapping):
        return sorted(set(item) - set(defaults))
    names = [f.name for f in dataclasses.fields(item)] if dataclasses.is_dataclass(item) else []
    return sorted(k for k in names if not k.startswith("_") and k not in defaults)


class _Fields:
    """A ``TrustRegion`` / ``KLPenalty`` (or a mapping with the same keys), read by field name; unknown fields are
    refused."""

    def __init__(self, item: Any, defaults: dict[str, Any], what: str) -> None:
        unknown = _unknown_fields(item, defaults)
        if unknown:
            raise ValueError(f"reference: the {what} has fields {unknown} that offpolicy.reference does not implement")
        for name, default in defaults.items():
            value = _read(item, name, default)
            if value is None:
                raise ValueError(f"reference: a {what} needs {name}")
            setattr(self, name, value)


class _Config:
    """The correction's fields (``CORRECTION_DEFAULTS`` where absent) and the resolved ratio bounds."""

    def __init__(self, corr: Any) -> None:
        unknown = _unknown_fields(corr, CORRECTION_DEFAULTS)
        if unknown:
            raise ValueError(f"reference: the correction has fields {unknown} that offpolicy.reference does not "
                             "implement (add them to CORRECTION_DEFAULTS and their branch)")
        for name, default in CORRECTION_DEFAULTS.items():
            setattr(self, name, _read(corr, name, default))
        self.lower, self.upper = self._bounds()
        if self.trust_region is not None:
            self.trust_region = _Fields(self.trust_region, TRUST_REGION_DEFAULTS, "trust region")
            _trust_region_per_sequence(self.trust_region.level)
        if self.kl_penalty is not None:
            self.kl_penalty = _Fields(self.kl_penalty, KL_PENALTY_DEFAULTS, "KL penalty")
        self.per_sequence = _level_per_sequence(self.level)
        head = [("kl", self.kl_rejection)] if self.kl_rejection is not None else []
        #: ``(name, rule)``: ``"kl"`` for ``kl_rejection``, ``"rule{i}"`` for ``rejections[i]`` (the metric names).
        self.rules = [(name, _Rule(item)) for name, item in
                      head + [(f"rule{i}", item) for i, item in enumerate(self.rejections)]]
        #: ``(name, max_lag, level)`` of each staleness rejection (docs/spec.md#staleness-rejection): the
        #: ``max_staleness`` keyword (token level), then those in ``rejections``.
        self.staleness = ([("staleness", self.max_staleness, "token")] if self.max_staleness is not None else [])
        self.staleness += [(name, rule.max_lag, rule.level) for name, rule in self.rules if rule.kind == "staleness"]
        #: ``(name, max_flips, level)`` of each route-flip rejection (docs/spec.md#route-flip-rejection).
        self.route_flips = ([("route_flips", self.max_route_flips, "token")] if self.max_route_flips is not None
                            else [])
        self.route_flips += [(name, rule.max_flips, rule.level) for name, rule in self.rules
                             if rule.kind == "route_flips"]
        #: ``(name, rule)`` of each ratio rejection at the segment level (a band on each turn's geometric ratio).
        self.segment_rules = [(name, rule) for name, rule in self.rules
                              if rule.kind == "ratio" and rule.level == "segment"]
        self.rules = [(name, rule) for name, rule in self.rules if rule.kind not in ("staleness", "route_flips")
                      and not (rule.kind == "ratio" and rule.level == "segment")]
        self.token_rules = [rule for _, rule in self.rules if not rule.per_sequence]

    def _bounds(self) -> tuple[float, float]:
        b = self.bounds
        if self.weights == "none":
            if b is not None:
                raise ValueError("reference: bounds are meaningless with weights='none'")
            return (0.0, math.inf)
        if self.weights not in DEFAULT_BOUNDS:
            raise ValueError(f"reference: weights={self.weights!r} is not implemented here")
        if b is None:
            return DEFAULT_BOUNDS[self.weights]
        if isinstance(b, (int, float)):
            # Only TIS takes a single number C, meaning (0, C).
            if self.weights != "tis":
                raise ValueError(f"reference: weights={self.weights!r} takes bounds (L, U), got {b!r}")
            return (0.0, float(b))
        lo, hi = b
        return (float(lo), float(hi))


def _read(obj: Any, name: str, default: Any) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _config(corr: Any) -> _Config:
    if isinstance(corr, _Config):
        return corr
    return _Config({} if corr is None else corr)


# ---------------------------------------------------------------------------------------------------------------
# Weight functions, docs/spec.md#weights
# ---------------------------------------------------------------------------------------------------------------


def _weight(rc: Tensor, inside: Tensor, cfg: _Config) -> Tensor:
    """``f`` of the weight mode at clamped float64 ratios ``rc``; ``inside = 1[L <= r <= U]`` on the unclamped ratio."""
    if cfg.weights == "none":
        return torch.ones_like(rc)
    if cfg.weights == "tis":
        # clamp(r, c, C)
        return torch.minimum(torch.maximum(rc, torch.full_like(rc, cfg.lower)), torch.full_like(rc, cfg.upper))
    if cfg.weights == "mis":
        return rc * inside.double()
    if cfg.weights == "reject":
        return inside.double()
    raise ValueError(f"reference: weights={cfg.weights!r} is not implemented here")


def _outside_is_rejection(cfg: _Config) -> bool:
    """Whether a ratio outside the bounds is a rejection (the token leaves the normaliser under
    ``rejected_in_normalizer=False``), not merely a weight of 0: pure rejection sampling only."""
    return cfg.weights == "reject"


def _clamp_ratio(r: Tensor, cfg: _Config) -> Tensor:
    return r.clamp(math.exp(-cfg.max_log_ratio), math.exp(cfg.max_log_ratio))


def f(r: Tensor, corr: Any, token_rejection: bool = True) -> Tensor:
    """The weight function (docs/spec.md#weights) at ratio ``r`` (float64), the token-level rejection rules
    included unless ``token_rejection=False``.

    ``r`` is clamped to ``exp(+-max_log_ratio)`` before use (the spec's "clamp in log space first"); bounds are
    tested on the unclamped ratio.
    """
    cfg = _config(corr)
    r = r.double()
    inside = (r >= cfg.lower) & (r <= cfg.upper)
    out = _weight(_clamp_ratio(r, cfg), inside, cfg)
    if token_rejection:
        out = out * _token_keep(r, cfg)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Ratio levels, docs/spec.md#sequence-level
# ---------------------------------------------------------------------------------------------------------------


def _level_per_sequence(level: str) -> bool:
    if level == "token":
        return False
    if level in ("sequence", "geometric", "segment"):
        return True
    raise ValueError(f"reference: level={level!r} is not implemented here")


def sequence_log_ratio(log_r: Tensor, level: str) -> Tensor:
    """``log rho`` of one sequence from its trained tokens' ``log r``: the sum (``"sequence"``) or the mean
    (``"geometric"``)."""
    if level == "sequence":
        return log_r.sum()
    if level in ("geometric", "segment"):
        # "segment": the same mean, over one turn's trained tokens instead of the whole sequence's.
        return log_r.mean()
    raise ValueError(f"reference: no per-sequence ratio for level={level!r}")


# ---------------------------------------------------------------------------------------------------------------
# KL estimators and statistics, docs/spec.md#kl-rejection
# ---------------------------------------------------------------------------------------------------------------


def kl(r: Tensor, estimator: str) -> Tensor:
    """Schulman's k1 / k2 / k3 of KL(q||p) at ratio ``r = p / q``."""
    if estimator == "k1":
        return -torch.log(r)
    if estimator == "k2":
        return 0.5 * torch.log(r) ** 2
    if estimator == "k3":
        return r - 1 - torch.log(r)
    if estimator == "low_var_kl":
        return (r - 1 - torch.log(r)).clamp(-10.0, 10.0)
    raise ValueError(f"reference: estimator={estimator!r} is not implemented here")


def _kl_level_per_sequence(level: str) -> bool:
    if level == "token":
        return False
    if level in ("seq_sum", "seq_mean", "seq_max"):
        return True
    raise ValueError(f"reference: KL level={level!r} is not implemented here")


def kl_statistic(k: Tensor, level: str) -> Tensor:
    """The per-sequence statistic of one sequence's KL estimates ``k``: sum, mean or max."""
    if level == "seq_sum":
        return k.sum()
    if level == "seq_mean":
        return k.mean()
    if level == "seq_max":
        return k.max()
    raise ValueError(f"reference: no per-sequence KL statistic for level={level!r}")


def _kl_band(rule: _Rule) -> tuple[float, float]:
    """A KL rule keeps ``k`` in ``[lo, hi]`` (two-sided) or ``k <= threshold``."""
    t = rule.threshold
    return (float(t[0]), float(t[1])) if isinstance(t, tuple) else (-math.inf, float(t))


# ---------------------------------------------------------------------------------------------------------------
# Rejections: token-level rules (folded into f) and sequence rules, docs/spec.md#veto, #kl-rejection, #opsm
# ---------------------------------------------------------------------------------------------------------------


def _token_keep(r: Tensor, cfg: _Config) -> Tensor:
    """``[N]`` bool: tokens every token-level rejection rule keeps (unclamped float64 ratios ``r``)."""
    keep = torch.ones_like(r, dtype=torch.bool)
    for rule in cfg.token_rules:
        if rule.kind == "kl":
            lo, hi = _kl_band(rule)
            k = kl(_clamp_ratio(r, cfg), rule.estimator)
            keep = keep & (k >= lo) & (k <= hi)
        elif rule.kind == "ratio":
            keep = keep & (r >= rule.lower) & (r <= rule.upper)
        else:
            raise ValueError(f"reference: rejection kind {rule.kind!r} is not implemented here")
    return keep


def _sequence_rules(cfg: _Config):
    """``{name: drops(r, r_p, adv) -> bool}`` over one sequence's trained tokens: ``r`` the ratio the weights act
    on, ``r_p`` the current policy's ``p / q`` (both unclamped float64), ``adv`` the advantages."""
    rules = {}
    if cfg.veto is not None:
        # Any trained token with r < veto drops the sequence.
        rules["veto"] = lambda r, r_p, adv: bool((r < cfg.veto).any())
    if cfg.veto_high is not None:
        # SkyRL's outlier-high mask: any trained token with r > veto_high (log r clamped) drops the sequence.
        rules["veto_high"] = lambda r, r_p, adv: bool(
            (torch.log(r).clamp(-cfg.max_log_ratio, cfg.max_log_ratio) > math.log(cfg.veto_high)).any())
    if cfg.opsm_delta is not None:
        # Negative mean advantage and mean_t (lq - log p) of the current policy above delta.
        rules["opsm"] = lambda r, r_p, adv: bool(adv.mean() < 0 and (-torch.log(r_p)).mean() > cfg.opsm_delta)
    if cfg.seq_logprob_error is not None:
        # NeMo-RL: mean over the sequence's trained tokens of exp(|log r|) (log r clamped) above the threshold.
        def seq_error(r, r_p, adv):
            lr = torch.log(r).clamp(-cfg.max_log_ratio, cfg.max_log_ratio)
            return float(torch.exp(lr.abs()).mean()) > cfg.seq_logprob_error
        rules["seq_logprob_error"] = seq_error
    for name, rule in cfg.rules:
        if not rule.per_sequence:
            continue
        if rule.kind == "kl":
            def drops(r, r_p, adv, rule=rule):
                lo, hi = _kl_band(rule)
                stat = float(kl_statistic(kl(_clamp_ratio(r, cfg), rule.estimator), rule.level))
                return not (lo <= stat <= hi)
        elif rule.kind == "ratio":
            def drops(r, r_p, adv, rule=rule):
                rho = math.exp(float(sequence_log_ratio(torch.log(r), rule.level)))
                return not (rule.lower <= rho <= rule.upper)
        else:
            raise ValueError(f"reference: rejection kind {rule.kind!r} is not implemented here")
        rules[name] = drops
    return rules


# ---------------------------------------------------------------------------------------------------------------
# Batch normalisation, docs/spec.md#batch-normalization
# ---------------------------------------------------------------------------------------------------------------


def _normalisation_mean(w: Tensor, sel: Tensor, seqs: list[Tensor], cfg: _Config) -> float | None:
    """The batch mean the weights are divided by, or None without normalisation."""
    if cfg.batch_normalize is False:
        return None
    if cfg.batch_normalize is True or cfg.batch_normalize == "tokens":
        # The mean weight over the batch's kept trained tokens.
        kept = [float(w[t]) for t in range(w.shape[0]) if sel[t]]
        return sum(kept) / len(kept) if kept else 0.0
    if cfg.batch_normalize == "sequences":
        # The mean over sequences of each sequence's mean kept weight.
        means = []
        for idx in seqs:
            kept = [float(w[t]) for t in idx.tolist() if sel[t]]
            if kept:
                means.append(sum(kept) / len(kept))
        return sum(means) / len(means) if means else 0.0
    raise ValueError(f"reference: batch_normalize={cfg.batch_normalize!r} is not implemented here")


# ---------------------------------------------------------------------------------------------------------------
# Surrogates, docs/spec.md#decoupled-ppo
# ---------------------------------------------------------------------------------------------------------------


def _surrogate_name(cfg: _Config) -> str:
    tr = cfg.trust_region
    if tr is not None and tr.on == "update" and cfg.ppo_clip is None and cfg.cispo is None:
        # The trust region's masked ratio u A (on the update, no PPO clip, no CISPO).
        return "trust_region"
    if cfg.topr is not None:
        return "topr"
    if cfg.kl_cov is not None:
        return "kl_cov"
    if cfg.clip_cov is not None:
        return "clip_cov"
    if cfg.kimi15 is not None:
        return "kimi15"
    if cfg.sapo is not None:
        return "sapo"
    if cfg.vespo is not None:
        return "vespo"
    if cfg.gmpo is not None:
        return "gmpo"
    if cfg.cispo is not None:
        return "cispo"
    if cfg.ppo_clip is not None:
        if cfg.ppo_ratio == "token":
            return "ppo"
        if cfg.ppo_ratio == "gspo_token":
            return "gspo_token"
        raise ValueError(f"reference: ppo_ratio={cfg.ppo_ratio!r} is not implemented here")
    return "score_function"


def _clip(u: Tensor, a: Tensor, cfg: _Config) -> Tensor:
    """One token of the clipped surrogate: ``min(min(u, delta) A, clip(u, 1 - eps_lo, 1 + eps_hi) A)``, bounded
    below by ``c A`` where ``A < 0`` under a dual clip ``c``."""
    lo, hi = cfg.ppo_clip
    first = (torch.minimum(u, torch.tensor(float(cfg.ppo_delta), dtype=u.dtype)) if cfg.ppo_delta is not None
             else u) * a
    second = u.clamp(1 - lo, 1 + hi) * a
    s = torch.minimum(first, second)
    if cfg.dual_clip is not None and a < 0:
        s = torch.maximum(s, cfg.dual_clip * a)
    return s


def _surrogate(logp_y: Tensor, prox: Tensor | None, adv: Tensor, seqs: list[Tensor], cfg: _Config,
               tr_ref: Tensor | None = None, lq: Tensor | None = None,
               kept: Tensor | None = None) -> Tensor | None:
    """``[N]`` the surrogate ``s_t`` whose ``-w_t s_t`` is the token loss, or None for the score-function term
    ``A_t log p(y_t)`` (formed by the caller, which adds score centering). ``tr_ref``: the trust region's
    ``log p_ref`` of the update (``_trust_region_state``)."""
    name = _surrogate_name(cfg)
    if name == "score_function":
        return None
    if name == "trust_region":
        return _trust_region_ratio(logp_y, tr_ref, adv, cfg)
    if name == "topr":
        # docs/spec.md#topr: A log p where A >= 0; sg(clamp(u, 0, 1)) A log p where A < 0, u = p / pi_old (the
        # proximal policy, else the sampler's lq).
        pos, neg = cfg.topr
        old = prox if prox is not None else lq
        out = torch.zeros_like(logp_y)
        for t in range(logp_y.shape[0]):
            u = math.exp(min(max(float(logp_y[t].detach() - old[t]), -cfg.max_log_ratio), cfg.max_log_ratio))
            coef = pos if adv[t] >= 0 else neg * min(max(u, 0.0), 1.0)
            out[t] = coef * adv[t] * logp_y[t] if coef != 0 else 0.0
        return out
    if name == "kimi15":
        # docs/spec.md#kimi15: A log p - tau/2 (log p - log pi_old)^2, pi_old the proximal policy, else the sampler.
        old = prox if prox is not None else lq
        out = torch.zeros_like(logp_y)
        for t in range(logp_y.shape[0]):
            log_u = (logp_y[t] - old[t]).clamp(-cfg.max_log_ratio, cfg.max_log_ratio)
            out[t] = adv[t] * logp_y[t] - cfg.kimi15 / 2 * log_u ** 2
        return out
    if prox is None:
        raise ValueError(f"reference: the {name!r} surrogate needs proximal_logprobs")
    mlr = cfg.max_log_ratio
    out = torch.zeros_like(logp_y)
    if name == "ppo":
        for t in range(logp_y.shape[0]):
            u = torch.exp((logp_y[t] - prox[t]).clamp(-mlr, mlr))
            out[t] = _clip(u, adv[t], cfg)
    elif name == "gspo_token":
        # Value: the sequence's exp(mean_t log(p_t / pi_prox_t)); gradient: token t's own log p.
        for idx in seqs:
            log_s = (logp_y[idx].detach() - prox[idx]).mean()
            for t in idx.tolist():
                log_ratio = (log_s + logp_y[t] - logp_y[t].detach()).clamp(-mlr, mlr)
                out[t] = _clip(torch.exp(log_ratio), adv[t], cfg)
    elif name == "cispo":
        # sg(clamp(u, lo, hi)) A log p(y).
        lo, hi = cfg.cispo
        for t in range(logp_y.shape[0]):
            u = math.exp(min(max(float(logp_y[t].detach() - prox[t]), -mlr), mlr))
            coef = min(max(u, lo), hi)
            out[t] = coef * adv[t] * logp_y[t] if coef != 0 else 0.0
    elif name == "kl_cov":
        # docs/spec.md#kl-cov: s_t = A_t u_t, minus coef |log u_t| on the top max(1, int(n ratio)) kept trained
        # tokens (finite log p) by (A_t - mean A)(log p_t - mean log p).
        ratio, coef = cfg.kl_cov
        lp_d = logp_y.detach()
        valid = [t for t in range(logp_y.shape[0]) if kept[t] and math.isfinite(float(lp_d[t]))]
        top = set()
        if valid:
            a_mean = sum(float(adv[t]) for t in valid) / len(valid)
            l_mean = sum(float(lp_d[t]) for t in valid) / len(valid)
            cov = {t: (float(adv[t]) - a_mean) * (float(lp_d[t]) - l_mean) for t in valid}
            top = set(sorted(valid, key=lambda t: -cov[t])[:max(1, int(len(valid) * ratio))])
        for t in range(logp_y.shape[0]):
            log_u = (logp_y[t] - prox[t]).clamp(-mlr, mlr)
            out[t] = torch.exp(log_u) * adv[t] - (coef * log_u.abs() if t in top else 0.0)
    elif name == "clip_cov":
        # docs/spec.md#clip-cov: PPO's min(u A, clip(u) A), set to 0 on max(1, int(n ratio)) tokens drawn among the
        # kept trained tokens (finite log p) PPO leaves unclipped with lb < (A_t - mean A)(log p_t - mean log p) < ub:
        # the candidates in token order, permuted by randperm under a CPU generator seeded with clip_cov_seed.
        if len(cfg.clip_cov) == 3:  # verl's three knobs: (clip_cov_ratio, clip_cov_lb, clip_cov_ub)
            cov_ratio, lb, ub = cfg.clip_cov
        else:
            (lb, ub), cov_ratio = cfg.clip_cov, cfg.clip_cov_ratio
        lo, hi = cfg.clip_cov_eps
        lp_d = logp_y.detach()
        valid = [t for t in range(logp_y.shape[0]) if kept[t] and math.isfinite(float(lp_d[t]))]
        drop = set()
        if valid:
            a_mean = sum(float(adv[t]) for t in valid) / len(valid)
            l_mean = sum(float(lp_d[t]) for t in valid) / len(valid)
            cand = []
            for t in valid:
                u = math.exp(min(max(float(lp_d[t] - prox[t]), -mlr), mlr))
                a = float(adv[t])
                clipped = (a > 0 and u > 1 + hi) or (a < 0 and u < 1 - lo)
                cov = (a - a_mean) * (float(lp_d[t]) - l_mean)
                if not clipped and lb < cov < ub:
                    cand.append(t)
            perm = torch.randperm(len(cand), generator=torch.Generator().manual_seed(cfg.clip_cov_seed)).tolist()
            drop = {cand[i] for i in perm[:max(1, int(len(valid) * cov_ratio))]}
        for t in range(logp_y.shape[0]):
            u_t = torch.exp((logp_y[t] - prox[t]).clamp(-mlr, mlr))
            s_t = torch.minimum(u_t * adv[t], u_t.clamp(1 - lo, 1 + hi) * adv[t])
            out[t] = s_t * 0.0 if t in drop else s_t
    elif name == "sapo":
        out = _sapo(logp_y, prox, adv, seqs, cfg)
    elif name == "vespo":
        out = _vespo(logp_y, prox, adv, seqs, cfg)
    elif name == "gmpo":
        out = _gmpo(logp_y, prox, adv, seqs, cfg)
    else:
        raise ValueError(f"reference: surrogate {name!r} is not implemented here")
    return out


# ---------------------------------------------------------------------------------------------------------------
# SAPO, VESPO, GMPO and the KL penalty, docs/spec.md#sapo, #vespo, #gmpo, #kl-penalty
# ---------------------------------------------------------------------------------------------------------------


def _ratio(log_x: Tensor, cfg: _Config) -> Tensor:
    """``exp(log_x)`` with ``log_x`` clamped to ``[-max_log_ratio, max_log_ratio]`` first."""
    return torch.exp(log_x.clamp(-cfg.max_log_ratio, cfg.max_log_ratio))


def _sapo(logp_y: Tensor, prox: Tensor, adv: Tensor, seqs: list, cfg: _Config) -> Tensor:
    """docs/spec.md#sapo, token by token: ``s_t = (4 / tau) sigmoid(tau (u_t - 1)) A_t``, ``tau`` = ``tau_pos``
    where ``A_t > 0`` else ``tau_neg``."""
    tau_pos, tau_neg = cfg.sapo
    out = torch.zeros_like(logp_y)
    if cfg.sapo_level == "token":
        for t in range(logp_y.shape[0]):
            tau = tau_pos if float(adv[t]) > 0 else tau_neg
            u = _ratio(logp_y[t] - prox[t], cfg)
            out[t] = 4.0 / tau / (1.0 + torch.exp(-tau * (u - 1.0))) * adv[t]
    elif cfg.sapo_level == "sequence":
        # The gate of the sequence's s_i = exp(mean_t clamp(log u_t)) over its trained tokens, differentiable through
        # each of them; tau by each token's own A_t.
        for idx in seqs:
            terms = [(logp_y[t] - prox[t]).clamp(-cfg.max_log_ratio, cfg.max_log_ratio) for t in idx.tolist()]
            s_i = torch.exp(torch.stack(terms).sum() / len(terms))
            for t in idx.tolist():
                tau = tau_pos if float(adv[t]) > 0 else tau_neg
                out[t] = 4.0 / tau / (1.0 + torch.exp(-tau * (s_i - 1.0))) * adv[t]
    else:
        raise ValueError(f"reference: sapo_level={cfg.sapo_level!r} is not implemented here")
    return out


def _vespo(logp_y: Tensor, prox: Tensor, adv: Tensor, seqs: list, cfg: _Config) -> Tensor:
    """docs/spec.md#vespo, sequence by sequence: ``log W = clamp(sum_t clamp(log u_t), log 1e-8, max)``,
    ``phi = exp(lam + k log W - lam W)`` (detached; ``(k, lam)`` by the sign of ``A_t``), ``s_t = phi A_t log p``."""
    k_pos, lam_pos, k_neg, lam_neg = cfg.vespo
    out = torch.zeros_like(logp_y)
    for idx in seqs:
        log_w = sum(min(max(float(logp_y[t].detach()) - float(prox[t]), -cfg.max_log_ratio), cfg.max_log_ratio)
                    for t in idx.tolist())
        log_w = min(max(log_w, math.log(1e-8)), cfg.max_log_ratio)
        for t in idx.tolist():
            k, lam = (k_pos, lam_pos) if float(adv[t]) >= 0 else (k_neg, lam_neg)
            phi = math.exp(lam + k * log_w - lam * math.exp(log_w))
            out[t] = phi * adv[t] * logp_y[t] if phi != 0 else 0.0
    return out


def _gmpo(logp_y: Tensor, prox: Tensor, adv: Tensor, seqs: list, cfg: _Config) -> Tensor:
    """docs/spec.md#gmpo, sequence by sequence: ``l_t = log u_t`` (clamped), kept where it is on the pessimistic
    side of ``[-eps_lo, eps_hi]`` for the sign of ``A_t`` and clipped to it otherwise (0 where ``A_t = 0``);
    ``s_t = A_t exp(mean_i l)``, differentiable through every ``l`` of the sequence."""
    eps_lo, eps_hi = cfg.gmpo
    out = torch.zeros_like(logp_y)
    for idx in seqs:
        terms = []
        for t in idx.tolist():
            lu = (logp_y[t] - prox[t]).clamp(-cfg.max_log_ratio, cfg.max_log_ratio)
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


def _kl_penalty_estimate(log_rho: Tensor, estimator: str) -> Tensor:
    """``KL(p || p_ref)`` estimate at ``rho = p_ref / p``: ``k1 = -log rho``, ``k2 = (log rho)^2 / 2``,
    ``k3 = rho - 1 - log rho``."""
    if estimator == "k1":
        return -log_rho
    if estimator == "k2":
        return log_rho ** 2 / 2
    if estimator in ("k3", "low_var_kl"):
        return torch.exp(log_rho) - 1 - log_rho
    raise ValueError(f"reference: KL penalty estimator={estimator!r} is not implemented here")


def _kl_penalty(logp_y: Tensor, ref: Tensor, old: Tensor, mask: Tensor, cfg: _Config) -> tuple[Tensor, Tensor]:
    """docs/spec.md#kl-penalty, token by token: ``(pen [N], est [N])``; the estimate times the differentiable
    ``p / pi_old`` when importance-weighted; ``pen = coef * est`` on trained tokens the trainer can produce, else 0."""
    spec = cfg.kl_penalty
    pen = torch.zeros_like(logp_y)
    est = torch.zeros(logp_y.shape[0], dtype=torch.float64)
    for t in range(logp_y.shape[0]):
        if not mask[t] or float(logp_y[t].detach()) == -math.inf:
            continue
        log_rho = (ref[t] - logp_y[t]).clamp(-cfg.max_log_ratio, cfg.max_log_ratio)
        k = _kl_penalty_estimate(log_rho, spec.estimator)
        if spec.importance_weighted:
            k = _ratio(logp_y[t] - old[t], cfg) * k
        if spec.estimator == "low_var_kl":
            # slime's low_var_kl: the (weighted) k3 clamped to [-10, 10] last.
            k = k.clamp(-10.0, 10.0)
        pen[t] = float(spec.coef) * k
        est[t] = float(k)
    return pen, est


# ---------------------------------------------------------------------------------------------------------------
# Aggregation, docs/spec.md#aggregation
# ---------------------------------------------------------------------------------------------------------------


def _aggregate(token_loss, mask, aggregation, seqs, num_loss_tokens, num_sequences, constant_normalizer):
    if aggregation == "token_mean":
        denom = num_loss_tokens if num_loss_tokens is not None else max(int(mask.sum()), 1)
        return token_loss.sum() / denom
    if aggregation == "constant":
        return token_loss.sum() / constant_normalizer
    if aggregation == "seq_mean_token_mean":
        per_seq = [token_loss[idx].sum() / idx.numel() for idx in seqs]
    elif aggregation == "seq_mean_token_sum":
        per_seq = [token_loss[idx].sum() for idx in seqs]
    else:
        raise ValueError(f"reference: aggregation={aggregation!r} is not implemented here")
    denom = num_sequences if num_sequences is not None else max(len(seqs), 1)
    return torch.stack(per_seq).sum() / denom if per_seq else token_loss.sum() * 0


# ---------------------------------------------------------------------------------------------------------------
# The loss
# ---------------------------------------------------------------------------------------------------------------


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


def support_mask(candidates: Any, vocab: int) -> Tensor:
    """``[N, V]`` bool: True on each row's recorded ids (``candidates.ids`` ``[N, K]``, -1 padded)."""
    mask = torch.zeros(candidates.ids.shape[0], vocab + 1, dtype=torch.bool, device=candidates.ids.device)
    ids = torch.where(candidates.ids >= 0, candidates.ids.long(), vocab)
    return mask.scatter(1, ids, True)[:, :vocab]


def reference_policy_loss(
    logits: Tensor,
    tokens: Tensor,
    sampler_logprobs: Tensor,
    advantages: Tensor,
    candidates: Any = None,
    loss_mask: Tensor | None = None,
    temperature: float | Tensor = 1.0,
    correction: Any = None,
    seq_ids: Tensor | None = None,
    aggregation: str = "token_mean",
    num_loss_tokens: float | None = None,
    *,
    proximal_logprobs: Tensor | None = None,
    num_sequences: float | None = None,
    constant_normalizer: float | None = None,
    reference_logprobs: Tensor | None = None,
    segment_ids: Tensor | None = None,
    versions: Tensor | None = None,
    current_version: int | None = None,
    route_flips: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Literal float64 policy loss. Returns ``(loss, token_loss [N], weight [N])``; ``loss`` is differentiable
    with respect to ``logits`` (pass float64 logits with ``requires_grad`` for gradients).

    ``candidates``: anything with ``.ids [N, K]``, ``.logprobs [N, K]`` and ``.kind`` (``"head"`` | ``"support"``);
    ``correction``: a ``Correction`` or a mapping of its fields (None: plain REINFORCE); ``reference_logprobs``
    ``[N]`` goes with ``correction.kl_penalty``, ``segment_ids`` ``[N]`` with ``level="segment"``, ``versions``
    ``[N]`` and ``current_version`` with a staleness rejection, ``route_flips`` ``[N]`` with a route-flip
    rejection."""
    cfg = _config(correction)
    if cfg.kl_penalty is not None and reference_logprobs is None:
        raise ValueError("reference: kl_penalty needs reference_logprobs")
    st = _state(logits, tokens, sampler_logprobs, advantages, candidates, loss_mask, temperature, cfg, seq_ids,
                proximal_logprobs, segment_ids, versions, current_version, route_flips)
    n, lp, logp_y, adv, mask, keep, w = st["n"], st["lp"], st["logp_y"], st["adv"], st["mask"], st["keep"], st["w"]
    if cfg.score_centering and candidates is None:
        raise ValueError("score centering needs candidates")
    if cfg.score_centering and (cfg.per_sequence or _surrogate_name(cfg) != "score_function"):
        raise ValueError("reference: score centering is defined for the token-level score-function term only")
    s = _surrogate(logp_y, None if proximal_logprobs is None else proximal_logprobs.double(), adv, st["seqs"], cfg,
                   st["tr_ref"], lq=st["lq"], kept=mask & keep)
    token_loss = torch.zeros(n, dtype=torch.float64)
    for t in range(n):
        if not (mask[t] and keep[t]) or adv[t] == 0:
            continue
        if s is not None:
            if w[t] != 0:
                token_loss[t] = -w[t] * s[t]
            continue
        term = w[t] * logp_y[t] if w[t] != 0 else torch.zeros((), dtype=torch.float64)
        if cfg.score_centering:
            c, ids, _ = _centering_row(lp[t], candidates, t, st["is_support"], cfg)
            for cv, v in zip(c, ids):
                # A candidate the trainer gives probability 0 contributes exactly 0 (its score is undefined).
                if cv != 0 and lp[t, v] > -math.inf:
                    term = term - st["scale"] * cv * lp[t, v]
        token_loss[t] = -adv[t] * term
    if cfg.trust_region is not None and cfg.trust_region.penalty:
        token_loss = token_loss + _trust_region_penalty(logp_y, st["tr_ref"], mask & keep, cfg)
    counted, seqs = mask, st["seqs"]
    if not cfg.rejected_in_normalizer:
        # Rejected tokens (sequence rules, token-level rejection rules, the trust region) leave the normaliser.
        counted = mask & keep & ~st["token_rejected"] & ~st["tr_masked"]
        if _outside_is_rejection(cfg):
            # A ratio outside the band is a rejection for this mode: the token leaves the normaliser too.
            b = st["bounded"]
            counted = counted & (b >= cfg.lower) & (b <= cfg.upper)
        seqs = [idx[counted[idx]] for idx in seqs if bool(counted[idx].any())]
    loss = _aggregate(token_loss, counted, aggregation, seqs, num_loss_tokens, num_sequences, constant_normalizer)
    if cfg.kl_penalty is not None:
        old = proximal_logprobs.double() if proximal_logprobs is not None else st["lq"]
        pen, _ = _kl_penalty(logp_y, reference_logprobs.double(), old, mask, cfg)
        loss = loss + _aggregate(pen, mask, aggregation, st["seqs"], num_loss_tokens, num_sequences,
                                 constant_normalizer)
        token_loss = token_loss + pen
    # Keep the loss attached to the logits even when every token is masked (its gradient is then zero).
    x = logits.double()
    loss = loss + torch.where(torch.isfinite(x), x, torch.zeros_like(x)).sum() * 0
    return loss, token_loss.detach(), w.detach()


def _state(logits, tokens, sampler_logprobs, advantages, candidates, loss_mask, temperature, cfg: _Config, seq_ids,
           proximal_logprobs, segment_ids=None, versions=None, current_version=None, route_flips=None) -> dict:
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
    tr_per_sequence = cfg.trust_region is not None and _trust_region_per_sequence(cfg.trust_region.level)
    tr_per_turn = cfg.trust_region is not None and cfg.trust_region.level == "segment"
    if (cfg.level == "segment" or bool(cfg.segment_rules) or tr_per_turn) != (segment_ids is not None):
        raise ValueError("reference: level='segment' (or a segment-level ratio rejection or trust region) and "
                         "segment_ids go together")
    if seq_ids is None and ((cfg.per_sequence and cfg.level != "segment") or _sequence_rules(cfg) or cfg.batch_normalize == "sequences"
                            or any(level == "sequence" for _, _, level in cfg.staleness + cfg.route_flips)
                            or _surrogate_name(cfg) in ("gspo_token", "vespo", "gmpo") or tr_per_sequence
                            or (_surrogate_name(cfg) == "sapo" and cfg.sapo_level == "sequence")):
        raise ValueError("reference: this correction needs seq_ids")

    # Importance weight w_t at the correction's level (a token-level rejection rule zeros the token's own weight).
    bounded = r.clone()
    if not cfg.per_sequence:
        w = f(r, cfg)
    else:
        w = torch.zeros(n, dtype=torch.float64)
        for idx in (seqs if cfg.level != "segment" else _turns(seq_ids, segment_ids, mask)):
            bounded[idx] = torch.exp(sequence_log_ratio(torch.log(r[idx]), cfg.level))
            w[idx] = f(bounded[idx][:1], cfg, token_rejection=False)[0]
        w = w * _token_keep(r, cfg)
    token_rejected = mask & ~_token_keep(r, cfg)
    # A sampled token the trainer gives probability 0 gets weight exactly 0 (its loss w log p would be infinite).
    impossible = mask & (logp_y.detach() == -math.inf)
    w = torch.where(impossible, torch.zeros_like(w), w)

    # Sequence rejections: a sequence is dropped when any rule says so.
    rules = _sequence_rules(cfg)
    keep = torch.ones(n, dtype=torch.bool)
    dropped_by = {name: torch.zeros(n, dtype=torch.bool) for name in rules}
    for idx in seqs:
        for name, drops in rules.items():
            if drops(r[idx], r_p[idx], adv[idx]):
                dropped_by[name][idx] = True
                keep[idx] = False
    # Staleness rejections: a trained token more than max_lag versions behind current_version is rejected (with
    # level="sequence", its whole sequence is).
    for name, max_lag, level in cfg.staleness:
        if versions is None or current_version is None:
            raise ValueError("reference: a staleness rejection needs versions and current_version")
        stale = [bool(mask[t]) and int(current_version) - int(versions[t]) > max_lag for t in range(n)]
        dropped_by[name] = torch.zeros(n, dtype=torch.bool)
        groups = seqs if level == "sequence" else [torch.tensor([t]) for t in range(n)]
        for idx in groups:
            if any(stale[t] for t in idx.tolist()):
                dropped_by[name][idx] = True
                keep[idx] = False
    # Route-flip rejections: a trained token whose routing flipped in more than max_flips MoE layers is rejected
    # (with level="sequence", its whole sequence is).
    for name, max_flips, level in cfg.route_flips:
        if route_flips is None:
            raise ValueError("reference: a route-flip rejection needs route_flips")
        flipped = [bool(mask[t]) and int(route_flips[t]) > max_flips for t in range(n)]
        dropped_by[name] = torch.zeros(n, dtype=torch.bool)
        for idx in (seqs if level == "sequence" else [torch.tensor([t]) for t in range(n)]):
            if any(flipped[t] for t in idx.tolist()):
                dropped_by[name][idx] = True
                keep[idx] = False
    # Segment-level ratio rejections: a turn's trained tokens are dropped when exp(mean of their log r) lies outside
    # [lower, upper].
    for name, rule in cfg.segment_rules:
        dropped_by[name] = torch.zeros(n, dtype=torch.bool)
        for idx in _turns(seq_ids, segment_ids, mask):
            rho = math.exp(float(torch.log(r[idx]).mean()))
            if not (rule.lower <= rho <= rule.upper):
                dropped_by[name][idx] = True
                keep[idx] = False
    if cfg.m2po is not None:
        # M2PO (docs/spec.md#m2po): over the batch's trained tokens, largest (log r)^2 first (log r clamped), drop
        # them one by one until the mean of the rest is below tau; keep at least one.
        m2 = {t: min(max(math.log(float(r[t])) if r[t] > 0 else -math.inf, -cfg.max_log_ratio), cfg.max_log_ratio) ** 2
              for t in range(n) if mask[t]}
        order = sorted(m2, key=lambda t: -m2[t])
        dropped_by["m2po"] = torch.zeros(n, dtype=torch.bool)
        for k in range(len(order)):
            rest = [m2[t] for t in order[k:]]
            if sum(rest) / len(rest) < cfg.m2po or k == len(order) - 1:
                for t in order[:k]:
                    dropped_by["m2po"][t] = True
                    keep[t] = False
                break
    w = w * (mask & keep)
    # The trust region's mask (docs/spec.md#trust-region) zeroes the weight before the normalisation.
    tr_masked, tr_ref = _trust_region_state(logp_y.detach(), lq, proximal_logprobs, adv, mask,
                                            _turns(seq_ids, segment_ids, mask) if tr_per_turn else seqs, cfg)
    w = w * ~tr_masked
    scale = 1.0
    mean_w = _normalisation_mean(w, mask & keep, seqs, cfg)
    if mean_w is not None:
        scale = 1.0 / mean_w if mean_w > 0 else 1.0
        w = w * scale
    return dict(n=n, lp=lp, logp_y=logp_y, lq=lq, adv=adv, mask=mask, keep=keep, w=w, scale=scale, seqs=seqs,
                r_p=r_p, r=r, bounded=bounded, impossible=impossible, is_support=is_support,
                token_rejected=token_rejected, dropped_by=dropped_by, tr_masked=tr_masked, tr_ref=tr_ref)


def _centering_row(lp_row: Tensor, cands: Any, t: int, is_support: bool, cfg: _Config):
    """docs/spec.md#score-centering for row ``t``: ``(c(v) list, ids list, (P_H, Q_H, rho))`` with
    ``c(v) = q f(p/q) - alpha p`` over the recorded ids."""
    valid = cands.ids[t] >= 0
    ids = cands.ids[t][valid].long()
    p = torch.exp(lp_row.detach()[ids])
    q = torch.exp(cands.logprobs[t][valid].double())
    with torch.no_grad():
        m = torch.where(q > 0, q * f(p / torch.where(q > 0, q, torch.ones_like(q)), cfg), torch.zeros_like(q))
        if is_support:
            rho = 1.0
            alpha = f(torch.ones(1, dtype=torch.float64), cfg)[0]
        else:
            rho = max(1 - float(q.sum()), TAIL_EPS) / max(1 - float(p.sum()), TAIL_EPS)
            alpha = rho * f(torch.tensor([1 / rho], dtype=torch.float64), cfg)[0]
    return (m - alpha * p).tolist(), ids.tolist(), (float(p.sum()), float(q.sum()), rho)


def _turns(seq_ids: Tensor | None, segment_ids: Tensor, mask: Tensor) -> list[Tensor]:
    """Index tensors of each turn's trained tokens: the tokens sharing both a sequence id and a segment id (a
    segment id alone without ``seq_ids``), token by token."""
    groups: dict[tuple[int, int], list[int]] = {}
    for t in range(mask.shape[0]):
        if mask[t]:
            key = (int(seq_ids[t]) if seq_ids is not None else 0, int(segment_ids[t]))
            groups.setdefault(key, []).append(t)
    return [torch.tensor(v, dtype=torch.int64) for v in groups.values()]


def _sequences(seq_ids: Tensor, mask: Tensor) -> list[Tensor]:
    """Index tensors of each sequence's trained tokens (sequences without any are left out)."""
    out = []
    for s in torch.unique(seq_ids).tolist():
        idx = ((seq_ids == s) & mask).nonzero().flatten()
        if idx.numel():
            out.append(idx)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Metrics, docs/spec.md#metrics
# ---------------------------------------------------------------------------------------------------------------


def reference_metrics(
    logits: Tensor,
    tokens: Tensor,
    sampler_logprobs: Tensor,
    advantages: Tensor,
    candidates: Any = None,
    loss_mask: Tensor | None = None,
    temperature: float | Tensor = 1.0,
    correction: Any = None,
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
    segment_ids: Tensor | None = None,
    route_flips: Tensor | None = None,
) -> dict[str, float]:
    """Every key of docs/spec.md#metrics (those of ``policy_loss``'s ``out.metrics``, entropy included), literally,
    token by token in float64; same arguments as :func:`reference_policy_loss` plus the metric-only ones (the
    aggregation arguments matter only for the ``kl_penalty`` key)."""
    corr = _config(correction)
    if corr.kl_penalty is not None and reference_logprobs is None:
        raise ValueError("reference: kl_penalty needs reference_logprobs")
    st = _state(logits, tokens, sampler_logprobs, advantages, candidates, loss_mask, temperature, corr, seq_ids,
                proximal_logprobs, segment_ids, versions, current_version, route_flips)
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
        if corr.per_sequence:
            # One weight per sequence: the mean of its trained tokens' final weights.
            ws = [sum(float(st["w"][t]) for t in idx.tolist()) / idx.numel() for idx in st["seqs"]]
            sq = sum(x * x for x in ws)
            out["seq_ess"] = sum(ws) ** 2 / (len(ws) * sq) if sq > 0 else 0.0
    for name, dropped in st["dropped_by"].items():
        # Each rule's share of trained tokens (a token rule such as the staleness rejection needs no seq_ids).
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


def _clamped_log_ratio(st: dict, t: int, corr: _Config) -> float:
    lr = float(st["logp_y"][t].detach() - st["lq"][t])
    return min(max(lr, -corr.max_log_ratio), corr.max_log_ratio)


def _is_extreme(st: dict, t: int, corr: _Config) -> bool:
    r = math.exp(_clamped_log_ratio(st, t, corr))
    return r < EXTREME[0] or r > EXTREME[1]


def _sequence_metrics(st: dict, corr: _Config) -> dict[str, float]:
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


def _probability_agreement(p: list[float], q: list[float]) -> dict[str, float]:
    """Pearson's correlation of the trained tokens' ``p`` and ``q`` (1 when a side is constant and ``p == q``
    everywhere, else 0 when a side is constant or there is no token) and ``|p - q|``'s max, mean and std with
    Bessel's correction (0 under two tokens)."""
    n = len(p)
    mp, mq = _mean(p), _mean(q)
    sxy = sum((a - mp) * (b - mq) for a, b in zip(p, q))
    sxx = sum((a - mp) ** 2 for a in p)
    syy = sum((b - mq) ** 2 for b in q)
    if sxx > 0 and syy > 0:
        pearson = min(max(sxy / (math.sqrt(sxx) * math.sqrt(syy)), -1.0), 1.0)
    else:
        pearson = 1.0 if n and all(a == b for a, b in zip(p, q)) else 0.0
    d = [abs(a - b) for a, b in zip(p, q)]
    md = _mean(d)
    return {
        "prob_pearson": pearson,
        "prob_abs_diff_max": max(d, default=0.0),
        "prob_abs_diff_mean": md,
        "prob_abs_diff_std": math.sqrt(sum((x - md) ** 2 for x in d) / (n - 1)) if n > 1 else 0.0,
    }


def _token_metrics(st: dict, sel: Tensor, corr: _Config) -> dict[str, float]:
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
    extra.update(_probability_agreement([math.exp(float(st["logp_y"][t])) for t in rows],
                                        [math.exp(float(st["lq"][t])) for t in rows]))
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
# Trust regions on probability differences, docs/spec.md#trust-region (the TrustRegion read by field name)
# ---------------------------------------------------------------------------------------------------------------


def _bernoulli_kl(log_a: float, log_b: float) -> float:
    """``KL(Bern(a) || Bern(b))`` with ``0 log 0 = 0``; ``inf`` where ``b`` is 0 or 1 and ``a`` is not."""
    a, na = math.exp(log_a), -math.expm1(log_a)
    nb = -math.expm1(log_b)
    head = 0.0 if a == 0 else (math.inf if log_b == -math.inf else a * (log_a - log_b))
    tail = 0.0 if na == 0 else (math.inf if nb == 0 else na * (math.log(na) - math.log(nb)))
    return head + tail


def _trust_region_divergence(lp: float, lr: float, d: float, divergence: str) -> float:
    """The divergence of one token between ``log p = lp`` and ``log p_ref = lr`` (``d = p - p_ref``)."""
    if divergence == "difference":
        return abs(d)
    if divergence == "binary_kl":
        return _bernoulli_kl(lr, lp)
    if divergence == "binary_kl_max":
        return max(_bernoulli_kl(lr, lp), _bernoulli_kl(lp, lr))
    raise ValueError(f"reference: trust region divergence={divergence!r} is not implemented here")


def _trust_region_per_sequence(level: str) -> bool:
    if level in ("token", "segment"):  # "segment": per turn, seq_ids optional
        return False
    if level in ("sequence", "geometric", "sequence_max"):
        return True
    raise ValueError(f"reference: trust region level={level!r} is not implemented here")


def _trust_region_state(logp_y: Tensor, lq: Tensor, proximal: Tensor | None, adv: Tensor, mask: Tensor,
                        seqs: list, cfg: _Config) -> tuple[Tensor, Tensor | None]:
    """``([N] bool masked, [N] float64 log p_ref of the update)``: the tokens the trust region masks, token by
    token (or sequence by sequence, ``seqs``; turn by turn at ``level="segment"``, ``seqs`` then the turns), and the
    log-probabilities the update's ratio and penalty divide by."""
    n = logp_y.shape[0]
    tr = cfg.trust_region
    masked = torch.zeros(n, dtype=torch.bool)
    if tr is None:
        return masked, None
    prox = proximal.double() if proximal is not None else None
    upd_ref = prox if prox is not None else lq
    if tr.on == "update":
        num, den = logp_y, upd_ref
    elif tr.on == "weights":
        num, den = (prox if prox is not None else logp_y), lq
    else:
        raise ValueError(f"reference: trust region on={tr.on!r} is not implemented here")
    d = [math.exp(float(num[t])) - math.exp(float(den[t])) for t in range(n)]
    div = [_trust_region_divergence(float(num[t]), float(den[t]), d[t], tr.divergence) if mask[t] else 0.0
           for t in range(n)]
    lower, upper = float(tr.lower), float(tr.upper)

    def rises_or_falls(t: int) -> tuple[bool, bool]:
        return d[t] > 0 and div[t] > upper, d[t] < 0 and div[t] > lower

    if _trust_region_per_sequence(tr.level) or tr.level == "segment":
        if tr.sign != "none":
            raise ValueError(f"reference: a sequence-level trust region needs sign='none', got {tr.sign!r}")
        for idx in seqs:
            toks = idx.tolist()
            if tr.level == "sequence_max":
                # Masked when the token level (both sides) masks any of the sequence's trained tokens.
                if any(rise or fall for rise, fall in map(rises_or_falls, toks)):
                    masked[idx] = True
                continue
            if tr.divergence == "difference":
                # The sum ("sequence") or the mean ("geometric"; "segment": over the turn) of d, in [-lower, upper].
                total = sum(d[t] for t in toks)
                stat = total if tr.level == "sequence" else total / len(toks)
                if stat > upper or stat < -lower:
                    masked[idx] = True
                continue
            # The sum or the mean of the sequence's divergences D >= 0: one band, lower == upper.
            if lower != upper:
                raise ValueError("reference: a sequence's summed or mean divergence needs lower == upper")
            total = sum(div[t] for t in toks)
            stat = total if tr.level == "sequence" else total / len(toks)
            if stat > upper:
                masked[idx] = True
        return masked, upd_ref
    for t in range(n):
        if not mask[t]:
            continue
        rise, fall = rises_or_falls(t)
        if tr.sign == "advantage":
            masked[t] = rise if adv[t] > 0 else fall
        elif tr.sign == "none":
            masked[t] = rise or fall
        else:
            raise ValueError(f"reference: trust region sign={tr.sign!r} is not implemented here")
    return masked, upd_ref


def _trust_region_ratio(logp_y: Tensor, ref: Tensor, adv: Tensor, cfg: _Config) -> Tensor:
    """``[N]`` the surrogate ``u_t A_t``, ``u = exp(clamp(log p - log p_ref, +-max_log_ratio))``, token by token."""
    out = torch.zeros_like(logp_y)
    for t in range(logp_y.shape[0]):
        out[t] = torch.exp((logp_y[t] - ref[t]).clamp(-cfg.max_log_ratio, cfg.max_log_ratio)) * adv[t]
    return out


def _trust_region_penalty(logp_y: Tensor, ref: Tensor, kept: Tensor, cfg: _Config) -> Tensor:
    """``[N]`` ``c (log p - log p_ref)^2`` on kept trained tokens the trainer can produce, 0 elsewhere."""
    out = torch.zeros_like(logp_y)
    for t in range(logp_y.shape[0]):
        if kept[t] and logp_y[t] > -math.inf:
            out[t] = float(cfg.trust_region.penalty) * (logp_y[t] - ref[t]) ** 2
    return out
