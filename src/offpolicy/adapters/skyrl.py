"""SkyRL (``skyrl`` 0.3.x): offpolicy's loss as a registered SkyRL policy loss.

    from offpolicy.adapters.skyrl import register
    register("offpolicy", op.Correction(weights="mis", bounds=(0.5, 5.0)))   # before SkyRL syncs its registries
    # config: trainer.algorithm.policy_loss_type=offpolicy

On Python 3.11 :func:`register` imports SkyRL's loss registry past skyrl 0.3.0's ``skyrl.backends/__init__``, which
pydantic refuses there (:func:`ppo_utils`), so the snippet works as written.

SkyRL calls a registered loss as ``fn(log_probs, old_log_probs, advantages, config, loss_mask=None,
rollout_logprobs=None) -> (loss, metrics)`` with ``[B, T]`` tensors and expects the *masked sum*: it has already
scaled the advantages by its ``loss_reduction`` (``apply_loss_reduction_to_advantages_minibatch``). offpolicy's
per-token loss is linear in the advantage, so the sum over tokens with pre-scaled advantages is SkyRL's reduction.
The sampler's log-probabilities arrive as ``rollout_logprobs`` (required); ``old_log_probs`` is the proximal policy
for ``Correction.ppo_clip``. The :class:`~offpolicy.Correction` is looked up by ``config.policy_loss_type``.

Guards (:mod:`offpolicy.adapters.guard`, on every batch, warned once,
``offpolicy/guard/<code>`` in the metrics): SkyRL applies ``algorithm.off_policy_correction`` (and the deprecated
``use_tis``) inside its own losses only, so under this loss a configured one is silently not applied
(``skyrl_off_policy_correction``); trained ``rollout_logprobs`` above 0 or NaN are an error, exactly 0 on 32
trained tokens in a row warn (``sampler_logprobs_zero``), and above the trainer's on almost every token warn (``narrower_sampler``: a top_p /
top_k filter, which this loss cannot replay, or a lower sampler temperature).
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

import torch
from torch import Tensor

from offpolicy.adapters.guard import Guard, Suspect, check_sampler_logprobs
from offpolicy.corrections.correction import Correction
from offpolicy.loss.logprobs import policy_loss_from_logprobs

_CORRECTIONS: dict[str, Correction] = {}
#: ``algorithm.off_policy_correction`` fields -> their neutral value (SkyRL 0.3's OffPolicyCorrectionConfig).
_SKYRL_CORRECTION_OFF = {"tis_ratio_type": None, "sequence_mask_metric": None,
                         "outlier_token_is_threshold_low": None, "outlier_token_is_threshold_high": None,
                         "token_mask_is_threshold_low": None, "token_mask_is_threshold_high": None}
SKYRL_CORRECTION_IGNORED = Suspect(
    "skyrl_off_policy_correction",
    "SkyRL applies algorithm.off_policy_correction (and use_tis / tis_imp_ratio_cap) inside its own policy losses "
    "only: under the offpolicy loss the configured truncation / masking is silently not applied",
    "unset it and express it in the registered Correction (e.g. tis_ratio_type=token with "
    "token_tis_ratio_clip_high=c is Correction(weights='tis', bounds=(0, c)))")
#: One guard per process (SkyRL calls the loss per micro-batch).
GUARD = Guard([SKYRL_CORRECTION_IGNORED])


def register(name: str = "offpolicy", correction: Correction = Correction(weights="mis", bounds=(0.5, 5.0))) -> None:
    """Register ``correction`` as SkyRL policy loss ``name`` (``trainer.algorithm.policy_loss_type=<name>``)."""
    if not isinstance(correction, Correction):
        raise TypeError(f"correction must be an offpolicy.Correction, got {type(correction).__name__}")
    if correction.score_centering:
        raise ValueError("SkyRL passes no candidate record to policy losses: score_centering cannot be applied")
    _CORRECTIONS[name] = correction
    ppo_utils().register_policy_loss(name)(policy_loss)


def ppo_utils() -> types.ModuleType:
    """SkyRL's ``skyrl.backends.skyrl_train.utils.ppo_utils``, imported on Python 3.11 too.

    skyrl 0.3.0's ``skyrl/backends/__init__.py`` imports its Tinker types, which pydantic refuses on Python < 3.12
    (``typing.TypedDict``: ``PydanticUserError``); ``ppo_utils`` itself does not need them. On that failure, and only
    there, ``skyrl.backends`` is registered as a plain package of its folder (without running its ``__init__``) and
    the import retried; a working ``skyrl.backends`` is left alone.
    """
    try:
        from skyrl.backends.skyrl_train.utils import ppo_utils as module
    except Exception as exc:  # pydantic.errors.PydanticUserError (a RuntimeError) on Python < 3.12
        if sys.version_info >= (3, 12) or "TypedDict" not in str(exc) or "skyrl.backends" in sys.modules:
            raise
        import skyrl

        package = types.ModuleType("skyrl.backends")
        package.__path__ = [os.path.join(os.path.dirname(skyrl.__file__), "backends")]
        sys.modules["skyrl.backends"] = package
        from skyrl.backends.skyrl_train.utils import ppo_utils as module
    return module


def policy_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, config: Any,
                loss_mask: Tensor | None = None, rollout_logprobs: Tensor | None = None) -> tuple[Tensor, dict]:
    """SkyRL's registered-loss signature: ``[B, T]`` tensors; returns ``(masked sum, metrics)``."""
    name = getattr(config, "policy_loss_type", None)
    if name not in _CORRECTIONS:
        raise ValueError(f"config.policy_loss_type={name!r} is not an offpolicy loss; registered: "
                         f"{sorted(_CORRECTIONS)}")
    if rollout_logprobs is None:
        raise ValueError("rollout_logprobs is required (the sampler's log-probs): enable them in SkyRL's generator")
    correction = _CORRECTIONS[name]
    b, t = log_probs.shape
    mask = torch.ones(b, t, dtype=torch.bool, device=log_probs.device) if loss_mask is None else loss_mask.bool()
    flags = check_sampler_logprobs(GUARD, rollout_logprobs, mask, name="rollout_logprobs", trainer_logprobs=log_probs)
    if GUARD.calls == 1 and (configured := skyrl_corrections_set(config)):
        flags.update(GUARD.flag(SKYRL_CORRECTION_IGNORED, f"set: {', '.join(configured)}"))
    out = policy_loss_from_logprobs(
        log_probs.reshape(-1), rollout_logprobs.reshape(-1), advantages.reshape(-1), loss_mask=mask.reshape(-1),
        correction=correction, seq_ids=torch.arange(b, device=log_probs.device)[:, None].expand(b, t).reshape(-1),
        aggregation="constant", constant_normalizer=1.0,
        proximal_logprobs=old_log_probs.reshape(-1) if correction.ppo_clip is not None else None,
    )
    return out.loss, {f"offpolicy/{k}": float(v) for k, v in {**out.metrics, **flags}.items()}


def skyrl_corrections_set(config: Any) -> list[str]:
    """The SkyRL off-policy-correction options of ``config`` (``algorithm``) that are not at their neutral value,
    as ``name=value``."""
    opc = getattr(config, "off_policy_correction", None)
    found = [f"off_policy_correction.{k}={getattr(opc, k)!r}" for k, off in _SKYRL_CORRECTION_OFF.items()
             if opc is not None and getattr(opc, k, off) != off]
    if getattr(config, "use_tis", False):
        found.append("use_tis=True")
    cap = getattr(config, "tis_imp_ratio_cap", -1.0)
    if cap is not None and cap > 0:
        found.append(f"tis_imp_ratio_cap={cap}")
    return found


__all__ = ["GUARD", "SKYRL_CORRECTION_IGNORED", "policy_loss", "ppo_utils", "register", "skyrl_corrections_set"]
