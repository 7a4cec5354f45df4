"""verl: offpolicy's loss as a registered verl policy loss (``actor.policy_loss.loss_mode=offpolicy``).

Loaded by ``import verl`` through the ``verl.plugins`` entry point that offpolicy's package declares (inside the Ray
workers too), or with ``VERL_USE_EXTERNAL_MODULES=offpolicy.adapters.verl``. verl calls a registered loss as

    fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config: ActorConfig, rollout_is_weights)

with ``[B, T]`` tensors and ``config.global_batch_info`` (``dp_size``, ``batch_num_tokens``, ``global_batch_size``,
``loss_scale_factor``); ``ppo_loss`` does not pass ``rollout_log_probs`` (see docs/integrations.md for the upstream
change). The sampler's log-probabilities reach the loss in one of two ways, both set with config alone:

* **from rollout_is_weights** (decoupled mode; the default when verl passes weights): with
  ``algorithm.rollout_correction.rollout_is=token`` and ``rollout_is_threshold`` at least ``exp(20)`` (verl clamps
  the log-ratio to ``[-20, 20]`` before exponentiating, so nothing is truncated), verl's weights are
  ``exp(old_log_prob - rollout_log_prob)``, hence ``lq = old_log_prob - log(w)`` (exact to fp32 rounding), and
  ``old_log_prob`` is the proximal policy of decoupled PPO (``Correction.ppo_clip``).
* **old_log_prob is the sampler's** (no weights passed: a pipeline that writes the rollout log-probs into
  ``old_log_probs``, as verl's bypass mode does; verl's ``apply_bypass_mode`` then forces ``loss_mode=bypass_mode``,
  so this path serves custom loss functions and the upstream change, not bypass mode itself).

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
#: verl's default ``algorithm.rollout_correction.rollout_is_threshold``.
DEFAULT_IS_THRESHOLD = 2.0
TRUNCATED_WEIGHTS = Suspect(
    "rollout_is_threshold",
    "verl truncated rollout_is_weights at algorithm.rollout_correction.rollout_is_threshold (default 2.0): lq = "
    "old_log_prob - log(w) is then wrong on every truncated token, a silently different loss",
    "set algorithm.rollout_correction.rollout_is_threshold=1e30 (with rollout_is=token): the Correction does the "
    "truncation")
#: One guard per process (verl calls the loss per micro-batch): the first batches, then one in 50.
GUARD = Guard([TRUNCATED_WEIGHTS])


def truncated_weights(rollout_is_weights: Tensor, old_log_prob: Tensor, response_mask: Tensor) -> tuple[int, float]:
    """``(count, value)`` of trained tokens whose weight sits at a truncation: the largest weight, held by tokens of
    different ``old_log_prob`` (two different ratios cannot round to one weight), or verl's default threshold
    itself; ``(0, nan)`` if none. Weights at verl's ``exp(SAFETY_BOUND)`` clamp are not counted.

    Args:
        rollout_is_weights, old_log_prob: ``[B, T]`` float; response_mask: ``[B, T]`` bool/int.
    """
    mask = response_mask.bool()
    w = rollout_is_weights.detach()[mask]
    if w.numel() == 0:
        return 0, float("nan")
    top = w.max()
    at = w == top
    distinct = torch.unique(old_log_prob.detach()[mask][at]).numel()
    if float(top) < math.exp(SAFETY_BOUND) * (1 - 1e-6) and (distinct >= 2 or float(top) == DEFAULT_IS_THRESHOLD):
        return int(at.sum()), float(top)
    return 0, float("nan")


def register_correction(name: str, correction: Correction) -> None:
    """Register ``correction`` as verl loss mode ``name`` (``actor.policy_loss.loss_mode=<name>``)."""
    if not isinstance(correction, Correction):
        raise TypeError(f"correction must be an offpolicy.Correction, got {type(correction).__name__}")
    if correction.score_centering:
        raise ValueError("verl passes no candidate record to policy losses: score_centering cannot be applied")
    _CORRECTIONS[name] = correction
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


def sampler_logprobs(old_log_prob: Tensor, rollout_is_weights: Tensor | None,
                     response_mask: Tensor) -> tuple[Tensor, Tensor | None]:
    """``(lq [B, T], proximal [B, T] or None)`` from what verl passes (see the module docstring)."""
    if rollout_is_weights is None:
        return old_log_prob, None
    if rollout_is_weights.shape != old_log_prob.shape:
        raise ValueError(f"rollout_is_weights must be [B, T] like old_log_prob {tuple(old_log_prob.shape)}, got "
                         f"{tuple(rollout_is_weights.shape)}")
    mask = response_mask.bool()
    w = rollout_is_weights.to(old_log_prob.dtype)
    if bool((mask & ~(w > 0)).any()):
        raise ValueError("rollout_is_weights: a trained token has weight <= 0 (an IcePop/rejection setting zeroed "
                         "it), so lq cannot be recovered; use rollout_is=token with rollout_is_threshold >= exp(20)")
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
    b, t = log_prob.shape
    lq, proximal = sampler_logprobs(old_log_prob.detach(), rollout_is_weights, response_mask)
    if correction.ppo_clip is not None and proximal is None:
        raise ValueError("Correction.ppo_clip needs the proximal policy: run verl in decoupled mode with "
                         "rollout_is=token weights (see offpolicy.adapters.verl)")
    mask = response_mask.bool()
    seq_ids = torch.arange(b, device=log_prob.device)[:, None].expand(b, t).reshape(-1)
    out = policy_loss_from_logprobs(
        log_prob.reshape(-1), lq.reshape(-1), advantages.reshape(-1), loss_mask=mask.reshape(-1),
        correction=correction, seq_ids=seq_ids,
        proximal_logprobs=proximal.reshape(-1) if correction.ppo_clip is not None else None,
        **aggregation_args(loss_agg_mode, mask, dict(config.global_batch_info)),
    )
    metrics = {f"offpolicy/{k}": float(v) for k, v in out.metrics.items()}
    if rollout_is_weights is not None and GUARD.tick():
        count, value = truncated_weights(rollout_is_weights, old_log_prob, mask)
        if count:
            flags = GUARD.flag(TRUNCATED_WEIGHTS, f"{count} of {int(mask.sum())} trained tokens have weight "
                                                  f"exactly {value:g}")
            metrics.update({f"offpolicy/{k}": v for k, v in flags.items()})
    return out.loss, metrics


for _name, _corr in PRESETS.items():
    register_correction(_name, _corr)

__all__ = ["AGGREGATIONS", "DEFAULT_IS_THRESHOLD", "GUARD", "PRESETS", "aggregation_args", "correction_for",
           "policy_loss", "register_correction", "sampler_logprobs", "truncated_weights"]
