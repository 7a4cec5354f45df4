"""A verl-style policy loss on ``[B, T]`` log-probabilities, built on ``op.policy_loss_from_logprobs``.

    python examples/verl_style_policy_loss.py

Trainers in the verl / TRL / OpenRLHF family compute per-token log-probabilities with their own kernels and call a
``compute_policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_log_probs)``
on padded ``[B, T]`` tensors. :func:`offpolicy_policy_loss` below has that shape: it flattens the trained tokens,
maps ``loss_agg_mode`` onto offpolicy's aggregations and returns the loss with offpolicy's metrics. With verl
installed, registering it is one decorator (the registry's exact signature varies between verl releases; adapt the
argument list to yours)::

    from verl.trainer.ppo.core_algos import register_policy_loss
    register_policy_loss("offpolicy_mis")(offpolicy_policy_loss)

Three ratios meet here: the sampler's ``rollout_log_probs`` (q: other numerics, stale weights), the trainer's
``old_log_prob`` recomputed before the update (the proximal policy) and the current ``log_prob``. The default
correction is masked importance sampling of the sampler -> trainer mismatch with PPO clipping of the update
(decoupled PPO); without ``old_log_prob`` it is MIS of ``log_prob`` against ``rollout_log_probs``.

The script checks the function against ``op.policy_loss`` on the logits the log-probabilities came from (the
same loss and gradient) and prints the metrics.
"""

from __future__ import annotations

import torch

import offpolicy as op

#: verl's ``loss_agg_mode`` -> offpolicy's aggregation.
AGGREGATIONS = {
    "token-mean": "token_mean",
    "seq-mean-token-mean": "seq_mean_token_mean",
    "seq-mean-token-sum": "seq_mean_token_sum",
    "seq-mean-token-sum-norm": "constant",  # the batch's token sum over the response length T (Dr. GRPO)
}


def offpolicy_policy_loss(
    old_log_prob: torch.Tensor | None,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    correction: op.Correction | None = None,
    rollout_log_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Off-policy-corrected policy loss on padded ``[B, T]`` tensors.

    Args:
        old_log_prob: ``[B, T]`` proximal log-probabilities (the trainer's, before the update), or None.
        log_prob: ``[B, T]`` current log-probabilities of the sampled tokens (differentiable).
        advantages: ``[B, T]``.
        response_mask: ``[B, T]`` 1 on trained tokens.
        loss_agg_mode: one of :data:`AGGREGATIONS`.
        correction: an :class:`offpolicy.Correction`; default MIS ``(0.5, 5)`` with PPO clipping ``0.2`` when
            ``old_log_prob`` is given.
        rollout_log_probs: ``[B, T]`` the sampler's log-probabilities of the same tokens (required: the ratio to
            correct is trainer / sampler).

    Returns:
        ``(loss, metrics)``: the scalar loss and detached metrics as floats.
    """
    if rollout_log_probs is None:
        raise ValueError("rollout_log_probs is required: it is the sampler's side of the ratio")
    if loss_agg_mode not in AGGREGATIONS:
        raise ValueError(f"loss_agg_mode must be one of {list(AGGREGATIONS)}, got {loss_agg_mode!r}")
    if correction is None:
        correction = op.Correction(weights="mis", bounds=(0.5, 5.0),
                                   ppo_clip=(0.2, 0.2) if old_log_prob is not None else None)
    b, t = log_prob.shape
    mask = response_mask.bool()
    rows = torch.arange(b, device=log_prob.device)[:, None].expand(b, t)
    out = op.policy_loss_from_logprobs(
        log_prob[mask], rollout_log_probs[mask], advantages[mask], correction=correction, seq_ids=rows[mask],
        aggregation=AGGREGATIONS[loss_agg_mode], constant_normalizer=float(t),
        proximal_logprobs=old_log_prob[mask] if correction.ppo_clip is not None else None,
    )
    return out.loss, {k: float(v) for k, v in out.metrics.items()}


def main() -> None:
    torch.manual_seed(0)
    b, t, v = 4, 7, 40
    logits = torch.randn(b, t, v, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        sampler_logq = torch.log_softmax(logits + 0.4 * torch.randn(b, t, v, dtype=torch.float64), -1)
        old = torch.log_softmax(logits + 0.1 * torch.randn(b, t, v, dtype=torch.float64), -1)  # pre-update policy
    tokens = torch.distributions.Categorical(logits=sampler_logq).sample()
    mask = torch.ones(b, t)
    mask[1, 5:] = 0  # a shorter response
    adv = torch.randn(b, 1, dtype=torch.float64).expand(b, t)
    rollout = sampler_logq.gather(-1, tokens[..., None])[..., 0]
    old_lp = old.gather(-1, tokens[..., None])[..., 0]

    for mode in AGGREGATIONS:
        log_prob = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]  # what the trainer computes
        loss, metrics = offpolicy_policy_loss(old_lp, log_prob, adv, mask, mode, rollout_log_probs=rollout)
        (grad,) = torch.autograd.grad(loss, logits)
        # The same loss straight from the logits.
        sel = mask.bool()
        want = op.policy_loss(
            logits[sel], tokens[sel], rollout[sel], adv[sel],
            correction=op.Correction(weights="mis", bounds=(0.5, 5.0), ppo_clip=(0.2, 0.2)),
            seq_ids=torch.arange(b)[:, None].expand(b, t)[sel], aggregation=AGGREGATIONS[mode],
            constant_normalizer=float(t), proximal_logprobs=old_lp[sel],
        )
        (want_grad,) = torch.autograd.grad(want.loss, logits)
        assert torch.allclose(loss, want.loss, rtol=1e-12) and torch.allclose(grad, want_grad, rtol=1e-10, atol=1e-14)
        print(f"{mode:<24} loss {float(loss.detach()):+.5f} (equals policy_loss on the logits)  "
              f"kl_k3 {metrics['kl_k3']:.4f}  weight_mean {metrics['weight_mean']:.3f}  "
              f"masked above {metrics['ratio_above_upper_frac']:.3f}")


if __name__ == "__main__":
    main()
