"""verl: offpolicy's loss as a registered verl policy loss (``actor.policy_loss.loss_mode=offpolicy``).

Loaded by ``import verl`` through the ``verl.plugins`` entry point that offpolicy's package declares (inside the Ray
workers too), or with ``VERL_USE_EXTERNAL_MODULES=offpolicy.adapters.verl``. verl calls a registered loss as

    fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config: ActorConfig, rollout_is_weights)

with ``[B, T]`` tensors and ``config.global_batch_info`` (``dp_size``, ``batch_num_tokens``, ``global_batch_size``,
``loss_scale_factor``); ``ppo_loss`` does not pass ``rollout_log_probs`` (see docs/integrations.md for the upstream
change). The sampler's log-probabilities reach the loss in one of two ways, both set with config alone:

* **from rollout_is_weights** (decoupled mode; every name but those registered with ``old_log_prob_is_sampler``):
  with ``algorithm.rollout_correction.rollout_is=token`` and ``rollout_is_threshold`` at least ``exp(20)`` (verl
  clamps the log-ratio to ``[-20, 20]`` before exponentiating, so nothing is truncated), verl's weights are
  ``exp(old_log_prob - rollout_log_prob)``, hence ``lq = old_log_prob - log(w)`` (exact to fp32 rounding), and
  ``old_log_prob`` is the proximal policy of decoupled PPO (``Correction.ppo_clip``). No weights (verl's YAML default
  ``rollout_is: null``, or no ``rollout_log_probs``) is an error: ``old_log_prob`` is then the trainer's own
  recomputed policy and no correction would be applied. ``rollout_is=sequence`` (the dataclass default) is an error
  too: one weight per sequence cannot give back per-token log-probs.
* **old_log_prob is the sampler's** (an explicit opt-in: ``loss_mode=offpolicy_old_is_sampler``, or any name
  registered with ``register_correction(..., old_log_prob_is_sampler=True)``), for a pipeline that writes the
  rollout log-probs into ``old_log_probs`` (verl's ``apply_bypass_mode`` does, but then forces
  ``loss_mode=bypass_mode``, so this path serves custom pipelines and the upstream change, not bypass mode itself).
  Weights passed beside it must all be 1 (``old == rollout``), else ``old_log_prob`` is not the sampler's.

Checks on every batch, ``O(B T)`` with one host sync (:func:`weight_stats`): a trained weight ``<= 0`` or NaN, the
sequence-constant weights of ``rollout_is=sequence`` (errors), and weights truncated at ``rollout_is_threshold``
(``rollout_is_threshold`` warning, once; :func:`truncated_weights`).

The :class:`~offpolicy.Correction` is chosen by the loss-mode name: ``offpolicy`` (token MIS ``[0.5, 5]``, the
IcePop default band), the presets in :data:`PRESETS`, or any name registered with :func:`register_correction`
(from a module named in ``VERL_USE_EXTERNAL_MODULES``). verl records no candidate sets, so score centering and
mask replay are out of reach here until the upstream change ships a support record.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

try:
    from verl.trainer.ppo.core_algos import register_policy_loss
except ImportError as exc:  # pragma: no cover - exercised only without verl
    raise ImportError("offpolicy.adapters.verl needs verl: tools/setup_test_envs.sh builds a venv with it") from exc

from offpolicy.adapters.guard import Guard, Suspect
from offpolicy.corrections.correction import Correction
from offpolicy.loss.logprobs import policy_loss_from_logprobs

#: verl clamps ``log(pi_old / pi_rollout)`` to ``[-SAFETY_BOUND, SAFETY_BOUND]`` before exponentiating
#: (verl/trainer/ppo/rollout_corr_helper.py); weights at the clamp do not give back ``lq`` exactly.
SAFETY_BOUND = 20.0
#: verl's ``loss_agg_mode`` -> offpolicy's aggregation.
AGGREGATIONS = {
    "token-mean": "token_mean", "token-sum": "constant", "seq-mean-token-sum": "seq_mean_token_sum",
    "seq-mean-token-sum-norm": "seq_mean_token_sum", "seq-mean-token-mean": "seq_mean_token_mean",
}
PRESETS: dict[str, Correction] = {
    "offpolicy": Correction(weights="mis", bounds=(0.5, 5.0)),
    "offpolicy_tis": Correction(weights="tis", bounds=(0.0, 2.0)),
    "offpolicy_seq_mis": Correction(weights="mis", bounds=(0.5, 2.0), level="sequence"),
    "offpolicy_geo_mis": Correction(weights="mis", bounds=(0.9, 1.1), level="geometric"),
    "offpolicy_ppo_mis": Correction(weights="mis", bounds=(0.5, 5.0), ppo_clip=(0.2, 0.2)),
}
_CORRECTIONS: dict[str, Correction] = {}
#: Loss-mode names whose ``old_log_prob`` is the sampler's (registered with ``old_log_prob_is_sampler=True``).
_OLD_IS_SAMPLER: set[str] = set()
#: The opt-in preset for a pipeline that writes the rollout log-probs into ``old_log_probs``.
OLD_IS_SAMPLER_PRESET = "offpolicy_old_is_sampler"
#: verl's default ``algorithm.rollout_correction.rollout_is_threshold``.
DEFAULT_IS_THRESHOLD = 2.0
#: Recent batch maxima remembered (weight -> ``old_log_prob`` there) to recognise a threshold from one token per
#: batch; few, so that an honest maximum equal to a remembered one to the last bit stays a ~1e-6 event per batch.
MAX_REMEMBERED = 16
TRUNCATED_WEIGHTS = Suspect(
    "rollout_is_threshold",
    "verl truncated rollout_is_weights at algorithm.rollout_correction.rollout_is_threshold (default 2.0): lq = "
    "old_log_prob - log(w) is then wrong on every truncated token, a silently different loss",
    "set algorithm.rollout_correction.rollout_is_threshold=1e30 (with rollout_is=token): the Correction does the "
    "truncation")
#: One guard per process (verl calls the loss per micro-batch); its checks run on every batch.
GUARD = Guard([TRUNCATED_WEIGHTS])


def weight_stats(rollout_is_weights: Tensor, old_log_prob: Tensor, response_mask: Tensor) -> dict[str, float]:
    """What the checks of :func:`policy_loss` need from verl's weights, ``O(B T)``, read back with one host sync.

    Args:
        rollout_is_weights, old_log_prob: ``[B, T]`` float; response_mask: ``[B, T]`` bool/int.

    Returns:
        ``tokens`` (trained), ``nonpositive`` (trained weights ``<= 0`` or NaN), ``top`` / ``bottom`` (largest /
        smallest trained weight, in the weights' dtype), ``at_top`` (trained tokens at ``top``), ``old_lo`` /
        ``old_hi`` (the range of ``old_log_prob`` over them), ``multi_rows`` (rows with 2+ trained tokens),
        ``constant_rows`` (those whose trained weights are all equal) and ``constant_rows_off_one`` (those at a
        weight other than 1).
    """
    mask = response_mask.bool()
    if mask.numel() == 0:
        return dict.fromkeys(("tokens", "nonpositive", "at_top", "multi_rows", "constant_rows",
                              "constant_rows_off_one"), 0.0) | {"top": -math.inf, "bottom": math.inf,
                                                                "old_lo": math.inf, "old_hi": -math.inf}
    w, old = rollout_is_weights.detach(), old_log_prob.detach()
    big, small = torch.full_like(w, math.inf), torch.full_like(w, -math.inf)
    top = torch.where(mask, w, small).amax()
    at = mask & (w == top)
    old_big, old_small = torch.full_like(old, math.inf), torch.full_like(old, -math.inf)
    row_hi, row_lo = torch.where(mask, w, small).amax(-1), torch.where(mask, w, big).amin(-1)
    multi = mask.sum(-1) >= 2
    constant = multi & (row_hi == row_lo)
    values = torch.stack([x.double() for x in (
        mask.sum(), (mask & ~(w > 0)).sum(), top, row_lo.amin(), at.sum(), torch.where(at, old, old_big).amin(),
        torch.where(at, old, old_small).amax(), multi.sum(), constant.sum(), (constant & (row_hi != 1)).sum())])
    keys = ("tokens", "nonpositive", "top", "bottom", "at_top", "old_lo", "old_hi", "multi_rows", "constant_rows",
            "constant_rows_off_one")
    return dict(zip(keys, values.tolist()))


def configured_threshold(config) -> float | None:
    """The upper ``rollout_is_threshold`` the actor config carries (``actor.policy_loss.rollout_correction``; verl
    copies ``algorithm.rollout_correction`` there in bypass mode only, so in decoupled mode it is the user's own
    setting or the dataclass default), or None."""
    try:
        value = config.policy_loss.get("rollout_correction", None).get("rollout_is_threshold", None)
    except AttributeError:
        return None
    try:
        return float(str(value).split("_")[-1]) if value is not None else None
    except ValueError:
        return None


def truncated_weights(stats: dict[str, float], thresholds: tuple[float, ...] = (DEFAULT_IS_THRESHOLD,),
                      memory: dict | None = None) -> tuple[int, float]:
    """``(count, value)`` of trained tokens whose weight sits at a truncation, from :func:`weight_stats`; ``(0, nan)``
    if none. The largest weight is a truncation when two tokens of different ``old_log_prob`` hold it (two different
    ratios cannot round to one weight), when it is a known threshold (``thresholds``, as the weights' dtype holds
    them: an honest largest weight equal to one to the last bit has probability ~1e-7), or when an earlier batch's
    largest weight was the same value at a different ``old_log_prob`` (``memory``, kept across batches: a threshold
    that truncates one token per batch is named from its second batch). Weights at verl's ``exp(SAFETY_BOUND)``
    clamp and weights of exactly 1 (``old == rollout``) are never counted."""
    top = stats["top"]
    if not stats["at_top"] or not math.isfinite(top) or top == 1.0 or top >= math.exp(SAFETY_BOUND) * (1 - 1e-6):
        return 0, float("nan")
    hit = stats["old_hi"] > stats["old_lo"] or top in thresholds
    if not hit and memory is not None:
        seen = memory.setdefault("verl_batch_max", {})
        earlier = seen.get(top)
        hit = earlier is not None and earlier != stats["old_lo"]
        if earlier is None:
            if len(seen) >= MAX_REMEMBERED:
                seen.pop(next(iter(seen)))
            seen[top] = stats["old_lo"]
    return (int(stats["at_top"]), top) if hit else (0, float("nan"))


def register_correction(name: str, correction: Correction, *, old_log_prob_is_sampler: bool = False) -> None:
    """Register ``correction`` as verl loss mode ``name`` (``actor.policy_loss.loss_mode=<name>``).

    Args:
        old_log_prob_is_sampler: the loss takes ``old_log_prob`` as the sampler's log-probs (a pipeline that writes
            the rollout log-probs into ``old_log_probs``); default False: they are recovered from verl's
            ``rollout_is_weights`` (``rollout_is=token``), and a batch without weights is an error.
    """
    if not isinstance(correction, Correction):
        raise TypeError(f"correction must be an offpolicy.Correction, got {type(correction).__name__}")
    if correction.score_centering:
        raise ValueError("verl passes no candidate record to policy losses: score_centering cannot be applied")
    if old_log_prob_is_sampler and correction.surrogate.needs_proximal:
        raise ValueError(f"old_log_prob_is_sampler=True leaves no proximal policy for the Correction's PPO-family "
                         f"surrogate ({type(correction.surrogate).__name__}): register it without "
                         "old_log_prob_is_sampler and run verl with rollout_is=token weights")
    _CORRECTIONS[name] = correction
    (_OLD_IS_SAMPLER.add if old_log_prob_is_sampler else _OLD_IS_SAMPLER.discard)(name)
    register_policy_loss(name)(policy_loss)


def correction_for(config) -> Correction:
    """The :class:`~offpolicy.Correction` of ``config.policy_loss.loss_mode``."""
    mode = config.policy_loss.get("loss_mode", "vanilla")
    if mode not in _CORRECTIONS:
        raise ValueError(f"actor.policy_loss.loss_mode={mode!r} is not an offpolicy loss; registered: "
                         f"{sorted(_CORRECTIONS)}")
    return _CORRECTIONS[mode]


def aggregation_args(loss_agg_mode: str, response_mask: Tensor, global_batch_info: dict) -> dict:
    """verl's ``agg_loss`` normalisation as :func:`offpolicy.policy_loss_from_logprobs` arguments.

    verl's loss on a rank is ``(sum over its tokens or sequences) / global count * dp_size``: data-parallel
    averaging of the gradients then yields the global-batch mean. offpolicy divides by ``global count / dp_size``.
    """
    if loss_agg_mode not in AGGREGATIONS:
        raise ValueError(f"loss_agg_mode must be one of {sorted(AGGREGATIONS)}, got {loss_agg_mode!r}")
    dp = global_batch_info.get("dp_size", 1) or 1
    tokens = global_batch_info.get("batch_num_tokens")
    seqs = global_batch_info.get("global_batch_size")
    mask = response_mask.bool()
    if loss_agg_mode == "token-mean":
        if tokens is None:
            if dp > 1:
                raise ValueError("global_batch_info['batch_num_tokens'] is required when dp_size > 1")
            return {"aggregation": "token_mean", "num_loss_tokens": mask.sum().clamp_min(1).to(torch.float32)}
        return {"aggregation": "token_mean", "num_loss_tokens": float(tokens) / dp}
    if loss_agg_mode == "token-sum":
        return {"aggregation": "constant", "constant_normalizer": 1.0 / dp}
    if seqs is None:
        if dp > 1:
            raise ValueError("global_batch_info['global_batch_size'] is required when dp_size > 1")
        seqs = int((mask.sum(-1) > 0).sum())
    num_sequences = float(seqs) / dp
    if loss_agg_mode == "seq-mean-token-sum-norm":
        scale = global_batch_info.get("loss_scale_factor")
        num_sequences *= float(mask.shape[-1] if scale is None else scale)
    return {"aggregation": AGGREGATIONS[loss_agg_mode], "num_sequences": max(num_sequences, 1e-30)}


def sampler_logprobs(old_log_prob: Tensor, rollout_is_weights: Tensor | None, response_mask: Tensor, *,
                     old_is_sampler: bool = False,
                     stats: dict[str, float] | None = None) -> tuple[Tensor, Tensor | None]:
    """``(lq [B, T], proximal [B, T] or None)`` from what verl passes (see the module docstring).

    Args:
        old_log_prob, response_mask: ``[B, T]``; rollout_is_weights: ``[B, T]`` or None.
        old_is_sampler: the loss mode's opt-in (``old_log_prob`` is the sampler's).
        stats: :func:`weight_stats` of the weights, if already computed.

    Raises:
        ValueError: no weights without the opt-in (``rollout_is`` null: no correction would be applied); weights with
            the opt-in that are not all 1; a trained weight ``<= 0``; sequence-level weights (``rollout_is=sequence``).
    """
    if rollout_is_weights is None:
        if old_is_sampler:
            return old_log_prob, None
        raise ValueError(
            "verl passed no rollout_is_weights: algorithm.rollout_correction.rollout_is is null (verl's YAML default) "
            "or the batch has no rollout_log_probs, so old_log_prob is the trainer's recomputed policy, not the "
            "sampler's, and no off-policy correction would be applied. Fix: set "
            "algorithm.rollout_correction.rollout_is=token and rollout_is_threshold=1e30 (with "
            "actor_rollout_ref.rollout.calculate_log_probs=True); a pipeline that writes the rollout log-probs into "
            f"old_log_probs opts in with loss_mode={OLD_IS_SAMPLER_PRESET} (or register_correction(..., "
            "old_log_prob_is_sampler=True))")
    if rollout_is_weights.shape != old_log_prob.shape:
        raise ValueError(f"rollout_is_weights must be [B, T] like old_log_prob {tuple(old_log_prob.shape)}, got "
                         f"{tuple(rollout_is_weights.shape)}")
    if stats is None:
        stats = weight_stats(rollout_is_weights, old_log_prob, response_mask)
    if old_is_sampler:
        if stats["tokens"] and not (abs(stats["top"] - 1) <= 1e-6 and abs(stats["bottom"] - 1) <= 1e-6):
            raise ValueError(
                f"this loss mode takes old_log_prob as the sampler's log-probs, but verl's rollout_is_weights = "
                f"exp(old_log_prob - rollout_log_prob) range over [{stats['bottom']:.4g}, {stats['top']:.4g}], not 1: "
                "old_log_prob is the trainer's recomputed policy. Use loss_mode=offpolicy with "
                "algorithm.rollout_correction.rollout_is=token and rollout_is_threshold=1e30")
        return old_log_prob, None
    if stats["nonpositive"]:
        raise ValueError("rollout_is_weights: a trained token has weight <= 0 (an IcePop/rejection setting zeroed "
                         "it), so lq cannot be recovered; use rollout_is=token with rollout_is_threshold >= exp(20)")
    if stats["multi_rows"] and stats["constant_rows"] == stats["multi_rows"] and stats["constant_rows_off_one"]:
        raise ValueError(
            f"rollout_is_weights are constant along each sequence (all {int(stats['multi_rows'])} sequences with 2+ "
            "trained tokens, not all at 1): verl computed them with algorithm.rollout_correction.rollout_is=sequence "
            "(RolloutCorrectionConfig's default), one weight exp(sum_t log ratio) per sequence, which cannot give back "
            "the sampler's per-token log-probs (lq = old_log_prob - log w would be wrong, even positive). Fix: set "
            "algorithm.rollout_correction.rollout_is=token and rollout_is_threshold=1e30; a sequence-level "
            "correction is the Correction's (e.g. loss_mode=offpolicy_seq_mis)")
    mask = response_mask.bool()
    w = rollout_is_weights.to(old_log_prob.dtype)
    log_w = torch.where(mask, torch.log(torch.where(mask, w, torch.ones_like(w))), torch.zeros_like(w))
    return old_log_prob - log_w, old_log_prob


def policy_loss(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                loss_agg_mode: str = "token-mean", config=None,
                rollout_is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """verl's registered-loss signature: ``[B, T]`` tensors in, ``(loss, metrics)`` out.

    Args:
        old_log_prob: ``[B, T]`` proximal policy (decoupled mode) or the sampler's log-probs (see the module).
        log_prob: ``[B, T]`` differentiable trainer log-probs at the rollout temperature.
        advantages: ``[B, T]``.
        response_mask: ``[B, T]`` bool/int.
        loss_agg_mode: verl's aggregation (all five of :data:`AGGREGATIONS`).
        config: verl ``ActorConfig`` (``policy_loss.loss_mode`` picks the Correction; ``global_batch_info``).
        rollout_is_weights: ``[B, T]`` verl's ``exp(old - rollout)``, or None.
    """
    if config is None:
        raise ValueError("config (verl ActorConfig) is required: it names the Correction and the global batch")
    correction = correction_for(config)
    mode = config.policy_loss.get("loss_mode", "vanilla")
    b, t = log_prob.shape
    mask = response_mask.bool()
    aggregation = aggregation_args(loss_agg_mode, mask, dict(config.global_batch_info))
    stats = None
    if rollout_is_weights is not None and rollout_is_weights.shape == old_log_prob.shape:
        stats = weight_stats(rollout_is_weights, old_log_prob, mask)  # the one host sync of the checks
    lq, proximal = sampler_logprobs(old_log_prob.detach(), rollout_is_weights, response_mask,
                                    old_is_sampler=mode in _OLD_IS_SAMPLER, stats=stats)
    needs_proximal = correction.surrogate.needs_proximal  # the old_log_prob_is_sampler modes have none (refused)
    seq_ids = torch.arange(b, device=log_prob.device)[:, None].expand(b, t).reshape(-1)
    out = policy_loss_from_logprobs(
        log_prob.reshape(-1), lq.reshape(-1), advantages.reshape(-1), loss_mask=mask.reshape(-1),
        correction=correction, seq_ids=seq_ids,
        proximal_logprobs=proximal.reshape(-1) if needs_proximal else None, **aggregation,
    )
    metrics = {f"offpolicy/{k}": float(v) for k, v in out.metrics.items()}
    if proximal is not None and GUARD.tick():
        known = {DEFAULT_IS_THRESHOLD} | ({configured_threshold(config)} - {None})
        dtype = rollout_is_weights.dtype
        known_as_weights = tuple(float(torch.tensor(v, dtype=dtype)) for v in known)
        count, value = truncated_weights(stats, known_as_weights, GUARD.memory)
        if count:
            flags = GUARD.flag(TRUNCATED_WEIGHTS, f"{count} of {int(stats['tokens'])} trained tokens have weight "
                                                  f"exactly {value:g}")
            metrics.update({f"offpolicy/{k}": v for k, v in flags.items()})
    return out.loss, metrics


for _name, _corr in PRESETS.items():
    register_correction(_name, _corr)
register_correction(OLD_IS_SAMPLER_PRESET, PRESETS["offpolicy"], old_log_prob_is_sampler=True)

__all__ = ["AGGREGATIONS", "DEFAULT_IS_THRESHOLD", "GUARD", "OLD_IS_SAMPLER_PRESET", "PRESETS", "aggregation_args",
           "configured_threshold", "correction_for", "policy_loss", "register_correction", "sampler_logprobs",
           "truncated_weights", "weight_stats"]
