"""prime-rl: offpolicy's loss as a custom trainer loss, one sequence at a time.

    [trainer.loss]
    type = "custom"
    import_path = "offpolicy.adapters.prime_rl.policy_loss"

    [trainer.loss.kwargs]          # the Correction's fields
    weights = "mis"
    bounds = [0.5, 5.0]

prime-rl calls ``fn(inputs: LossInputs, **kwargs) -> LossOutputs`` per sequence with ``[seq]`` tensors
``trainer_logprobs`` (differentiable), ``inference_logprobs`` (the sampler's ``lq``), ``advantages``, ``loss_mask``
and optional ``loss_weights``, and aggregates the returned sums itself (its documented example returns the masked
sum). ``loss_weights`` scale the advantages (the per-token loss is linear in them). prime-rl needs Python >= 3.12
and is not on PyPI: inputs are read by attribute and the output is prime-rl's ``LossOutputs`` when it is importable,
else a dataclass with its two fields.

Guards (:mod:`offpolicy.adapters.guard`, on every sequence, warned once,
``offpolicy/guard/<code>`` in the metrics): trained ``inference_logprobs`` above 0 or NaN are an error, exactly 0 on
32 trained tokens in a row (across sequences) warn (``sampler_logprobs_zero``), and above ``trainer_logprobs`` on almost every token of a sequence of at least 32
trained tokens warn (``narrower_sampler``: a top_p / top_k filter, which prime-rl passes no support to replay, or a
lower sampler temperature).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from offpolicy.adapters.guard import Guard, check_sampler_logprobs
from offpolicy.corrections.correction import Correction
from offpolicy.loss.logprobs import policy_loss_from_logprobs

try:
    from prime_rl.trainer.rl.loss import LossOutputs
except ImportError:
    @dataclass
    class LossOutputs:  # type: ignore[no-redef]
        """prime-rl's ``LossOutputs``: a scalar loss and scalar metrics (averaged over sequences by prime-rl)."""

        loss: Tensor
        metrics: dict[str, Tensor] = field(default_factory=dict)


#: One guard per process (prime-rl calls the loss per sequence).
GUARD = Guard([])


def correction_from_kwargs(kwargs: dict[str, Any]) -> Correction:
    """A :class:`~offpolicy.Correction` from TOML kwargs (lists become tuples); default token MIS ``[0.5, 5]``."""
    if not kwargs:
        return Correction(weights="mis", bounds=(0.5, 5.0))
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()}
    correction = Correction(**fields)
    if correction.score_centering:
        raise ValueError("prime-rl passes no candidate record to losses: score_centering cannot be applied")
    if correction.batch_normalize:
        raise ValueError("prime-rl calls the loss per sequence: batch_normalize would normalise within one sequence")
    if correction.ppo_clip is not None:
        raise ValueError("prime-rl passes no proximal log-probs: ppo_clip cannot be applied")
    return correction


def policy_loss(inputs: Any, **kwargs: Any) -> LossOutputs:
    """One sequence: ``inputs`` with ``[seq]`` tensors (see the module docstring); kwargs are Correction fields."""
    correction = correction_from_kwargs(kwargs)
    logp = inputs.trainer_logprobs
    adv = inputs.advantages
    if getattr(inputs, "loss_weights", None) is not None:
        adv = adv * inputs.loss_weights
    n = logp.shape[0]
    flags = check_sampler_logprobs(GUARD, inputs.inference_logprobs, inputs.loss_mask, name="inference_logprobs",
                                   trainer_logprobs=logp)
    out = policy_loss_from_logprobs(
        logp, inputs.inference_logprobs, adv, loss_mask=inputs.loss_mask, correction=correction,
        seq_ids=torch.zeros(n, dtype=torch.long, device=logp.device), aggregation="constant",
        constant_normalizer=1.0,
    )
    metrics = {f"offpolicy/{k}": v.detach() for k, v in out.metrics.items()}
    metrics.update({f"offpolicy/{k}": torch.tensor(v, device=logp.device) for k, v in flags.items()})
    return LossOutputs(loss=out.loss, metrics=metrics)


__all__ = ["GUARD", "LossOutputs", "correction_from_kwargs", "policy_loss"]
