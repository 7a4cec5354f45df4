"""Check a framework's own policy loss with ``offpolicy.testing`` (no GPU, about a minute on 2 cores).

    python examples/check_my_loss.py

The loss below is written the way RL frameworks write theirs (slime / verl style): it never sees logits, only
per-token log-probabilities ``[B, T]`` the trainer computed, the rollout engine's log-probabilities, advantages
and, for score centering, the rollout's top-p support with its log-probabilities ``[B, T, K]``; it returns
per-token losses that the framework aggregates elsewhere. It implements the mixed-fleet study's recipe (docs/spec.md#sources), MIS + score centering
+ top-p mask replay, and has a switch for a classic mistake: centering with the sampler's probabilities ``q(v)``
instead of ``q(v) f(p(v) / q(v))`` (the "unweighted" variant, which drifts as soon as MIS masks anything).

To check it, write a ten-line adapter from the kit's signature
``fn(logits [N, V], tokens [N], sampler_logprobs [N], candidates, advantages [N], temperature) -> loss [N]`` to
the framework's tensors (here: temperature, mask replay, gather, and ``[N] -> [1, N]``), declare what it claims
with a ``LossConfig``, and call ``check_all``. The correct variant passes; the buggy one fails ``zero_drift`` (and
``agreement``), with a shrunk example.

In your own test suite the same is one line::

    def test_my_loss():
        offpolicy.testing.check_all(my_adapter, CLAIM)

or, without writing a test: ``OFFPOLICY_LOSS=check_my_loss:correct_adapter pytest --pyargs offpolicy.testing``
(from this folder; the adapters carry their claim via ``with_config``).
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

from offpolicy.testing import LossConfig, check_all, with_config


# ----------------------------------------------------------------------------------------------------------------
# The "framework" code under test (what lives in your trainer)
# ----------------------------------------------------------------------------------------------------------------


def compute_policy_loss(
    log_probs: Tensor,
    rollout_log_probs: Tensor,
    advantages: Tensor,
    topk_log_probs: Tensor,
    topk_rollout_log_probs: Tensor,
    topk_mask: Tensor,
    mis_low: float = 0.5,
    mis_high: float = 5.0,
    unweighted_centering: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token MIS policy-gradient loss with score centering over the replayed top-p support.

    Args:
        log_probs: [B, T] trainer log-probs of the sampled tokens, renormalised over the rollout's support.
        rollout_log_probs: [B, T] rollout engine log-probs of the sampled tokens.
        advantages: [B, T].
        topk_log_probs: [B, T, K] trainer log-probs of the support tokens (renormalised over the support).
        topk_rollout_log_probs: [B, T, K] rollout log-probs of the support tokens.
        topk_mask: [B, T, K] bool, real support entries.

    Returns:
        pg_losses [B, T] (aggregate them yourself) and detached metrics.
    """
    # Rollout log-probs and advantages are data: if either comes from a graph (a proximal policy, a critic), no
    # gradient may reach it through the weights.
    rollout_log_probs, advantages = rollout_log_probs.detach(), advantages.detach()
    log_ratio = (log_probs.detach() - rollout_log_probs).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    keep = (ratio >= mis_low) & (ratio <= mis_high)
    is_weight = torch.where(keep, ratio, torch.zeros_like(ratio))
    pg_term = torch.where(is_weight != 0, is_weight * log_probs, torch.zeros_like(log_probs))

    # Score centering: subtract sum_v q(v) f(p(v)/q(v)) grad log p(v) (support records: minus p(v), which only
    # changes the value). The coefficients are constants for autograd.
    with torch.no_grad():
        q = torch.where(topk_mask, topk_rollout_log_probs.exp(), torch.zeros_like(topk_log_probs))
        p = torch.where(topk_mask, topk_log_probs.exp(), torch.zeros_like(topk_log_probs))
        if unweighted_centering:
            m = q
        else:
            cand_ratio = (topk_log_probs - topk_rollout_log_probs).clamp(-20.0, 20.0).exp()
            cand_keep = (cand_ratio >= mis_low) & (cand_ratio <= mis_high) & topk_mask
            m = torch.where(cand_keep, q * cand_ratio, torch.zeros_like(q))
        coef = m - p
    centering = torch.where(coef != 0, coef * topk_log_probs, torch.zeros_like(topk_log_probs)).sum(-1)
    pg_losses = -advantages * (pg_term - centering)
    pg_losses = torch.where(advantages != 0, pg_losses, torch.zeros_like(pg_losses))
    metrics = {"mis_masked_frac": (~keep).float().mean().detach(), "is_weight_mean": is_weight.mean().detach()}
    return pg_losses, metrics


# ----------------------------------------------------------------------------------------------------------------
# The adapter to the kit's signature, and what the loss claims
# ----------------------------------------------------------------------------------------------------------------

CLAIM = LossConfig(weights="mis", bounds=(0.5, 5.0), score_centering=True, record="support")


def _adapter(unweighted_centering: bool):
    def adapter(logits, tokens, sampler_logprobs, candidates, advantages, temperature):
        # What the trainer does before calling the loss: temperature, mask replay (renormalise over the rollout's
        # support), gather; then the framework's [B, T] layout with B = 1.
        valid = candidates.ids >= 0
        x = logits.double() / temperature
        support_logits = x.gather(1, candidates.ids.clamp_min(0)).masked_fill(~valid, float("-inf"))
        lse = torch.logsumexp(support_logits, dim=1, keepdim=True)
        log_probs = x.gather(1, tokens[:, None]) - lse
        topk_log_probs = support_logits - lse
        pg_losses, _ = compute_policy_loss(
            log_probs.T, sampler_logprobs[None], advantages[None], topk_log_probs[None],
            candidates.logprobs[None], valid[None], unweighted_centering=unweighted_centering,
        )
        return pg_losses[0]

    return adapter


correct_adapter = with_config(CLAIM)(_adapter(unweighted_centering=False))
buggy_adapter = with_config(CLAIM)(_adapter(unweighted_centering=True))
correct_adapter.__qualname__ = "compute_policy_loss[correct]"
buggy_adapter.__qualname__ = "compute_policy_loss[unweighted_centering]"


def main(max_examples: int = 30) -> int:
    good = check_all(correct_adapter, CLAIM, max_examples=max_examples, raise_on_failure=False)
    print(good, end="\n\n")
    bad = check_all(buggy_adapter, CLAIM, max_examples=max_examples, raise_on_failure=False)
    print(bad)
    ok = good.passed and "zero_drift" in bad.failed
    print("\nas expected: the correct loss passes, the unweighted centering drifts" if ok else "\nUNEXPECTED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
